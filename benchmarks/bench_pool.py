"""GPUPool and the "gpuwarden" joblib backend vs joblib's default loky backend, side by side.

Measured in one run, same number of workers for everyone:
  - per-task overhead: wall time / number of tiny tasks, warm workers (best of --repeat);
  - first-result latency: from creating the pool (cold) to the first result;
  - cold start with torch: pool creation to the first result of a task that uses torch.

Without a GPU the pool runs on a simulated 2-GPU host (tests/scenarios/two_gpu.json), so
its workers are pinned exactly as on a real one. Usage: python benchmarks/bench_pool.py
"""
# verify-gpu: --n-jobs 2 --tasks 500 --repeat 1

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def tiny(x: int) -> int:
    return x + 1


def torch_task(x: int) -> float:
    import torch

    return float(torch.ones(4).sum()) + x


def best(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-jobs", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if not os.environ.get("GPUWARDEN_SIMULATE"):
        from gpuwarden.inventory import real_gpu_present

        if not real_gpu_present():
            os.environ["GPUWARDEN_SIMULATE"] = str(ROOT / "tests/scenarios/two_gpu.json")
    warnings.simplefilter("ignore")
    logging.getLogger("gpuwarden.pool").setLevel(logging.ERROR)  # the crash drill below
    import joblib
    from joblib import Parallel, delayed
    from joblib.externals.loky import get_reusable_executor

    import gpuwarden  # noqa: F401 - registers the joblib backend
    from gpuwarden.pool import GPUPool
    from gpuwarden.pool.joblib_backend import shutdown_reusable_pool

    n, tasks = args.n_jobs, args.tasks
    per_gpu = max(1, n // 2)
    print(f"joblib {joblib.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"n_jobs={n}, {tasks} tiny tasks, host: {os.environ.get('GPUWARDEN_SIMULATE') or 'NVML'}")
    rows: list[tuple[str, float, float]] = []

    # -- executor level: loky's reusable executor vs GPUPool, one submit per task ---------
    t0 = time.perf_counter()
    loky = get_reusable_executor(max_workers=n, reuse=False)
    loky.submit(tiny, 0).result()
    loky_first = time.perf_counter() - t0
    loky_s = best(lambda: [f.result() for f in [loky.submit(tiny, i) for i in range(tasks)]],
                  args.repeat)
    loky.shutdown(wait=True)
    rows.append(("loky executor, submit() per task", loky_s / tasks, loky_first))
    baseline = {"executor": loky_s / tasks}  # each row's competitor, kept by name

    for method in ("forkserver", "spawn"):
        t0 = time.perf_counter()
        pool = GPUPool(workers_per_gpu=per_gpu, max_workers=n, start_method=method, preload=())
        pool.submit(tiny, 0).result()
        first = time.perf_counter() - t0
        s = best(lambda: [f.result() for f in [pool.submit(tiny, i) for i in range(tasks)]],  # noqa: B023
                 args.repeat)
        pool.shutdown()
        rows.append((f"GPUPool {method}, submit() per task", s / tasks, first))

    # -- joblib level: Parallel with backend loky vs gpuwarden (auto-batching in both) ---
    for backend, extra in (("loky", {}), ("gpuwarden", {"workers_per_gpu": per_gpu, "preload": ()})):
        t0 = time.perf_counter()
        with joblib.parallel_config(backend=backend, n_jobs=n, **extra):
            next(iter(Parallel(return_as="generator")(delayed(tiny)(i) for i in range(1))))
            first = time.perf_counter() - t0
            s = best(lambda: Parallel()(delayed(tiny)(i) for i in range(tasks)), args.repeat)
        rows.append((f"joblib Parallel, backend={backend}", s / tasks, first))
        if backend == "loky":
            baseline["joblib"] = s / tasks
        if backend == "loky":
            get_reusable_executor().shutdown(wait=True)
        else:
            shutdown_reusable_pool()

    print(f"\n{'':42} {'per task':>10} {'ratio':>7} {'first result (cold)':>20}")
    for name, per_task, first in rows:
        ratio = per_task / baseline["joblib" if name.startswith("joblib") else "executor"]
        print(f"{name:42} {per_task * 1e6:8.0f}us {ratio:6.2f}x {first * 1e3:17.0f} ms")

    # -- cold start of workers that use torch -----------------------------------------------
    print("\ncold start to the first result of a task that imports torch:")
    t0 = time.perf_counter()
    loky = get_reusable_executor(max_workers=n, reuse=False)
    for f in [loky.submit(torch_task, i) for i in range(n)]:
        f.result()
    loky_torch = time.perf_counter() - t0
    loky.shutdown(wait=True)
    print(f"  {'loky executor':40} {loky_torch * 1e3:8.0f} ms (all {n} workers)")
    for method in ("forkserver", "spawn"):
        t0 = time.perf_counter()
        with GPUPool(workers_per_gpu=per_gpu, max_workers=n, start_method=method,
                     preload=("torch",)) as pool:
            for f in [pool.submit(torch_task, i) for i in range(n)]:
                f.result()
            took = time.perf_counter() - t0
            # A replacement worker: what a crash costs before work resumes.
            t1 = time.perf_counter()
            pool.submit(os._exit, 1).exception()
            pool.submit(torch_task, 0).result()
            respawn = time.perf_counter() - t1
        print(f"  {'GPUPool ' + method + ', preload torch':40} {took * 1e3:8.0f} ms "
              f"({took / loky_torch:.2f}x loky); crash + replacement {respawn * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
