"""gpuwarden launch vs torchrun --standalone, side by side in one run (not a test).

    python benchmarks/bench_launch.py [--pairs 5] [--cap 30]

1. launcher alone: 2 ranks of a script that does not import torch; and the smallest launch,
   ``gpuwarden launch -n 1 --cpu hello.py`` beside ``torchrun --standalone --nproc-per-node 1``
   (what a launch imports before its first rank starts: the goal is 0.2 s);
2. launch → finish of a 2-rank gloo all_reduce (examples/allreduce.py);
3. rank crash → launcher exit (rank 1 raises after init; rank 0 sleeps);
4. one of 2 ranks never joins: time to a diagnosis (gpuwarden --stall-timeout 5s) vs torchrun,
   which is capped at --cap seconds (on its own it waits for gloo's 30-minute timeout);
5. launcher overhead: the wall of `-n 1 SCRIPT` minus the wall of `python -u SCRIPT` run directly
   with the environment a rank gets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), for a
   script without torch and for a 1-rank gloo all_reduce (the rank's normal exit included).

With --gpu (a real GPU only; exit 77 without one), instead: one rank on GPU 0, an NCCL
all_reduce (benchmarks/scripts/allreduce_nccl.py), launch → finish and the launcher's
overhead against the same script run directly, gpuwarden launch -n 1 vs torchrun.

Runs alternate (gpuwarden, torchrun) so both see the same machine load; medians are printed.
"""
# verify-gpu: --gpu --pairs 2

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
HERE = Path(__file__).parent / "scripts"


def gpuwarden(script: Path, *extra: str) -> list[str]:
    return [str(BIN / "gpuwarden"), "launch", "-n", "2", *extra, str(script)]


def torchrun(script: Path) -> list[str]:
    return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(script)]


def timed(cmd: list[str], env: dict[str, str] | None = None, cap_s: float | None = None
          ) -> tuple[float, int | None, float]:
    """Wall seconds, exit code (None when capped), and the wall clock at exit."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        code: int | None = proc.wait(timeout=cap_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        code = None
    return time.monotonic() - start, code, time.time()


def pairs(name: str, a: list[str], b: list[str], n: int, since_mark: bool = False,
          expect_failure: bool = False) -> tuple[float, float]:
    ours, theirs = [], []
    for _ in range(n):
        for cmd, out in ((a, ours), (b, theirs)):
            with tempfile.TemporaryDirectory() as tmp:
                mark = os.path.join(tmp, "mark")
                env = {**os.environ, "BENCH_MARK_FILE": mark}
                wall, code, ended = timed(cmd, env)
                # A run that ended the wrong way measured something else: stop, don't report it.
                if code is None or (code != 0) != expect_failure:
                    raise SystemExit(f"{name}: {' '.join(cmd)} exited {code}, expected "
                                     f"{'a failure' if expect_failure else '0'}")
                if since_mark:
                    with open(mark) as f:
                        wall = ended - float(f.read())
                out.append(wall)
    mo, mt = statistics.median(ours), statistics.median(theirs)
    print(f"| {name} | {mo:.2f} s | {mt:.2f} s | {mo / mt:.2f}x |", flush=True)
    return mo, mt


def overhead(label: str, script: Path, n: int) -> None:
    """Launcher wall minus the same script's wall run directly, as medians of alternating runs."""
    from gpuwarden.net import pick_free_port

    walls: dict[str, list[float]] = {"direct": [], "ours": [], "theirs": []}
    for _ in range(n):
        port = pick_free_port()
        rank_env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                    "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": str(port)}
        for key, cmd, env in (
                ("direct", [sys.executable, "-u", str(script)], rank_env),
                ("ours", [str(BIN / "gpuwarden"), "launch", "-n", "1", str(script)], None),
                ("theirs", [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "1",
                            str(script)], None)):
            wall, code, _ = timed(cmd, env)
            if code != 0:
                raise SystemExit(f"overhead: {' '.join(cmd)} exited {code}")
            walls[key].append(wall)
    direct = statistics.median(walls["direct"])
    mo, mt = statistics.median(walls["ours"]) - direct, statistics.median(walls["theirs"]) - direct
    print(f"| launcher overhead, -n 1, {label} (direct run {direct:.2f} s) | {mo:+.2f} s | "
          f"{mt:+.2f} s | - |", flush=True)


