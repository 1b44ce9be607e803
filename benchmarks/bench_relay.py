"""The output relay: gpuwarden launch vs torchrun --standalone on heavy output (not a test).

    python benchmarks/bench_relay.py [--pairs 3] [--lines 1000000]

Each rank writes to its stdout; the launcher's stdout is a file in both cases. torchrun lets its
ranks write to that file directly (no relay unless --tee); gpuwarden reads every rank's pipe and
writes ``[rankN]: ``-prefixed lines. Scenarios (2 ranks each):

1. N short lines per rank (``print``);
2. 100 writes of 1 MiB without a newline per rank (one 100 MiB "line": relayed in 64 KiB pieces);
3. one 50 MB line, 1 rank;
4. (``--tty``) N short lines per rank with the launcher on a terminal: a pseudo-terminal that
   the benchmark drains as fast as it can, as a terminal emulator would. torchrun's ranks write
   to that terminal themselves; gpuwarden's each write to a pseudo-terminal of their own that
   the relay reads and prefixes (what keeps isatty() true in the ranks while gpuwarden still
   sees every line).

Runs alternate so all see the same load; medians are printed with the size of what reached the
file (gpuwarden's is larger by the prefixes and the newlines that end cut pieces). torchrun's
walls include its agent's torch import (1.5-2.5 s on a quiet machine), gpuwarden's do not. The
"ranks alone" column is the same ranks started directly (``python -u``, as both launchers run
them), writing to the file with no launcher: the floor both are measured against.
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

BIN = Path(sys.executable).parent
SCRIPT = Path(__file__).parent / "scripts" / "chatty.py"


def run(cmd: list[str], copies: int = 1) -> tuple[float, int]:
    """Wall seconds and bytes written to stdout by ``copies`` concurrent runs of ``cmd``."""
    with tempfile.TemporaryFile() as out:
        start = time.monotonic()
        procs = [subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL,
                                  env={**os.environ, "RANK": str(i), "GPUWARDEN_SIMULATE":
                                       os.environ.get("GPUWARDEN_SIMULATE", "")})
                 for i in range(copies)]
        codes = [p.wait() for p in procs]
        wall = time.monotonic() - start
        if any(codes):
            raise SystemExit(f"{' '.join(cmd)} exited {codes}")
        size = out.seek(0, os.SEEK_END)
    return wall, size


def run_tty(cmd: list[str], copies: int = 1) -> tuple[float, int]:
    """As :func:`run`, stdout and stderr a pseudo-terminal drained by this process."""

    master, slave = os.openpty()
    start = time.monotonic()
    procs = [subprocess.Popen(cmd, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL,
                              env={**os.environ, "RANK": str(i), "GPUWARDEN_SIMULATE":
                                   os.environ.get("GPUWARDEN_SIMULATE", "")})
             for i in range(copies)]
    os.close(slave)
    size = 0
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: every writer is gone
            break
        if not data:
            break
        size += len(data)
    codes = [p.wait() for p in procs]
    wall = time.monotonic() - start
    os.close(master)
    if any(codes):
        raise SystemExit(f"{' '.join(cmd)} exited {codes}")
    return wall, size


def pairs(name: str, nproc: int, args: list[str], n: int, tty: bool = False) -> None:
    ours = [str(BIN / "gpuwarden"), "launch", "--cpu", "-n", str(nproc), str(SCRIPT), *args]
    theirs = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc), str(SCRIPT), *args]
    alone = [sys.executable, "-u", str(SCRIPT), *args]
    walls: dict[str, list[float]] = {"ours": [], "theirs": [], "alone": []}
    sizes = {}
    for _ in range(n):
        for key, cmd, copies in (("ours", ours, 1), ("theirs", theirs, 1), ("alone", alone, nproc)):
            wall, size = (run_tty if tty else run)(cmd, copies)
            walls[key].append(wall)
            sizes[key] = size
    mo, mt, ma = (statistics.median(walls[k]) for k in ("ours", "theirs", "alone"))
    print(f"| {name} | {mo:.2f} s ({sizes['ours'] / 1e6:.0f} MB out) | {mt:.2f} s "
          f"({sizes['theirs'] / 1e6:.0f} MB out) | {mo / mt:.2f}x | {ma:.2f} s |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--tty", action="store_true", help="only the terminal scenario")
    args = ap.parse_args()
    start = time.monotonic()
    print(f"medians of {args.pairs} alternating pairs, stdout to a file (on a terminal: to a "
          "pseudo-terminal drained by the benchmark)\n")
    print("| scenario | gpuwarden launch | torchrun --standalone | ratio | ranks alone |")
    print("|---|---|---|---|---|")
    pairs(f"2 ranks × {args.lines:,} lines, on a terminal", 2, ["lines", str(args.lines)],
          args.pairs, tty=True)
    if args.tty:
        return
    pairs(f"2 ranks × {args.lines:,} lines", 2, ["lines", str(args.lines)], args.pairs)
    pairs("2 ranks × 100 writes of 1 MiB, no newline", 2, ["chunks", "100", str(1 << 20)],
          args.pairs)
    pairs("1 rank, one 50 MB line", 1, ["chunks", "1", "50000000"], args.pairs)
    print(f"\n(benchmark took {time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
