"""Multi-node preflight: run on every node before any rank starts, every probe bounded.

The checks are the doctor's (``gpuwarden.doctor.net_checks``), fed with this node's probes, so
``gpuwarden doctor --nnodes N`` and ``gpuwarden launch --nnodes N`` say the same thing:

- MASTER_ADDR resolves within seconds (RDZV_DNS; PyTorch retries this silently for its whole
  timeout), and not to loopback;
- node 0 really owns that address (rank 0's store binds here; the other nodes connect to it), and
  no other node does (swapped ``--node-rank``); MASTER_PORT is free on node 0;
- NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name interfaces that exist and carry the route to
  MASTER_ADDR; unset, the interface that carries it is named, and GLOO_SOCKET_IFNAME is pinned to
  it when this host's name resolves to no usable local address (Gloo would fall back to loopback);
- on nodes > 0, MASTER_ADDR:MASTER_PORT accepts a connection within ``--rdzv-timeout``, reported
  as it happens: refused (rank 0 not up yet, or a wrong port: keep trying), timed out (packets
  dropped: a firewall, or a wrong address), no route.

Once a node > 0 has seen the port accept a connection it starts its ranks at once: the store is
up, and their own TCPStore clients connect (and retry) from there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TextIO

from gpuwarden import net
from gpuwarden.doctor.model import Check, Status
from gpuwarden.doctor.net_checks import (
    check_hostname,
    check_master_addr,
    check_master_port,
    check_route_interface,
    check_socket_ifname,
)
from gpuwarden.doctor.probes import Probes, RendezvousFacts, locate_master
from gpuwarden.errors import PortInUseError, RendezvousError
from gpuwarden.findings import Severity, render_one_line
from gpuwarden.launch.config import LaunchConfig

RETRY_REFUSED_S = 0.5  # between tries while nothing listens yet
PROBE_TIMEOUT_S = 3.0  # one connection attempt; a firewall that drops shows as this timeout


@dataclass
class RendezvousPreflight:
    notes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # set for the ranks (a pinned interface)
    waited_s: float = 0.0


def _raise(c: Check, config: LaunchConfig, hostname: str, *, port_in_use: bool = False) -> None:
    evidence = [*c.evidence, f"node {config.node_rank} of {config.nnodes} ({hostname})"]
    cls = PortInUseError if port_in_use else RendezvousError
    raise cls(c.what, why=c.why, fix=c.fix, evidence=evidence, code=c.code,
              fields={**c.fields, "node": config.node_rank, "hostname": hostname})


def check_rendezvous(config: LaunchConfig, env: dict[str, str], *, err: TextIO,
                     probes: Probes | None = None,
                     clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> RendezvousPreflight:
    """Run the multi-node preflight for ``config`` (``nnodes > 1``) on this node.

    Raises RendezvousError with the failure code: RDZV_DNS (MASTER_ADDR unknown here),
    RDZV_CONNECT_TIMEOUT (no answer for the whole window: packets dropped), RDZV_CONN_REFUSED
    (nothing listened for the whole window: node 0 not started, a wrong port; or no route; or
    node 0 does not own MASTER_ADDR), NCCL_NO_INTERFACE (a *_SOCKET_IFNAME names no usable
    interface); PortInUseError when node 0 cannot bind MASTER_PORT.
    """
    probes = probes or Probes()
    out = RendezvousPreflight()
    start = clock()
    addr, port, nnodes, me = config.master_addr, config.master_port, config.nnodes, config.node_rank
    assert port is not None  # config validation: multi-node needs --master-port
    interfaces = probes.interfaces()
    hostname = probes.hostname()
    resolution = probes.resolve(addr)
    mine = {a for addrs in interfaces.values() for a in addrs}
    local, route = (locate_master(resolution.addresses, interfaces, probes.source_address_for)
                    if resolution.ok else (False, None))
    facts = RendezvousFacts(addr, port, None, resolution, local, None, None, route)
    c = check_master_addr(facts, nnodes)
    if c.status is Status.FAIL:
        _raise(c, config, hostname)
    owned = ", ".join(a for a in sorted(mine) if not net.is_loopback(a)) or "none"
    if me == 0 and not local:
        raise RendezvousError(
            f"this is node 0, but MASTER_ADDR {addr} ({', '.join(resolution.addresses)}) is not "
            "an address of this host",
            why="rank 0 runs here and hosts the rendezvous store; the other nodes connect to "
            "MASTER_ADDR and would find nobody listening there",
            fix=f"set --master-addr to one of this host's addresses ({owned}), or run node 0 on "
            f"the host that owns {addr}",
            evidence=[f"node 0 ({hostname}) has {owned}"], code="RDZV_CONN_REFUSED")
    if me != 0 and local:
        raise RendezvousError(
            f"this is node {me}, but MASTER_ADDR {addr} is this host's own address",
            why="rank 0 (node 0) hosts the store at MASTER_ADDR: this node's ranks would wait for "
            "a rank 0 that runs elsewhere",
            fix="give --node-rank 0 on this host, or set --master-addr to node 0's address",
            evidence=[f"node {me} ({hostname}) has {owned}"], code="RDZV_CONN_REFUSED")
    if me == 0:
        c = check_master_port(RendezvousFacts(addr, port, None, resolution, True,
                                              probes.port_is_free(port), None, route))
        if c.status is Status.FAIL:
            _raise(c, config, hostname, port_in_use=True)

    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        c = check_socket_ifname(var, env.get(var), interfaces, route_interface=route)
        if c.status is Status.FAIL:
            _raise(c, config, hostname)
        if c.status is Status.WARN:
            out.notes.append(render_one_line(replace(c, severity=Severity.WARNING, fix=None)))

    c = check_hostname(hostname, probes.resolve(hostname), nnodes, env)
    if c.status in (Status.WARN, Status.FAIL):
        # launch goes on (the job may still work): a warning, whatever the doctor calls it
        warning = replace(c, severity=Severity.WARNING)
        line = render_one_line(warning)
        if not env.get("GLOO_SOCKET_IFNAME") and route:
            # Gloo binds what the hostname resolves to, else falls back to loopback: the other
            # nodes could never connect. The route to MASTER_ADDR names the right interface.
            out.env["GLOO_SOCKET_IFNAME"] = route
            line = render_one_line(replace(warning, fix=None)) + (
                f"; gpuwarden sets GLOO_SOCKET_IFNAME={route} for the ranks (the interface "
                "of the route to MASTER_ADDR)")
        out.notes.append(line)
    c = check_route_interface(interfaces, route, addr, env, nnodes)
    if c.status is not Status.SKIP:
        out.notes.append(c.what)
    for line in out.notes:
        print(f"gpuwarden: {line}", file=err, flush=True)

    if me != 0:
        _wait_for_store(config, hostname, resolution, probes, err, clock, sleep, start)
    out.waited_s = clock() - start
    return out


def _wait_for_store(config: LaunchConfig, hostname: str, resolution: net.Resolution,
                    probes: Probes, err: TextIO,
                    clock: Callable[[], float], sleep: Callable[[float], None],
                    start: float) -> None:
    """Probe MASTER_ADDR:MASTER_PORT until it accepts a connection or the window ends; say
    every change of outcome as it happens."""
    addr, port = config.master_addr, config.master_port
    assert port is not None
    deadline = start + config.rdzv_timeout_s
    last: net.ProbeStatus | None = None
    tries = 0
    while True:
        left = deadline - clock()
        # MASTER_ADDR was resolved once above: every try connects to those addresses
        probe = probes.connect_tcp(addr, resolution.addresses, port) if left >= PROBE_TIMEOUT_S \
            else net.connect_tcp(resolution.addresses, port, timeout_s=max(0.2, left), host=addr)
        tries += 1
        if probe.ok:
            if last is not None:
                print(f"gpuwarden: node {config.node_rank}: {addr}:{port} accepts connections "
                      f"after {clock() - start:.1f} s; starting the ranks", file=err, flush=True)
            return
        if probe.status is not last:
            last = probe.status
            print(f"gpuwarden: node {config.node_rank}: {_words(probe)}; retrying for up to "
                  f"{max(0.0, deadline - clock()):.0f} s more", file=err, flush=True)
        if clock() >= deadline:
            c = check_master_port(RendezvousFacts(addr, port, None, resolution, False, None, probe,
                                                  None))
            what = (f"node {config.node_rank} could not reach the rendezvous store at "
                    f"{addr}:{port} within {config.rdzv_timeout_s:g} s (--rdzv-timeout)")
            why = c.why or probe.detail
            if probe.status is net.ProbeStatus.REFUSED:
                why = ("the host answered every time but nothing listened on the port: node 0 "
                       "was not started (or failed before rank 0 bound the port), or the port "
                       "differs between nodes")
            raise RendezvousError(
                what, why=why, fix=c.fix, code=probe.code or "RDZV_CONN_REFUSED",
                evidence=[*c.evidence, f"{tries} tries from node {config.node_rank} ({hostname})"],
                fields={"host": addr, "port": port, "node": config.node_rank, "tries": tries})
        if probe.status is not net.ProbeStatus.TIMEOUT:
            sleep(min(RETRY_REFUSED_S, max(0.0, deadline - clock())))


def _words(probe: net.ProbeResult) -> str:
    where = f"{probe.host}:{probe.port}"
    if probe.status is net.ProbeStatus.REFUSED:
        return f"{where} refused the connection (rank 0 not started yet, or a wrong port)"
    if probe.status is net.ProbeStatus.TIMEOUT:
        return (f"{where} did not answer within {probe.elapsed_s:.1f} s: packets dropped "
                "(a firewall, or a wrong address)")
    if probe.status is net.ProbeStatus.NO_ROUTE:
        return f"no route to {probe.host}: {probe.detail}"
    return f"{where}: {probe.detail}"
