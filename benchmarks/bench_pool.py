"""GPUPool and the "gpuwarden" joblib backend vs joblib's default loky backend, side by side.

Measured in one run, same number of workers for everyone; every row is the median of
--repeat (5) measurements (the large array's, of twice as many), the competitors taking turns
repetition by repetition, and a summary lists each case's gpuwarden / loky ratio:
  - per-task overhead: wall time / number of tiny tasks, warm workers;
  - first-result latency: from creating the pool (cold) to the first result; for joblib's
    Parallel also its CPU: the pool's processes', from creating the pool to its shutdown;
  - a tiny torch computation per task (a 64x64 matmul), warm workers, both preloading torch
    (per-task time and the threads each worker runs with);
  - Parallel calls that alternate n_jobs (n, 2n, n, ...): a warm pool resized, not rebuilt;
  - the cost of a worker death: from the task that kills its (only) worker to the next result;
  - a large array (--array-mb, 200 MB) given to each of 8 tasks, warm workers: wall time
    and peak memory of the whole process tree (PSS, sampled every 5 ms: shared pages such
    as a memory map count once; RSS summed over the processes for comparison), this process
    counted by what it gained during the call (the array itself is in neither);
  - cold start with torch: pool creation to the first result of a task that uses torch;
  - a suite-like sequence, what a test-suite such as scikit-learn's does (issue 39): 16
    short Parallel calls, mostly one n_jobs and a few more, the caller's own work between
    them, an idle gap past gpuwarden's 10 s idle timeout in the middle (--suite-gap-s; not
    counted), tasks from a library that costs --suite-import-ms to import in each new worker;
    from cold, backends alternating (--only suite runs only this case).

With --cuda (a real GPU only; exit 77 without one), instead: the same work with CUDA in the
workers of one GPU, GPUPool vs loky's executor, both with --n-jobs workers on GPU 0:
  - cold start: pool creation to a first result from every worker (each creates its context);
  - a small CUDA computation per task (a 256x256 matmul on the GPU, a float back), warm;
  - a 1 MiB CUDA tensor returned by each task: GPUPool hands it back on the CPU, loky pickles
    it as a CUDA tensor, so the parent creates a CUDA context to receive it (said, and timed).

Without a GPU the pool runs on a simulated 2-GPU host (tests/scenarios/two_gpu.json), so
its workers are pinned exactly as on a real one. Usage: python benchmarks/bench_pool.py
"""
# verify-gpu: --cuda --n-jobs 2 --tasks 200 --repeat 5

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import shutil
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from _procs import as_installed

ROOT = Path(__file__).resolve().parents[1]


def tiny(x: int) -> int:
    return x + 1


def torch_task(x: int) -> float:
    import torch

    return float(torch.ones(4).sum()) + x


def cuda_matmul(x: int) -> float:
    import torch

    a = torch.full((256, 256), float(x % 7), device="cuda")
    return float((a @ a).sum())


def cuda_tensor(x: int) -> Any:
    import torch

    return torch.full((512, 512), float(x), device="cuda")  # 1 MiB of float32


