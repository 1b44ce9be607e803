"""The one place that touches sockets and name resolution: bounded probes for rendezvous.

Every probe has a deadline of seconds: PyTorch's own rendezvous retries a DNS
failure or a dropped SYN silently for 10–30 minutes, which is the stall
gpuwarden exists to cut short. Results say *which* failure it was (refused vs.
timed out vs. no route vs. unknown name), because each has a different cause:

- refused: the host answered, nothing listens on the port (rank 0 not up yet, wrong port);
- timed out: nothing answered at all (a firewall dropping packets, a wrong address);
- no route / unreachable: the host or its network cannot be reached from here;
- unknown name: the resolver does not know the name (RDZV_DNS).
"""

from __future__ import annotations

import errno
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

T = TypeVar("T")


class ProbeStatus(str, Enum):
    OK = "ok"
    REFUSED = "refused"
    TIMEOUT = "timeout"
    NO_ROUTE = "no_route"
    DNS = "dns"
    ERROR = "error"


# failure-codes.md code for each probe outcome
PROBE_CODES = {
    ProbeStatus.REFUSED: "RDZV_CONN_REFUSED",
    ProbeStatus.TIMEOUT: "RDZV_CONNECT_TIMEOUT",
    ProbeStatus.NO_ROUTE: "RDZV_CONN_REFUSED",
    ProbeStatus.DNS: "RDZV_DNS",
    ProbeStatus.ERROR: "RDZV_CONN_REFUSED",
}


@dataclass(frozen=True)
class Resolution:
    host: str
    addresses: tuple[str, ...]  # empty when the name is unknown
    error: str | None  # the resolver's words, e.g. "[Errno -2] Name or service not known"
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return bool(self.addresses)

    @property
    def all_loopback(self) -> bool:
        return self.ok and all(is_loopback(a) for a in self.addresses)


@dataclass(frozen=True)
class ProbeResult:
    host: str
    port: int
    status: ProbeStatus
    detail: str
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.status is ProbeStatus.OK

    @property
    def code(self) -> str | None:
        return PROBE_CODES.get(self.status)


def is_loopback(address: str) -> bool:
    import ipaddress  # here, not at the top: a launch of one node picks its port without it

    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def resolve(host: str, *, timeout_s: float = 3.0) -> Resolution:
    """Resolve ``host`` with a deadline.

    getaddrinfo has no timeout of its own and can block for the resolver's full
    retry cycle, so it runs in a daemon thread that we stop waiting for.
    """
    import ipaddress

    start = time.monotonic()
    try:
        ipaddress.ip_address(host)
        return Resolution(host, (host,), None, 0.0)
    except ValueError:
        pass
    answered, infos, error = _within(
        lambda: socket.getaddrinfo(host, None, type=socket.SOCK_STREAM), timeout_s,
        f"resolve-{host}")
    elapsed = time.monotonic() - start
    if not answered:
        return Resolution(host, (), f"the resolver did not answer within {timeout_s:g} s", elapsed)
    if error is not None:
        return Resolution(host, (), error, elapsed)
    addrs = tuple(dict.fromkeys(str(i[4][0]) for i in infos or ()))
    return Resolution(host, addrs, None if addrs else "no address", elapsed)


