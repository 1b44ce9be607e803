"""The output relay: gpuwarden launch vs torchrun --standalone on heavy output (not a test).

    python benchmarks/bench_relay.py [--pairs 3] [--lines 1000000] [--baseline DIR]
                                     [--only pipe|tty|hold]

Each rank writes to its stdout. Piped: the launcher's stdout is a file; torchrun lets its ranks
write to that file directly (no relay unless --tee); gpuwarden reads every rank's pipe and writes
``[rankN]: ``-prefixed lines. On a terminal: a pseudo-terminal that the benchmark drains as fast
as it can, as a terminal emulator would; torchrun's ranks write to it themselves, gpuwarden's
each write to a pseudo-terminal of their own that the relay reads, and with two ranks or more
its terminal view (launch/ranks/terminal.py) shows them: identical lines said once (the ranks
of ``chatty.py lines`` all print the same lines), bars in place. Scenarios:

1. piped: N short lines per rank (``print``), 2 ranks; 100 writes of 1 MiB without a newline per
   rank, 2 ranks (one 100 MiB "line": relayed in 64 KiB pieces); one 50 MB line, 1 rank;
2. on a terminal: N lines per rank, 2 ranks, the same lines (collapsed while the ranks keep in
   step) and lines of each rank's own (``chatty.py distinct``: nothing to collapse); 100k lines
   per rank, 8 ranks (collapsed); one 50 MB line, 1 rank and 2 ranks;
3. ``--only hold``: how long a line waits before it shows on the terminal: rank 0 prints a
   stamped line every 20 ms that no other rank says (the worst case: each waits its whole
   window), with the view and with ``--plain-console``; the delays from the rank's write to the
   reader's read (CLOCK_MONOTONIC on both sides).

``--baseline DIR``: also run the gpuwarden whose sources are in DIR (``git archive main src |
tar -x -C DIR``), with the same Python, as the "before" column. Runs alternate so all see the
same load; medians are printed with the size of what reached the file or terminal. torchrun's
walls include its agent's torch import (1.5-2.5 s on a quiet machine), gpuwarden's do not. The
"ranks alone" column is the same ranks started directly (``python -u``, as both launchers run
them), writing to the same place with no launcher: the floor both are measured against.
"launcher CPU" is the CPU time of the launcher's own process (gpuwarden's supervisor, whose
relay reads and writes every byte; torchrun's agent, which imports torch), read from /proc: on
a loaded machine it moves far less than the wall time does.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BIN = Path(sys.executable).parent
SCRIPT = Path(__file__).parent / "scripts" / "chatty.py"


def _env(rank: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "RANK": str(rank), "GPUWARDEN_SIMULATE":
           os.environ.get("GPUWARDEN_SIMULATE", "no-gpu"), "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    env.update(extra or {})
    return env


class CpuWatch:
    """The CPU seconds a process used itself (not its children), read from /proc until it
    exits: the launcher's own cost, which the machine's load does not inflate as it does the
    wall time."""

    def __init__(self, pid: int) -> None:
        self.path = f"/proc/{pid}/stat"
        self.seconds = 0.0
        self._tick = os.sysconf("SC_CLK_TCK")
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                with open(self.path) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                self.seconds = (int(fields[11]) + int(fields[12])) / self._tick
            except (OSError, IndexError, ValueError):
                return
            self._done.wait(0.02)

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return self.seconds


def run(cmd: list[str], copies: int = 1, extra: dict[str, str] | None = None) -> tuple[float, int, float]:
    """Wall seconds, bytes written to stdout by ``copies`` concurrent runs of ``cmd``, and the
    CPU seconds of the first (the launcher's own)."""
    with tempfile.TemporaryFile() as out:
        start = time.monotonic()
        procs = [subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, env=_env(i, extra))
                 for i in range(copies)]
        cpu = CpuWatch(procs[0].pid)
        codes = [p.wait() for p in procs]
        wall = time.monotonic() - start
        if any(codes):
            raise SystemExit(f"{' '.join(cmd)} exited {codes}")
        size = out.seek(0, os.SEEK_END)
    return wall, size, cpu.stop()


def _on_terminal(cmd: list[str], copies: int, extra: dict[str, str] | None,
                 on_data: object = None) -> tuple[float, int, float]:
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    start = time.monotonic()
    procs = [subprocess.Popen(cmd, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL,
                              env=_env(i, extra)) for i in range(copies)]
    cpu = CpuWatch(procs[0].pid)
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
        if on_data is not None:
            on_data(data)  # type: ignore[operator]
    codes = [p.wait() for p in procs]
    wall = time.monotonic() - start
    os.close(master)
    if any(codes):
        raise SystemExit(f"{' '.join(cmd)} exited {codes}")
    return wall, size, cpu.stop()


def run_tty(cmd: list[str], copies: int = 1, extra: dict[str, str] | None = None) -> tuple[float, int, float]:
    """As :func:`run`, stdout and stderr a pseudo-terminal drained by this process."""
    return _on_terminal(cmd, copies, extra)


