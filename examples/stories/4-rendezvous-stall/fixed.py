"""Story 4, the gpuwarden way: the same three mistakes, each named in seconds.

    python fixed.py wrong-addr     # `gpuwarden doctor` names RDZV_DNS before anything starts
    python fixed.py port-in-use    # doctor and `gpuwarden launch --master-port` name RDZV_PORT_IN_USE
    python fixed.py missing-rank   # `gpuwarden launch` names the rank that never arrived

Each case runs the diagnosis first (it must give the expected failure code), then the job the
gpuwarden way: `gpuwarden launch --cpu -n 2 train.py` sets MASTER_ADDR/MASTER_PORT itself (a free
port on this host) and starts every rank WORLD_SIZE counts, so none of the three can happen.
The commands are printed before their output, as a user would type them.

Exit code: 0 when every diagnosis named its code and the job then ran; 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpuwarden.net import pick_free_port

HERE = Path(__file__).resolve().parent
CASES = ("wrong-addr", "port-in-use", "missing-rank")
GPUWARDEN = [sys.executable, "-m", "gpuwarden"]
# The failure code of a report: doctor's "[FAIL] ... (CODE)", launch's "error[CODE]: ...".
_CODE = re.compile(r"^\[FAIL\] .*\((?P<doctor>[A-Z_]+)\)$|^error\[(?P<launch>[A-Z_]+)\]:", re.MULTILINE)


def step(title: str, args: list[str], expect_code: str | None) -> bool:
    """Run one gpuwarden command, show it and its output; True if it ended as expected:
    exit 0 when ``expect_code`` is None, else a failure report naming ``expect_code``."""
    print(f"\n## {title}\n$ gpuwarden {' '.join(args)}", flush=True)
    start = time.monotonic()
    proc = subprocess.run([*GPUWARDEN, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, cwd=HERE, check=False)
    took = time.monotonic() - start
    print(proc.stdout.rstrip(), flush=True)
    codes = [m.group("doctor") or m.group("launch") for m in _CODE.finditer(proc.stdout)]
    if expect_code is None:
        ok = proc.returncode == 0
        print(f"-> exit {proc.returncode} after {took:.1f} s: {'the job ran' if ok else 'FAILED'}")
    else:
        ok = proc.returncode != 0 and expect_code in codes
        print(f"-> exit {proc.returncode} after {took:.1f} s, named {', '.join(codes) or 'nothing'}"
              f" (expected {expect_code})")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=CASES)
    parser.add_argument("--stall-timeout", default="3s",
                        help="gpuwarden launch --stall-timeout for the missing rank (default 3s)")
    parser.add_argument("--no-launch", action="store_true",
                        help="only the doctor's diagnosis, no launch")
    args = parser.parse_args()
    train = "train.py"
    launch = ["launch", "--cpu", "-n", "2", "--grace", "1s"]
    results: list[bool] = []
    holder: subprocess.Popen[bytes] | None = None
    try:
        if args.case == "wrong-addr":
            results.append(step("preflight: the address rank 0 would be reached at",
                                ["doctor", "--master-addr", "node-0.cluster.invalid",
                                 "--master-port", str(pick_free_port())], "RDZV_DNS"))
        elif args.case == "port-in-use":
            port = pick_free_port()
            holder = subprocess.Popen([sys.executable, str(HERE / "port_holder.py"), str(port)],
                                      stdout=subprocess.PIPE, start_new_session=True)
            assert holder.stdout is not None
            holder.stdout.readline()
            print(f"(pid {holder.pid}, a process left over from an earlier run, holds port {port})")
            results.append(step("preflight: the port rank 0 would bind",
                                ["doctor", "--master-addr", "127.0.0.1", "--master-port", str(port)],
                                "RDZV_PORT_IN_USE"))
            if not args.no_launch:
                results.append(step("the launcher refuses a busy port before any rank starts",
                                    [*launch, "--master-port", str(port), train], "RDZV_PORT_IN_USE"))
        elif not args.no_launch:
            results.append(step("rank 1 never reaches init_process_group: named, with its stack",
                                [*launch, "--stall-timeout", args.stall_timeout, train,
                                 "--stuck-rank", "1"], "RDZV_WORKERS_MISSING"))
        if not args.no_launch:
            results.append(step("the job, launched by gpuwarden (its own address, a free port, "
                                "every rank)", [*launch, train], None))
    finally:
        if holder is not None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
    ok = bool(results) and all(results)
    print(f"\n{'ok' if ok else 'FAILED'}: {sum(results)} of {len(results)} step(s) as expected")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
