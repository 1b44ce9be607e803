"""Throughput of ``gpuwarden explain`` on a large noisy log, beside the obvious alternatives.

Generates a noisy training log (timestamps, tqdm bars, warnings, interleaved rank
prefixes, ANSI colours) of --size-mb MiB with a CUDA OOM on one rank and the other
ranks' watchdog echoes near the end, then times in one run:

  * gpuwarden explain (keyword prefilter over blocks, regexes on the few hit lines);
  * the naive matcher: every signature regex of the same knowledge base on every
    line (what a straightforward implementation does), timed on a slice and
    extrapolated, since on the whole log it takes minutes;
  * ``grep -c -F -i -f keywords`` (GNU grep, a C lower bound that only counts the
    keyword lines and explains nothing), when grep is installed.

Also reports the peak resident memory of the explain pass (a child process), to
show the log is never held whole, and what the line normalizer costs: fresh processes
with it and without it (``Explainer(normalize_lines=False)``), run in alternating
pairs (--pairs), compared by their CPU time, which a machine loaded by other jobs
disturbs far less than wall time. ``--baseline SRC`` compares, in the same way and in the
same run, this checkout with another one's ``src`` directory (e.g. main's, from
``git archive main src | tar -x -C /tmp/base``): fresh processes alternating between the two,
each one's CPU time, MiB/s and peak RSS. Usage:

    python benchmarks/explain_throughput.py [--size-mb 200] [--keep PATH] [--pairs 3]
                                            [--baseline SRC]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuwarden.explain import explain_file, load_knowledge

NOISE_LINES = [
    "[2026-01-01 10:{m:02d}:{s:02d}] INFO trainer: step={i} loss={loss:.4f} lr=3.0e-04 "
    "grad_norm=1.{g:03d} tokens/s=51234",
    "[rank{r}]: Epoch 3:  {p:2d}%|{bar:<20}| {i}/100000 [12:01<40:00,  9.87it/s, loss={loss:.3f}]",
    "{r}: /usr/lib/python3.11/site-packages/torch/utils/checkpoint.py:90: UserWarning: None of "
    "the inputs have requires_grad=True. Gradients will be None",
    "\x1b[32m[default{r}]:\x1b[0m [INFO] saved checkpoint to /ckpt/step_{i}.pt in 1.2{g:03d}s",
    "[rank{r}]: WARNING: data loader is slow: 0.{g:03d}s waiting for batch {i}",
]
FAILURE = [
    "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has "
    "a total capacity of 79.15 GiB of which 30.75 MiB is free. Process 91234 has 52.10 GiB "
    "memory in use. Including non-PyTorch memory, this process has 27.00 GiB memory in use.",
    "[rank0]:[E1121 10:59:01.1 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective "
    "operation timeout: WorkNCCL(SeqNum=88, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
    "Timeout(ms)=600000) ran for 600013 milliseconds before timing out.",
]


def generate(path: Path, size_mb: int) -> int:
    """Write the noisy log; return the line number of the OOM."""
    block_lines = []
    for i in range(20000):
        t = NOISE_LINES[i % len(NOISE_LINES)]
        block_lines.append(t.format(i=i, m=(i // 60) % 60, s=i % 60, loss=1 / (1 + i % 97),
                                    g=i % 1000, r=i % 8, p=i % 100, bar="█" * (i % 21)))
    block = ("\n".join(block_lines) + "\n").encode()
    target = size_mb << 20
    with path.open("wb") as fh:
        written = 0
        lines = 0
        while written + len(block) < target - len(block):
            fh.write(block)
            written += len(block)
            lines += len(block_lines)
        fh.write(("\n".join(FAILURE) + "\n").encode())
        fh.write(block)
    return lines + 1


def naive_lines_per_s(path: Path, max_bytes: int) -> float:
    """Every signature regex on every line: bytes per second on the first max_bytes."""
    kb = load_knowledge()
    patterns = [s.pattern for e in kb.entries for s in e.signatures]
    done = 0
    t0 = time.perf_counter()
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            for p in patterns:
                if p.search(line):
                    break
            done += len(line)
            if done >= max_bytes:
                break
    return done / (time.perf_counter() - t0)


def grep_seconds(path: Path) -> float | None:
    grep = shutil.which("grep")
    if not grep:
        return None
    kb = load_knowledge()
    words = sorted({k for e in kb.entries for k in e.keywords})
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as kw:
        kw.write("\n".join(words) + "\n")
    try:
        t0 = time.perf_counter()
        subprocess.run([grep, "-c", "-F", "-i", "-f", kw.name, str(path)], check=False,
                       capture_output=True, env={**os.environ, "LC_ALL": "C"})
        return time.perf_counter() - t0
    finally:
        os.unlink(kw.name)


def explain_in_child(path: Path, *, normalize: bool = True, src: Path | None = None
                     ) -> tuple[float, float, str, int]:
    """Run the explain pass in a fresh process: its wall and CPU seconds, the answer, and its
    peak RSS (KiB, Linux). ``normalize=False``: without the line normalizer. ``src``: import
    gpuwarden from that directory instead of this checkout."""
    code = (
        "import resource, sys, time\n"
        "import gpuwarden\n"
        "assert gpuwarden.__file__.startswith(sys.argv[3]), (gpuwarden.__file__, sys.argv[3])\n"
        "from gpuwarden.explain import load_knowledge\n"
        "from gpuwarden.explain.engine import Explainer\n"
        "kb = load_knowledge()\n"
        "t0 = time.perf_counter(); c0 = time.process_time()\n"
        "ex = Explainer(kb, normalize_lines=sys.argv[2] == 'on')\n"
        "with open(sys.argv[1], 'rb') as fh:\n"
        "    for block in iter(lambda: fh.read(4 << 20), b''):\n"
        "        ex.feed_bytes(block)\n"
        "d = ex.result()\n"
        "print(time.perf_counter() - t0, time.process_time() - c0, d.primary.code,"
        " resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(src), env.get("PYTHONPATH"))))
    where = str(src.resolve()) if src is not None else str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code, str(path), "on" if normalize else "off",
                          where], check=True, capture_output=True, text=True, env=env).stdout.split()
    return float(out[0]), float(out[1]), out[2], int(out[3])


def baseline_comparison(path: Path, src: Path, pairs: int
                        ) -> tuple[list[float], list[float], int, int]:
    """CPU seconds of the explain pass with the baseline's src and with this checkout's, in
    alternating pairs of fresh processes, and the highest peak RSS (KiB) of each."""
    base: list[float] = []
    this: list[float] = []
    rss = {True: 0, False: 0}
    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        for is_base in order:
            _, cpu, answer, peak = explain_in_child(path, src=src if is_base else None)
            assert answer == "CUDA_OOM", (answer, is_base)
            (base if is_base else this).append(cpu)
            rss[is_base] = max(rss[is_base], peak)
    return base, this, rss[True], rss[False]


def normalizer_cost(path: Path, pairs: int) -> tuple[list[float], list[float]]:
    """CPU seconds of the explain pass without and with the normalizer, in alternating pairs."""
    off: list[float] = []
    on: list[float] = []
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        for normalize in order:
            _, cpu, answer, _ = explain_in_child(path, normalize=normalize)
            assert answer == "CUDA_OOM"
            (on if normalize else off).append(cpu)
    return off, on


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=200)
    ap.add_argument("--keep", type=Path, default=None, help="write the log here and keep it")
    ap.add_argument("--pairs", type=int, default=3,
                    help="runs without and with the normalizer, alternating (default 3)")
    ap.add_argument("--baseline", type=Path, default=None, metavar="SRC",
                    help="another checkout's src directory to compare with, in alternating "
                    "pairs of fresh processes")
    args = ap.parse_args()
    tmpdir = tempfile.mkdtemp(prefix="gpuwarden-explain-bench-")
    path = args.keep or Path(tmpdir) / "noisy.log"
    try:
        oom_line = generate(path, args.size_mb)
        size = path.stat().st_size
        mib = size / 2**20
        print(f"log: {mib:.0f} MiB, {path}")

        # warm the page cache so every contender reads from memory
        with path.open("rb") as fh:
            while fh.read(1 << 24):
                pass

        t0 = time.perf_counter()
        diag = explain_file(path)
        dt = time.perf_counter() - t0
        assert diag.primary.code == "CUDA_OOM" and diag.primary.first_line == oom_line, diag
        assert [f.code for f in diag.others] == ["NCCL_WATCHDOG_TIMEOUT"]
        child_dt, _, child_code, rss_kib = explain_in_child(path)
        assert child_code == "CUDA_OOM"
        off, on = normalizer_cost(path, args.pairs)

        naive_bps = naive_lines_per_s(path, max_bytes=min(size, 16 << 20))
        grep_dt = grep_seconds(path)

        print(f"{'method':<44} {'seconds':>9} {'MiB/s':>8} {'vs explain':>10}")
        print(f"{'gpuwarden explain (in-process)':<44} {dt:>9.2f} {mib / dt:>8.1f} {1.0:>10.2f}")
        print(f"{'gpuwarden explain (fresh process)':<44} {child_dt:>9.2f} "
              f"{mib / child_dt:>8.1f} {child_dt / dt:>10.2f}")
        naive_dt = size / naive_bps
        print(f"{'naive: every regex on every line (extrap.)':<44} {naive_dt:>9.2f} "
              f"{mib / naive_dt:>8.1f} {naive_dt / dt:>10.2f}")
        if grep_dt is not None:
            print(f"{'grep -c -F -i -f keywords (counts only)':<44} {grep_dt:>9.2f} "
                  f"{mib / grep_dt:>8.1f} {grep_dt / dt:>10.2f}")
        cpu_off, cpu_on = statistics.median(off), statistics.median(on)
        print(f"line normalizer, {args.pairs} alternating pairs of fresh processes, CPU time: "
              f"without {cpu_off:.2f} s ({mib / cpu_off:.1f} MiB/s), with {cpu_on:.2f} s "
              f"({mib / cpu_on:.1f} MiB/s): {100 * (cpu_on / cpu_off - 1):+.1f} %")
        print(f"  CPU seconds without: {' '.join(f'{x:.2f}' for x in off)}; "
              f"with: {' '.join(f'{x:.2f}' for x in on)}")
        print(f"peak RSS of the fresh explain process: {rss_kib / 1024:.0f} MiB "
              f"for a {mib:.0f} MiB log")
        if args.baseline is not None:
            base, this, base_rss, this_rss = baseline_comparison(path, args.baseline, args.pairs)
            b, t = statistics.median(base), statistics.median(this)
            print(f"baseline {args.baseline} vs this checkout, {args.pairs} alternating pairs "
                  f"of fresh processes, CPU time (median):")
            print(f"  baseline: {b:.2f} s = {mib / b:.1f} MiB/s, peak RSS "
                  f"{base_rss / 1024:.0f} MiB; runs: {' '.join(f'{x:.2f}' for x in base)}")
            print(f"  this:     {t:.2f} s = {mib / t:.1f} MiB/s, peak RSS "
                  f"{this_rss / 1024:.0f} MiB; runs: {' '.join(f'{x:.2f}' for x in this)}")
            print(f"  this checkout vs baseline: {100 * (t / b - 1):+.1f} % CPU time")
        print(f"answer: {diag.primary.code} at line {diag.primary.first_line} "
              f"(rank {diag.primary.first_rank}); echoes: {[f.code for f in diag.others]}")
    finally:
        if args.keep is None:
            shutil.rmtree(tmpdir, ignore_errors=True)


if __name__ == "__main__":
    main()