def commands(nproc: int, args: list[str], baseline: str | None) -> list[tuple[str, list[str], int, dict[str, str]]]:
    ours = [sys.executable, "-m", "gpuwarden", "launch", "--cpu", "-n", str(nproc), str(SCRIPT), *args]
    out = [("ours", ours, 1, {})]
    if baseline:
        out.append(("before", ours, 1, {"PYTHONPATH": baseline}))
    out.append(("theirs", [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc),
                           str(SCRIPT), *args], 1, {}))
    out.append(("alone", [sys.executable, "-u", str(SCRIPT), *args], nproc, {}))
    return out


def pairs(name: str, nproc: int, args: list[str], n: int, baseline: str | None,
          tty: bool = False) -> None:
    cmds = commands(nproc, args, baseline)
    walls: dict[str, list[float]] = {key: [] for key, *_ in cmds}
    cpus: dict[str, list[float]] = {key: [] for key, *_ in cmds}
    sizes: dict[str, int] = {}
    for _ in range(n):
        for key, cmd, copies, extra in cmds:
            wall, size, cpu = (run_tty if tty else run)(cmd, copies, extra)
            walls[key].append(wall)
            cpus[key].append(cpu)
            sizes[key] = size
    med = {k: statistics.median(v) for k, v in walls.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpus.items()}

    def cell(key: str) -> str:
        return (f"{med[key]:.2f} s ({sizes[key] / 1e6:.1f} MB out, launcher CPU "
                f"{cpu_med[key]:.2f} s)")

    before = f" {cell('before')} | {med['before'] / med['theirs']:.2f}x |" if baseline else ""
    print(f"| {name} | {cell('ours')} | {med['ours'] / med['theirs']:.2f}x |{before} "
          f"{cell('theirs')} | {med['alone']:.2f} s |", flush=True)


def hold(n_lines: int, gap_s: float) -> None:
    """How long a line rank 0 alone says waits before the terminal shows it."""
    stamp = re.compile(rb"stamp (\d+\.\d+)")
    class Seen:
        def __init__(self) -> None:
            self.delays: list[float] = []
            self.buf = bytearray()

        def __call__(self, data: bytes) -> None:
            now = time.monotonic()
            self.buf += data
            cut = self.buf.rfind(b"\n")
            if cut >= 0:
                for m in stamp.finditer(bytes(self.buf[:cut])):
                    self.delays.append(now - float(m.group(1)))
                del self.buf[:cut + 1]

    for label, flags in (("view (default)", []), ("--plain-console", ["--plain-console"])):
        seen = Seen()
        _on_terminal([sys.executable, "-m", "gpuwarden", "launch", "--cpu", "-n", "2", *flags,
                      str(SCRIPT), "stamped", str(n_lines), str(gap_s)], 1, {}, seen)
        delays = sorted(seen.delays)
        q = statistics.quantiles(delays, n=100)
        print(f"| {label} | {len(delays)} | {q[49] * 1e3:.1f} ms | {q[98] * 1e3:.1f} ms | "
              f"{delays[-1] * 1e3:.1f} ms |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--baseline", metavar="DIR", help="sources of the gpuwarden to compare with")
    ap.add_argument("--only", choices=("pipe", "tty", "hold"))
    args = ap.parse_args()
    start = time.monotonic()
    print(f"load average at the start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"{os.cpu_count()} CPUs")
    if args.only in (None, "hold"):
        print("\nhow long a line waits before the terminal shows it (rank 0 alone says it)\n")
        print("| console | lines | median | p99 | max |")
        print("|---|---|---|---|---|")
        hold(200, 0.02)
        if args.only == "hold":
            return
    base = str(Path(args.baseline).resolve() / "src") if args.baseline else None
    before = " before | ratio before |" if base else ""
    print(f"\nmedians of {args.pairs} alternating runs\n")
    print(f"| scenario | gpuwarden launch | ratio |{before} torchrun --standalone | ranks alone |")
    print("|---|---|---|" + ("---|---|" if base else "") + "---|---|")
    if args.only in (None, "tty"):
        pairs(f"on a terminal: 2 ranks × {args.lines:,} lines", 2, ["lines", str(args.lines)],
              args.pairs, base, tty=True)
        pairs(f"on a terminal: 2 ranks × {args.lines:,} distinct lines", 2,
              ["distinct", str(args.lines)], args.pairs, base, tty=True)
        pairs("on a terminal: 8 ranks × 100,000 identical lines", 8, ["lines", "100000"],
              args.pairs, base, tty=True)
        pairs("on a terminal: 1 rank, one 50 MB line", 1, ["chunks", "1", "50000000"],
              args.pairs, base, tty=True)
        pairs("on a terminal: 2 ranks, one 50 MB line each", 2, ["chunks", "1", "50000000"],
              args.pairs, base, tty=True)
    if args.only in (None, "pipe"):
        pairs(f"piped: 2 ranks × {args.lines:,} lines", 2, ["lines", str(args.lines)],
              args.pairs, base)
        pairs("piped: 2 ranks × 100 writes of 1 MiB, no newline", 2,
              ["chunks", "100", str(1 << 20)], args.pairs, base)
        pairs("piped: 1 rank, one 50 MB line", 1, ["chunks", "1", "50000000"], args.pairs, base)
    print(f"\nload average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"benchmark took {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
