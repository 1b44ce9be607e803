"""Rendezvous and network checks: hostname, MASTER_ADDR/MASTER_PORT, socket interface variables.

Each check is a pure function of probe results (``gpuwarden.net`` types), so the
multi-node preflight can call them with its own probes per node.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuwarden import net
from gpuwarden.doctor.model import Check, Status, check
from gpuwarden.doctor.probes import RendezvousFacts

OK, WARN, FAIL, SKIP = Status.OK, Status.WARN, Status.FAIL, Status.SKIP


def check_hostname(hostname: str, resolution: net.Resolution, nnodes: int,
                   env: Mapping[str, str]) -> Check:
    """The hostname must not resolve only to loopback (127.0.1.1) for multi-node jobs.

    Gloo picks its interface by resolving the hostname when GLOO_SOCKET_IFNAME is
    unset, and the c10d rendezvous advertises this host by name: a loopback answer
    makes peers on other nodes connect to their own loopback.
    """
    cid, code = "hostname", "RDZV_CONN_REFUSED"
    shown = f"{hostname} -> {', '.join(resolution.addresses) or resolution.error}"
    if not resolution.ok:
        return check(cid, code, FAIL if nnodes > 1 else WARN,
                     f"this host's name {hostname!r} does not resolve",
                     why="Gloo and the c10d rendezvous look this host up by name "
                     f"({resolution.error})",
                     fix="add the name to /etc/hosts with the address other nodes reach it by",
                     evidence=[shown])
    if resolution.all_loopback:
        pinned = bool(env.get("GLOO_SOCKET_IFNAME"))
        status = FAIL if nnodes > 1 and not pinned else WARN
        return check(cid, code, status,
                     f"this host's name {hostname!r} resolves only to loopback "
                     f"({', '.join(resolution.addresses)})",
                     why="fine on one node; across nodes Gloo binds loopback and peers trying to "
                     "reach this host by name connect to themselves ('Connection refused', "
                     "timeouts)" + ("; GLOO_SOCKET_IFNAME is set, which avoids the Gloo part"
                                    if pinned else ""),
                     fix="map the hostname to the node's network address in /etc/hosts (Debian "
                     "puts 127.0.1.1 there), or set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME",
                     evidence=[shown])
    return check(cid, code, OK, f"{hostname} resolves to {', '.join(resolution.addresses)}",
                 evidence=[f"resolved in {resolution.elapsed_s * 1000:.0f} ms"])


def check_master_addr(rdzv: RendezvousFacts, nnodes: int) -> Check:
    """MASTER_ADDR resolves (RDZV_DNS), and to something other nodes can reach."""
    cid, code = "master_addr", "RDZV_DNS"
    if rdzv.addr is None:
        return check(cid, code, SKIP, "MASTER_ADDR is not set (a single-node launch picks one)")
    res = rdzv.resolution
    assert res is not None  # an address set is always resolved (probes._rendezvous)
    if not res.ok:
        error = res.error or "not resolved"
        return check(cid, code, FAIL, f"MASTER_ADDR {rdzv.addr!r} does not resolve",
                     why=f"the resolver says: {error}; PyTorch would retry this silently until "
                     "its rendezvous timeout (10-30 minutes)",
                     fix="set MASTER_ADDR to a name or IP address every node can resolve "
                     "(rank 0's host)",
                     evidence=[f"{rdzv.addr}: {error} after {res.elapsed_s:.2f} s"])
    addrs = ", ".join(res.addresses)
    evidence = [f"{rdzv.addr} -> {addrs} in {res.elapsed_s * 1000:.0f} ms"]
    if rdzv.route_interface:
        evidence.append(f"route to it leaves through {rdzv.route_interface}")
    if nnodes > 1 and res.all_loopback:
        # torchrun runs it: a rehearsal with every node on this host, or this host's own name
        # on Debian's 127.0.1.1 line (the launcher then advertises a routable address).
        return check(cid, code, WARN, f"MASTER_ADDR {rdzv.addr!r} is loopback ({addrs}) in a "
                     f"{nnodes}-node job", why="fine when every node runs on this host (a "
                     "rehearsal); nodes on other hosts reach their own loopback, not this host",
                     fix="set MASTER_ADDR to rank 0's network address", evidence=evidence)
    where = "this host" if rdzv.local else "another host"
    return check(cid, code, OK, f"MASTER_ADDR {rdzv.addr} resolves to {addrs} ({where})",
                 evidence=evidence)


def check_master_port(rdzv: RendezvousFacts) -> Check:
    """MASTER_PORT free here when rank 0 runs here, else reachable on MASTER_ADDR."""
    cid = "master_port"
    if rdzv.port_error:
        return check(cid, "USAGE", FAIL, rdzv.port_error, fix="export MASTER_PORT=29500 (or any free port)")
    if rdzv.port is None:
        return check(cid, "RDZV_PORT_IN_USE", SKIP, "MASTER_PORT is not set (a launch picks one)")
    if rdzv.addr is not None and (rdzv.resolution is None or not rdzv.resolution.ok):
        return check(cid, "RDZV_CONN_REFUSED", SKIP, f"port {rdzv.port} not probed: MASTER_ADDR "
                     "does not resolve")
    if rdzv.local:
        if rdzv.port_free:
            return check(cid, "RDZV_PORT_IN_USE", OK, f"port {rdzv.port} is free on this host "
                         "(rank 0's store can bind it)")
        return check(cid, "RDZV_PORT_IN_USE", FAIL, f"port {rdzv.port} is already in use on this host",
                     why="rank 0 binds MASTER_PORT for the rendezvous store and fails with "
                     "'Address already in use'; the other ranks then wait until their timeout",
                     fix=f"pick a free port (`ss -ltnp 'sport = :{rdzv.port}'` shows who holds "
                     "this one; gpuwarden launch picks a free one itself)",
                     evidence=[f"bind(0.0.0.0:{rdzv.port}) failed with EADDRINUSE"])
    probe = rdzv.probe
    assert probe is not None
    evidence = [f"{probe.host}:{probe.port}: {probe.status.value} after {probe.elapsed_s:.2f} s: "
                f"{probe.detail}"]
    if probe.ok:
        return check(cid, "RDZV_CONNECT_TIMEOUT", OK, f"{probe.host}:{probe.port} accepts "
                     "connections (rank 0's store is up)", evidence=evidence)
    code = probe.code or "RDZV_CONN_REFUSED"
    if probe.status is net.ProbeStatus.REFUSED:
        return check(cid, code, WARN, f"nothing listens on {probe.host}:{probe.port} yet",
                     why="the host answered and refused: fine before rank 0 starts; if rank 0 "
                     "runs, MASTER_PORT is wrong",
                     fix="start rank 0 first, and give every node the same MASTER_PORT",
                     evidence=evidence)
    if probe.status is net.ProbeStatus.TIMEOUT:
        return check(cid, code, FAIL, f"{probe.host}:{probe.port} does not answer",
                     why="no reply at all, not even a refusal: a firewall drops the packets or "
                     "the address is not on this network; PyTorch would wait out its timeout",
                     fix="open the port between the nodes, or use an address on a network they "
                     "share (pin it with NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME)",
                     evidence=evidence)
    return check(cid, code, FAIL, f"{probe.host}:{probe.port} cannot be reached",
                 why=probe.detail, fix="check the route to MASTER_ADDR (`ip route get ADDR`)",
                 evidence=evidence)


def _describe_ifaces(interfaces: Mapping[str, tuple[str, ...]]) -> list[str]:
    return [f"{name}: {', '.join(addrs) or 'no address'}" for name, addrs in interfaces.items()]


def check_socket_ifname(var: str, value: str | None, interfaces: Mapping[str, tuple[str, ...]],
                        *, route_interface: str | None = None) -> Check:
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name interfaces that exist and have an address."""
    cid, code = var.lower(), "NCCL_NO_INTERFACE"
    if value is None or not value.strip():
        return check(cid, code, SKIP, f"{var} is not set (the library picks an interface)")
    gloo = var.startswith("GLOO")
    spec = net.parse_ifname_spec(value, exact=gloo)
    usable = {n: a for n, a in interfaces.items() if any(net.usable_address(x) for x in a)}
    chosen = [n for n in usable if spec.matches(n)]
    evidence = _describe_ifaces(interfaces)
    syntax = ("exact interface names, comma-separated" if gloo else
              "prefixes (eth matches eth0), ^ to exclude, = for exact names")
    if gloo:
        missing = [n for n in spec.names if n not in usable]
        if missing:
            return check(cid, code, FAIL, f"{var}={value!r} names {', '.join(missing)}, which "
                         "this host does not have (or has no address on)",
                         why="Gloo fails to create its device ('Unable to find address for ...')",
                         fix=f"name an interface that exists here ({', '.join(usable) or 'none'}), "
                         "or unset it", evidence=evidence)
    elif not chosen:
        return check(cid, code, FAIL, f"{var}={value!r} matches no interface with an address",
                     why=f"NCCL reads it as {syntax}; with no match it fails with 'Bootstrap : "
                     "no socket interface found'",
                     fix=f"name an existing interface ({', '.join(usable) or 'none'}), or unset it",
                     evidence=evidence)
    if route_interface and route_interface not in chosen:
        return check(cid, code, WARN, f"{var}={value!r} selects {', '.join(chosen)}, but the route "
                     f"to MASTER_ADDR leaves through {route_interface}",
                     why="fine if the selected interfaces reach the other nodes; otherwise "
                     "connections between ranks are refused or time out",
                     fix=f"include {route_interface}, or check that the nodes share the network "
                     f"of {', '.join(chosen)}", evidence=evidence)
    loop_only = all(all(net.is_loopback(a) for a in usable[n]) for n in chosen)
    what = f"{var}={value!r} selects {', '.join(chosen)}"
    if loop_only:
        return check(cid, code, WARN, what + " (loopback only: single-node jobs only)",
                     why="other nodes cannot reach a loopback address",
                     fix="name a network interface for multi-node jobs", evidence=evidence)
    return check(cid, code, OK, what, evidence=evidence)


