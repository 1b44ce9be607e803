"""--max-restarts across two network-namespace hosts: one decision for the whole job, made
once in the job's store, so both nodes restart (or end) at the same attempt, print the same
attempt lines and name the same failure. (The same exception twice ending the job on every
node is the pure test of test_multinode_preflight.py: two launchers' sides on one store.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import test_multinode_jobs as jobs  # noqa: E402
from _netns import Hosts, unavailable_reason  # noqa: E402
from test_multinode_jobs import c10d_line, finish, no_leftovers, start  # noqa: E402

hosts = jobs.hosts  # the same two named hosts' fixture (made once for this module)

SCRIPT = str(Path(__file__).parent / "launch_scripts" / "restart.py")
_reason = unavailable_reason()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""),
              pytest.mark.timeout(150),
              pytest.mark.slow]
RESTART = ["--grace", "2s", "--restart-backoff", "0.5s", "--rdzv-timeout", "30s",
           "--stall-timeout", "15s"]


def _attempt_lines(text: str) -> list[str]:
    return re.findall(r"^gpuwarden: (attempt \d/\d failed: .*)$", text, re.MULTILINE)


def _static(h: Hosts, node: int, port: int) -> list[str]:
    return ["--nnodes", "2", "--node-rank", str(node), "--master-addr", h.addrs[0],
            "--master-port", str(port), "-n", "1"]


def test_a_failure_on_node_1_restarts_both_nodes_and_the_job_finishes(hosts: Hosts) -> None:
    port = 29731
    (code0, text0, _), (code1, text1, _) = finish(
        [start(hosts, n, [*_static(hosts, n, port), "--max-restarts", "2", *RESTART], SCRIPT,
               "raise_last") for n in (0, 1)], timeout=120)
    assert code1 == 0, text1
    assert code0 == 0, text0
    line = "attempt 1/3 failed: RANK_FAILED (rank 1: RuntimeError at "
    assert line in text1 and line in text0  # node 0 names node 1's failure, not its echo
    for rank in range(2):
        assert f"rank {rank} done, restart count 1 of 2, sum 4" in text0 + text1
    no_leftovers(hosts)


def test_a_rank_killed_on_every_attempt_ends_both_nodes_at_the_same_attempt(
        hosts: Hosts) -> None:
    """torchrun's own command line: rank 1 (node 1) is SIGKILLed after init on every attempt;
    node 0's ranks only see the echo (gloo: connection closed). Both nodes restart once, then
    both end, each naming node 1's SIGKILL."""
    port = 29751
    flags = [*c10d_line(hosts, port), "--max-restarts", "1", *RESTART]
    (code0, text0, _), (code1, text1, _) = finish(
        [start(hosts, n, flags, SCRIPT, "kill_always") for n in (0, 1)], timeout=120)
    assert code0 == 1 and code1 == 137, (text0, text1)
    expected = ["attempt 1/2 failed: RANK_FAILED (rank 1: SIGKILL); a cause that can pass: "
                "restarting in 0.5 s",
                "attempt 2/2 failed: RANK_FAILED (rank 1: SIGKILL); no restarts left "
                "(--max-restarts 1)"]
    assert _attempt_lines(text0) == expected and _attempt_lines(text1) == expected, (text0, text1)
    root = f"the job's first failure (RANK_FAILED): rank 1 on node 1 ({hosts.hostnames[1]}): " \
        "killed by SIGKILL(-9)"
    assert root in text0 and root in text1
    no_leftovers(hosts)
