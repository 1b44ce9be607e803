"""GPU workers for Dask distributed: gpuwarden's GPU discipline on Dask's engine.

``gpuwarden worker tcp://SCHEDULER:8786`` on each host (or :func:`start_workers` from Python)
leases GPUs with the same leases as ``gpuwarden run``, launch and the pool, then starts
``workers_per_gpu`` Dask workers per GPU (distributed's own Nanny and Worker), each with its own
``CUDA_VISIBLE_DEVICES``, a name that says host and GPU (``box-a/GPU1/0``) and a ``GPU``
resource. A worker that dies fails its task with :class:`~gpuwarden.errors.DaskWorkerDiedError`
(host, GPU, signal) instead of ``KilledWorker``. joblib's own ``dask`` backend runs sweeps over
these workers unchanged::

    from distributed import Client
    from joblib import Parallel, delayed, parallel_config

    with Client("tcp://10.0.0.4:8786"), parallel_config(backend="dask"):
        results = Parallel()(delayed(train)(lr) for lr in grid)

:func:`local_cluster` does the same on one host with no scheduler to start. Needs the
``dask`` extra (``pip install gpuwarden[dask]``). See docs/dask.md.
"""

from __future__ import annotations

from gpuwarden.dask.plan import GPU_RESOURCE, WorkerSpec, plan_workers
from gpuwarden.dask.workers import (
    LocalGPUCluster,
    WorkerGroup,
    WorkerOptions,
    local_cluster,
    start_workers,
)
from gpuwarden.errors import DaskWorkerDiedError, SchedulerUnreachableError

__all__ = [
    "GPU_RESOURCE",
    "DaskWorkerDiedError",
    "LocalGPUCluster",
    "SchedulerUnreachableError",
    "WorkerGroup",
    "WorkerOptions",
    "WorkerSpec",
    "local_cluster",
    "plan_workers",
    "start_workers",
]