def check_route_interface(interfaces: Mapping[str, tuple[str, ...]], route_interface: str | None,
                          master_addr: str | None, env: Mapping[str, str], nnodes: int) -> Check:
    """Which interface carries the traffic to MASTER_ADDR, said when it matters: a multi-node
    job on a host with several network interfaces and no *_SOCKET_IFNAME pinning one."""
    cid, code = "route_interface", "RDZV_CONN_REFUSED"
    if nnodes < 2 or master_addr is None:
        return check(cid, code, SKIP, "single node: no interface between nodes to choose")
    networks = [n for n, addrs in interfaces.items()
                if any(net.usable_address(a) and not net.is_loopback(a) for a in addrs)]
    if route_interface is None:
        return check(cid, code, SKIP, f"no route from here to MASTER_ADDR {master_addr} is known")
    pinned = [v for v in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if env.get(v)]
    what = (f"traffic to MASTER_ADDR {master_addr} leaves through {route_interface} "
            f"({', '.join(interfaces.get(route_interface, ())) or 'no address'})")
    if len(networks) > 1 and len(pinned) < 2:
        unset = [v for v in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if v not in pinned]
        return check(cid, code, OK, what + f"; {' and '.join(unset)} unset with "
                     f"{len(networks)} network interfaces ({', '.join(networks)}): NCCL and Gloo "
                     f"pick their own; set {unset[0]}={route_interface} to pin that one",
                     evidence=_describe_ifaces(interfaces))
    return check(cid, code, OK, what)


def net_checks(hostname: str, hostname_resolution: net.Resolution, rdzv: RendezvousFacts,
               interfaces: Mapping[str, tuple[str, ...]], env: Mapping[str, str],
               nnodes: int) -> list[Check]:
    return [
        check_hostname(hostname, hostname_resolution, nnodes, env),
        check_master_addr(rdzv, nnodes),
        check_master_port(rdzv),
        check_socket_ifname("NCCL_SOCKET_IFNAME", env.get("NCCL_SOCKET_IFNAME"), interfaces,
                            route_interface=rdzv.route_interface),
        check_socket_ifname("GLOO_SOCKET_IFNAME", env.get("GLOO_SOCKET_IFNAME"), interfaces,
                            route_interface=rdzv.route_interface),
        check_route_interface(interfaces, rdzv.route_interface, rdzv.addr, env, nnodes),
    ]
