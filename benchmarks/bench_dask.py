"""`gpuwarden worker` vs plain `dask worker` processes on one Dask scheduler, side by side.

Same engine (distributed's Nanny and Worker), same number of workers, one thread each:
  - start-up: from starting the command to every worker registered at the scheduler;
  - per-task overhead: wall time / number of tiny tasks through joblib's `dask` backend and
    through client.map, warm workers (median of --repeat runs, the two setups alternating).

The GPU discipline (leases, per-worker CUDA_VISIBLE_DEVICES, the task record the death report
reads, the scheduler plugin) must add no measurable per-task cost. Without a GPU the workers run
on a simulated 2-GPU host (tests/scenarios/two_gpu.json), pinned exactly as on a real one.
Usage: python benchmarks/bench_dask.py [--workers 2] [--tasks 1000] [--repeat 5]
"""
# verify-gpu: --workers 2 --tasks 300 --repeat 2

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASK = str(Path(sys.executable).parent / "dask")


def tiny(x: int) -> int:
    return x + 1


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [e.get("PYTHONPATH")])])
    if not e.get("GPUWARDEN_SIMULATE"):
        from gpuwarden.inventory import real_gpu_present

        if not real_gpu_present():
            e["GPUWARDEN_SIMULATE"] = str(ROOT / "tests/scenarios/two_gpu.json")
    return e


def start_scheduler(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    info = tmp / "scheduler.json"
    proc = subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", "0",
                             "--no-dashboard", "--scheduler-file", str(info)], env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not info.exists() or not info.read_text().strip():
        time.sleep(0.05)
    return proc, json.loads(info.read_text())["address"]


def host_gpus() -> int:
    """GPUs of the host the workers will see: the simulated one, or NVML's."""
    simulated = env().get("GPUWARDEN_SIMULATE")
    if simulated:
        from gpuwarden.inventory.simulated import SimulatedBackend

        return len(SimulatedBackend(simulated).read_host().gpus)
    from gpuwarden.inventory.nvml import device_count

    return device_count()


def commands(address: str, workers: int) -> dict[str, list[str]]:
    """Both setups start ``workers`` nanny-managed workers with one thread each."""
    gpus = 2 if workers % 2 == 0 and host_gpus() >= 2 else 1
    return {
        "gpuwarden worker": [sys.executable, "-m", "gpuwarden", "worker", address, "--gpus",
                             str(gpus), "--workers-per-gpu", str(workers // gpus)],
        "dask worker": [DASK, "worker", address, "--nworkers", str(workers), "--nthreads", "1",
                        "--no-dashboard"],
    }


def start_workers(client: Any, cmd: list[str], workers: int, lease_dir: str
                  ) -> tuple[subprocess.Popen[bytes], float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**env(), "GPUWARDEN_LEASE_DIR": lease_dir},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client.wait_for_workers(workers, timeout=120)
    return proc, time.perf_counter() - t0


def stop_workers(client: Any, proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(60)
    while client.scheduler_info(n_workers=-1)["workers"]:
        time.sleep(0.05)


def per_task_s(run: Callable[[], object], tasks: int) -> float:
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) / tasks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-dask-"))
    try:
        return compare(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def compare(args: argparse.Namespace, tmp: Path) -> int:
    from distributed import Client
    from joblib import Parallel, delayed, parallel_config

    lease_dir = str(tmp / "leases")
    os.mkdir(lease_dir)
    names = ["gpuwarden worker", "dask worker"]
    startup: dict[str, list[float]] = {n: [] for n in names}
    joblib_s: dict[str, list[float]] = {n: [] for n in names}
    map_s: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.repeat):
        for name in names if i % 2 == 0 else reversed(names):
            # A fresh scheduler each time: gpuwarden's scheduler plugin stays installed once a
            # gpuwarden worker registered it, and its cost belongs to gpuwarden's column.
            run_dir = Path(tempfile.mkdtemp(dir=tmp))
            scheduler, address = start_scheduler(run_dir)
            try:
                with Client(address) as client:
                    proc, took = start_workers(client, commands(address, args.workers)[name],
                                               args.workers, lease_dir)
                    startup[name].append(took)
                    try:
                        client.gather(client.map(tiny, range(50), pure=False))  # warm up
                        with parallel_config(backend="dask"):
                            joblib_s[name].append(per_task_s(
                                lambda: Parallel()(delayed(tiny)(x) for x in range(args.tasks)),
                                args.tasks))
                        map_s[name].append(per_task_s(
                            lambda: client.gather(client.map(tiny, range(args.tasks),
                                                             pure=False)),
                            args.tasks))
                    finally:
                        stop_workers(client, proc)
            finally:
                scheduler.terminate()
                scheduler.wait(30)

    def med(values: list[float]) -> float:
        return statistics.median(values)

    print(f"{args.workers} workers x 1 thread, {args.tasks} tiny tasks, median of "
          f"{args.repeat} (alternating), {os.cpu_count()} CPU(s)")
    print(f"{'':28}{'gpuwarden worker':>18}{'dask worker':>14}{'ratio':>8}")
    rows = (("start-up (s)", startup, 1.0), ("per task, joblib dask (ms)", joblib_s, 1e3),
            ("per task, client.map (ms)", map_s, 1e3))
    for label, data, scale in rows:
        g, d = med(data[names[0]]) * scale, med(data[names[1]]) * scale
        print(f"{label:28}{g:>18.3f}{d:>14.3f}{g / d:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
