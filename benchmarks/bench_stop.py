"""How promptly the other ranks are stopped when one fails, beside torchrun (not a test).

    python benchmarks/bench_stop.py [--repeat 5] [--nproc 2]

gloo on CPU, torch imported in every rank (so a failing rank's interpreter teardown takes as
long as it does in a real job). After init and one all_reduce, rank 1 fails (raise, or
sys.exit(3)); the others either sleep in 2 ms steps (busy) or loop on all_reduce (collective),
writing a heartbeat after each step. Measured: from rank 1's last stamp before it failed to the
last heartbeat of the rank that ran longest (how long the others went on), and, for the
collective case, how many victims reached their own error (gloo's 'Connection closed by peer')
before the launcher stopped them. Times are monotonic stamps the ranks write themselves.
torchrun --standalone with its defaults (--monitor-interval 0.1); gpuwarden launch defaults.
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
RANK = ROOT / "benchmarks" / "scripts" / "stop_rank.py"
BIN = Path(sys.executable).parent
CAP_S = 120.0


def _run(tool: str, mode: str, victim: str, nproc: int) -> tuple[float | None, int, float]:
    stamps = Path(tempfile.mkdtemp(prefix="bench-stop-"))
    env = {**os.environ, "STAMP_DIR": str(stamps), "BENCH_MODE": mode, "BENCH_VICTIM": victim,
           "GPUWARDEN_SIMULATE": str(ROOT / "tests" / "scenarios" / "nogpu.json")}
    if tool == "torchrun":
        argv = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc), str(RANK)]
    else:
        argv = [str(BIN / "gpuwarden"), "launch", "-n", str(nproc), "--cpu", str(RANK)]
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    wait_or_kill_tree(proc, CAP_S)
    wall = time.monotonic() - start
    if not (stamps / "failed").exists():
        return None, 0, wall
    failed = float((stamps / "failed").read_text())
    beats = [float(p.read_text().strip() or "nan") for p in stamps.glob("beat_*")]
    beats = [b for b in beats if b == b]
    went_on = max(beats) - failed if beats else 0.0
    return max(0.0, went_on), len(list(stamps.glob("echo_*"))), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--tools", default="gpuwarden,torchrun")
    args = ap.parse_args()
    print(f"{args.nproc} ranks; median (min-max) of {args.repeat}: how long the other ranks ran "
          "on after rank 1 failed; wall time of the launch")
    for mode, victim in (("raise", "busy"), ("exit", "busy"), ("raise", "collective")):
        for tool in args.tools.split(","):
            runs = [_run(tool, mode, victim, args.nproc) for _ in range(args.repeat)]
            got = [r[0] for r in runs if r[0] is not None]
            echoes = [r[1] for r in runs]
            walls = [r[2] for r in runs]
            line = (f"{statistics.median(got) * 1000:6.0f} ms ({min(got) * 1000:.0f}-"
                    f"{max(got) * 1000:.0f})") if got else "no stamp"
            echo = f", victims at their own error: {sum(echoes)} of " \
                   f"{(args.nproc - 1) * len(runs)}" if victim == "collective" else ""
            print(f"  rank 1 {mode:5} / others {victim:10} {tool:9} went on {line}{echo}; "
                  f"wall {statistics.median(walls):.1f} s", flush=True)


if __name__ == "__main__":
    main()