def gpu(n: int) -> None:
    from gpuwarden.inventory import real_gpu_present

    if not real_gpu_present():
        print("bench_launch --gpu: no GPU here (NVML reports none): skipped", file=sys.stderr)
        raise SystemExit(77)
    script = HERE / "allreduce_nccl.py"
    print(f"medians of {n} alternating pairs, one rank on GPU 0\n")
    print("| scenario (1 rank, GPU 0, NCCL) | gpuwarden launch | torchrun --standalone | ratio |")
    print("|---|---|---|---|")
    pairs("launch → finish, NCCL all_reduce", [str(BIN / "gpuwarden"), "launch", "-n", "1",
                                               str(script)],
          [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "1", str(script)], n)
    overhead("1-rank NCCL all_reduce", script, n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--cap", type=float, default=30.0)
    ap.add_argument("--gpu", action="store_true",
                    help="only the one-GPU NCCL comparison (exit 77 without a GPU)")
    args = ap.parse_args()
    if args.gpu:
        gpu(args.pairs)
        return
    os.environ.setdefault("GPUWARDEN_SIMULATE", "")
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)  # warm the page cache
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    torch_import = time.monotonic() - t0
    print(f"medians of {args.pairs} alternating pairs; `python -c 'import torch'` takes "
          f"{torch_import:.2f} s here\n")
    print("| scenario (2 ranks, CPU, gloo) | gpuwarden launch | torchrun --standalone | ratio |")
    print("|---|---|---|---|")
    pairs("launcher alone (script without torch)", gpuwarden(HERE / "hello.py"),
          torchrun(HERE / "hello.py"), args.pairs)
    pairs("launcher alone, 1 rank: `-n 1 --cpu` (script without torch)",
          [str(BIN / "gpuwarden"), "launch", "-n", "1", "--cpu", str(HERE / "hello.py")],
          [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "1", str(HERE / "hello.py")],
          args.pairs)
    pairs("launch → finish, all_reduce", gpuwarden(ROOT / "examples" / "allreduce.py"),
          torchrun(ROOT / "examples" / "allreduce.py"), args.pairs)
    pairs("rank crash → launcher exit", gpuwarden(HERE / "crash_after_init.py"),
          torchrun(HERE / "crash_after_init.py"), args.pairs, since_mark=True, expect_failure=True)

    stall_s = 5.0
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "BENCH_MARK_FILE": os.path.join(tmp, "mark")}
        wall, code, ended = timed(gpuwarden(HERE / "never_joins.py", "--stall-timeout", f"{stall_s:g}s"),
                                  env, cap_s=args.cap)
        with open(env["BENCH_MARK_FILE"]) as f:
            waited = ended - float(f.read())
        ours = f"{wall:.2f} s (exit {code}; {waited:.2f} s after rank 0 began waiting, stall timeout {stall_s:g} s)"
        twall, tcode, _ = timed(torchrun(HERE / "never_joins.py"), env, cap_s=args.cap)
        theirs = (f"no diagnosis within the {args.cap:g} s cap (stopped; on its own it waits "
                  "for gloo's 30 min timeout)" if tcode is None else f"{twall:.2f} s (exit {tcode})")
    print(f"| one rank never joins → diagnosis | {ours} | {theirs} | - |")
    for label, script in (("script without torch", HERE / "hello.py"),
                          ("1-rank gloo all_reduce", ROOT / "examples" / "allreduce.py")):
        overhead(label, script, args.pairs)
    print(f"\n(benchmark took {time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
