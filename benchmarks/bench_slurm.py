"""Slurm: gpuwarden launch beside torchrun on a real Slurm (not a test).

    sudo python benchmarks/bench_slurm.py [--repeat 3] [--cap 90] [--two-hosts]

The cluster of the tests (tests/_slurm.py: Debian's slurm-wlm 22.05 and munge, slurmctld and
two slurmd, Gres=gpu:2 per node, proctrack/linuxproc, KillWait=10), two ranks per node of
tests/launch_scripts/slurm_train.py (gloo on CPU, torch imported in every rank). The same
Slurm command lines under both launchers; torchrun's are its documented ones (one node:
``--standalone --nproc-per-node=2``; two nodes: Slurm's recipe, c10d at the first node:29500).

1. launch -> finish, one node: ``srun --nodes=1 --gres=gpu:2 LAUNCHER train.py``, the wall time
   of srun (Slurm's step creation included);
2. launch -> finish, two nodes: ``srun --nodes=2 --ntasks-per-node=1 --gres=gpu:2 ...``;
   gpuwarden with no flag (everything from Slurm) and with torchrun's c10d line;
3. scancel -> nothing left: a two-node batch job whose ranks wait after init; from scancel to
   the moment no process of the job is left (by process, in the cluster's namespaces);
4. a node's launcher killed -> job ended: the same job, SIGKILL to the launcher (torchrun: its
   agent) on the second node; until Slurm records the job ended, capped at --cap (then
   scancel); the job's processes still there at that moment, and those left behind once
   scancel and KillWait are through (parent pid 1: Slurm's proctrack/linuxproc no longer
   finds them, and they run on).

Each number is the median of --repeat runs, with the spread.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests._slurm import Cluster, cluster_of, unavailable_reason  # noqa: E402

TRAIN = ROOT / "tests" / "launch_scripts" / "slurm_train.py"
ONE_NODE = {
    "gpuwarden": "gpuwarden launch train.py",
    "torchrun": "torchrun --standalone --nproc-per-node=2 train.py",
}
# The id is the job's in a batch script; srun's line is expanded on the login host, where
# SLURM_JOB_ID is not set yet: a fixed one (each run's store is gone before the next starts).
C10D = ("--nnodes=2 --nproc-per-node=2 --rdzv-id=bench --rdzv-backend=c10d "
        "--rdzv-endpoint=n1:29500 train.py")
TWO_NODES = {
    "gpuwarden (no flag)": "gpuwarden launch train.py",
    "gpuwarden (c10d line)": f"gpuwarden launch {C10D}",
    "torchrun (c10d line)": f"torchrun {C10D}",
}
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def timed_srun(c: Cluster, work: Path, options: str, line: str) -> float:
    start = time.monotonic()
    r = c.run(["bash", "-c", f"srun {options} {line}"], cwd=work, timeout=300)
    took = time.monotonic() - start
    if r.returncode != 0 or r.stdout.count("train:") < 2:
        raise RuntimeError(f"{line}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    return took


def hold_job(c: Cluster, work: Path, line: str) -> tuple[int, Path]:
    """A two-node batch job whose four ranks wait after init; (job, hold dir) once they do."""
    hold = Path(tempfile.mkdtemp(dir=work))
    job = c.sbatch(f"#!/bin/bash\nsrun {line}\n", "--nodes=2", "--ntasks-per-node=1",
                   "--gres=gpu:2", f"--output={hold}/out", cwd=work,
                   env={"TRAIN_HOLD_DIR": str(hold)})
    deadline = time.monotonic() + 180
    while not all((hold / f"ready.{r}").exists() for r in range(4)):
        if time.monotonic() > deadline or c.state(job) in ENDED:
            raise RuntimeError(f"{line}: the ranks never got ready\n"
                               + ((hold / "out").read_text() if (hold / "out").exists() else ""))
        time.sleep(0.05)
    return job, hold


def scancel_to_nothing_left(c: Cluster, work: Path, line: str) -> float:
    job, _ = hold_job(c, work, line)
    start = time.monotonic()
    c.check(["scancel", str(job)])
    left = c.wait_no_job_processes(120)
    if left:
        raise RuntimeError(f"left after 120 s: {c.describe(left)}")
    return time.monotonic() - start


def launcher_killed(c: Cluster, work: Path, line: str, cap: float) -> tuple[float, int, int]:
    """(seconds until the job ended, or inf at the cap; the job's processes still there at
    that moment; its processes left behind after scancel and KillWait, parent pid 1)."""
    job, _ = hold_job(c, work, line)
    name = "gpuwarden launch" if line.startswith("gpuwarden") else "torchrun"
    victims = [p for p, _ in c.processes("n2", name)]
    if len(victims) != 1:
        raise RuntimeError(f"{name} on n2: {c.processes('n2')}")
    start = time.monotonic()
    os.kill(victims[0], signal.SIGKILL)
    took = float("inf")
    while time.monotonic() - start < cap:
        if c.state(job) in ENDED:
            took = time.monotonic() - start
            break
        time.sleep(0.1)
    time.sleep(1.0)  # what the job's end left, a moment later (not Slurm's own teardown)
    left = len([p for p in c.job_pids() if "slurmstepd" not in c.describe([p])])
    c.run(["scancel", str(job)])
    c.wait_no_job_processes(15)  # KillWait (10 s) and a margin
    orphans = [p for p in c.job_pids() if _ppid(p) == 1 and "slurmstepd" not in c.describe([p])]
    for pid in orphans:  # processes of this benchmark's job, in the cluster's namespaces
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    c.wait_no_job_processes(120)
    return took, left, len(orphans)


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def median(xs: list[float]) -> str:
    finite = [x for x in xs if x != float("inf")]
    if len(finite) < len(xs) / 2:
        return f"not within the cap ({len(xs) - len(finite)} of {len(xs)})"
    m = statistics.median(xs)
    spread = f" ({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 and max(xs) != float("inf") \
        else (f" ({len(xs) - len(finite)} of {len(xs)} past the cap)" if len(finite) < len(xs)
              else "")
    return f"{m:.2f} s{spread}"


def repeat(n: int, fn: Callable[[], float]) -> list[float]:
    return [fn() for _ in range(n)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cap", type=float, default=90.0)
    p.add_argument("--two-hosts", action="store_true",
                   help="each slurmd in its own network and UTS namespace")
    p.add_argument("--only", default="", help="comma-separated parts: 1,2,3,4")
    args = p.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    parts = set(args.only.split(",")) if args.only else {"1", "2", "3", "4"}
    work = Path(tempfile.mkdtemp(prefix="bench-slurm-"))
    shutil.copy(TRAIN, work / "train.py")
    rows: list[tuple[str, str, str]] = []
    load = os.getloadavg()[0]
    with cluster_of(two_hosts=args.two_hosts) as c:
        if "1" in parts:
            for who, line in ONE_NODE.items():
                xs = repeat(args.repeat, lambda line=line: timed_srun(
                    c, work, "--nodes=1 --gres=gpu:2", line))
                rows.append(("launch -> finish, 1 node x 2 ranks", who, median(xs)))
        if "2" in parts:
            for who, line in TWO_NODES.items():
                xs = repeat(args.repeat, lambda line=line: timed_srun(
                    c, work, "--nodes=2 --ntasks-per-node=1 --gres=gpu:2", line))
                rows.append(("launch -> finish, 2 nodes x 2 ranks", who, median(xs)))
        if "3" in parts:
            for who, line in (("gpuwarden", TWO_NODES["gpuwarden (no flag)"]),
                              ("torchrun", TWO_NODES["torchrun (c10d line)"])):
                xs = repeat(args.repeat, lambda line=line: scancel_to_nothing_left(c, work, line))
                rows.append(("scancel -> nothing left, 2 nodes", who, median(xs)))
        if "4" in parts:
            for who, line in (("gpuwarden", TWO_NODES["gpuwarden (no flag)"]),
                              ("torchrun", TWO_NODES["torchrun (c10d line)"])):
                runs = [launcher_killed(c, work, line, args.cap) for _ in range(args.repeat)]
                rows.append(("n2's launcher SIGKILLed -> job ended", who,
                             f"{median([t for t, _, _ in runs])}; the job's processes at that "
                             f"moment: {[n for _, n, _ in runs]}; left behind after scancel "
                             f"(parent pid 1): {[n for _, _, n in runs]}"))
    shutil.rmtree(work, ignore_errors=True)
    load = max(load, os.getloadavg()[0])
    print(f"| {'two hosts' if args.two_hosts else 'one host'}, median of {args.repeat} "
          f"| launcher | time |\n|---|---|---|")
    for what, who, value in rows:
        print(f"| {what} | {who} | {value} |")
    print(f"\nload average (1 min) up to {load:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
