"""The doctor's network checks against real loopback sockets and the real resolver."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from gpuwarden import net
from gpuwarden.doctor import Options, Probes, Report, Status, run_doctor
from gpuwarden.doctor.net_checks import check_master_port
from gpuwarden.doctor.probes import RendezvousFacts, TorchInfo

pytestmark = pytest.mark.timeout(30)

# The torch subprocess is not what these tests are about: keep them fast.
NO_TORCH = TorchInfo(False, error="not probed in this test")


def doctor(master_addr: str, master_port: int) -> Report:
    return run_doctor(Options(master_addr=master_addr, master_port=master_port, env={}),
                      Probes(query_torch=lambda env: NO_TORCH))


@pytest.fixture
def listener() -> Iterator[int]:
    """A real TCP listener on 127.0.0.1; yields its port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield int(sock.getsockname()[1])


@pytest.fixture
def closed_port() -> int:
    """A port that was just free and has no listener (bound, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_bound_port_on_this_host_is_rdzv_port_in_use(listener: int) -> None:
    report = doctor(master_addr="127.0.0.1", master_port=listener)
    check = report.by_id("master_port")
    assert (check.status, check.code) == (Status.FAIL, "RDZV_PORT_IN_USE")
    assert str(listener) in check.what


def test_free_port_on_this_host_is_ok(closed_port: int) -> None:
    report = doctor(master_addr="localhost", master_port=closed_port)
    check = report.by_id("master_port")
    assert (check.status, check.code) == (Status.OK, "RDZV_PORT_IN_USE")


def _remote(port: int) -> RendezvousFacts:
    """MASTER_ADDR as another node would probe it: a real TCP connect to the port."""
    probe = net.probe_tcp("127.0.0.1", port, timeout_s=3.0)
    res = net.resolve("127.0.0.1")
    return RendezvousFacts("127.0.0.1", port, None, res, False, None, probe, None)


def test_closed_port_probed_remotely_is_connection_refused(closed_port: int) -> None:
    start = time.monotonic()
    check = check_master_port(_remote(closed_port))
    assert (check.status, check.code) == (Status.WARN, "RDZV_CONN_REFUSED")
    assert "refused" in check.evidence[0]
    assert time.monotonic() - start < 2.5  # a refusal is immediate: the 3 s timeout not spent


def test_listening_port_probed_remotely_is_reachable(listener: int) -> None:
    check = check_master_port(_remote(listener))
    assert check.status is Status.OK and "accepts connections" in check.what


def test_unresolvable_master_addr_is_rdzv_dns_within_3_s() -> None:
    start = time.monotonic()
    report = doctor(master_addr="wrong.address.invalid", master_port=29500)
    elapsed = time.monotonic() - start
    check = report.by_id("master_addr")
    assert (check.status, check.code) == (Status.FAIL, "RDZV_DNS")
    assert elapsed < 7.0  # the resolver is cut at 3 s; margin for a loaded machine


@pytest.mark.slow
def test_a_hanging_resolver_is_cut_off_at_3_s(monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.getaddrinfo

    def slow(host: str, *args: object, **kwargs: object) -> object:
        if host == "slow.example.invalid":
            time.sleep(10)  # a resolver that never answers in time (a dead DNS server)
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    start = time.monotonic()
    report = doctor(master_addr="slow.example.invalid", master_port=29500)
    elapsed = time.monotonic() - start
    check = report.by_id("master_addr")
    assert (check.status, check.code) == (Status.FAIL, "RDZV_DNS")
    assert "did not answer within 3 s" in (check.why or "")
    assert elapsed < 7.0  # cut at 3 s, not after the resolver's 10 s; margin for a loaded machine


def test_real_interfaces_and_route_lookup() -> None:
    ifaces = net.interface_addresses()
    lo = net.interface_of("127.0.0.1", ifaces)
    assert lo is not None and "127.0.0.1" in ifaces[lo]
    assert net.source_address_for("127.0.0.1") == "127.0.0.1"
    check = run_doctor(Options(env={"NCCL_SOCKET_IFNAME": f"={lo}", "GLOO_SOCKET_IFNAME": "nope0"}),
                       Probes(query_torch=lambda env: NO_TORCH))
    assert check.by_id("nccl_socket_ifname").status is Status.WARN  # loopback only
    gloo = check.by_id("gloo_socket_ifname")
    assert (gloo.status, gloo.code) == (Status.FAIL, "NCCL_NO_INTERFACE")


@pytest.mark.parametrize(("raw", "exclude", "exact", "names"), [
    ("eth,ib", False, False, ("eth", "ib")),
    ("^docker,lo", True, False, ("docker", "lo")),
    ("=eth0", False, True, ("eth0",)),
    ("^=eth0,eth1", True, True, ("eth0", "eth1")),
    ("mlx5_0:1, eth0 ", False, False, ("mlx5_0", "eth0")),
])
def test_parse_ifname_spec(raw: str, exclude: bool, exact: bool, names: tuple[str, ...]) -> None:
    spec = net.parse_ifname_spec(raw)
    assert (spec.exclude, spec.exact, spec.names) == (exclude, exact, names)


def test_ifname_matching_follows_nccl() -> None:
    assert net.parse_ifname_spec("eth").matches("eth0")
    assert not net.parse_ifname_spec("=eth").matches("eth0")
    assert not net.parse_ifname_spec("^eth").matches("eth0")
    assert net.parse_ifname_spec("^eth").matches("ib0")
    assert not net.parse_ifname_spec("eth0", exact=True).matches("eth01")


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_connect_tries_every_address_when_the_first_refuses(listener: int) -> None:
    # a name answering ::1 (or another address) first while the listener bound only 127.0.0.1
    first = "::1" if _ipv6_loopback() else "127.0.0.2"
    start = time.monotonic()
    probe = net.connect_tcp((first, "127.0.0.1"), listener, timeout_s=3.0, host="master")
    assert probe.ok, probe.detail
    assert probe.host == "master" and "connected to 127.0.0.1" in probe.detail
    assert time.monotonic() - start < 2.5  # the refused first address cost no 3 s timeout


def test_connect_reports_refused_naming_every_address_tried(closed_port: int) -> None:
    probe = net.connect_tcp(("127.0.0.2", "127.0.0.1"), closed_port, timeout_s=3.0)
    assert probe.status is net.ProbeStatus.REFUSED and probe.code == "RDZV_CONN_REFUSED"
    assert "127.0.0.2: refused; 127.0.0.1: refused" in probe.detail


def test_master_addr_is_resolved_once_and_its_addresses_are_connected_to(listener: int) -> None:
    asked: list[str] = []
    connected: list[tuple[str, tuple[str, ...], int]] = []

    def resolve(host: str) -> net.Resolution:
        asked.append(host)
        return net.Resolution(host, ("10.0.0.9", "10.0.0.10"), None, 0.001)

    def connect(host: str, addresses: tuple[str, ...], port: int) -> net.ProbeResult:
        connected.append((host, addresses, port))
        return net.ProbeResult(host, port, net.ProbeStatus.OK, "connected", 0.001)

    report = run_doctor(Options(master_addr="master.example", master_port=listener, nnodes=2,
                                env={}),
                        Probes(query_torch=lambda env: NO_TORCH, resolve=resolve,
                               connect_tcp=connect, hostname=lambda: "node1"))
    assert report.by_id("master_port").status is Status.OK
    assert asked.count("master.example") == 1
    assert connected == [("master.example", ("10.0.0.9", "10.0.0.10"), listener)]


def test_locate_master_counts_any_loopback_as_this_host() -> None:
    from gpuwarden.doctor.probes import locate_master

    ifaces = {"lo": ("127.0.0.1", "::1"), "eth0": ("10.0.0.5",)}
    route = {"10.0.0.9": "10.0.0.5", "10.0.0.5": "10.0.0.5"}.get
    # Debian's /etc/hosts maps the hostname to 127.0.1.1, which no interface lists
    assert locate_master(("127.0.1.1",), ifaces, route) == (True, None)
    assert locate_master(("10.0.0.5",), ifaces, route) == (True, "eth0")
    assert locate_master(("10.0.0.9",), ifaces, route) == (False, "eth0")
    assert locate_master(("10.9.9.9",), ifaces, route) == (False, None)
