"""--max-restarts beside torchrun's (not a test): 2 ranks, gloo on CPU.

    python benchmarks/bench_restart.py [--repeat 3]

1. recovery: rank 1 is SIGKILLed after its first step on attempt 0 (--max-restarts 1); the
   time from its death to the first step of the next attempt (every rank past init_process_group
   and one all_reduce), for gpuwarden with --restart-backoff 0 and with the default 1s, and for
   torchrun --standalone. A run still going after 90 s is killed and counted as failed (hung).
2. a deterministic bug: rank 1 raises the same KeyError after init on every attempt,
   --max-restarts 3; wall time from start to exit and the attempts run (torchrun runs all 4,
   gpuwarden stops after the second).
Times are monotonic stamps the ranks write themselves (one clock for the whole machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _procs import wait_or_kill_tree

ROOT = Path(__file__).resolve().parents[1]
RANK = ROOT / "benchmarks" / "scripts" / "restart_rank.py"
BIN = Path(sys.executable).parent
CAP_S = 90.0  # a run still going after this is counted as hung (and its process group killed)


def _run(tool: str, mode: str, restarts: int, extra: list[str]) -> tuple[float, Path, int]:
    stamps = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    env = {**os.environ, "STAMP_DIR": str(stamps), "BENCH_MODE": mode,
           "GPUWARDEN_SIMULATE": str(ROOT / "tests" / "scenarios" / "nogpu.json")}
    if tool == "torchrun":
        argv = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
                "--max-restarts", str(restarts), *extra, str(RANK)]
    else:
        argv = [str(BIN / "gpuwarden"), "launch", "-n", "2", "--cpu",
                "--max-restarts", str(restarts), *extra, str(RANK)]
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    # torchrun's restarted attempt can hang in its rendezvous: -1 when it outlived the cap
    code = wait_or_kill_tree(proc, CAP_S)
    if code is None:
        code = -1
    return time.monotonic() - start, stamps, code


def recovery(tool: str, extra: list[str]) -> float | None:
    """Seconds from the death to the restarted attempt's first step; None: it never got there
    (torchrun's restarted gloo ranks connect to the old attempt's addresses: connectFullMesh
    'Connection refused', the job fails)."""
    _, stamps, code = _run(tool, "kill_once", 1, extra)
    steps = [float(p.read_text()) for p in stamps.glob("step_1_*")]
    if code != 0 or len(steps) < 2:
        return None
    return max(steps) - float((stamps / "failed").read_text())


def deterministic(tool: str, extra: list[str]) -> tuple[float, int, int]:
    """Wall time, attempts started, attempts that reached the bug (torchrun's restarted gloo
    attempts may fail in their rendezvous before)."""
    wall, stamps, code = _run(tool, "keyerror", 3, extra)
    assert code != 0
    if code == -1:
        wall = float("inf")
    started = {p.name.split("_")[1] for p in stamps.glob("start_*")}
    return wall, len(started), len(list(stamps.glob("failed_*")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cases = [("gpuwarden --restart-backoff 0", "gpuwarden", ["--restart-backoff", "0"]),
             ("gpuwarden (backoff 1s, default)", "gpuwarden", []),
             ("torchrun --standalone", "torchrun", [])]
    print(f"1. from a rank's SIGKILL to the next attempt's first step (median of {args.repeat})")
    for label, tool, extra in cases:
        got = [recovery(tool, extra) for _ in range(args.repeat)]
        times = [t for t in got if t is not None]
        failed = f", {len(got) - len(times)} of {len(got)} restarts failed" if len(times) < len(got) \
            else ""
        line = (f"{statistics.median(times):6.2f} s  (min {min(times):.2f}, max {max(times):.2f}"
                f"{failed})") if times else f"never: the restarted attempt failed ({len(got)} of {len(got)})"
        print(f"   {label:34} {line}")
    print("2. the same KeyError on every attempt, --max-restarts 3: wall time, attempts started "
          "(of them, reached the KeyError)")
    for label, tool, extra in cases:
        runs = [deterministic(tool, extra) for _ in range(args.repeat)]
        walls = [w for w, _, _ in runs]
        wall = statistics.median(walls)
        shown = f"{wall:6.2f} s" if wall != float("inf") else f"hung (killed at {CAP_S:g} s)"
        print(f"   {label:34} {shown}  attempts "
              f"{max(r[1] for r in runs)} ({min(r[2] for r in runs)}-{max(r[2] for r in runs)})")


if __name__ == "__main__":
    main()
