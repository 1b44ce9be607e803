"""`gpuwarden stacks` across two namespace hosts: the job of test_status_jobs.py (rank 2 sleeps
before every all_reduce) with two ranks on each node; one `stacks` on node 0 answers for both
nodes, node 1's ranks through the job's own c10d store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _netns import Hosts, make_hosts, remove_hosts, unavailable_reason  # noqa: E402

SCRIPT = str(Path(__file__).parent / "launch_scripts" / "straggler.py")
GPUWARDEN = str(Path(sys.executable).parent / "gpuwarden")
PORT = 29731
_reason = unavailable_reason()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""),
              pytest.mark.timeout(180),
              pytest.mark.slow, pytest.mark.xdist_group("status-two-nodes")]


@dataclass
class TwoNodes:
    hosts: Hosts
    launchers: list[subprocess.Popen[bytes]]
    logs: Path
    stop: Path


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:
    d = tmp_path_factory.mktemp("two-nodes")
    hosts = make_hosts(2)
    launchers: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(2):
            hosts.write_hosts(i, [f"{hosts.addrs[i]} {os.uname().nodename}"])
        env = {**os.environ, "SLOW_RANK": "2", "SLOW_DELAY_S": "1", "STOP_FILE": str(d / "stop"),
               "STAMP_DIR": str(d)}
        for node in range(2):
            # node 1 holds the straggler: its launcher is told to keep quiet about it
            quiet = ["--no-straggler-note"] if node == 1 else []
            argv = [GPUWARDEN, "launch", "--nnodes", "2", "--node-rank", str(node),
                    "--master-addr", hosts.addrs[0], "--master-port", str(PORT), "-n", "2",
                    "--cpu", *quiet, SCRIPT]
            with open(d / f"node{node}.out", "wb") as out, open(d / f"node{node}.err", "wb") as err:
                launchers.append(subprocess.Popen(hosts.cmd(node, argv), stdout=out, stderr=err,
                                                  env=env, start_new_session=True))
        deadline = time.monotonic() + 90
        while not (d / "first_step").exists():
            assert time.monotonic() < deadline, (d / "node0.err").read_text()
            assert all(p.poll() is None for p in launchers), (d / "node1.err").read_text()
            time.sleep(0.2)
        job = TwoNodes(hosts, launchers, d, d / "stop")
        yield job
        # After the module's tests, whatever their order (a test that stopped the job would
        # have to run last): a failure here is an error at the teardown of the last one.
        both_nodes_end_cleanly_with_only_the_scripts_lines(job)
    finally:
        (d / "stop").touch()
        for p in launchers:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        remove_hosts(hosts)


def test_one_stacks_answers_for_both_nodes(job: TwoNodes) -> None:
    """Rank 2 sleeps 1 s per step, then joins the others' all_reduce: a sample can find it in
    there too (the collective takes a while at load 10, and across the two hosts), which is a
    right answer for that instant. So the tests sample until they see it away (5 samples at
    most; each answer must be one of the two)."""
    node0 = str(job.launchers[0].pid)
    for _ in range(5):
        r = subprocess.run(job.hosts.cmd(0, [GPUWARDEN, "stacks", "--json", node0]),
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        # answered means within the launcher's 1.5 s wait for other nodes
        assert [(n["node"], n["answered"]) for n in doc["nodes"]] == [(0, True), (1, True)], \
            doc["nodes"]
        assert {r["rank"]: r["node"] for r in doc["ranks"]} == {0: 0, 1: 0, 2: 1, 3: 1}
        groups = [(g["ranks"], g["nodes"], g["odd"]) for g in doc["groups"]]
        assert doc["groups"][0]["wait"]["op"] == "all_reduce"
        if groups != [([0, 1, 2, 3], [0, 1], False)]:  # the straggler caught in the collective
            break
    assert groups == [([0, 1, 3], [0, 1], False), ([2], [1], True)]
    for _ in range(5):
        text = subprocess.run(job.hosts.cmd(1, [GPUWARDEN, "stacks", str(job.launchers[1].pid)]),
                              capture_output=True, text=True, timeout=30).stdout
        if "rank 2 [node 1: 2] (1 of 4): running" in text:
            break
    assert "ranks 0-1, 3 [node 0: 0-1; node 1: 3] (3 of 4): waiting in all_reduce" in text, text
    assert "rank 2 [node 1: 2] (1 of 4): running: <module> at straggler.py:" in text, text


def test_node_1_names_its_straggler_in_status_but_keeps_quiet_when_told(job: TwoNodes) -> None:
    node1 = str(job.launchers[1].pid)
    deadline = time.monotonic() + 40
    while True:
        r = subprocess.run([GPUWARDEN, "status", "--json", node1], capture_output=True, text=True,
                           timeout=30)
        launch = json.loads(r.stdout)["jobs"][0]["launch"]
        if launch and launch.get("straggler"):
            break
        assert time.monotonic() < deadline, r.stdout
        time.sleep(0.5)
    assert launch["straggler"]["rank"] == 2 and launch["node_rank"] == 1
    assert [row["rank"] for row in launch["ranks"]] == [2, 3]
    time.sleep(5)  # longer than the launcher waits before its note: it would have said it
    assert "RANK_STRAGGLER" not in (job.logs / "node1.err").read_text()


def both_nodes_end_cleanly_with_only_the_scripts_lines(job: TwoNodes) -> None:
    """The shared job's end, however often stacks and status asked its ranks: both launchers
    exit 0, the ranks printed only the script's lines, nothing is left in the namespaces."""
    job.stop.touch()
    for node, p in enumerate(job.launchers):
        assert p.wait(60) == 0, (job.logs / f"node{node}.err").read_text()
    for node in range(2):
        out = (job.logs / f"node{node}.out").read_text().splitlines()
        ranks = (2 * node, 2 * node + 1)
        assert sorted(out) == sorted([f"[rank{r}]: rank {r} {w}" for r in ranks
                                      for w in ("ready", "done")]), out
    deadline = time.monotonic() + 15
    while job.hosts.pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job.hosts.pids() == []
