"""Multi-node jobs across network-namespace hosts: real launchers, real gloo ranks.

Two hosts made once for the module, each with its own host name (``n0-<tag>``, ``n1-<tag>``)
that every host resolves, as on a cluster; each test uses its own port. Every launcher starts
its node agent (torch's c10d rendezvous) and its ranks import torch: the tests run one or two
ranks per node and short timeouts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _netns import Hosts, make_hosts, remove_hosts, unavailable_reason  # noqa: E402

SCRIPT = str(Path(__file__).parent / "launch_scripts" / "mn_allreduce.py")
GPUWARDEN = str(Path(sys.executable).parent / "gpuwarden")
_reason = unavailable_reason()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""),
              pytest.mark.timeout(120),
              pytest.mark.slow]


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    h = make_hosts(2, named=True)
    try:
        yield h
    finally:
        remove_hosts(h)


_port = iter(range(29611, 29700))


def c10d_line(h: Hosts, port: int, nnodes: str = "2", nproc: str = "1") -> list[str]:
    """torchrun's multi-node command line, the same on every node (torchrun's docs)."""
    return [f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--rdzv-id=job1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={h.hostnames[0]}:{port}"]


def start(h: Hosts, node: int, flags: list[str], script: str = SCRIPT, *args: str,
          env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    argv = [GPUWARDEN, "launch", *flags, "--cpu", script, *args]
    return subprocess.Popen(h.cmd(node, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})


def _static(h: Hosts, node: int, port: int, *extra: str) -> list[str]:
    return ["--nnodes", "2", "--node-rank", str(node), "--master-addr", h.addrs[0],
            "--master-port", str(port), *extra]


def finish(procs: list[subprocess.Popen[str]], timeout: float = 90) -> list[tuple[int, str, float]]:
    """(exit code, stdout+stderr, monotonic end time) per launcher, in order."""
    ends: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(ends) < len(procs) and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if i not in ends and p.poll() is not None:
                ends[i] = time.monotonic()
        time.sleep(0.05)
    out = []
    for i, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
        so, se = p.communicate(timeout=10)
        out.append((p.returncode, so + se, ends.get(i, float("inf"))))
    return out


def no_leftovers(h: Hosts) -> None:
    deadline = time.monotonic() + 5
    while h.pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert h.pids() == [], "processes left in the namespaces"


def sums(text: str) -> list[tuple[str, str]]:
    return sorted(re.findall(r"rank (\d)/\d on \d: all_reduce=(\S+)", text))


def test_static_two_nodes_two_ranks_each(hosts: Hosts) -> None:
    """--node-rank numbering (torchrun's static rendezvous): RANK = node * 2 + local rank."""
    port = next(_port)
    results = finish([start(hosts, 0, _static(hosts, 0, port, "-n", "2")),
                      start(hosts, 1, _static(hosts, 1, port, "-n", "2"))])
    for code, text, _ in results:
        assert code == 0, text
    lines = re.findall(r"rank (\d)/4 on (\d): all_reduce=(\S+)", results[0][1] + results[1][1])
    assert sorted(lines) == [("0", "0", "10"), ("1", "0", "10"), ("2", "1", "10"),
                             ("3", "1", "10")]  # 1+2+3+4, ranks numbered node by node
    no_leftovers(hosts)


def test_torchruns_c10d_line_started_5s_apart_on_a_store_host_whose_name_is_loopback(
        hosts: Hosts) -> None:
    """The line every node runs unchanged (no --node-rank), the node that is not the endpoint's
    host first, 5 s before it: it says it waits for the store, then joins. The endpoint's host
    has Debian's /etc/hosts (its own name on 127.0.1.1) while the other node resolves the name
    to the network: torchrun runs this; gpuwarden too, naming the address it advertises
    instead and pinning Gloo to its interface."""
    port = next(_port)
    name0, name1 = hosts.hostnames
    hosts.write_hosts(0, [f"127.0.1.1 {name0}", f"{hosts.addrs[1]} {name1}"])
    try:
        late = start(hosts, 1, c10d_line(hosts, port))
        time.sleep(5)
        results = finish([start(hosts, 0, c10d_line(hosts, port)), late])
    finally:
        hosts.write_hosts(0, [f"{hosts.addrs[0]} {name0}", f"{hosts.addrs[1]} {name1}"])
    (code0, text0, _), (code1, text1, _) = results
    assert code0 == 0 and code1 == 0, (text0, text1)
    assert sums(text0 + text1) == [("0", "3"), ("1", "3")]
    assert "refused the connection" in text1  # said as it waited, then joined
    assert f"advertises {hosts.addrs[0]} ({hosts.ifaces[0]})" in text0, text0
    assert f"GLOO_SOCKET_IFNAME={hosts.ifaces[0]}" in text0, text0
    no_leftovers(hosts)


def test_a_crash_on_node_1_is_named_identically_on_both_nodes(hosts: Hosts,
                                                             tmp_path: Path) -> None:
    port, grace_s = next(_port), 3.0
    stamp = tmp_path / "crash-time"
    # rank 1 (the second host's: torch orders the nodes by name) raises after init while rank 0
    # sleeps outside any collective: only the job's store can stop it early
    env = {"CRASH_RANK": "1", "CRASH_STAMP": str(stamp)}
    start_at = time.monotonic()
    flags = [*c10d_line(hosts, port), "--grace", f"{grace_s:g}s"]
    (code0, text0, end0), (code1, text1, end1) = finish(
        [start(hosts, 0, flags, env=env), start(hosts, 1, flags, env=env)])
    root = (f"the job's first failure (RANK_FAILED): rank 1 on node 1 ({hosts.hostnames[1]}): "
            "RuntimeError: rank 1 crashed on purpose")
    assert code1 == 1 and "error[RANK_FAILED]: rank 1 failed first: RuntimeError: rank 1 " \
        "crashed on purpose" in text1, text1
    assert code0 == 1 and "error[NODE_ABORTED]: rank 1 on node 1" in text0, text0
    assert root in text0 and root in text1, (text0, text1)
    crashed_at = float(stamp.read_text())
    # both launchers, on both nodes, are gone soon after the crash (rank 0 would sleep 120 s;
    # a generous bound: the machine is shared, bench_multinode.py measures the time)
    assert end1 - crashed_at < grace_s + 8.0, f"node 1 exited {end1 - crashed_at:.1f} s after"
    assert end0 - crashed_at < grace_s + 8.0, f"node 0 exited {end0 - crashed_at:.1f} s after"
    assert max(end0, end1) - start_at < 60, "the job was not stopped early"
    no_leftovers(hosts)


def test_a_node_that_never_comes_is_named_within_the_join_timeout(hosts: Hosts) -> None:
    """Node 0 hosts the store and waits for node 1, bounded by --rdzv-timeout (join_timeout),
    naming who joined and who is missing; no rank starts."""
    port, timeout_s = next(_port), 4.0
    begin = time.monotonic()
    [(code, text, end)] = finish([start(hosts, 0, _static(hosts, 0, port, "--rdzv-timeout",
                                                          f"{timeout_s:g}s"))])
    assert code == 1, text
    assert (f"error[RDZV_WORKERS_MISSING]: the rendezvous at {hosts.addrs[0]}:{port} did not "
            f"complete within") in text, text
    assert f"1 of 2 node(s) joined (node 0 ({hosts.hostnames[0]})); missing: node 1" in text
    assert "rendezvous at" in text.split("error[")[0]  # said while it waited (after 2 s)
    assert end - begin < timeout_s + 30  # torch's import in the agent (slow on a loaded host), then the bound
    assert "[rank" not in text
    no_leftovers(hosts)
