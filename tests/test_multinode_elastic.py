"""Three named network-namespace hosts on a bridge: Slurm's srun recipe (torchrun's c10d line)
on three nodes started in any order, elastic membership (``--nnodes 1:2``: alone, a late node,
a node lost), and waits that are bounded and name the missing host."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _netns import Hosts, make_hosts, remove_hosts, unavailable_reason  # noqa: E402
from test_multinode_jobs import c10d_line, finish, no_leftovers, start  # noqa: E402

STEPS = str(Path(__file__).parent / "launch_scripts" / "mn_steps.py")
_reason = unavailable_reason()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""),
              pytest.mark.timeout(150),
              pytest.mark.slow]


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    h = make_hosts(3, named=True)
    try:
        yield h
    finally:
        remove_hosts(h)


def test_slurms_srun_recipe_on_three_nodes_started_in_any_order(hosts: Hosts) -> None:
    """torchrun's c10d line as Slurm's recipe has it (--nnodes=$SLURM_NNODES, Slurm's
    variables set as srun sets them), the endpoint's host last, 5 s after the first: node ranks
    come from torch's rendezvous (by host name here), every rank gets the sum of all three."""
    port = 29661

    def node(n: int) -> subprocess.Popen[str]:
        return start(hosts, n, _srun_recipe(hosts, port, 3), env=_slurm_env(hosts, n, 3))

    procs = {2: node(2)}
    time.sleep(2.5)
    procs[1] = node(1)
    time.sleep(2.5)
    procs[0] = node(0)
    results = finish([procs[0], procs[1], procs[2]])
    for code, text, _ in results:
        assert code == 0, text
    text = "".join(t for _, t, _ in results)
    assert sorted(re.findall(r"rank (\d)/3 on (\d): all_reduce=(\S+)", text)) == [
        ("0", "0", "6"), ("1", "1", "6"), ("2", "2", "6")]
    no_leftovers(hosts)


def _wait_for(proc_text: list[str], proc: subprocess.Popen[str], pattern: str,
              timeout: float) -> None:
    """Read ``proc``'s stdout into ``proc_text`` until ``pattern`` shows."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    os.set_blocking(proc.stdout.fileno(), False)
    while time.monotonic() < deadline:
        try:
            chunk = os.read(proc.stdout.fileno(), 65536)
        except BlockingIOError:
            chunk = b""
        if chunk:
            proc_text.append(chunk.decode(errors="replace"))
        if re.search(pattern, "".join(proc_text)):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} never showed: {''.join(proc_text)}")


def test_elastic_alone_then_a_late_node_then_that_node_lost(hosts: Hosts) -> None:
    """``--nnodes 1:2`` on host 0 alone: it starts after last_call with a world of 1. Host 1
    comes later: host 0 sees it waiting, both re-rendezvous with a world of 2 (not a restart,
    as torchrun). Then host 1 dies (every process in it SIGKILLed): host 0 names it lost,
    uses its one restart, and finishes alone."""
    port = 29671
    flags = [*c10d_line(hosts, port, nnodes="1:2"), "--max-restarts", "1", "--grace", "2s",
             "--restart-backoff", "0.5s",
             "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1"]
    env = {"STEPS": "150", "STEP_S": "0.1", "STEPS_AFTER_RESTART": "3"}
    first = start(hosts, 0, flags, STEPS, env=env)
    out0: list[str] = []
    _wait_for(out0, first, r"rank 0/1 step 0", 60)  # alone, after last_call
    late = start(hosts, 1, flags, STEPS, env=env)
    out1: list[str] = []
    _wait_for(out1, late, r"rank 1/2 step 0", 60)  # joined: a world of 2
    for pid in subprocess.run(["ip", "netns", "pids", hosts.names[1]], capture_output=True,
                              text=True).stdout.split():
        os.kill(int(pid), signal.SIGKILL)  # host 1 is gone
    late.wait(10)
    [(code, text, _)] = finish([first], timeout=90)
    text = "".join(out0) + text
    assert code == 0, text
    assert "node(s) waiting to join the job: re-rendezvous with the new set of nodes (a " \
        "membership change, not counted as a restart)" in text
    assert "rank 0/2 step 0 sum 2 restart 0" in text
    assert (f"attempt 1/2 failed: NODE_LOST (node 1 ({hosts.hostnames[1]}): went silent") in text
    assert re.search(r"rank 0/1 step 2 sum 1 restart 1", text), text
    no_leftovers(hosts)


def _slurm_env(h: Hosts, node: int, nnodes: int) -> dict[str, str]:
    """What srun --nodes=N --ntasks-per-node=1 sets on node ``node`` (hosts n0..n<N-1>)."""
    tag = h.hostnames[0].split("-", 1)[1]
    nodelist = f"n[0-{nnodes - 1}]-{tag}"
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": str(nnodes),
            "SLURM_NNODES": str(nnodes), "SLURM_JOB_NODELIST": nodelist,
            "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_NUM_NODES": str(nnodes),
            "SLURM_STEP_NUM_TASKS": str(nnodes), "SLURM_NTASKS": str(nnodes),
            "SLURM_STEP_ID": "0", "SLURM_NODEID": str(node), "SLURM_PROCID": str(node),
            "SLURM_LOCALID": "0"}


def _srun_recipe(h: Hosts, port: int, nnodes: int, *extra: str) -> list[str]:
    """`srun torchrun --nnodes=$SLURM_NNODES --nproc-per-node=N --rdzv-backend=c10d
    --rdzv-endpoint=$head:PORT train.py`, as Slurm users paste it."""
    return [f"--nnodes={nnodes}", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={h.hostnames[0]}:{port}", *extra]


def test_a_node_of_the_allocation_that_never_joins_is_named_by_its_host(hosts: Hosts) -> None:
    """Slurm's node list says who should come: the wait of the endpoint's node, bounded by
    join_timeout, names the host that did not (the second node of a two-node allocation)."""
    port = 29691
    begin = time.monotonic()
    [(code, text, end)] = finish([start(hosts, 0, _srun_recipe(hosts, port, 2, "--rdzv-conf",
                                                               "join_timeout=4"),
                                        env=_slurm_env(hosts, 0, 2))])
    assert code == 1, text
    assert f"error[RDZV_WORKERS_MISSING]: the rendezvous at {hosts.hostnames[0]}:{port} did " \
        f"not complete within 4 s (join_timeout): 1 of 2 node(s) joined ({hosts.hostnames[0]}); " \
        f"missing: {hosts.hostnames[1]}" in text, text
    assert end - begin < 4 + 30  # the agent's torch import (seconds on a loaded host), then join_timeout
    no_leftovers(hosts)


def test_the_endpoints_host_that_never_comes_is_named_within_the_join_timeout(
        hosts: Hosts) -> None:
    port = 29692
    begin = time.monotonic()
    [(code, text, end)] = finish([start(hosts, 1, [*c10d_line(hosts, port), "--rdzv-conf",
                                                   "join_timeout=3"])])
    assert code == 1, text
    assert "error[RDZV_CONN_REFUSED]" in text, text
    assert f"missing: the store's host {hosts.hostnames[0]}" in text
    assert end - begin < 3 + 30  # probing, not the agent, bounds it; a loaded host is slow
    no_leftovers(hosts)
