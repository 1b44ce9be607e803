"""The "gpuwarden" joblib backend: joblib's Parallel over a :class:`GPUPool`.

Usage::

    import gpuwarden  # registers the backend (joblib is not imported by this)
    from joblib import Parallel, delayed, parallel_config

    with parallel_config(backend="gpuwarden", n_jobs=4, workers_per_gpu=2):
        results = Parallel()(delayed(train)(lr) for lr in grid)

Implements joblib's current backend API (``submit`` + ``retrieve_result_callback``, with
auto-batching of tiny tasks like loky's backend). Like loky's reusable executor, the pool
outlives one ``Parallel`` call: the next call with the same settings reuses its warm
workers, and a pool left idle ``idle_worker_timeout`` seconds (default 300) is shut down,
which releases its GPUs. Nested ``Parallel`` calls inside a worker run sequentially.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from joblib._parallel_backends import (
    AutoBatchingMixin,
    FallbackToBackend,
    ParallelBackendBase,
    SequentialBackend,
)

from gpuwarden.pool.executor import GPUPool
from gpuwarden.pool.plan import WORKER_ENV

_lock = threading.Lock()
_reusable: dict[str, Any] = {"settings": None, "n": None, "pool": None, "timer": None}


def _settings_key(pool_kwargs: dict[str, Any]) -> str:
    return repr(sorted(pool_kwargs.items()))


def _usable_slots(pool_kwargs: dict[str, Any]) -> int:
    """How many workers ``n_jobs=-1`` means: every slot of the GPUs the pool would take.

    The warm pool with these settings answers with its own size: its workers hold the
    GPUs (leased, CUDA contexts in NVML), so counting afresh would find them taken. Else the
    count is the lease manager's answer for ``gpus="auto"``, the one ``take_gpus`` acts on,
    under the pool's own ``min_free``/``allow_shared``.
    """
    from gpuwarden.lease.manager import make_request
    from gpuwarden.pool.gpus import usable_gpu_count

    settings = _settings_key(pool_kwargs)
    with _lock:
        pool = _reusable["pool"]
        if pool is not None and _reusable["settings"] == settings:
            return int(pool.n_workers)
    # Other settings replace the warm pool anyway: let its GPUs go before counting them.
    shutdown_reusable_pool()
    workers_per_gpu = int(pool_kwargs.get("workers_per_gpu", 1))
    min_free = pool_kwargs.get("min_free")
    gpus = usable_gpu_count(
        pool_kwargs.get("gpus", "auto"), workers_per_gpu=workers_per_gpu,
        min_free_bytes=make_request(1, min_free=min_free).constraints.min_free_bytes,
        allow_shared=bool(pool_kwargs.get("allow_shared", False)),
        inventory=pool_kwargs.get("inventory"))
    if gpus:
        return gpus * workers_per_gpu
    return int(pool_kwargs.get("cpu_workers") or os.cpu_count() or 1)


def _get_pool(n_workers: int, pool_kwargs: dict[str, Any]) -> GPUPool:
    settings = _settings_key(pool_kwargs)
    with _lock:
        timer = _reusable["timer"]
        if timer is not None:
            timer.cancel()
            _reusable["timer"] = None
        pool = _reusable["pool"]
        # n_workers as asked, or as the pool turned out (fewer GPUs were free than asked).
        if pool is not None and _reusable["settings"] == settings and \
                n_workers in (_reusable["n"], pool.n_workers):
            return pool
        _reusable["pool"] = None
    if pool is not None:
        pool.shutdown(wait=True)
    pool = GPUPool(max_workers=n_workers, **pool_kwargs)
    with _lock:
        _reusable["settings"], _reusable["pool"], _reusable["n"] = settings, pool, n_workers
    return pool


def _drop_pool(pool: GPUPool, *, kill: bool) -> None:
    with _lock:
        if _reusable["pool"] is pool:
            _reusable["pool"] = _reusable["settings"] = None
    pool.shutdown(wait=True, cancel_futures=True, kill_workers=kill)


def _schedule_idle_shutdown(pool: GPUPool, idle_s: float) -> None:
    def expire() -> None:
        with _lock:
            if _reusable["pool"] is not pool or _reusable["timer"] is not timer:
                return
            _reusable["pool"] = _reusable["settings"] = _reusable["timer"] = None
        pool.shutdown(wait=True)

    timer = threading.Timer(idle_s, expire)
    timer.daemon = True
    with _lock:
        if _reusable["pool"] is not pool:
            return
        _reusable["timer"] = timer
    timer.start()


def shutdown_reusable_pool() -> None:
    """Shut down the pool kept warm between Parallel calls (and release its GPUs) now."""
    with _lock:
        pool = _reusable["pool"]
        timer = _reusable["timer"]
        _reusable["pool"] = _reusable["settings"] = _reusable["timer"] = None
    if timer is not None:
        timer.cancel()
    if pool is not None:
        pool.shutdown(wait=True)


class GpuwardenBackend(AutoBatchingMixin, ParallelBackendBase):
    """joblib backend over GPUPool. Backend arguments (``parallel_config(backend="gpuwarden",
    ...)``) are GPUPool's: ``gpus``, ``workers_per_gpu``, ``memory_fraction``, ``start_method``,
    ``preload``, ``initializer``, ``min_free`` ..., plus ``idle_worker_timeout`` (seconds)."""

    supports_retrieve_callback = True
    supports_inner_max_num_threads = False
    default_n_jobs = -1  # every usable slot: the reason to pick this backend

    def __init__(self, nesting_level: int | None = None,
                 inner_max_num_threads: int | None = None, *,
                 idle_worker_timeout: float = 300.0, **pool_kwargs: Any) -> None:
        super().__init__(nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads)
        self._pool_kwargs = pool_kwargs
        self._idle_s = idle_worker_timeout
        self._pool: GPUPool | None = None
        self.parallel: Any = None

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if os.environ.get(WORKER_ENV) is not None:
            return 1  # inside a pool worker: nested loops run sequentially, on this GPU
        if n_jobs is None:
            n_jobs = self.default_n_jobs
        if n_jobs < 0:
            slots = _usable_slots(self._pool_kwargs)
            return max(slots + 1 + n_jobs, 1)
        return n_jobs

    def configure(self, n_jobs: int | None = 1, parallel: Any = None, prefer: Any = None,
                  require: Any = None, **_joblib_kwargs: Any) -> int:
        # joblib also passes its memmapping settings (max_nbytes, mmap_mode, temp_folder);
        # the pool sends arguments by value, so they do not apply.
        n = self.effective_n_jobs(n_jobs)
        if n == 1:
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        self._pool = _get_pool(n, self._pool_kwargs)
        self.parallel = parallel
        return n

    def submit(self, func: Callable[[], Any], callback: Callable[[Any], None] | None = None
               ) -> Future[Any]:
        assert self._pool is not None
        future = self._pool.submit(func)
        if callback is not None:
            future.add_done_callback(callback)
        return future

    def retrieve_result_callback(self, out: Future[Any]) -> Any:
        return out.result()

    def terminate(self) -> None:
        if self._pool is not None:
            _schedule_idle_shutdown(self._pool, self._idle_s)
            self._pool = None
        self.reset_batch_stats()

    def abort_everything(self, ensure_ready: bool = True) -> None:
        if self._pool is not None:
            _drop_pool(self._pool, kill=True)
            self._pool = None
        if ensure_ready and self.parallel is not None:
            self.configure(n_jobs=self.parallel.n_jobs, parallel=self.parallel,
                           **self.parallel._backend_kwargs)

    def get_nested_backend(self) -> tuple[Any, int | None]:
        nesting_level = (self.nesting_level or 0) + 1
        return SequentialBackend(nesting_level=nesting_level), None