def cuda_section(args: argparse.Namespace) -> int:
    """GPUPool vs loky with CUDA in the workers of GPU 0 (the module docstring says what)."""
    from gpuwarden.inventory import real_gpu_present

    if not real_gpu_present():
        print("bench_pool --cuda: no GPU here (NVML reports none): skipped", file=sys.stderr)
        return 77
    from joblib.externals.loky import get_reusable_executor

    from gpuwarden.pool import GPUPool

    n, tasks = args.n_jobs, args.tasks
    print(f"CUDA in {n} workers on GPU 0, {tasks} tasks, median of {args.repeat}, "
          "the two sides alternating")

    # torch is imported here before either is measured: the first tensor result unpickled in
    # this process imports it (1-2 s, more on a loaded box), and whichever side came first
    # was charged for it. (A CPU dry run of this section with --repeat 1 put it on GPUPool,
    # measured first: 41-123 ms per tensor against loky's 7.5 ms; with torch imported first,
    # 3.3 ms against 19 ms.) Importing torch does not initialize CUDA.
    import torch

    # wait: a job that just ended may still hold its lease for a moment (the first real-GPU
    # run started this right after a launcher was stopped, and was refused).
    def gpupool() -> Any:
        return GPUPool(gpus=1, workers_per_gpu=n, allow_shared=True, preload=("torch",),
                       wait="60s")

    def loky() -> Any:
        return get_reusable_executor(max_workers=n, reuse=False)

    def first_from_every_worker(pool: Any) -> float:
        t0 = time.perf_counter()
        for f in [pool.submit(cuda_matmul, i) for i in range(n)]:
            f.result()
        return time.perf_counter() - t0

    def batch(pool: Any, fn: Callable[[int], Any], count: int) -> float:
        t0 = time.perf_counter()
        for f in [pool.submit(fn, i) for i in range(count)]:
            f.result()
        return (time.perf_counter() - t0) / count

    # Each side measured in turn, repetition by repetition (runs 1-4 measured GPUPool's rows
    # first, then loky's: the card's clocks and the box's load differ between the halves and
    # put 0.72x, then 1.01-1.17x on the same code). Cold starts: a new pool each time.
    cold: dict[str, list[float]] = {"GPUPool": [], "loky": []}
    for _ in range(args.repeat):
        for name, make in (("GPUPool", gpupool), ("loky", loky)):
            t0 = time.perf_counter()
            pool = make()
            first_from_every_worker(pool)
            cold[name].append(time.perf_counter() - t0)
            pool.shutdown(wait=True)
    # Warm: both pools kept, the small matmul alternating.
    pools = {"GPUPool": gpupool(), "loky": loky()}
    matmul: dict[str, list[float]] = {"GPUPool": [], "loky": []}
    for pool in pools.values():
        batch(pool, cuda_matmul, tasks)  # warm-up: contexts, kernels, clocks
    for _ in range(args.repeat):
        for name, pool in pools.items():
            matmul[name].append(batch(pool, cuda_matmul, tasks))
    # CUDA tensors back: GPUPool's first, since loky's make this process create a context.
    tensor = {"GPUPool": [batch(pools["GPUPool"], cuda_tensor, tasks // 4)
                          for _ in range(args.repeat)]}
    device = pools["GPUPool"].submit(cuda_tensor, 1).result().device.type
    pool_parent_cuda = torch.cuda.is_initialized()
    tensor["loky"] = [batch(pools["loky"], cuda_tensor, tasks // 4) for _ in range(args.repeat)]
    loky_parent_cuda = torch.cuda.is_initialized()
    for pool in pools.values():
        pool.shutdown(wait=True)

    rows = {name: {"cold": statistics.median(cold[name]), "matmul": statistics.median(matmul[name]),
                   "tensor": statistics.median(tensor[name])} for name in ("loky", "GPUPool")}
    print(f"{'':12} {'cold start':>12} {'matmul/task':>13} {'1 MiB CUDA tensor back/task':>29}")
    for name, r in rows.items():
        print(f"{name:12} {r['cold'] * 1e3:9.0f} ms {r['matmul'] * 1e6:10.0f} us "
              f"{r['tensor'] * 1e6:26.0f} us")
    lo, gp = rows["loky"], rows["GPUPool"]
    print(f"GPUPool / loky: cold {gp['cold'] / lo['cold']:.2f}x, matmul {gp['matmul'] / lo['matmul']:.2f}x, "
          f"tensor back {gp['tensor'] / lo['tensor']:.2f}x")
    print("each repetition (ms; us per task): cold GPUPool "
          + " ".join(f"{t * 1e3:.0f}" for t in cold["GPUPool"]) + ", loky "
          + " ".join(f"{t * 1e3:.0f}" for t in cold["loky"]) + "; matmul GPUPool "
          + " ".join(f"{t * 1e6:.0f}" for t in matmul["GPUPool"]) + ", loky "
          + " ".join(f"{t * 1e6:.0f}" for t in matmul["loky"]))
    print(f"CUDA initialized in this process: after GPUPool {pool_parent_cuda}, after loky "
          f"{loky_parent_cuda}; GPUPool's CUDA tensors arrive on: {device}")
    return 0


def array_sum(a: Any) -> float:
    return float(a.sum())


def torch_small(x: int) -> float:
    import torch

    a = torch.full((64, 64), float(x))
    return float((a @ a).sum())


def torch_threads(_: int) -> int:
    import torch

    return int(torch.get_num_threads())


def die(_: int) -> None:
    os._exit(1)


class TreeMemory:
    """Peak memory of this process and all its descendants, sampled in a thread. This process
    counts by what it gained since the start: what it held before (its heap, grown by earlier
    cases and by the other backend's calls, and never given back) is neither backend's cost,
    and counted whole it went to whichever backend was measured second (+16 MiB)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        import psutil

        self._me = psutil.Process()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.peak_pss = self.peak_rss = 0
        self._base_pss = self._base_rss = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        import psutil

        pss = rss = 0
        for proc in [self._me, *self._me.children(recursive=True)]:
            try:
                info = proc.memory_full_info()
            except psutil.Error:
                continue
            if proc is self._me:
                if not self._base_pss:
                    self._base_pss, self._base_rss = info.pss, info.rss
                pss += info.pss - self._base_pss
                rss += info.rss - self._base_rss
            else:
                pss += info.pss
                rss += info.rss
        self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._interval_s)

    def __enter__(self) -> TreeMemory:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's reaped children and their reaped ones."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def large_array_run(run: Callable[[], list[float]]) -> tuple[float, TreeMemory]:
    """Wall time and peak tree memory of one call; each process first drops unused heap."""
    import gc

    gc.collect()
    with TreeMemory() as memory:
        t0 = time.perf_counter()
        run()
        took = time.perf_counter() - t0
    return took, memory


def turns(names: Iterable[str], rep: int) -> list[str]:
    """The order the competitors go in at repetition ``rep``: rotated each time, so that none
    always goes first or right after the same other (a shared box's load drifts: measured in
    blocks, whichever side ran in a quiet minute won by 15-30 %)."""
    order = list(names)
    k = rep % len(order)
    return order[k:] + order[:k]


def medians_in_turns(runs: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """The median wall time of ``repeat`` calls of each of ``runs``, the calls taken in turns
    (the best of a few would flatter whichever side had a quiet moment)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(repeat):
        for name in turns(runs, rep):
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def first_result() -> int:
    """The first result of a one-task Parallel call in the current joblib configuration."""
    from joblib import Parallel, delayed

    return next(iter(Parallel(return_as="generator")(delayed(tiny)(i) for i in range(1))))


SUITE_LIB = """\
# Written by benchmarks/bench_pool.py: a library whose import costs what --suite-import-ms says
# (CPU time, like scikit-learn's 1-3 s), imported in the caller and in every worker that runs
# one of its functions.
import time

_end = time.process_time() + {import_s}
while time.process_time() < _end:
    pass


def fit(x):
    total = 0
    for i in range(20000):
        total += i * x
    return total
"""


def suite_calls(n: int) -> list[int]:
    """n_jobs of the suite-like sequence's Parallel calls. In scikit-learn's tests (traced for
    issue 39) most calls of one module ask for the same n_jobs, a few for more."""
    return [n] * 6 + [2 * n] + [n] * 5 + [n + 1] + [n] * 3


def suite_round(backend: str, calls: list[int], gap_s: float, extra: dict[str, Any]) -> float:
    """One pass of the suite-like sequence from cold: its wall time, less the idle gap."""
    import _bench_suite_lib as lib
    from joblib import Parallel, delayed

    t0 = time.perf_counter()
    for i, k in enumerate(calls):
        Parallel(backend=backend, n_jobs=k, **extra)(delayed(lib.fit)(x) for x in range(8))
        lib.fit(3)  # the test's own work between its Parallel calls
        if i == len(calls) // 2 and gap_s:
            time.sleep(gap_s)  # a long test without Parallel: past gpuwarden's idle timeout
    return time.perf_counter() - t0 - gap_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-jobs", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5,
                        help="measurements per row; each row shows their median")
    parser.add_argument("--array-mb", type=int, default=200,
                        help="size of the array given to each of 8 tasks (0: skip)")
    parser.add_argument("--suite-gap-s", type=float, default=11.0,
                        help="the idle gap in the suite-like sequence (0: none)")
    parser.add_argument("--suite-import-ms", type=float, default=500.0,
                        help="CPU time the suite-like sequence's library costs to import")
    parser.add_argument("--only", choices=("suite",), default=None,
                        help="run only this case")
    parser.add_argument("--cuda", action="store_true",
                        help="only the CUDA comparison on the real GPU 0 (exit 77 without one)")
    args = parser.parse_args()
    as_installed(ROOT / "src" / "gpuwarden")
    if args.cuda:
        return cuda_section(args)
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

    n, tasks, repeat = args.n_jobs, args.tasks, args.repeat
    per_gpu = max(1, n // 2)
    load = os.getloadavg()[0]
    print(f"joblib {joblib.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"n_jobs={n}, host: {os.environ.get('GPUWARDEN_SIMULATE') or 'NVML'}, "
          f"load average {load:.1f}; every row: the median of {repeat} (the large array: "
          f"{2 * repeat})")
    ratios: dict[str, float] = {}  # each case's gpuwarden / loky, for the summary

    def reset() -> None:
        get_reusable_executor().shutdown(wait=True)
        shutdown_reusable_pool()

    if args.only != "suite":
        # -- executor level: loky's reusable executor vs GPUPool, one submit per task --------
        # Each repetition starts a pool cold (first result) and then runs the tiny tasks.
        makers: dict[str, Callable[[], Any]] = {
            "loky executor": lambda: get_reusable_executor(max_workers=n, reuse=False),
            **{f"GPUPool {method}": (lambda method=method: GPUPool(
                workers_per_gpu=per_gpu, max_workers=n, start_method=method, preload=()))
               for method in ("forkserver", "spawn")}}
        executor_firsts: dict[str, list[float]] = {name: [] for name in makers}
        executor_tasks: dict[str, list[float]] = {name: [] for name in makers}
        for rep in range(repeat):
            for name in turns(makers, rep):
                t0 = time.perf_counter()
                pool = makers[name]()
                pool.submit(tiny, 0).result()
                executor_firsts[name].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for f in [pool.submit(tiny, i) for i in range(tasks)]:
                    f.result()
                executor_tasks[name].append((time.perf_counter() - t0) / tasks)
                pool.shutdown(wait=True)
        rows: list[tuple[str, float, float]] = [
            (f"{name}, submit() per task", statistics.median(executor_tasks[name]),
             statistics.median(executor_firsts[name])) for name in makers]

        # -- joblib level: Parallel with backend loky vs gpuwarden (auto-batching in both) ---
        backends = {"loky": {}, "gpuwarden": {"workers_per_gpu": per_gpu, "preload": ()}}
        firsts: dict[str, list[float]] = {b: [] for b in backends}
        per_task: dict[str, list[float]] = {b: [] for b in backends}
        for rep in range(repeat):
            for backend in turns(backends, rep):
                reset()
                t0 = time.perf_counter()
                with joblib.parallel_config(backend=backend, n_jobs=n, **backends[backend]):
                    first_result()
                    firsts[backend].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    Parallel()(delayed(tiny)(i) for i in range(tasks))
                    per_task[backend].append((time.perf_counter() - t0) / tasks)
        for backend in backends:
            rows.append((f"joblib Parallel, backend={backend}",
                         statistics.median(per_task[backend]), statistics.median(firsts[backend])))
        reset()
        # What a cold first result costs in CPU: the CPU time of the processes the pool started
        # (counted when they are reaped, at shutdown), from creating the pool to its shutdown
        # after the first result. loky's workers each import joblib and numpy, at once, and
        # the first ready one runs the batch; gpuwarden's fork server imports them once and
        # forks its workers.
        first_cpu: dict[str, list[float]] = {b: [] for b in backends}
        for rep in range(repeat):
            for backend in turns(backends, rep):
                reset()
                before = children_cpu_s()
                with joblib.parallel_config(backend=backend, n_jobs=n, **backends[backend]):
                    first_result()
                reset()
                first_cpu[backend].append(children_cpu_s() - before)
        cold_cpu = {b: statistics.median(v) for b, v in first_cpu.items()}

        print(f"\n{tasks} tiny tasks (x + 1), n_jobs={n}:")
        print(f"{'':42} {'per task':>10} {'ratio':>7} {'first result (cold)':>20} {'ratio':>7}")
        for name, per_task_s, first in rows:
            base = rows[3] if name.startswith("joblib") else rows[0]
            print(f"{name:42} {per_task_s * 1e6:8.0f}us {per_task_s / base[1]:6.2f}x "
                  f"{first * 1e3:17.0f} ms {first / base[2]:6.2f}x")
        for name, per_task_s, first in rows[1:3] + rows[4:]:
            base = rows[3] if name.startswith("joblib") else rows[0]
            ratios[f"{name}: per task"] = per_task_s / base[1]
            ratios[f"{name}: first result"] = first / base[2]
        ratios["joblib Parallel, backend=gpuwarden: first result, CPU"] = \
            cold_cpu["gpuwarden"] / cold_cpu["loky"]
        print(f"joblib Parallel, first result from cold, the CPU of the pool's processes (until "
              f"its shutdown): loky {cold_cpu['loky'] * 1e3:.0f} ms, gpuwarden "
              f"{cold_cpu['gpuwarden'] * 1e3:.0f} ms "
              f"({ratios['joblib Parallel, backend=gpuwarden: first result, CPU']:.2f}x)")

        # -- a tiny torch computation per task, warm workers preloading torch ----------------
        import torch  # noqa: F401 - the gpuwarden backend then preloads it in its fork server

        # As many tasks as the tiny-task rows: with 200, the row timed joblib's batch-size
        # ramp (its auto-batching starts at one task per batch), which settled at ~55 or ~108 us
        # per task from call to call on either backend alike.
        torch_tasks = tasks
        print(f"\na tiny torch computation per task (64x64 matmul), {torch_tasks} tasks, "
              f"n_jobs={n}, warm workers:")
        threads = {backend: sorted(set(Parallel(backend=backend, n_jobs=n)(
            delayed(torch_threads)(i) for i in range(2 * n)))) for backend in ("loky", "gpuwarden")}
        torch_rows = medians_in_turns(
            {backend: (lambda backend=backend: Parallel(backend=backend, n_jobs=n)(
                delayed(torch_small)(i) for i in range(torch_tasks)))
             for backend in ("loky", "gpuwarden")}, repeat)
        for backend, s in torch_rows.items():
            torch_rows[backend] = s / torch_tasks
            print(f"  {'joblib Parallel, backend=' + backend:40} {s / torch_tasks * 1e6:8.0f} us "
                  f"per task (torch threads per worker: {threads[backend]})")
        ratios["tiny torch task"] = torch_rows["gpuwarden"] / torch_rows["loky"]
        print(f"  gpuwarden / loky: {ratios['tiny torch task']:.2f}x")
        reset()

        # -- Parallel calls that alternate n_jobs: a warm pool resizes ----------------------
        calls = [n, 2 * n] * 3
        print(f"\n{len(calls)} Parallel calls alternating n_jobs {n}/{2 * n} (100 tiny tasks each, "
              "the first call cold):")
        alternating: dict[str, list[float]] = {"loky": [], "gpuwarden": []}
        for rep in range(repeat):
            for backend in turns(alternating, rep):
                extra = {"preload": ()} if backend == "gpuwarden" else {}
                reset()
                t0 = time.perf_counter()
                for k in calls:
                    Parallel(backend=backend, n_jobs=k, **extra)(delayed(tiny)(i) for i in range(100))
                alternating[backend].append(time.perf_counter() - t0)
        alt = {b: statistics.median(v) for b, v in alternating.items()}
        for backend, took in alt.items():
            print(f"  {'joblib Parallel, backend=' + backend:40} {took * 1e3:8.0f} ms")
        ratios["alternating n_jobs"] = alt["gpuwarden"] / alt["loky"]
        print(f"  gpuwarden / loky: {ratios['alternating n_jobs']:.2f}x")
        reset()

        # -- a worker death: from the killing task to the next result -------------------------
        # One worker, so that the next task waits for the replacement (or, for loky, for the
        # executor it builds again: a death breaks a loky executor).
        print("\na worker death (os._exit in a task) until the replacement has run the next "
              "task, 1 worker without torch:")

        def loky_death() -> None:
            get_reusable_executor(max_workers=1).submit(die, 0).exception()
            get_reusable_executor(max_workers=1).submit(tiny, 0).result()

        get_reusable_executor(max_workers=1).submit(tiny, 0).result()
        with contextlib.ExitStack() as stack:  # a pool per method, one GPU each, side by side
            death_runs: dict[str, Callable[[], Any]] = {"loky": loky_death}
            for method in ("forkserver", "spawn"):
                pool = stack.enter_context(GPUPool(gpus=1, max_workers=1, start_method=method,
                                                   preload=()))
                pool.submit(tiny, 0).result()
                death_runs[method] = lambda pool=pool: (pool.submit(die, 0).exception(),
                                                        pool.submit(tiny, 0).result())
            deaths = medians_in_turns(death_runs, repeat)
        get_reusable_executor().shutdown(wait=True)
        for name, took in deaths.items():
            label = "loky executor" if name == "loky" else f"GPUPool {name}"
            print(f"  {label:40} {took * 1e3:8.1f} ms ({took / deaths['loky']:.2f}x loky)")
            if name != "loky":
                ratios[f"worker death, GPUPool {name}"] = took / deaths["loky"]

        # -- a large array to 8 tasks: memory maps (both backends), warm workers ---------------
        if args.array_mb:
            import numpy as np

            array = np.random.default_rng(0).random(args.array_mb * 2**20 // 8)
            expected = float(array.sum())
            print(f"\na {array.nbytes / 2**20:.0f} MB float64 array to each of 8 tasks "
                  f"(a.sum()), n_jobs={n}, warm workers; peak memory of the process tree:")
            print(f"  {'':40} {'time':>8} {'peak PSS':>10} {'peak RSS sum':>13}")
            # The backends take turns, each turn from fresh workers warmed the same way (one
            # backend's idle workers are not in the other's peak), twice as many turns as the
            # other rows: loky's time here is bimodal (~200 or ~320 ms from one block of runs to
            # the next), and the peak depends on how many of the array's pages each worker has
            # mapped at once (280-410 MiB for either backend, sampled every 5 ms; every 20 ms
            # missed the peak by up to 200 MiB).
            array_backends = {"loky": {}, "gpuwarden": {"preload": ()}}
            runs: dict[str, list[tuple[float, int, int]]] = {b: [] for b in array_backends}
            for rep in range(2 * repeat):
                for backend in turns(array_backends, rep):
                    with joblib.parallel_config(backend=backend, n_jobs=n,
                                                **array_backends[backend]):
                        Parallel()(delayed(tiny)(i) for i in range(n))  # warm the workers
                        # ... and this process: its first call with the array grows its heap
                        # by ~16 MiB that stays (joblib's hashing and dumping, either
                        # backend), which was counted in the peak of whichever came first.
                        Parallel()(delayed(array_sum)(array) for _ in range(n))
                        took, memory = large_array_run(
                            lambda: Parallel()(delayed(array_sum)(array) for _ in range(8)))
                        runs[backend].append((took, memory.peak_pss, memory.peak_rss))
                        if rep == 0:
                            assert Parallel()(delayed(array_sum)(array) for _ in range(1)) \
                                == [expected]
                    reset()
            measured: dict[str, tuple[float, float]] = {}
            for backend, backend_runs in runs.items():
                took, pss, rss = (statistics.median(r[i] for r in backend_runs) for i in range(3))
                measured[backend] = (took, pss)
                print(f"  {'joblib Parallel, backend=' + backend:40} {took * 1e3:6.0f} ms "
                      f"{pss / 2**20:7.0f} MiB {rss / 2**20:10.0f} MiB")
            (loky_t, loky_pss), (gw_t, gw_pss) = measured["loky"], measured["gpuwarden"]
            ratios["large array: time"] = gw_t / loky_t
            ratios["large array: peak PSS"] = gw_pss / loky_pss
            print(f"  gpuwarden / loky: time {gw_t / loky_t:.2f}x, peak PSS {gw_pss / loky_pss:.2f}x")
            del array

        # -- cold start of workers that use torch ---------------------------------------------
        print("\ncold start to the first result of a task that imports torch:")

        def loky_torch_start() -> float:
            t0 = time.perf_counter()
            loky = get_reusable_executor(max_workers=n, reuse=False)
            for f in [loky.submit(torch_task, i) for i in range(n)]:
                f.result()
            took = time.perf_counter() - t0
            loky.shutdown(wait=True)
            return took

        def pool_torch_start(method: str) -> float:
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
                respawns[method].append(time.perf_counter() - t1)
            return took

        starts: dict[str, list[float]] = {"loky": [], "forkserver": [], "spawn": []}
        respawns: dict[str, list[float]] = {"forkserver": [], "spawn": []}
        for rep in range(repeat):
            for name in turns(starts, rep):
                starts[name].append(loky_torch_start() if name == "loky" else pool_torch_start(name))
        loky_torch = statistics.median(starts["loky"])
        print(f"  {'loky executor':40} {loky_torch * 1e3:8.0f} ms (all {n} workers)")
        for method in ("forkserver", "spawn"):
            took = statistics.median(starts[method])
            ratios[f"torch cold start, GPUPool {method}"] = took / loky_torch
            print(f"  {'GPUPool ' + method + ', preload torch':40} {took * 1e3:8.0f} ms "
                  f"({took / loky_torch:.2f}x loky); crash + replacement "
                  f"{statistics.median(respawns[method]) * 1e3:.0f} ms")

    # -- a suite-like sequence: many short Parallel calls, work between, an idle gap --------
    # What scikit-learn's test-suite does to a backend (issue 39): each test calls Parallel
    # with its own n_jobs, between them the test's own work, and now and then a test without
    # Parallel runs longer than gpuwarden's idle timeout (10 s). The tasks' library costs
    # --suite-import-ms to import in every worker that has not imported it yet.
    import tempfile

    lib_dir = tempfile.mkdtemp(prefix="gpuwarden-bench-")
    Path(lib_dir, "_bench_suite_lib.py").write_text(
        SUITE_LIB.format(import_s=args.suite_import_ms / 1e3))
    sys.path.insert(0, lib_dir)
    calls = suite_calls(n)
    print(f"\na suite-like sequence from cold: {len(calls)} Parallel calls of 8 tasks, n_jobs "
          f"{'/'.join(str(k) for k in sorted(set(calls)))}, the caller's own work between "
          f"calls, an idle gap of {args.suite_gap_s:g} s in the middle (not counted), a "
          f"library costing {args.suite_import_ms:g} ms to import in each new worker; "
          "backends alternate:")
    suite: dict[str, list[float]] = {"loky": [], "gpuwarden": []}
    for rep in range(repeat):
        for backend in turns(suite, rep):
            reset()
            extra = {"preload": ()} if backend == "gpuwarden" else {}
            suite[backend].append(suite_round(backend, calls, args.suite_gap_s, extra))
    reset()
    sys.path.remove(lib_dir)
    shutil.rmtree(lib_dir, ignore_errors=True)
    med = {b: statistics.median(v) for b, v in suite.items()}
    for backend, took in med.items():
        each = " ".join(f"{t:.2f}" for t in suite[backend])
        print(f"  {'joblib Parallel, backend=' + backend:40} {took:8.2f} s   (runs: {each})")
    ratios["suite-like sequence"] = med["gpuwarden"] / med["loky"]
    print(f"  gpuwarden / loky: {ratios['suite-like sequence']:.2f}x")

    print(f"\nsummary, gpuwarden / loky (median of {repeat} each; load average "
          f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end):")
    for name, ratio in ratios.items():
        print(f"  {name:52} {ratio:6.2f}x{'' if ratio <= 1.0 else '   > 1.0'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