def _within(call: Callable[[], T], timeout_s: float, name: str
            ) -> tuple[bool, T | None, str | None]:
    """``call()`` (a resolver call: no timeout of its own, it can block for the resolver's
    whole retry cycle) in a daemon thread we stop waiting for after ``timeout_s``: whether it
    answered, its value, and its error (OSError, UnicodeError) as text."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = call()
        except (OSError, UnicodeError) as exc:
            box["error"] = str(exc)

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return False, None, None
    return True, box.get("value"), box.get("error")


def host_fqdn(*, timeout_s: float = 2.0) -> str | None:
    """This host's name as ``socket.getfqdn()`` gives it: the name torch's rendezvous advertises
    for a node (and torchrun's workers get as MASTER_ADDR on one node). None when the resolver
    does not answer within ``timeout_s`` (getfqdn has no timeout of its own)."""
    _answered, name, _error = _within(socket.getfqdn, timeout_s, "resolve-fqdn")
    return name or None


def is_local_address(address: str) -> bool:
    """Whether ``address`` is one of this host's (a socket can be bound to it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address.split("%")[0], 0))
        return True
    except OSError:
        return False


def probe_tcp(host: str, port: int, *, timeout_s: float = 3.0) -> ProbeResult:
    """Resolve ``host`` and try ``host:port`` (:func:`connect_tcp`), all within ``timeout_s``."""
    start = time.monotonic()
    res = resolve(host, timeout_s=timeout_s)
    if not res.ok:
        return ProbeResult(host, port, ProbeStatus.DNS, res.error or "unknown name",
                           time.monotonic() - start)
    left = max(0.1, timeout_s - (time.monotonic() - start))
    probe = connect_tcp(res.addresses, port, timeout_s=left, host=host)
    return ProbeResult(host, port, probe.status, probe.detail, time.monotonic() - start)


# Which failure to report when every address failed: the one that says most about the
# host (it answered: refused) before the ones that say less (silence, no route).
_FAILURE_RANK = (ProbeStatus.REFUSED, ProbeStatus.TIMEOUT, ProbeStatus.NO_ROUTE,
                 ProbeStatus.ERROR)


def connect_tcp(addresses: Sequence[str], port: int, *, timeout_s: float = 3.0,
                host: str | None = None) -> ProbeResult:
    """Try a TCP connection to each of ``addresses`` in turn, all within ``timeout_s``.

    A name often resolves to ``::1`` before ``127.0.0.1`` (or to a v6 and a v4
    address) while the listener has bound only one of them, so the first refusal
    is not the answer: like a client's connect loop, the next address is tried.
    Each attempt gets an equal share of the time left, so one address that drops
    packets cannot starve the others. ``host`` (default: the first address) names
    the target in the result.
    """
    if not addresses:
        raise ValueError("connect_tcp needs at least one address")
    start = time.monotonic()
    deadline = start + timeout_s
    failures: list[tuple[ProbeStatus, str]] = []
    for i, address in enumerate(addresses):
        share = max(0.05, (deadline - time.monotonic()) / (len(addresses) - i))
        status, detail = _connect_one(address, port, share)
        if status is ProbeStatus.OK:
            return ProbeResult(host or address, port, status, detail, time.monotonic() - start)
        failures.append((status, detail))
    status, detail = min(failures, key=lambda f: _FAILURE_RANK.index(f[0]))
    if len(failures) > 1:
        detail += " (tried " + "; ".join(f"{a}: {s.value}" for a, (s, _) in
                                         zip(addresses, failures, strict=True)) + ")"
    return ProbeResult(host or addresses[0], port, status, detail, time.monotonic() - start)


def _connect_one(address: str, port: int, timeout_s: float) -> tuple[ProbeStatus, str]:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect((address, port))
        except TimeoutError:
            return ProbeStatus.TIMEOUT, (
                f"no answer from {address}:{port} within {timeout_s:.3g} s: packets are "
                "dropped (a firewall) or the address does not exist on the network")
        except ConnectionRefusedError:
            return ProbeStatus.REFUSED, (f"{address} answered but nothing listens on port {port} "
                                         "(rank 0 not started yet, or a wrong port)")
        except OSError as exc:
            if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
                return ProbeStatus.NO_ROUTE, f"no route to {address}: {exc.strerror}"
            return ProbeStatus.ERROR, f"{address}:{port}: {exc.strerror or exc}"
    return ProbeStatus.OK, f"connected to {address}:{port}"


def port_is_free(port: int, host: str = "") -> bool:
    """Whether a listener could bind ``port`` here now (the rendezvous store binds all addresses)."""
    for family, addr in ((socket.AF_INET, host or "0.0.0.0"), (socket.AF_INET6, host or "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((addr, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            # EADDRNOTAVAIL and friends: that family is not usable here; it cannot conflict.
        finally:
            sock.close()
    return True


def pick_free_port(host: str = "") -> int:
    """A free port for a listener that binds it later: rank 0's rendezvous store, after its
    torch import (seconds on a busy host).

    Not one the kernel hands out for port 0: those come from the ephemeral range, which every
    outgoing connection on the host draws its local port from too, and beside other work one
    took the port first (EADDRINUSE in rank 0, attempt 2 of a restarted job, on a loaded box).
    Below that range the kernel assigns nothing by itself: a random port there, checked free
    on both address families; the kernel's choice only when the range leaves no room."""
    low = _ephemeral_low()
    if low is not None and low - PICKED_PORT_FLOOR >= 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(PICKED_PORT_FLOOR, low)
            if port_is_free(port, host):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# Picked ports are at least this (below: well-known services and the old default ranges).
PICKED_PORT_FLOOR = 10000


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (net.ipv4.ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def interface_addresses(*, up_only: bool = True) -> dict[str, tuple[str, ...]]:
    """Interface name -> its IPv4/IPv6 addresses (``{'lo': ('127.0.0.1', '::1'), ...}``).

    Interfaces that are down are left out unless ``up_only`` is False: NCCL and Gloo
    cannot use them either.
    """
    import psutil

    stats = psutil.net_if_stats()
    out: dict[str, tuple[str, ...]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        if up_only and name in stats and not stats[name].isup:
            continue
        out[name] = tuple(a.address.split("%")[0] for a in addrs
                          if a.family in (socket.AF_INET, socket.AF_INET6))
    return out


def source_address_for(address: str) -> str | None:
    """The local address the kernel's routing table picks to reach ``address``.

    A connected UDP socket sends nothing; connecting it only asks the kernel for
    the route, so this is instant and safe to call towards any address.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((address.split("%")[0], 9))  # port 9 (discard); no packet leaves
            return str(sock.getsockname()[0])
    except OSError:
        return None  # no route to it at all


def interface_of(address: str, interfaces: Mapping[str, tuple[str, ...]]) -> str | None:
    """The name of the interface that holds ``address`` (None when no interface does)."""
    for name, addrs in interfaces.items():
        if address in addrs:
            return name
    return None


@dataclass(frozen=True)
class IfnameSpec:
    """NCCL_SOCKET_IFNAME's syntax: ``eth,ib`` prefixes; ``^docker,lo`` excludes;
    ``=eth0`` exact names; ``^=eth0`` excludes exact names. ``:port`` suffixes
    (an IB port) are ignored for sockets. Gloo's GLOO_SOCKET_IFNAME is a comma list of
    exact names: parse it with ``exact=True``."""

    raw: str
    names: tuple[str, ...]
    exclude: bool
    exact: bool

    def matches(self, interface: str) -> bool:
        hit = any(interface == n if self.exact else interface.startswith(n) for n in self.names)
        return hit != self.exclude


def parse_ifname_spec(raw: str, *, exact: bool = False) -> IfnameSpec:
    text = raw.strip()
    exclude = text.startswith("^")
    if exclude:
        text = text[1:]
    if text.startswith("="):
        exact, text = True, text[1:]
    names = tuple(n.split(":")[0].strip() for n in text.split(",") if n.split(":")[0].strip())
    return IfnameSpec(raw, names, exclude, exact)


def usable_address(address: str) -> bool:
    """An address NCCL's socket bootstrap would use: IPv4, or IPv6 that is not link-local."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    return not (ip.version == 6 and ip.is_link_local)
