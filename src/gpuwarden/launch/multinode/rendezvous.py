"""Multi-node rendezvous, from this node: the preflight, then the named wait for the others.

**Preflight** (every probe bounded, before GPUs are leased). The checks are the doctor's
(``gpuwarden.doctor.net_checks``), fed with this node's probes, so ``gpuwarden doctor --nnodes
N`` and ``gpuwarden launch --nnodes N`` say the same thing:

- the endpoint (MASTER_ADDR, or --rdzv-endpoint's host) resolves within seconds (RDZV_DNS;
  PyTorch retries this silently for its whole timeout);
- which node hosts the job's store: static, node 0, which must own the address (and no other
  node does: swapped --node-rank); c10d, whichever node owns the endpoint's address (torch's
  ``is_host`` when given). Its port must be free there;
- a loopback endpoint is a one-machine rehearsal (every node on this host): said, not refused.
  An endpoint named by this host's own name that its /etc/hosts maps to loopback (Debian's
  127.0.1.1) while the other nodes resolve it to the network: this node hosts the store (it
  listens on every interface) and advertises a routable address, which it names;
- NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name interfaces that exist and carry the route; unset,
  the interface that carries it is named, and GLOO_SOCKET_IFNAME is pinned to it when this
  host's name resolves to no usable local address (Gloo would fall back to loopback);
- the nodes that do not host the store probe the endpoint until it accepts a connection, within
  the join timeout (--rdzv-timeout, join_timeout), saying each change as it happens: refused
  (not up yet, or a wrong port: keep trying), timed out (packets dropped: a firewall, or a wrong
  address), no route.

**Join** (:func:`join_round`): torch's ``next_rendezvous`` in the node agent, bounded by the
join timeout on every node, the one hosting the store included. While it waits, the agent
reports the round's participants; this node names who joined and who is missing (by host: the
node ranks of a static job, Slurm's node list, or the nodes of the round before), every few
seconds on a terminal, on each change otherwise.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

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
from gpuwarden.launch.multinode.node_agent import AgentError, NodeAgent, NodeInfo, Round

RETRY_REFUSED_S = 0.05  # between tries while nothing listens yet (a refusal costs microseconds;
# the store comes up the moment torch is imported on its node, and every node waits for it)
PROBE_TIMEOUT_S = 3.0  # one connection attempt; a firewall that drops shows as this timeout
TTY_EVERY_S = 3.0  # a wait says where it stands this often on a terminal
PIPE_EVERY_S = 30.0  # and at least this often when piped (and on every change)
QUIET_FIRST_S = 2.0  # a rendezvous that completes within this says nothing


@dataclass
class RendezvousPreflight:
    notes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # set for the ranks (a pinned interface)
    waited_s: float = 0.0
    hosting: bool | None = None  # this node hosts the job's store (None: torch decides)
    host_guessed: bool = False  # hosting is gpuwarden's reading of the addresses, not is_host
    local_addr: str | None = None  # the address this node advertises (None: its host name)


def _who(config: LaunchConfig) -> str:
    return f"node {config.node_rank}" if config.node_rank is not None else "this node"


def _raise(c: Check, config: LaunchConfig, hostname: str, *, port_in_use: bool = False) -> None:
    evidence = [*c.evidence, f"{_who(config)} of {config.nnodes} ({hostname})"]
    cls = PortInUseError if port_in_use else RendezvousError
    raise cls(c.what, why=c.why, fix=c.fix, evidence=evidence, code=c.code,
              fields={**c.fields, "node": config.node_rank, "hostname": hostname})


def check_rendezvous(config: LaunchConfig, env: dict[str, str], *, err: TextIO,
                     probes: Probes | None = None,
                     clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> RendezvousPreflight:
    """Run the multi-node preflight for ``config`` (``nnodes > 1``) on this node.

    Raises RendezvousError with the failure code: RDZV_DNS (the endpoint unknown here),
    RDZV_CONNECT_TIMEOUT (no answer for the whole window: packets dropped), RDZV_CONN_REFUSED
    (nothing listened for the whole window: the store's node not started, a wrong port; or no
    route; or node 0 does not own MASTER_ADDR), NCCL_NO_INTERFACE (a *_SOCKET_IFNAME names no
    usable interface); PortInUseError when the store's port is taken on the node that hosts it.
    """
    probes = probes or Probes()
    out = RendezvousPreflight()
    start = clock()
    addr, port, nnodes, me = config.master_addr, config.master_port, config.nnodes, config.node_rank
    assert port is not None  # config validation: multi-node needs --master-port / an endpoint
    interfaces = probes.interfaces()
    hostname = probes.hostname()
    resolution = probes.resolve(addr)
    local, route = (locate_master(resolution.addresses, interfaces, probes.source_address_for)
                    if resolution.ok else (False, None))
    facts = RendezvousFacts(addr, port, None, resolution, local, None, None, route)
    c = check_master_addr(facts, nnodes)
    loopback = resolution.ok and resolution.all_loopback
    if c.status is Status.FAIL and not loopback:
        _raise(c, config, hostname)
    routable = _routable(interfaces)
    owned = ", ".join(routable) or "none"
    own_name = loopback and _is_own_name(addr, hostname) and bool(routable)
    chosen: tuple[str, str] | None = None  # (address, interface) advertised instead of the name
    if loopback and own_name:
        chosen = _pick_routable(interfaces, probes.source_address_for)
        gloo = "" if env.get("GLOO_SOCKET_IFNAME") else \
            f", and its ranks' Gloo binds there (GLOO_SOCKET_IFNAME={chosen[1]})"
        out.notes.append(
            f"the endpoint {addr} is this host's own name and resolves to "
            f"{', '.join(resolution.addresses)} here (loopback, as Debian's /etc/hosts has it): "
            f"this node hosts the job's store (it listens on every interface) and advertises "
            f"{chosen[0]} ({chosen[1]}) to the other nodes{gloo}; --local-addr chooses another")
    elif loopback:
        out.notes.append(f"the endpoint {addr} is loopback ({', '.join(resolution.addresses)}): "
                         "every node of this job must run on this host (a rehearsal); nodes on "
                         "other hosts could never reach it")
    if config.dynamic:
        given = dict(config.rdzv_conf).get("is_host")
        if given is not None:
            out.hosting = given.lower() in ("1", "true", "yes", "y", "t")
        else:
            out.hosting, out.host_guessed = local, True
    else:
        out.hosting = me == 0
        if me == 0 and not local:
            raise RendezvousError(
                f"this is node 0, but MASTER_ADDR {addr} ({', '.join(resolution.addresses)}) is "
                "not an address of this host",
                why="node 0 hosts the job's store and runs rank 0; the other nodes connect to "
                "MASTER_ADDR and would find nobody listening there",
                fix=f"set --master-addr to one of this host's addresses ({owned}), or run node 0 "
                f"on the host that owns {addr} (or use --rdzv-backend c10d, where the node that "
                "owns the endpoint hosts it, whatever its rank)",
                evidence=[f"node 0 ({hostname}) has {owned}"], code="RDZV_CONN_REFUSED")
        if me != 0 and local and not loopback:
            # Two nodes on one host (a rehearsal), or a swapped --node-rank: node 0 on the other
            # host refuses the second case (it does not own MASTER_ADDR), so go on and say it.
            out.notes.append(f"MASTER_ADDR {addr} is this host's own address: node 0 must run "
                             f"on this host too (node {me} waits for it here)")
    port_free = probes.port_is_free(port) if out.hosting else None
    if out.hosting and not port_free:
        if config.dynamic and out.host_guessed:
            out.notes.append(f"port {port} is already in use on this host: this node joins the "
                             "store there as a client (another node of this job on this host "
                             "hosts it)")
            out.hosting = False
        else:
            c = check_master_port(RendezvousFacts(addr, port, None, resolution, True, False, None,
                                                  route))
            _raise(c, config, hostname, port_in_use=True)

    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        c = check_socket_ifname(var, env.get(var), interfaces, route_interface=route)
        if c.status is Status.FAIL:
            _raise(c, config, hostname)
        if c.status is Status.WARN:
            out.notes.append(render_one_line(replace(c, severity=Severity.WARNING, fix=None)))

    host_resolution = probes.resolve(hostname)
    c = check_hostname(hostname, host_resolution, nnodes, env)
    name_ok = c.status not in (Status.WARN, Status.FAIL)
    if config.local_addr:
        out.local_addr = config.local_addr
    elif chosen is not None:
        out.local_addr = chosen[0]
    elif loopback:
        out.local_addr = resolution.addresses[0]  # a rehearsal: every node on this host
    elif not name_ok:
        # torch advertises this host by name; the name does not lead here from elsewhere
        source = probes.source_address_for(resolution.addresses[0])
        if source and not net.is_loopback(source):
            out.local_addr = source
    if not name_ok and not loopback:
        # launch goes on (the job may still work): a warning, whatever the doctor calls it
        warning = replace(c, severity=Severity.WARNING)
        line = render_one_line(warning)
        pin = route or (chosen[1] if chosen else None)
        if not env.get("GLOO_SOCKET_IFNAME") and pin:
            # Gloo binds what the hostname resolves to, else falls back to loopback: the other
            # nodes could never connect. The route to the endpoint names the right interface.
            out.env["GLOO_SOCKET_IFNAME"] = pin
            line = render_one_line(replace(warning, fix=None)) + (
                f"; gpuwarden sets GLOO_SOCKET_IFNAME={pin} for the ranks (the interface "
                "of the route to MASTER_ADDR)")
        if out.local_addr and config.dynamic:
            line += f"; this node advertises {out.local_addr}"
        out.notes.append(line)
    elif chosen is not None and not env.get("GLOO_SOCKET_IFNAME"):
        out.env["GLOO_SOCKET_IFNAME"] = chosen[1]  # Gloo would bind this host's name: loopback
    c = check_route_interface(interfaces, route, addr, env, nnodes)
    if c.status is not Status.SKIP:
        out.notes.append(c.what)
    for line in out.notes:
        print(f"gpuwarden: {line}", file=err, flush=True)

    if not out.hosting:
        _wait_for_store(config, hostname, resolution, probes, err, clock, sleep, start)
    out.waited_s = clock() - start
    return out


def _routable(interfaces: dict[str, tuple[str, ...]]) -> list[str]:
    return sorted({a for addrs in interfaces.values() for a in addrs
                   if net.usable_address(a) and not net.is_loopback(a)
                   and not a.startswith("fe80")})


def _is_own_name(addr: str, hostname: str) -> bool:
    """Whether ``addr`` names this host (its name, short or not; no resolver call: it may hang)."""
    names = {hostname.lower(), hostname.split(".")[0].lower()}
    return addr.lower() in names or addr.split(".")[0].lower() in names


def _pick_routable(interfaces: dict[str, tuple[str, ...]],
                   source_address_for: Callable[[str], str | None]) -> tuple[str, str]:
    """This host's address for the other nodes when its name leads to loopback: the one the
    default route leaves from, else the first IPv4 address of a non-loopback interface."""
    source = source_address_for("198.51.100.1")  # TEST-NET-2: only the default route leads there
    if source and not net.is_loopback(source):
        return source, net.interface_of(source, interfaces) or "?"
    for name in sorted(interfaces):
        for a in interfaces[name]:
            if net.usable_address(a) and not net.is_loopback(a) and ":" not in a:
                return a, name
    for name in sorted(interfaces):
        for a in interfaces[name]:
            if net.usable_address(a) and not net.is_loopback(a):
                return a, name
    return "127.0.0.1", "lo"


def _wait_for_store(config: LaunchConfig, hostname: str, resolution: net.Resolution,
                    probes: Probes, err: TextIO,
                    clock: Callable[[], float], sleep: Callable[[float], None],
                    start: float) -> None:
    """Probe the endpoint until it accepts a connection or the window ends; say every change
    of outcome as it happens, and where it stands every few seconds on a terminal."""
    addr, port = config.master_addr, config.master_port
    assert port is not None
    deadline = start + config.rdzv_timeout_s
    last: net.ProbeStatus | None = None
    tries = 0
    tty = _isatty(err)
    said_at = clock()
    who = _who(config)
    while True:
        left = deadline - clock()
        # MASTER_ADDR was resolved once above: every try connects to those addresses
        probe = probes.connect_tcp(addr, resolution.addresses, port) if left >= PROBE_TIMEOUT_S \
            else net.connect_tcp(resolution.addresses, port, timeout_s=max(0.2, left), host=addr)
        tries += 1
        if probe.ok:
            if last is not None:
                print(f"gpuwarden: {who}: {addr}:{port} accepts connections "
                      f"after {clock() - start:.1f} s; joining the rendezvous", file=err, flush=True)
            return
        now = clock()
        if probe.status is not last or (tty and now - said_at >= TTY_EVERY_S):
            last, said_at = probe.status, now
            print(f"gpuwarden: {who}: {_words(probe)}; retrying for up to "
                  f"{max(0.0, deadline - now):.0f} s more", file=err, flush=True)
        if now >= deadline:
            c = check_master_port(RendezvousFacts(addr, port, None, resolution, False, None, probe,
                                                  None))
            what = (f"{who} could not reach the rendezvous store at {addr}:{port} within "
                    f"{config.rdzv_timeout_s:g} s (--rdzv-timeout, join_timeout)")
            why = c.why or probe.detail
            if probe.status is net.ProbeStatus.REFUSED:
                why = (f"{addr} answered every time but nothing listened on the port: the node "
                       "that hosts the job's store (the one that owns the endpoint's address; "
                       "node 0 with --node-rank) was not started, or failed before it listened, "
                       "or the port differs between nodes")
            raise RendezvousError(
                what, why=why, fix=c.fix, code=probe.code or "RDZV_CONN_REFUSED",
                evidence=[*c.evidence, f"{tries} tries from {who} ({hostname})",
                          f"missing: the store's host {addr}"],
                fields={"host": addr, "port": port, "node": config.node_rank, "tries": tries,
                        "missing": [addr]})
        if probe.status is not net.ProbeStatus.TIMEOUT:
            sleep(min(RETRY_REFUSED_S, max(0.0, deadline - clock())))


def _words(probe: net.ProbeResult) -> str:
    where = f"{probe.host}:{probe.port}"
    if probe.status is net.ProbeStatus.REFUSED:
        return f"{where} refused the connection (the store's node not up yet, or a wrong port)"
    if probe.status is net.ProbeStatus.TIMEOUT:
        return (f"{where} did not answer within {probe.elapsed_s:.1f} s: packets dropped "
                "(a firewall, or a wrong address)")
    if probe.status is net.ProbeStatus.NO_ROUTE:
        return f"no route to {probe.host}: {probe.detail}"
    return f"{where}: {probe.detail}"


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# ---- the join --------------------------------------------------------------------------------


def connect(agent: NodeAgent, config: LaunchConfig, pre: RendezvousPreflight, *,
            run_id: str, local_world_size: int) -> bool:
    """Create torch's c10d rendezvous handler in the node agent; True when this node hosts
    the job's store. Raises RendezvousError in the words of the failure."""
    conf = dict(config.rdzv_conf)
    conf["join_timeout"] = str(max(1, math.ceil(config.rdzv_timeout_s)))
    me = {"host": socket.gethostname(), "addr": pre.local_addr or "",
          "node_rank": config.node_rank, "local_world_size": local_world_size}
    try:
        agent.wait_ready()
        reply = agent.call(
            "connect", endpoint=f"{_bracket(config.master_addr)}:{config.master_port}",
            run_id=run_id, min_nodes=config.fewest_nodes, max_nodes=config.nnodes, conf=conf,
            local_addr=pre.local_addr, is_host=pre.hosting, guessed=pre.host_guessed, me=me,
            static_master_addr=None if config.dynamic else config.master_addr,
            timeout_s=config.rdzv_timeout_s + 60)
    except AgentError as exc:
        if exc.inner == "ModuleNotFoundError" or "No module named" in exc.message:
            raise RendezvousError(
                f"a multi-node launch needs torch on every node: {exc.message}",
                why="the node agent runs torch's own c10d rendezvous (the ranks need torch "
                "anyway)", fix="install torch in this environment (pip install torch)",
                code="USAGE") from None
        raise RendezvousError(
            f"{_who(config)} could not open the job's store at {config.master_addr}:"
            f"{config.master_port}: {exc.message}",
            why="torch's c10d rendezvous backend failed to host or reach the TCPStore there",
            fix="check that the port is free on the endpoint's host and reachable from here",
            evidence=agent.stderr_tail(4), code="RDZV_CONN_REFUSED") from None
    return bool(reply.get("hosting"))


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class _WaitPrinter:
    """Says where a join stands: who joined, who is missing, how long it may still wait."""

    def __init__(self, config: LaunchConfig, err: TextIO, timeout_s: float,
                 previous: tuple[NodeInfo, ...]) -> None:
        self.config = config
        self.err = err
        self.timeout_s = timeout_s
        self.previous = previous
        self.tty = _isatty(err)
        self.started = time.monotonic()
        self.last_line = ""
        self.last_key: tuple[Any, ...] | None = None
        self.said_at = 0.0
        self.last_event: dict[str, Any] | None = None

    def summary(self, event: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
        c = self.config
        joined = [h for h in event.get("participants", []) if isinstance(h, dict)]
        waiting = [h for h in event.get("wait_list", []) if isinstance(h, dict)]
        names = [_label(h, c) for h in joined]
        missing = missing_nodes(c, joined, self.previous)
        if event.get("me_in") == "wait_list" and event.get("complete"):
            text = (f"round {event.get('round')} still runs on {', '.join(names) or 'other nodes'}"
                    ": this node joins the next round when they re-rendezvous (after their "
                    "ranks end, or at once when they see a node waiting)")
        else:
            want = c.fewest_nodes if c.elastic else c.nnodes
            text = f"{len(joined)} of {want}{'' if not c.elastic else f'-{c.nnodes}'} node(s) " \
                   f"joined ({', '.join(names) or 'none yet'})"
            if missing:
                text += f"; missing: {', '.join(missing)}"
            elif len(joined) < want:
                text += f"; waiting for {want - len(joined)} more"
            elif c.elastic and event.get("last_call"):
                text += "; enough nodes: the round completes after last_call_timeout"
            if waiting:
                text += f"; waiting for the next round: {', '.join(_label(h, c) for h in waiting)}"
        key = (tuple(names), tuple(missing), event.get("me_in"), len(waiting))
        return text, key

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("event") != "waiting":
            return
        self.last_event = event
        now = time.monotonic()
        waited = now - self.started
        if waited < QUIET_FIRST_S:
            return
        text, key = self.summary(event)
        due = TTY_EVERY_S if self.tty else PIPE_EVERY_S
        if key != self.last_key or now - self.said_at >= due:
            self.last_key, self.said_at = key, now
            left = max(0.0, self.timeout_s - waited)
            print(f"gpuwarden: rendezvous at {self.config.master_addr}:{self.config.master_port}"
                  f": {text}; waited {waited:.0f} s, up to {left:.0f} s more (join_timeout)",
                  file=self.err, flush=True)


def _label(host: dict[str, Any], config: LaunchConfig) -> str:
    from gpuwarden.safetext import escape_untrusted

    name = escape_untrusted(str(host.get("host", "?")))
    if config.node_rank is not None and host.get("node_rank") is not None:
        return f"node {host.get('node_rank')} ({name})"
    return name


def missing_nodes(config: LaunchConfig, joined: list[dict[str, Any]],
                  previous: tuple[NodeInfo, ...] = ()) -> list[str]:
    """Who has not joined, by name when anything says who should: --node-rank (static), the
    scheduler's host list (Slurm), or the nodes of the round before (a node lost)."""
    hosts = {str(h.get("host", "")).split(".")[0].lower() for h in joined}
    if config.node_rank is not None:
        ranks = {h.get("node_rank") for h in joined}
        named = {r: h for r, h in zip(range(config.nnodes), config.expected_hosts, strict=False)}
        return [f"node {r}" + (f" ({named[r]})" if r in named else "")
                for r in range(config.nnodes) if r not in ranks]
    if config.expected_hosts:
        return [h for h in config.expected_hosts if h.split(".")[0].lower() not in hosts]
    return [n.host for n in previous if n.host.split(".")[0].lower() not in hosts]


def join_round(agent: NodeAgent, config: LaunchConfig, err: TextIO, *, timeout_s: float,
               previous: tuple[NodeInfo, ...] = ()) -> Round:
    """Join the next round of the job's rendezvous (torch's next_rendezvous in the agent),
    bounded by ``timeout_s``, naming who joined and who is missing as it waits.

    Raises RendezvousError: RDZV_WORKERS_MISSING when the nodes did not all join in time
    (joined and missing named), NODE_ABORTED when the rendezvous was closed (the job ended
    elsewhere), RDZV_STORE_LOST when the job's store went away, USAGE when the nodes disagree
    (two nodes with one --node-rank, different -n)."""
    printer = _WaitPrinter(config, err, timeout_s, previous)
    try:
        reply = agent.call("join", timeout_s=timeout_s, on_event=printer.on_event)
    except AgentError as exc:
        raise _join_error(exc, config, printer, timeout_s) from None
    nodes = tuple(NodeInfo.of(n) for n in reply.get("nodes", []))
    rnd = Round(int(reply["round"]), int(reply["group_rank"]), int(reply["group_world_size"]),
                str(reply["master_addr"]), int(reply["master_port"]), nodes,
                _json_or_none(reply.get("job")))
    rnd = _check_round(rnd, config)
    waited = time.monotonic() - printer.started
    if waited >= QUIET_FIRST_S or rnd.round > 0:
        names = ", ".join(n.label for n in sorted(rnd.nodes, key=lambda n: n.group_rank))
        print(f"gpuwarden: rendezvous round {rnd.round} complete after {waited:.1f} s: "
              f"{rnd.group_world_size} node(s) ({names}); this is node {rnd.group_rank}",
              file=err, flush=True)
    return rnd


def _json_or_none(text: Any) -> dict[str, Any] | None:
    import json

    if not text:
        return None
    try:
        data = json.loads(text)
    except (TypeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _check_round(rnd: Round, config: LaunchConfig) -> Round:
    """Static: the ranks follow --node-rank, which must be one per node; every node must run
    as many ranks (RANK = node * ranks per node, as torchrun numbers them)."""
    from gpuwarden.errors import UsageError

    sizes = {n.local_world_size for n in rnd.nodes}
    if len(sizes) > 1:
        raise UsageError("the nodes run different numbers of ranks: " + ", ".join(
            f"{n.label} -n {n.local_world_size}" for n in rnd.nodes),
            fix="give every node the same --nproc-per-node")
    if config.node_rank is None:
        return rnd
    by_rank: dict[int, list[NodeInfo]] = {}
    for n in rnd.nodes:
        by_rank.setdefault(-1 if n.node_rank is None else n.node_rank, []).append(n)
    twice = {r: ns for r, ns in by_rank.items() if len(ns) > 1}
    if twice:
        r, ns = next(iter(twice.items()))
        raise UsageError(f"--node-rank {r} was given on {len(ns)} nodes: "
                         f"{', '.join(n.label for n in ns)}",
                         fix=f"number the nodes 0 to {config.nnodes - 1}, each once")
    nodes = tuple(replace(n, group_rank=n.node_rank if n.node_rank is not None else -1)
                  for n in rnd.nodes)
    return replace(rnd, group_rank=config.node_rank, nodes=nodes)


def _join_error(exc: AgentError, config: LaunchConfig, printer: _WaitPrinter,
                timeout_s: float) -> RendezvousError:
    event = printer.last_event or {}
    joined = [h for h in event.get("participants", []) if isinstance(h, dict)]
    names = ", ".join(_label(h, config) for h in joined) or "none"
    missing = missing_nodes(config, joined, printer.previous)
    where = f"{config.master_addr}:{config.master_port}"
    if exc.kind in ("RendezvousTimeoutError", "TimeoutError"):
        want = config.fewest_nodes
        what = (f"the rendezvous at {where} did not complete within {timeout_s:.0f} s "
                f"(join_timeout): {len(joined)} of {want} node(s) joined ({names})")
        if missing:
            what += f"; missing: {', '.join(missing)}"
        return RendezvousError(
            what, code="RDZV_WORKERS_MISSING",
            why="every node must run the launcher with the same endpoint and run id; a missing "
            "node was not started, failed before it joined (its own output says why), or "
            "cannot reach the endpoint",
            fix="start the missing node(s), or give more time: --rdzv-conf join_timeout=SECONDS",
            evidence=[f"joined: {names}", f"missing: {', '.join(missing) or 'unknown hosts'}"],
            fields={"joined": [str(h.get("host")) for h in joined], "missing": missing})
    if exc.kind in ("RendezvousClosedError", "RendezvousGracefulExitError"):
        return RendezvousError(
            f"the rendezvous at {where} is closed: the job already ended on its other nodes",
            code="NODE_ABORTED", why="a node closes the rendezvous when the job ends there "
            "(success, or a failure it will not restart), so late nodes stop instead of waiting",
            fix="start every node of a job together; read the other nodes' reports")
    if exc.kind == "UsageError":
        return RendezvousError(exc.message, code="USAGE")
    return RendezvousError(
        f"the job's store at {where} went away while this node joined: {exc.message}",
        code="RDZV_STORE_LOST", why="the store's host (the node that owns the endpoint's "
        "address) died, stopped, or lost the network",
        fix=f"look at the launcher on the host of {config.master_addr} first")
