"""The "gpuwarden" joblib backend: joblib's Parallel over a :class:`GPUPool`.

Usage::

    import gpuwarden  # registers the backend (joblib is not imported by this)
    from joblib import Parallel, delayed, parallel_config

    with parallel_config(backend="gpuwarden", n_jobs=4, workers_per_gpu=2):
        results = Parallel()(delayed(train)(lr) for lr in grid)

Implements joblib's current backend API (``submit`` + ``retrieve_result_callback``, with
auto-batching of tiny tasks like loky's backend). Large numpy arrays in arguments travel as
memory maps through joblib's own machinery (``max_nbytes``, ``mmap_mode``, ``temp_folder``
as with loky). Like loky's reusable executor, the pool outlives one ``Parallel`` call: the
next call with the same settings reuses its warm workers; a pool left idle
``idle_worker_timeout`` seconds (default :data:`IDLE_WORKER_TIMEOUT_S`) releases its GPUs,
and keeps its workers :data:`PARKED_WORKER_TIMEOUT_S` more when none of them is on a GPU
(the next call leases the same GPUs again), else shuts down; a new :class:`GPUPool` in this
process takes over an idle warm pool's GPUs at once. Nested ``Parallel`` calls run
sequentially (see :meth:`effective_n_jobs`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from joblib._memmapping_reducer import TemporaryResourcesManager, get_memmapping_reducers
from joblib._parallel_backends import (
    AutoBatchingMixin,
    FallbackToBackend,
    ParallelBackendBase,
    SequentialBackend,
)
from joblib.parallel import register_parallel_backend

from gpuwarden.pool import BACKEND_NAME
from gpuwarden.pool.plan import WORKER_ENV

if TYPE_CHECKING:
    # Loaded on the first Parallel call: registering the backend costs no executor import.
    from gpuwarden.pool.executor import GPUPool

# Seconds: GPUs are a shared resource, so an idle warm pool lets them go soon; long enough
# that a loop of Parallel calls keeps its lease.
IDLE_WORKER_TIMEOUT_S = 10.0
# Seconds a warm pool that let its GPUs go keeps its workers (loky's idle timeout): when none
# of them holds a context on a GPU they hold nothing another job could want, and a new
# worker would import again what the tasks need (scikit-learn: seconds per worker). The next
# call leases the same GPUs again, or gets a new pool when another job took one meanwhile.
PARKED_WORKER_TIMEOUT_S = 300.0
# The module every task of this backend needs in its worker (preloaded by the fork server).
JOBLIB_PRELOAD = "joblib.parallel"
# How long an answer to "how many GPUs could a pool get beside the warm one's?" is kept
# (_count_beside): it costs ~1 ms (NVML and the leases), and scikit-learn's tests make hundreds
# of Parallel calls a second with the same warm pool.
BESIDE_TTL_S = 2.0
# question -> (warm pool, when, answer); one entry per question, kept for one pool (whose
# settings the answer was counted under: a pool is the warm one only for its own settings),
# which it does not keep alive: however the pool goes (shut down, replaced, dropped after an
# abort, released idle), the entry stops answering and holds nothing of it.
_beside_seen: dict[str, tuple[weakref.ref[Any], float, int]] = {}
# joblib's memmapping settings, as loky's backend takes them (Parallel passes them to
# configure()); joblib's own defaults apply when a caller gives none.
_MEMMAP_DEFAULTS: dict[str, Any] = {"max_nbytes": 1e6, "mmap_mode": "r", "temp_folder": None,
                                    "prewarm": False, "verbose": 0}
# What Parallel passes to every backend and a process pool has no use for.
_JOBLIB_ONLY = ("context", "prefer", "require")

_lock = threading.Lock()
_reusable: dict[str, Any] = {}
# Pools replaced by a call with other settings while another call still used them: each is
# shut down when its last call ends (never under a call that runs on it).
_replaced: list[dict[str, Any]] = []


def _forget_reusable() -> None:
    """Empty the warm-pool registry (under a fresh lock: a forked child may have inherited
    the old one held by a thread that does not exist in the child)."""
    global _lock
    _lock = threading.Lock()
    _reusable.update(settings=None, n=None, pool=None, timer=None, timer_at=None,
                     deadline=None, users=0)
    _replaced.clear()


_forget_reusable()
# A child forked while a warm pool exists (a multiprocessing worker, os.fork) must never use
# the parent's pool: its workers and GPU leases belong to the parent.
os.register_at_fork(after_in_child=_forget_reusable)


def _settings_key(pool_kwargs: dict[str, Any]) -> str:
    return repr(sorted(pool_kwargs.items()))


def _usable_slots(pool_kwargs: dict[str, Any]) -> tuple[int, bool]:
    """How many workers ``n_jobs=-1`` means (every slot of the GPUs the pool would have), and
    whether they are GPU slots.

    The warm pool with these settings counts its own GPUs (leased, CUDA contexts in NVML:
    counted afresh they would look taken) plus the GPUs still usable beside them; else the
    count is the lease manager's answer for ``gpus="auto"``, the one ``take_gpus`` acts on,
    under the pool's own ``min_free``/``allow_shared``.
    """
    from gpuwarden.lease.grant import make_request
    from gpuwarden.pool.gpus import usable_gpu_count

    settings = _settings_key(pool_kwargs)
    with _lock:
        pool = _reusable["pool"]
        own = pool if pool is not None and _reusable["settings"] == settings else None
    if own is None:
        # Other settings replace the warm pool anyway: let its GPUs go before counting them.
        release_if_idle()
    workers_per_gpu = int(pool_kwargs.get("workers_per_gpu") or 1)
    spec = pool_kwargs.get("gpus", "auto")

    def count() -> int:
        min_free, mem = pool_kwargs.get("min_free"), pool_kwargs.get("mem_per_worker")
        return usable_gpu_count(
            spec, workers_per_gpu=workers_per_gpu,
            min_free_bytes=make_request(1, min_free=min_free).constraints.min_free_bytes,
            allow_shared=bool(pool_kwargs.get("allow_shared", False)),
            inventory=pool_kwargs.get("inventory"),
            mem_per_worker_bytes=make_request(1, mem=mem).memory_bytes if mem is not None else 0)

    if own is not None and own.holds_gpus:  # a parked pool's GPUs are counted afresh
        gpus = len(own.gpus) if spec != "auto" else \
            len(own.gpus) + _count_beside(own, "n_jobs=-1", count)
    else:
        gpus = count()
    if gpus:
        return gpus * workers_per_gpu, True
    if own is not None:
        return int(own.n_workers), False
    return int(pool_kwargs.get("cpu_workers") or os.cpu_count() or 1), False


def _get_pool(n_workers: int, pool_kwargs: dict[str, Any]) -> GPUPool:
    """The warm pool when its settings match (resized to ``n_workers``, as loky's reusable
    executor is), else a new one; counted as in use.

    A warm pool that another call is using is never shut down nor shrunk under it: a call
    with other settings gets a pool of its own (the other one goes when its call ends), one
    with more workers grows the shared pool."""
    settings = _settings_key(pool_kwargs)
    idle_old = None
    with _lock:
        _reusable["deadline"] = None  # in use: its idle clock, if set, rings for nothing
        pool = _reusable["pool"]
        # A parked pool (its GPUs let go when it was idle) takes them again before it is
        # judged like a warm one; when another job took one, a new pool is started.
        if pool is not None and _reusable["settings"] == settings and pool.running \
                and pool._unpark() \
                and _fits(pool, n_workers, pool_kwargs, shared=bool(_reusable["users"])):
            _reusable["users"] += 1
            target = n_workers if _reusable["users"] == 1 else max(n_workers, pool.n_workers)
            if target != pool.n_workers:
                pool.resize(target)
            _reusable["n"] = n_workers
            return pool
        if pool is not None:
            old = dict(_reusable)
            if old["users"]:
                _replaced.append(old)
            else:
                idle_old = pool
                pool.shutdown(wait=False)
        stale = _reusable["timer"]
        _reusable.update(pool=None, settings=None, n=None, users=0, timer=None)
    if stale is not None:
        stale.cancel()
    if idle_old is not None:
        idle_old.shutdown(wait=True)
    from gpuwarden.pool.executor import GPUPool

    pool = GPUPool(max_workers=n_workers,
                   **{"preload": _default_preload(), **pool_kwargs})
    with _lock:
        previous = dict(_reusable) if _reusable["pool"] is not None else None
        _reusable.update(settings=settings, pool=pool, n=n_workers, users=1, timer=None,
                         deadline=None)
        if previous is not None and previous["users"]:
            _replaced.append(previous)  # another thread's pool, in use: it goes when done
        elif previous is not None:
            previous["pool"].shutdown(wait=False)
    return pool


def _fits(pool: GPUPool, n_workers: int, pool_kwargs: dict[str, Any], *, shared: bool) -> bool:
    """Whether ``pool`` can serve a call of ``n_workers`` workers by resizing: within its
    capacity, and — when nobody else uses it and it took "auto" GPUs — not when a new pool
    would get more GPUs than it holds (workers spread over more GPUs beat more workers per
    GPU)."""
    capacity = pool.capacity
    if capacity is not None and n_workers > capacity:
        return False
    if shared or not pool.gpus or n_workers <= len(pool.gpus) \
            or pool_kwargs.get("gpus", "auto") != "auto":
        return True
    return _other_gpus(pool, pool_kwargs) == 0


def _other_gpus(pool: GPUPool, pool_kwargs: dict[str, Any]) -> int:
    """GPUs a new pool could take beside ``pool``'s: it only decides whether a call grows the
    warm pool or makes one over more GPUs."""
    from gpuwarden.pool.gpus import usable_gpu_count

    return _count_beside(pool, "other", lambda: usable_gpu_count(
        "auto", inventory=pool_kwargs.get("inventory"),
        allow_shared=bool(pool_kwargs.get("allow_shared", False))))


def _count_beside(pool: GPUPool, question: str, count: Callable[[], int]) -> int:
    """``count()``, a number of GPUs usable beside the warm ``pool``'s, asked again after
    :data:`BESIDE_TTL_S` or for another pool: a GPU another job frees or takes meanwhile
    is seen that much later (its lease, not this count, decides what a pool gets)."""
    now = time.monotonic()
    seen = _beside_seen.get(question)
    if seen is not None and seen[0]() is pool and now - seen[1] < BESIDE_TTL_S:
        return seen[2]
    answer = count()
    _beside_seen[question] = (weakref.ref(pool), now, answer)  # the warm pool's answer alone
    return answer


def _done_with(pool: GPUPool, idle_s: float) -> None:
    """A Parallel call stopped using ``pool``: once nobody uses it, its idle clock runs until
    ``idle_s`` from now (or, for a pool that was replaced meanwhile, it is shut down). When the
    clock runs out the pool lets its GPUs go: parked (workers kept,
    :data:`PARKED_WORKER_TIMEOUT_S` more) when none of its processes is on a GPU, else shut
    down.

    The clock is one timer thread that outlives the calls: a call that ends only moves the
    deadline, and the timer, when it rings early, sets itself again for what is left. Started
    and cancelled per call (scikit-learn's tests make hundreds of calls a second), a thread
    each cost more than the rest of the call's bookkeeping."""
    timer = stale = None
    with _lock:
        replaced = next((e for e in _replaced if e["pool"] is pool), None)
        if replaced is not None:
            replaced["users"] -= 1
            if replaced["users"] > 0:
                return
            _replaced.remove(replaced)
        else:
            if _reusable["pool"] is not pool:
                return
            _reusable["users"] = max(0, _reusable["users"] - 1)
            if _reusable["users"]:
                return
            deadline = time.monotonic() + idle_s
            _reusable["deadline"] = deadline
            if _reusable["timer"] is None or _reusable["timer_at"] > deadline:
                stale = _reusable["timer"]  # set for later than this call's idle_s
                timer = _arm_locked(pool, idle_s)
            if stale is None and timer is None:
                return  # the running clock rings before the deadline and sets itself again
    if stale is not None:
        stale.cancel()
    if timer is not None:
        timer.start()  # kept warm until it expires
    else:
        pool.shutdown(wait=True)


def _arm_locked(pool: GPUPool, delay_s: float) -> threading.Timer:
    """A new idle clock for the warm ``pool``, ringing in ``delay_s`` (started by the caller,
    after the lock)."""
    timer = threading.Timer(delay_s, _clock_rang, (pool,))
    timer.daemon = True
    _reusable.update(timer=timer, timer_at=time.monotonic() + delay_s)
    return timer


def _clock_rang(pool: GPUPool) -> None:
    """The warm pool's idle clock (the current thread) rang: set it again for what is left
    of the deadline, or let the pool's GPUs go (see :func:`_done_with`)."""
    again = None
    with _lock:
        if _reusable["pool"] is not pool or _reusable["timer"] is not threading.current_thread():
            return  # replaced, shut down, or set anew since
        _reusable["timer"] = None
        deadline = _reusable["deadline"]
        if _reusable["users"] or deadline is None:
            return  # in use: the call that ends last sets the clock
        now = time.monotonic()
        if now < deadline:
            again = _arm_locked(pool, deadline - now)
        elif not pool.parked and pool._park():
            _reusable["deadline"] = now + PARKED_WORKER_TIMEOUT_S
            again = _arm_locked(pool, PARKED_WORKER_TIMEOUT_S)
        else:
            _reusable.update(pool=None, settings=None, deadline=None)
            # Marked closing before the lock goes: a new pool asking for these GPUs waits
            # for them (GPUPool._take) instead of being refused.
            pool.shutdown(wait=False)
    if again is not None:
        again.start()
        return
    pool.shutdown(wait=True)


def _drop_pool(pool: GPUPool, *, kill: bool) -> None:
    timer = None
    with _lock:
        if _reusable["pool"] is pool:
            # Its idle clock goes with it, as in shutdown_reusable_pool: left set, it would
            # hold the dropped pool for up to PARKED_WORKER_TIMEOUT_S only to ring for nothing.
            timer = _reusable["timer"]
            _reusable.update(pool=None, settings=None, users=0, timer=None, deadline=None)
        _replaced[:] = [e for e in _replaced if e["pool"] is not pool]
    if timer is not None:
        timer.cancel()
    pool.shutdown(wait=True, cancel_futures=True, kill_workers=kill)


def shutdown_reusable_pool() -> None:
    """Shut down the pool kept warm between Parallel calls (and release its GPUs) now."""
    with _lock:
        pool, timer = _reusable["pool"], _reusable["timer"]
        _reusable.update(pool=None, settings=None, timer=None, deadline=None, users=0)
        if pool is not None:
            pool.shutdown(wait=False)
    if timer is not None:
        timer.cancel()
    if pool is not None:
        pool.shutdown(wait=True)


def release_if_idle() -> None:
    """Shut down the warm pool if no Parallel call is using it (its GPUs are released).

    GPUPool calls this before it takes GPUs, so that a pool created after a Parallel call
    in the same process gets the GPUs the warm pool would otherwise keep until it expires.
    """
    with _lock:
        if _reusable["pool"] is None or _reusable["users"]:
            return
    shutdown_reusable_pool()


class GpuwardenBackend(AutoBatchingMixin, ParallelBackendBase):
    """joblib backend over GPUPool. Backend arguments (``parallel_config(backend="gpuwarden",
    ...)`` or ``Parallel(backend="gpuwarden", ...)``) are GPUPool's: ``gpus``,
    ``workers_per_gpu``, ``memory_fraction``, ``mem_per_worker`` (with ``workers_per_gpu``),
    ``start_method``, ``preload``, ``initializer``, ``initargs``, ``min_free`` ..., plus ``idle_worker_timeout`` (seconds) and joblib's
    ``max_nbytes``/``mmap_mode``/``temp_folder``."""

    supports_retrieve_callback = True
    supports_inner_max_num_threads = False
    default_n_jobs = 1  # joblib's contract for n_jobs=None; n_jobs=-1 is every usable slot

    def __init__(self, nesting_level: int | None = None,
                 inner_max_num_threads: int | None = None, **backend_kwargs: Any) -> None:
        super().__init__(nesting_level=nesting_level,
                         inner_max_num_threads=inner_max_num_threads, **backend_kwargs)
        self._pool: GPUPool | None = None
        self._pool_kwargs: dict[str, Any] = _split_kwargs(backend_kwargs)[0]
        self._reducers: dict[type, Callable[[Any], Any]] | None = None
        self._temp_folders: TemporaryResourcesManager | None = None
        self._idle_s = IDLE_WORKER_TIMEOUT_S
        self.parallel: Any = None

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        """``n_jobs`` as the number of workers; 1 (sequential, in the caller) when nested.

        Nested means: inside a gpuwarden worker (silently: a task's inner loop runs on its
        GPU), or inside a task of another Parallel (joblib's ``nesting_level`` > 0: a loky,
        threading or multiprocessing task) or a daemonic process (a multiprocessing worker)
        — there with a warning, as loky does: a pool there would compete with its siblings
        for the same GPUs. A negative ``n_jobs`` that comes to one GPU slot is 2 for joblib
        (which runs ``n_jobs == 1`` in the caller, unleased, on whatever GPU it sees) and one
        pinned worker in the pool.
        """
        return self._resolve(n_jobs)[0]

    def _resolve(self, n_jobs: int | None) -> tuple[int, int]:
        """(what joblib is told, how many workers the pool gets)."""
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is None or n_jobs == 1:
            return 1, 1
        if os.environ.get(WORKER_ENV) is not None:
            return 1, 1
        nested = _nested_where(self.nesting_level)
        if nested is not None:
            warnings.warn(f"gpuwarden-backed parallel loops cannot be nested {nested}, "
                          "setting n_jobs=1", stacklevel=4)
            return 1, 1
        if n_jobs < 0:
            slots, on_gpus = _usable_slots(self._pool_kwargs)
            workers = max(slots + 1 + n_jobs, 1)
            return (max(workers, 2) if on_gpus else workers), workers
        return int(n_jobs), int(n_jobs)

    def configure(self, n_jobs: int | None = 1, parallel: Any = None, prefer: Any = None,
                  require: Any = None, **kwargs: Any) -> int:
        pool_kwargs, memmap_kwargs, idle_s = _split_kwargs({**self.backend_kwargs, **kwargs})
        self._pool_kwargs = pool_kwargs
        n, workers = self._resolve(n_jobs)
        if n == 1:
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        self._idle_s = idle_s
        self._pool = _get_pool(workers, pool_kwargs)
        self.parallel = parallel
        # joblib's memmapping, as its multiprocessing backend wires it: arrays above
        # max_nbytes are dumped once into a folder of this Parallel call and sent as memory
        # maps; terminate() deletes the folder. The folder (and joblib's resource tracker
        # process, which registers it) is made only when a first array is that large.
        temp_root = memmap_kwargs.pop("temp_folder")
        context_id = getattr(parallel, "_id", None)

        def resolve_temp_folder() -> str:
            if self._temp_folders is None:
                self._temp_folders = TemporaryResourcesManager(temp_root, context_id=context_id)
            return str(self._temp_folders.resolve_temp_folder_name())

        self._reducers = get_memmapping_reducers(
            temp_folder_resolver=resolve_temp_folder, unlink_on_gc_collect=False,
            **memmap_kwargs)[0]
        return n

    def submit(self, func: Callable[[], Any], callback: Callable[[Any], None] | None = None
               ) -> Future[Any]:
        assert self._pool is not None
        future = self._pool._submit(func, (), {}, self._reducers)
        if callback is not None:
            future.add_done_callback(callback)
        return future

    def retrieve_result_callback(self, out: Future[Any]) -> Any:
        return out.result()

    def terminate(self) -> None:
        if self._pool is not None:
            _done_with(self._pool, self._idle_s)
            self._pool = None
        self._clean_temp_folder()
        self.reset_batch_stats()

    def _clean_temp_folder(self) -> None:
        if self._temp_folders is not None:
            # Every task of the call has finished (or its worker was killed): the memory
            # maps' files can go, even while a worker still maps one (Linux keeps the pages).
            self._temp_folders._clean_temporary_resources(force=True, allow_non_empty=True)
            self._temp_folders = None
        self._reducers = None

    def abort_everything(self, ensure_ready: bool = True) -> None:
        if self._pool is not None:
            _drop_pool(self._pool, kill=True)
            self._pool = None
        self._clean_temp_folder()
        if ensure_ready and self.parallel is not None:
            self.configure(n_jobs=self.parallel.n_jobs, parallel=self.parallel,
                           **self.parallel._backend_kwargs)

    def get_nested_backend(self) -> tuple[Any, int | None]:
        nesting_level = (self.nesting_level or 0) + 1
        return SequentialBackend(nesting_level=nesting_level), None


def _nested_where(nesting_level: int | None) -> str | None:
    import multiprocessing

    if multiprocessing.current_process().daemon:
        return "in a daemonic process (e.g. a multiprocessing worker)"
    if nesting_level:
        return "inside a task of another Parallel call"
    return None


def _with_joblib(preload: tuple[str, ...]) -> tuple[str, ...]:
    # Every task is a joblib batch, which imports joblib.parallel (and numpy: ~0.25 s) where it
    # is unpickled: imported once by the server, a worker a resize adds runs its first batch at
    # once instead of importing first while the warm workers wait for work.
    return preload if JOBLIB_PRELOAD in preload else (*preload, JOBLIB_PRELOAD)


def _default_preload() -> tuple[str, ...]:
    """A new pool's preload when the caller gave none: torch too when the caller has imported
    it (its tasks likely use it); a caller that has not rarely sends tasks that do, and would
    wait seconds for an import it never uses."""
    return _with_joblib(("torch",) if "torch" in sys.modules else ())


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Backend arguments -> (GPUPool's, joblib memmapping's, idle timeout in seconds)."""
    pool_kwargs = dict(kwargs)
    for name in _JOBLIB_ONLY:
        pool_kwargs.pop(name, None)
    memmap_kwargs = {name: pool_kwargs.pop(name, default)
                     for name, default in _MEMMAP_DEFAULTS.items()}
    if memmap_kwargs["mmap_mode"] == "w+":
        memmap_kwargs["mmap_mode"] = "r+"  # as joblib: w+ would zero the data when mapped
    idle = pool_kwargs.pop("idle_worker_timeout", None)
    # n_jobs is the number of workers, as with every joblib backend: without an explicit
    # workers_per_gpu, n_jobs above the number of GPUs puts several workers on each.
    pool_kwargs.setdefault("workers_per_gpu", None)
    # A preload of the caller's is a setting (a pool with another one is not reused); without
    # one, the pool's is chosen when a pool is made (_default_preload), not here: it depends
    # on whether the caller has imported torch by then, and a warm pool replaced because
    # torch came in since (scikit-learn's tests import it half way) started every worker
    # again (2.2 s in test_cross_validate_many_jobs, loky 0.1 s). Its workers import torch
    # when a task needs it, as loky's do.
    if "preload" in pool_kwargs:
        pool_kwargs["preload"] = _with_joblib(tuple(pool_kwargs["preload"] or ()))
    if pool_kwargs.get("initializer") is None:
        pool_kwargs.pop("initializer", None)
        pool_kwargs.pop("initargs", None)
    return pool_kwargs, memmap_kwargs, IDLE_WORKER_TIMEOUT_S if idle is None else float(idle)


# The class takes the place of the hook's factory (gpuwarden/_joblib_hook.py); imported first
# (before joblib), this module's import of joblib ran the hook before the class existed, and
# registering here covers that order too.
register_parallel_backend(BACKEND_NAME, GpuwardenBackend)
