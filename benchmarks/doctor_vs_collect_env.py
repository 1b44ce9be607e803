"""Wall time of `gpuwarden doctor --json` against `python -m torch.utils.collect_env`.

collect_env is what PyTorch's issue template asks users to paste; the doctor answers more
questions (compute modes, /dev/shm, limits, rendezvous) and should not cost more. Each tool
runs as a fresh process, alternately, RUNS times; the medians and their ratio are printed.

    python benchmarks/doctor_vs_collect_env.py [RUNS]
"""
# verify-gpu: 3

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

GPUWARDEN = str(Path(sys.executable).with_name("gpuwarden"))
# name -> (argv, the exit codes a complete run may end with). doctor exits 0 or 1 by the worst
# check on this machine; with an unresolvable MASTER_ADDR it must fail (1). Anything else (a
# usage error, a traceback) would time a run that did not do the work.
TOOLS = {
    "gpuwarden doctor --json": ([GPUWARDEN, "doctor", "--json"], {0, 1}),
    "gpuwarden doctor --json --master-addr wrong.address.invalid --master-port 29500": (
        [GPUWARDEN, "doctor", "--json", "--master-addr", "wrong.address.invalid",
         "--master-port", "29500"], {1}),
    "python -m torch.utils.collect_env": ([sys.executable, "-m", "torch.utils.collect_env"], {0}),
}


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    times: dict[str, list[float]] = {name: [] for name in TOOLS}
    for _ in range(runs):
        for name, (argv, valid_exits) in TOOLS.items():
            start = time.monotonic()
            code = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
            times[name].append(time.monotonic() - start)
            if code not in valid_exits:
                raise SystemExit(f"{name} exited {code}, expected one of {sorted(valid_exits)}")
    base = statistics.median(times["python -m torch.utils.collect_env"])
    print(f"{'tool':<82} {'median s':>9} {'min s':>7} {'vs collect_env':>15}")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:<82} {med:9.2f} {min(values):7.2f} {med / base:14.2f}x")


if __name__ == "__main__":
    main()
