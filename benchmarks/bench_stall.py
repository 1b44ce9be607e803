"""Stalls seen from outside: time from a stall's start to gpuwarden's report, beside torchrun,
and the supervisor's own CPU while it samples 8 ranks (not a test).

    python benchmarks/bench_stall.py [--stall-timeout 5] [--cap 30] [--sample-s 20]

1. for each scenario of tests/launch_scripts/stall_kinds.py (2 ranks, gloo on CPU): the ranks
   stamp the moment they start to wait for good; gpuwarden runs in-process, so its detection
   time (``outcome.stall.detected_at``) and the moment its report is ready (all ranks stopped)
   are read directly; torchrun runs the same script, capped at --cap seconds (it has no stall
   detection: gloo's own timeout is 30 minutes, NCCL's watchdog 10). A scenario whose ranks
   fail on their own (exit0) shows the time to the failure report and the rank each names.
2. supervisor CPU: 8 ranks that sleep (no torch; the sampler answers the same for any script),
   at the default --stall-timeout (5m: a sample every 2 s) and at 4s (every 0.5 s); the
   supervisor's user+system CPU over the run, as a share of one core.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
KINDS = ROOT / "tests" / "launch_scripts" / "stall_kinds.py"
STALL = ROOT / "tests" / "launch_scripts" / "stall.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _stamps(d: str) -> list[float]:
    return [float(p.read_text()) for p in Path(d).glob("rank*")]


def gpuwarden_case(script: Path, mode: str, timeout_s: float) -> tuple[str, str, str]:
    from gpuwarden.launch.config import LaunchConfig
    from gpuwarden.launch.runner import launch

    with tempfile.TemporaryDirectory() as stamps:
        os.environ["STAMP_DIR"] = stamps
        os.environ["STALL_S"] = str(timeout_s)
        devnull = open(os.devnull, "w")  # noqa: SIM115
        config = LaunchConfig(target=str(script), args=(mode,), nproc=2, cpu=True,
                              stall_timeout_s=timeout_s, grace_s=1.0)
        report, outcome = launch(config, stdout=devnull, stderr=devnull)
        done = time.monotonic()
        starts = _stamps(stamps)
    if not starts:  # stall.py stamps nothing: its stall starts when rank 0 enters init
        starts = [outcome.started_at]
    start = min(starts)
    detected = f"{outcome.stall.detected_at - start:5.1f} s" if outcome.stall else "   -   "
    return detected, f"{done - start:5.1f} s", f"{report.code} (root rank {report.root_rank})"


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def torchrun_case(script: Path, mode: str, cap_s: float, timeout_s: float) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as stamps:
        env = {**os.environ, "STAMP_DIR": stamps, "STALL_S": str(timeout_s)}
        proc = subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc-per-node", "2",
                                 str(script), mode], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=cap_s)
            end = time.monotonic()
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)  # torchrun's workers live in sessions of their own
            proc.communicate()
            return f"none within the {cap_s:g} s cap", "-"
        starts = _stamps(stamps)
    m = re.search(r"Root Cause \(first observed failure\):\s*\[\d+\]:.*?rank\s*:\s*(\d+)", err, re.S)
    blamed = f"root cause rank {m.group(1)}" if m else f"exit {proc.returncode}"
    took = f"{end - min(starts):5.1f} s" if starts else "?"
    return took, blamed


def supervisor_cpu(n: int, timeout: str, seconds: float) -> str:
    from gpuwarden.launch.config import LaunchConfig
    from gpuwarden.launch.runner import launch
    from gpuwarden.units import parse_duration

    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "sleeps.py"
        script.write_text(f"import time\ntime.sleep({seconds})\n")
        config = LaunchConfig(target=str(script), nproc=n, cpu=True,
                              stall_timeout_s=parse_duration(timeout, what="t"))
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.monotonic()
        launch(config, stdout=open(os.devnull, "w"), stderr=open(os.devnull, "w"))  # noqa: SIM115
        wall = time.monotonic() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return f"{cpu:.2f} s CPU over {wall:.1f} s = {100 * cpu / wall:.2f} % of one core"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stall-timeout", type=float, default=5.0)
    ap.add_argument("--cap", type=float, default=30.0, help="torchrun's cap, seconds")
    ap.add_argument("--sample-s", type=float, default=20.0, help="length of the CPU runs")
    args = ap.parse_args()
    t = args.stall_timeout
    print(f"stall start -> report, 2 ranks, gloo on CPU, --stall-timeout {t:g}s, grace 1s")
    print(f"{'scenario':<10} {'detected':>9} {'report':>9}  {'gpuwarden says':<34} torchrun")
    cases = [("init", STALL, "noinit"), ("async", KINDS, "async"), ("ddp", KINDS, "ddp"),
             ("mismatch", KINDS, "mismatch"), ("exit0", KINDS, "exit0")]
    for name, script, mode in cases:
        detected, report_at, says = gpuwarden_case(script, mode, t)
        theirs, blamed = torchrun_case(script, mode, args.cap, t)
        print(f"{name:<10} {detected:>9} {report_at:>9}  {says:<34} {theirs} ({blamed})", flush=True)
    print("\nsupervisor CPU while sampling 8 ranks:")
    for timeout in ("5m", "4s"):
        print(f"  --stall-timeout {timeout}: {supervisor_cpu(8, timeout, args.sample_s)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
