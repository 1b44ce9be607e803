"""Lease latency: acquire+release, uncontended and under contention, beside filelock.

What is measured (simulated host, private lease directory in /tmp, CPU only):

- uncontended: one process leasing 1 GPU and releasing it, in a loop;
- contended: P processes looping "lease 1 GPU (wait), hold H ms, release" on the same
  host; latency = asking to granted, and hand-off = a release to the next grant of that GPU;
- competitor: filelock.FileLock (what ad-hoc "GPU lock" scripts use; torch depends on it)
  on one lock file per GPU, same loops. filelock polls every 50 ms by default when waiting.

It is not a test; run it: ``python benchmarks/bench_lease.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SCENARIO = {
    "hostname": "bench",
    "gpus": [{"index": i, "uuid": f"GPU-bench-{i}", "memory_total_mib": 24576,
              "memory_used_mib": 0} for i in range(2)],
}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(name: str, values_s: list[float]) -> str:
    ms = [v * 1000 for v in values_s]
    return (f"{name:<44} n={len(ms):<5} median {statistics.median(ms):8.3f} ms   "
            f"p99 {pct(ms, 0.99):8.3f} ms")


def uncontended_gpuwarden(n: int) -> list[float]:
    from gpuwarden.lease import acquire

    acquire(1).release()  # warm: files exist, modules imported
    out = []
    for _ in range(n):
        t = time.perf_counter()
        acquire(1).release()
        out.append(time.perf_counter() - t)
    return out


def uncontended_filelock(n: int, directory: Path) -> list[float]:
    from filelock import FileLock

    lock = FileLock(str(directory / "gpu0.lock"))
    out = []
    for _ in range(n):
        t = time.perf_counter()
        lock.acquire()
        lock.release()
        out.append(time.perf_counter() - t)
    return out


def _gpuwarden_loop(out: Path, loops: int, hold_s: float) -> Callable[[], None]:
    def body() -> None:
        from gpuwarden.lease import acquire

        lines = []
        for _ in range(loops):
            asked = time.monotonic()
            grant = acquire(1, wait=float("inf"))
            got = time.monotonic()
            time.sleep(hold_s)
            gpu = grant.gpus[0].uuid
            released = time.monotonic()
            grant.release()
            lines.append(json.dumps([asked, got, released, gpu]))
        with open(out, "a") as f:
            f.write("\n".join(lines) + "\n")

    return body


def _filelock_loop(out: Path, loops: int, hold_s: float, directory: Path
                   ) -> Callable[[], None]:
    def body() -> None:
        from filelock import FileLock, Timeout

        locks = [FileLock(str(directory / f"gpu{i}.lock")) for i in range(2)]
        lines = []
        for _ in range(loops):
            asked = time.monotonic()
            held = None
            while held is None:  # any free GPU, else wait on the first one (filelock's poll)
                for i, lock in enumerate(locks):
                    try:
                        lock.acquire(timeout=0)
                        held = i
                        break
                    except Timeout:
                        pass
                if held is None:
                    try:
                        locks[0].acquire(timeout=0.05)
                        held = 0
                    except Timeout:
                        pass
            got = time.monotonic()
            time.sleep(hold_s)
            released = time.monotonic()
            locks[held].release()
            lines.append(json.dumps([asked, got, released, f"gpu{held}"]))
        with open(out, "a") as f:
            f.write("\n".join(lines) + "\n")

    return body


def run_processes(make: Callable[[Path], Callable[[], None]], procs: int, tmp: Path
                  ) -> tuple[list[float], list[float], float]:
    out = tmp / f"out-{time.monotonic_ns()}.jsonl"
    started = time.monotonic()
    gate_r, gate_w = os.pipe()
    pids = []
    for _ in range(procs):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(gate_w)
                os.read(gate_r, 1)
                make(out)()
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(gate_r)
    os.close(gate_w)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"a benchmark process failed (pid {pid})")
    wall_s = time.monotonic() - started
    rows = [json.loads(line) for line in out.read_text().splitlines() if line]
    latency = [got - asked for asked, got, _rel, _gpu in rows]
    handoff = []
    by_gpu: dict[str, list[tuple[float, float, float]]] = {}
    for asked, got, released, gpu in rows:
        by_gpu.setdefault(gpu, []).append((got, released, asked))
    for spans in by_gpu.values():
        spans.sort()
        for (_g1, r1, _a1), (g2, _r2, a2) in zip(spans, spans[1:], strict=False):
            if a2 < r1:  # the next holder was already waiting when this one released
                handoff.append(g2 - r1)
    return latency, handoff, wall_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--hold-ms", type=float, default=5.0)
    args = parser.parse_args()
    n = 200 if args.quick else 1000
    loops = 15 if args.quick else 40
    hold_s = args.hold_ms / 1000

    with tempfile.TemporaryDirectory(prefix="gpuwarden-bench-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "host.json").write_text(json.dumps(SCENARIO))
        os.environ["GPUWARDEN_SIMULATE"] = str(tmp / "host.json")
        os.environ["GPUWARDEN_LEASE_DIR"] = str(tmp / "leases")
        (tmp / "fl").mkdir()
        print(f"simulated 2-GPU host, {os.cpu_count()} CPU(s), python {sys.version.split()[0]}")
        print("uncontended acquire+release, 1 process:")
        ours = uncontended_gpuwarden(n)
        theirs = uncontended_filelock(n, tmp / "fl")
        print("  " + summary("gpuwarden lease(1) (select + lock + record)", ours))
        print("  " + summary("filelock.FileLock (one lock, no selection)", theirs))
        print(f"  ratio gpuwarden / filelock (median): "
              f"{statistics.median(ours) / statistics.median(theirs):.1f}x")

        print(f"contended: {args.procs} processes x {loops} loops, hold {args.hold_ms:g} ms, "
              "2 GPUs:")
        ours_lat, ours_hand, ours_wall = run_processes(
            lambda out: _gpuwarden_loop(out, loops, hold_s), args.procs, tmp)
        fl_lat, fl_hand, fl_wall = run_processes(
            lambda out: _filelock_loop(out, loops, hold_s, tmp / "fl"), args.procs, tmp)
        print("  " + summary("gpuwarden: ask -> granted", ours_lat)
              + f"   max {max(ours_lat) * 1000:8.1f} ms")
        print("  " + summary("filelock:  ask -> granted", fl_lat)
              + f"   max {max(fl_lat) * 1000:8.1f} ms")
        print("  " + summary("gpuwarden: release -> next waiter's grant", ours_hand))
        print("  " + summary("filelock:  release -> next waiter's grant", fl_hand))
        ops = args.procs * loops
        print(f"  throughput: gpuwarden {ops / ours_wall:6.1f} leases/s, filelock "
              f"{ops / fl_wall:6.1f} leases/s (ideal {2 / hold_s:.0f}/s with 2 GPUs)")
        print(f"  ratios gpuwarden / filelock: hand-off (median) "
              f"{statistics.median(ours_hand) / statistics.median(fl_hand):.2f}x, worst wait "
              f"{max(ours_lat) / max(fl_lat):.2f}x, throughput {fl_wall / ours_wall:.2f}x")
        if (statistics.median(fl_lat) < statistics.median(ours_lat)
                and max(fl_lat) > max(ours_lat)):
            # Only when the numbers show it: a short median with a long tail is what unordered
            # service looks like (a releasing process takes the lock straight back).
            print("  (filelock: shorter median wait but a longer worst wait: it serves in no "
                  "order, so a releasing process often takes the lock straight back)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
