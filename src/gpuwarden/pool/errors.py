"""The errors a GPUPool future fails with, as concurrent.futures' own types too.

Each is the error of gpuwarden's tree (``gpuwarden.errors``: what, why, fix, evidence, code)
and also a ``concurrent.futures.process.BrokenProcessPool``, so code written for
``ProcessPoolExecutor`` (``except BrokenProcessPool``) handles a GPUPool the same way —
with one difference in meaning: a GPUPool is not broken by a worker's death; only the
task that worker was running fails. They live here, not in ``gpuwarden.errors``, so that
importing the error tree (every CLI command does) does not import multiprocessing.
"""

from __future__ import annotations

from concurrent.futures.process import BrokenProcessPool

from gpuwarden import errors


class WorkerDiedError(errors.WorkerDiedError, BrokenProcessPool):
    """The worker running this task died (signal, exit code); the pool replaced it."""


class PoolBrokenError(errors.PoolBrokenError, BrokenProcessPool):
    """The pool cannot run this task: its workers cannot start, or it was shut down or
    killed while the task ran."""


class TaskTransferError(errors.PoolError, BrokenProcessPool):
    """This task's function or arguments could not be unpickled in the worker, or its result
    could not be unpickled in the caller. Only this task fails."""


class PoolArgumentError(errors.UsageError, ValueError):
    """A bad count (``max_workers``, ``cpu_workers``, ``workers_per_gpu``): a UsageError, and a
    ValueError as concurrent.futures raises for ``max_workers``."""
