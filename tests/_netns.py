"""Hosts made of Linux network namespaces, for multi-node tests (root + iproute2).

Two hosts are joined by one veth pair; three or more hang off a bridge that lives in its own
namespace. Addresses come from 198.18.0.0/15 (RFC 2544's benchmarking range) and no namespace
has a default route, so nothing can leave. Every name carries a per-run tag: parallel or
leftover runs never collide. ``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over
``/etc/hosts``, which is how each host gets its own name resolution. With ``named=True`` each
host also gets its own host name (a UTS namespace per command, ``n<i>-<tag>``), and every
host's /etc/hosts knows every host's name, as on a cluster: waits and reports name hosts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

SUBNET = "198.18.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"gwprobe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot create a network namespace: {getattr(exc, 'stderr', exc)}"
    _ip("netns", "del", probe, check=False)
    return None


def nft_unavailable_reason(ns: str) -> str | None:
    if shutil.which("nft") is None:
        return "nftables (`nft`) is not installed"
    r = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "ruleset"], capture_output=True,
                       text=True, timeout=20)
    return None if r.returncode == 0 else f"nft does not work here: {r.stderr.strip()}"


@dataclass
class Hosts:
    tag: str
    names: list[str]  # namespace per host
    addrs: list[str]  # its address
    ifaces: list[str]  # its interface name
    extra: list[str] = field(default_factory=list)  # the bridge namespace
    hostnames: list[str] = field(default_factory=list)  # own host names (named=True)

    def cmd(self, host: int, argv: Sequence[str]) -> list[str]:
        if not self.hostnames:
            return ["ip", "netns", "exec", self.names[host], *argv]
        return ["ip", "netns", "exec", self.names[host], "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostnames[host], *argv]

    def write_hosts(self, host: int, lines: Sequence[str]) -> None:
        d = f"/etc/netns/{self.names[host]}"
        os.makedirs(d, exist_ok=True)
        with open(f"{d}/hosts", "w", encoding="utf-8") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{line}\n" for line in lines))

    def nft(self, host: int, *rules: str) -> None:
        for rule in rules:
            subprocess.run(self.cmd(host, ["nft", *rule.split()]), check=True, capture_output=True,
                           timeout=20)

    def pids(self) -> list[int]:
        """Processes still running inside any of the namespaces."""
        out: list[int] = []
        for ns in self.names:
            r = _ip("netns", "pids", ns, check=False)
            out += [int(p) for p in r.stdout.split()]
        return out


def make_hosts(count: int, *, named: bool = False) -> Hosts:
    tag = uuid.uuid4().hex[:6]
    names = [f"gwt{tag}-{i}" for i in range(count)]
    ifaces = [f"gw{tag}e{i}" for i in range(count)]  # <= 15 characters
    hosts = Hosts(tag, [], [f"{SUBNET}.{i + 1}" for i in range(count)], ifaces)
    try:
        for ns in names:
            _ip("netns", "add", ns)
            hosts.names.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        if count == 2:
            _ip("link", "add", ifaces[0], "netns", names[0], "type", "veth", "peer", "name",
                ifaces[1], "netns", names[1])
        else:
            bridge_ns = f"gwt{tag}-br"
            _ip("netns", "add", bridge_ns)
            hosts.extra.append(bridge_ns)
            _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", bridge_ns, "link", "set", "br0", "up")
            for i, ns in enumerate(names):
                port = f"gw{tag}p{i}"
                _ip("link", "add", ifaces[i], "netns", ns, "type", "veth", "peer", "name", port,
                    "netns", bridge_ns)
                _ip("-n", bridge_ns, "link", "set", port, "master", "br0")
                _ip("-n", bridge_ns, "link", "set", port, "up")
        for i, ns in enumerate(names):
            _ip("-n", ns, "addr", "add", f"{hosts.addrs[i]}/24", "dev", ifaces[i])
            _ip("-n", ns, "link", "set", ifaces[i], "up")
        _wait_visible(hosts)
        if named:
            hosts.hostnames = [f"n{i}-{tag}" for i in range(count)]
            for i in range(count):
                hosts.write_hosts(i, [f"{hosts.addrs[j]} {hosts.hostnames[j]}" for j in range(count)])
    except BaseException:
        remove_hosts(hosts)
        raise
    return hosts


def _wait_visible(hosts: Hosts, timeout_s: float = 10.0) -> None:
    """A fresh interface can take a moment to show in getifaddrs (psutil), which the code under
    test reads, even after `ip` lists it: wait until every host sees its own address."""
    import sys
    import time

    code = ("import psutil, sys; a = psutil.net_if_addrs().get(sys.argv[1], []); "
            "sys.exit(0 if any(x.address == sys.argv[2] for x in a) else 1)")
    for i in range(len(hosts.names)):
        deadline = time.monotonic() + timeout_s
        while subprocess.run(hosts.cmd(i, [sys.executable, "-c", code, hosts.ifaces[i],
                                           hosts.addrs[i]]), timeout=20).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{hosts.ifaces[i]} never showed {hosts.addrs[i]}")
            time.sleep(0.1)


def remove_hosts(hosts: Hosts) -> None:
    import signal

    for pid in hosts.pids():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for ns in [*hosts.names, *hosts.extra]:
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


@contextlib.contextmanager
def hosts_of(count: int, *, named: bool = False) -> Iterator[Hosts]:
    hosts = make_hosts(count, named=named)
    try:
        yield hosts
    finally:
        remove_hosts(hosts)
