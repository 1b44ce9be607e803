"""Wall time of `gpuwarden doctor --json` against `python -m torch.utils.collect_env`.

collect_env is what PyTorch's issue template asks users to paste; the doctor answers more
questions (compute modes, /dev/shm, limits, rendezvous) and should not cost more. Each tool
runs as a fresh process, alternately, RUNS times; the medians and their ratio are printed.

    python benchmarks/doctor_vs_collect_env.py [RUNS]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

GPUWARDEN = str(Path(sys.executable).with_name("gpuwarden"))
TOOLS = {
    "gpuwarden doctor --json": [GPUWARDEN, "doctor", "--json"],
    "gpuwarden doctor --json --master-addr wrong.address.invalid --master-port 29500": [
        GPUWARDEN, "doctor", "--json", "--master-addr", "wrong.address.invalid",
        "--master-port", "29500"],
    "python -m torch.utils.collect_env": [sys.executable, "-m", "torch.utils.collect_env"],
}


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    times: dict[str, list[float]] = {name: [] for name in TOOLS}
    for _ in range(runs):
        for name, argv in TOOLS.items():
            start = time.monotonic()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            times[name].append(time.monotonic() - start)
    base = statistics.median(times["python -m torch.utils.collect_env"])
    print(f"{'tool':<82} {'median s':>9} {'min s':>7} {'vs collect_env':>15}")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:<82} {med:9.2f} {min(values):7.2f} {med / base:14.2f}x")


if __name__ == "__main__":
    main()
