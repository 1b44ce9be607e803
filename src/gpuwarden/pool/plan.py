"""The pool's plan, a pure function: GPUs and workers per GPU -> one slot (and env) per worker.

Slots go round-robin over the GPUs (slot 0 on the first GPU, slot 1 on the second, ...), so
that a pool running fewer tasks than it has workers still spreads them over every GPU, and
slot i keeps its GPU when the pool is resized.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpuwarden.visibility import CHILD_ORDER_ENV

if TYPE_CHECKING:  # annotations only: a worker imports this module for its thread variables
    from gpuwarden.inventory.snapshot import GPUSnapshot

WORKER_ENV = "GPUWARDEN_POOL_WORKER"
# Thread pools of numerical libraries default to one thread per core in every worker; with N
# workers that is N x cores threads. joblib's loky backend caps them the same way.
THREAD_LIMIT_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class WorkerSlot:
    """One worker's place in the pool: its GPU (None: a CPU worker), its environment, and the
    thread cap its numerical libraries get (None: the caller set none and none applies)."""

    index: int
    gpu: GPUSnapshot | None
    env: Mapping[str, str] = field(default_factory=dict)
    threads: int | None = None

    @property
    def device_label(self) -> str:
        return self.gpu.label if self.gpu is not None else "CPU"


def plan_slots(gpus: Sequence[GPUSnapshot], workers_per_gpu: int, *, cpu_workers: int,
               max_workers: int | None = None, parent_env: Mapping[str, str] | None = None,
               cpu_count: int | None = None, extra_env: Mapping[str, str] | None = None,
               ) -> tuple[WorkerSlot, ...]:
    """``workers_per_gpu`` slots per GPU, or ``cpu_workers`` CPU slots when ``gpus`` is empty,
    the first ``max_workers`` of them when given.

    Every worker gets CUDA_DEVICE_ORDER=PCI_BUS_ID and its own CUDA_VISIBLE_DEVICES (the GPU's
    ``cuda_id``; empty for a CPU worker, so that a CPU worker never grabs a GPU by accident),
    thread caps of cores / workers (a value the caller set wins), and ``extra_env``.
    """
    parent_env = os.environ if parent_env is None else parent_env
    count = len(gpus) * workers_per_gpu if gpus else cpu_workers
    if max_workers is not None:
        count = min(count, max_workers)
    cores = cpu_count or os.cpu_count() or 1
    default_threads = str(max(1, cores // max(1, count)))
    slots = []
    for index in range(count):
        gpu = gpus[index % len(gpus)] if gpus else None
        env = dict(CHILD_ORDER_ENV)
        env["CUDA_VISIBLE_DEVICES"] = gpu.cuda_id if gpu is not None else ""
        env[WORKER_ENV] = str(index)
        for var in THREAD_LIMIT_VARS:
            env[var] = parent_env.get(var, default_threads)
        env.update(extra_env or {})
        threads = env["OMP_NUM_THREADS"]
        slots.append(WorkerSlot(index, gpu, env, int(threads) if threads.isdigit() else None))
    return tuple(slots)
