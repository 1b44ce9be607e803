"""--max-restarts across two network-namespace hosts: a failure on node 1 restarts both nodes
on the same attempt number, on a rendezvous port both derive from it (--master-port + attempt);
the same exception twice ends both."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import test_multinode_jobs as jobs  # noqa: E402
from _netns import Hosts, unavailable_reason  # noqa: E402
from test_multinode_jobs import GPUWARDEN, _finish, _no_leftovers  # noqa: E402

hosts = jobs.hosts  # the same two namespace hosts' fixture (made once for this module)

SCRIPT = str(Path(__file__).parent / "launch_scripts" / "restart.py")
_reason = unavailable_reason()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""),
              pytest.mark.timeout(150)]


def _job(h: Hosts, port: int, mode: str, restarts: int) -> list[tuple[int, str, float]]:
    import subprocess

    procs = []
    for node in (0, 1):
        argv = [GPUWARDEN, "launch", "--nnodes", "2", "--node-rank", str(node), "--master-addr",
                h.addrs[0], "--master-port", str(port), "-n", "2", "--cpu", "--grace", "2s",
                "--max-restarts", str(restarts), "--restart-backoff", "0.5s", "--rdzv-timeout", "20s",
                "--stall-timeout", "15s",
                SCRIPT, mode]
        procs.append(subprocess.Popen(h.cmd(node, argv), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=dict(os.environ)))
    return _finish(procs, timeout=120)


def test_a_failure_on_node_1_restarts_both_nodes_and_the_job_finishes(hosts: Hosts) -> None:
    (code0, text0, _), (code1, text1, _) = _job(hosts, 29731, "raise_last", 2)
    assert code1 == 0, text1
    assert code0 == 0, text0
    assert "attempt 1/3 failed: RANK_FAILED (rank 3: RuntimeError at " in text1
    assert "attempt 1/3 failed:" in text0  # node 0 learnt of it and restarted too
    for rank in range(4):
        assert f"rank {rank} done, restart count 1 of 2, sum 16" in text0 + text1
    _no_leftovers(hosts)


def test_the_same_exception_twice_on_node_1_ends_both_nodes(hosts: Hosts) -> None:
    (code0, text0, _), (code1, text1, _) = _job(hosts, 29741, "keyerror", 4)
    assert code1 == 1 and "same failure twice, not restarting" in text1, text1
    assert "attempt 1/5 failed: RANK_FAILED (rank 3: KeyError at " in text1
    assert "attempt 3/5" not in text1
    # node 0 decides alike when node 1's record reached it through the job's store; when its
    # ranks failed on the echo first (the record lost with the store), it restarts once more,
    # and the restarted attempt that node 1 never joins ends at --stall-timeout
    assert code0 == 1, text0
    assert "same failure twice, not restarting" in text0 or "other nodes did not join the " \
        "restarted attempt (they ended the job), not restarting" in text0, text0
    assert "attempt 4/5" not in text0
    _no_leftovers(hosts)
