"""Lease a GPU, run a child on it, release: the pattern a launcher or pool parent follows.

    GPUWARDEN_SIMULATE=tests/scenarios/two_idle.json python examples/lease_subprocess.py

The parent never touches CUDA; the child sees exactly the leased GPU as cuda:0.
"""

from __future__ import annotations

import os
import subprocess
import sys

from gpuwarden.lease import StatusPrinter, acquire


def main() -> int:
    with StatusPrinter() as printer:  # the live "waiting for ..." line ends once we are served
        grant = acquire(1, min_free="1GiB", wait="5m", label="example", on_wait=printer)
    with grant:
        print(f"leased {grant.visible_devices} ({grant.gpus[0].name})", file=sys.stderr)
        child = [sys.executable, "-c",
                 "import os; print('child sees CUDA_VISIBLE_DEVICES =', "
                 "os.environ['CUDA_VISIBLE_DEVICES'])"]
        return subprocess.run(child, env={**os.environ, **grant.env}).returncode


if __name__ == "__main__":
    raise SystemExit(main())
