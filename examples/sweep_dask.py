"""The sweep of sweep_joblib.py over the GPU workers of several hosts (Dask distributed).

On each host: ``gpuwarden worker tcp://SCHEDULER:8786 --workers-per-gpu 2`` (after
``dask scheduler`` somewhere). Then, anywhere that reaches the scheduler:

    python examples/sweep_dask.py tcp://SCHEDULER:8786

joblib's own ``dask`` backend sends each call to a worker; each worker sees only its GPU (as
cuda:0). Without an address it starts a one-host cluster (gpuwarden.dask.local_cluster).
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import cloudpickle
import sweep_joblib
from distributed import Client, get_worker
from joblib import Parallel, delayed, parallel_config
from sweep_joblib import train

# The workers on other hosts cannot import this directory: send the training code with the task.
cloudpickle.register_pickle_by_value(sweep_joblib)


def train_on_worker(lr: float, hidden: int) -> dict[str, Any]:
    result = train(lr, hidden)
    result["where"] = f"{get_worker().name} on {result['where']}"
    return result


def sweep(address: str) -> None:
    grid = list(itertools.product([1e-3, 1e-2, 3e-2], [16, 64]))
    with Client(address), parallel_config(backend="dask"):
        results = Parallel()(delayed(train_on_worker)(lr, hidden) for lr, hidden in grid)
    for r in sorted(results, key=lambda r: r["loss"]):
        print(f"lr={r['lr']:<6} hidden={r['hidden']:<3} loss={r['loss']:.4f}  {r['where']}")


def main() -> None:
    if len(sys.argv) > 1:
        sweep(sys.argv[1])
        return
    from gpuwarden.dask import local_cluster
    from gpuwarden.errors import NoGPUError

    try:
        cluster = local_cluster(workers_per_gpu=2)
    except NoGPUError as exc:
        print(f"no GPU ({exc.what}): 2 CPU workers")
        cluster = local_cluster(gpus=2, cpu=True)
    with cluster:
        sweep(cluster.scheduler_address)


if __name__ == "__main__":  # Dask's workers are spawned: they re-import this module
    main()
