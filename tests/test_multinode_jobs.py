"""Multi-node jobs across network-namespace hosts: real launchers, real gloo ranks, one store.

The torch-heavy cases live here (each rank imports torch: ~1.5 s of CPU), on two hosts made
once for the module; each test uses its own port.
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
              pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    h = make_hosts(2)
    try:
        for i in range(2):  # each host's name resolves to its own address, as on a real cluster
            h.write_hosts(i, [f"{h.addrs[i]} {os.uname().nodename}"])
        yield h
    finally:
        remove_hosts(h)


_port = iter(range(29611, 29700))


def _launch(h: Hosts, node: int, port: int, *extra: str, env: dict[str, str] | None = None,
            c10d: bool = False) -> subprocess.Popen[str]:
    where = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{h.addrs[0]}:{port}", "--rdzv-id",
             "job-c10d"] if c10d else ["--master-addr", h.addrs[0], "--master-port", str(port)]
    argv = [GPUWARDEN, "launch", "--nnodes", "2", "--node-rank", str(node), *where, "-n", "2",
            "--cpu", *extra, SCRIPT]
    return subprocess.Popen(h.cmd(node, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})


def _finish(procs: list[subprocess.Popen[str]], timeout: float = 90) -> list[tuple[int, str, float]]:
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


def _no_leftovers(h: Hosts) -> None:
    deadline = time.monotonic() + 5
    while h.pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert h.pids() == [], "processes left in the namespaces"


def test_two_nodes_two_ranks_all_reduce(hosts: Hosts) -> None:
    port = next(_port)
    results = _finish([_launch(hosts, 0, port), _launch(hosts, 1, port)])
    for code, text, _ in results:
        assert code == 0, text
    lines = re.findall(r"rank (\d)/4 on (\d): all_reduce=(\S+)", results[0][1] + results[1][1])
    assert sorted(lines) == [("0", "0", "10"), ("1", "0", "10"), ("2", "1", "10"),
                             ("3", "1", "10")]  # 1+2+3+4, ranks numbered node by node
    _no_leftovers(hosts)


def test_two_nodes_with_torchruns_c10d_command_line(hosts: Hosts) -> None:
    """`--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID --nnodes 2 --node-rank R`, as
    pasted from a torchrun job: the same job on the store at the endpoint."""
    port = next(_port)
    results = _finish([_launch(hosts, 0, port, c10d=True), _launch(hosts, 1, port, c10d=True)])
    for code, text, _ in results:
        assert code == 0, text
    lines = re.findall(r"rank (\d)/4 on (\d): all_reduce=(\S+)", results[0][1] + results[1][1])
    assert sorted(lines) == [("0", "0", "10"), ("1", "0", "10"), ("2", "1", "10"), ("3", "1", "10")]
    _no_leftovers(hosts)


def test_node_never_started_is_named_by_node_0(hosts: Hosts) -> None:
    port, stall_s = next(_port), 4.0
    [(code, text, _)] = _finish([_launch(hosts, 0, port, "--stall-timeout", f"{stall_s:g}s")])
    assert code == 1, text
    assert "error[RDZV_WORKERS_MISSING]" in text
    assert "rank(s) 2, 3 (node 1) of 4 did not get there" in text, text
    assert "last seen: never" in text
    waited = [float(w) for w in re.findall(r"waiting in init_process_group for ([\d.]+) s", text)]
    assert waited and max(waited) < stall_s + 2.0, text  # named within stall timeout + 2 s
    _no_leftovers(hosts)


def test_rank_crash_on_node_1_stops_both_nodes(hosts: Hosts, tmp_path: Path) -> None:
    port, grace_s = next(_port), 3.0
    stamp = tmp_path / "crash-time"
    # the others sleep 120 s outside any collective; rank 3 writes when it crashes
    env = {"CRASH_RANK": "3", "CRASH_STAMP": str(stamp)}
    start = time.monotonic()
    results = _finish([_launch(hosts, 0, port, "--grace", f"{grace_s:g}s", env=env),
                       _launch(hosts, 1, port, "--grace", f"{grace_s:g}s", env=env)])
    (code0, text0, end0), (code1, text1, end1) = results
    assert code1 == 1 and "rank 3 failed first: RuntimeError: rank 3 crashed on purpose" in text1
    assert code0 == 1 and "error[NODE_ABORTED]" in text0, text0
    assert "rank 3 (node 1" in text0 and "crashed on purpose" in text0, text0
    crashed_at = float(stamp.read_text())
    # both launchers, on both nodes, are gone within grace + 2 s of the crash
    assert end1 - crashed_at < grace_s + 2.0, f"node 1 exited {end1 - crashed_at:.1f} s after the crash"
    assert end0 - crashed_at < grace_s + 2.0, f"node 0 exited {end0 - crashed_at:.1f} s after the crash"
    assert max(end0, end1) - start < 40, "the job was not stopped early"
    _no_leftovers(hosts)
