"""The healthy-DDP soak: a 4-rank DDP job on CPU (gloo) under gpuwarden launch for N minutes,
with a short --stall-timeout, must end with exit 0 and no stall report (not a test: the issue's
30-minute run is `python benchmarks/soak_ddp.py --minutes 30`).

    python benchmarks/soak_ddp.py [--minutes 30] [--ranks 4] [--stall-timeout 10s]

The job (benchmarks/scripts/ddp_soak_rank.py) trains continuously and, between steps, does what
makes a naive stall detector cry wolf: async all_reduce + .wait(), barriers, rank 0 pausing
(a checkpoint, well under the timeout) while the others wait at a barrier, caught collective
errors. Prints the job's wall time, steps, any gpuwarden report, and the supervisor's CPU.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
RANK_SCRIPT = Path(__file__).parent / "scripts" / "ddp_soak_rank.py"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--stall-timeout", default="10s")
    args = ap.parse_args()

    from gpuwarden.launch.config import LaunchConfig
    from gpuwarden.launch.runner import launch
    from gpuwarden.units import parse_duration

    timeout_s = parse_duration(args.stall_timeout, what="--stall-timeout")
    os.environ["SOAK_UNTIL"] = str(time.time() + 60 * args.minutes)
    os.environ["SOAK_PAUSE_S"] = str(max(0.5, timeout_s * 0.3))
    config = LaunchConfig(target=str(RANK_SCRIPT), nproc=args.ranks, cpu=True,
                          stall_timeout_s=timeout_s)
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.monotonic()
    report, outcome = launch(config)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"\nsoak: {args.ranks} ranks, {args.minutes:g} min, --stall-timeout {args.stall_timeout}: "
          f"exit {report.exit_code}, stall report: {'YES' if outcome.stall else 'none'}, "
          f"wall {wall:.0f} s, supervisor CPU {cpu:.1f} s ({100 * cpu / wall:.2f} % of a core)")
    if not report.ok:
        print(report.render())
    return 0 if report.ok and outcome.stall is None else 1


if __name__ == "__main__":
    sys.exit(main())
