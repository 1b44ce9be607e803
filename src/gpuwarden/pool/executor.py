"""GPUPool: a concurrent.futures.Executor whose workers are each pinned to one GPU.

Three parts, one owner each (docs/pool.md, "How tasks flow"):

- the caller's threads (this module): the pool's arguments are checked and its GPUs leased;
  a task is pickled and put in the pool's mailbox (under a lock held for an append, never
  while user code runs); ``shutdown`` and ``resize`` are mailbox entries too;
- the manager thread (``_manager.py``, whose top draws the flow) owns every socket: it drains
  the mailbox, feeds events to the state machine (``_core.Core``: the one place a task's or a
  worker's state changes), carries out the actions the machine returns, and resolves
  futures — outside any lock, so a done-callback may call ``submit``, ``workers`` or
  ``shutdown``;
- the process server (``_server.py``), started with ``posix_spawn`` in the constructor,
  starts every worker and reports every exit; no thread of this process ever forks.

The pools of this process are tracked here too: at interpreter exit and after a fork, and
to tell a job step (``gpuwarden.lease.jobstep``) which GPUs they hold.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

from gpuwarden.errors import ConstraintError, GpuwardenError, PoolError, UsageError
from gpuwarden.pool import _core, _pickling
from gpuwarden.pool._core import Task
from gpuwarden.pool._manager import SERVER_EXIT_WAIT_S, Mailbox, Manager, WorkerInfo, log
from gpuwarden.pool.errors import PoolArgumentError, PoolBrokenError
from gpuwarden.pool.gpus import fraction_for as _fraction_for
from gpuwarden.pool.gpus import memory_per_worker as _memory_per_worker
from gpuwarden.pool.plan import WorkerSlot, plan_slots

if TYPE_CHECKING:
    from gpuwarden.inventory import Inventory
    from gpuwarden.inventory.snapshot import GPUSnapshot
    from gpuwarden.lease import Grant

__all__ = ["CPUFallbackWarning", "GPUPool", "WorkerInfo"]

START_METHODS = ("forkserver", "spawn")
# At interpreter exit, queued and running tasks get this long (GPUPool(exit_timeout_s=...)),
# then what still runs is killed: exit is never held up forever by a task that hangs.
EXIT_TIMEOUT_S = 5.0


class CPUFallbackWarning(UserWarning):
    """The pool found no GPU and runs its workers on the CPU."""


_warned_cpu = False


def _describe_task(fn: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """``train(0.3, <dict>)``: the function's name, plain values shown, other arguments by
    type. Never calls an argument's ``__repr__`` (it may raise, or cost more than pickling)."""
    items = getattr(fn, "items", None)
    if type(fn).__name__ == "BatchedCalls" and isinstance(items, list) and items:
        # joblib's batch of delayed calls: name the function the user wrote.
        return f"a joblib batch of {len(items)} call(s) to {_name(items[0][0])}"
    shown = ", ".join([*(_value(a) for a in args),
                       *(f"{k}={_value(v)}" for k, v in kwargs.items())])
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{_name(fn)}({shown})"


def _name(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) else f"<{type(fn).__name__}>"


def _value(value: Any) -> str:
    if value is None or type(value) in (bool, int, float, complex):
        return repr(value)
    if type(value) in (str, bytes) and len(value) <= 40:
        return repr(value)
    return f"<{type(value).__name__}>"


class _Chunk:
    """Runs ``fn`` over a chunk of argument tuples (map with chunksize > 1)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__qualname__ = f"chunk of {_name(fn)}"

    def __call__(self, chunk: Sequence[tuple[Any, ...]]) -> list[Any]:
        return [self.fn(*args) for args in chunk]


def _chunks(iterables: Sequence[Iterable[Any]], size: int) -> Iterator[tuple[tuple[Any, ...], ...]]:
    zipped = zip(*iterables, strict=False)
    while chunk := tuple(itertools.islice(zipped, size)):
        yield chunk


def _flatten(results: Iterator[list[Any]]) -> Iterator[Any]:
    for chunk in results:
        chunk.reverse()  # hand out items without the list keeping them
        while chunk:
            yield chunk.pop()


class GPUPool(Executor):
    """A process pool with ``workers_per_gpu`` workers on each GPU, each pinned before start.

    Every worker runs with its own ``CUDA_VISIBLE_DEVICES`` (one GPU, so inside it the GPU is
    ``cuda:0``) and ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, in place before the worker runs any
    code. GPUs are chosen by ``gpus``: ``"auto"`` (every usable GPU), a count, or a list of
    indices/UUIDs; they are leased through :func:`gpuwarden.pool.gpus.take_gpus` and released
    at shutdown. Without a GPU (no driver, none visible) ``gpus="auto"`` runs ``cpu_workers``
    CPU workers and warns once; ``gpus=0`` is a CPU pool on any host, without a warning.
    ``max_workers`` also caps the GPUs taken: only the GPUs those workers fill are leased.
    ``workers_per_gpu=None`` spreads ``max_workers`` workers over the GPUs taken (what the
    joblib backend does for ``n_jobs``). ``inventory``: where GPU state is read (default:
    NVML, or GPUWARDEN_SIMULATE's host). While the pool holds GPUs, processes started from
    this process (and from its workers) are job steps of its lease: a pool there uses these
    GPUs instead of waiting for them (``gpuwarden.lease.jobstep``).

    Raises (from the constructor, before any GPU is leased for argument errors): UsageError
    for a bad argument (also a ``ValueError`` for ``max_workers``, as concurrent.futures);
    a pickling error for an initializer that cannot be sent to the workers; ConstraintError
    (exit 4) when fewer GPUs than requested are usable (busy, too little free memory,
    prohibited compute mode; the error lists every GPU's verdict); NoGPUError when GPUs are
    requested explicitly on a host without NVML.

    Futures fail with the task's own exception (the worker's traceback as ``__cause__``), or
    with one named error (``gpuwarden.pool.errors``, each also a concurrent.futures
    ``BrokenProcessPool``): WorkerDiedError when its worker died while running it (only that
    task: the worker is replaced, the others run), TaskTransferError when its arguments or
    result could not be unpickled on the other side, PoolBrokenError when the workers cannot
    start (initializer error, repeated deaths at start-up) or the pool was killed while it
    ran. No future is left pending once ``shutdown(wait=True)`` returns. The pool belongs to
    the process that created it: inherited through ``fork`` it refuses work in the child
    (PoolError). At interpreter exit, tasks get ``exit_timeout_s`` seconds, then what still
    runs is killed.
    """

    def __init__(
        self,
        gpus: str | int | Sequence[int | str] = "auto",
        workers_per_gpu: int | None = 1,
        *,
        max_workers: int | None = None,
        cpu_workers: int | None = None,
        memory_fraction: float | None = None,
        mem_per_worker: int | str | None = None,
        initializer: Callable[..., Any] | None = None,
        initargs: tuple[Any, ...] = (),
        start_method: str = "forkserver",
        preload: Sequence[str] = ("torch",),
        min_free: int | str | None = None,
        allow_shared: bool = False,
        wait: float | str | None = None,
        label: str = "gpuwarden pool",
        inventory: Inventory | None = None,
        exit_timeout_s: float = EXIT_TIMEOUT_S,
    ) -> None:
        # Everything that can be refused is refused before a GPU is leased: an error here
        # never leaves GPUs held for as long as its traceback is kept (a REPL, a notebook).
        _check_count("workers_per_gpu", workers_per_gpu)
        if start_method not in START_METHODS:
            raise UsageError(f"start_method={start_method!r} is not one of {START_METHODS}",
                             fix="'forkserver' (fast starts, preloads once) or 'spawn'")
        if memory_fraction is not None and not 0 < memory_fraction <= 1:
            raise UsageError(f"memory_fraction={memory_fraction}: must be in (0, 1]",
                             fix="a fraction of the GPU, e.g. 0.45 with two workers per GPU")
        _check_count("max_workers", max_workers)
        _check_count("cpu_workers", cpu_workers)
        mem_bytes = _memory_per_worker(mem_per_worker, workers_per_gpu)
        if isinstance(gpus, bool) or (isinstance(gpus, int) and gpus < 0):
            raise UsageError(f"gpus={gpus!r}: expected 'auto', a count >= 0, or a list of ids",
                             fix="gpus='auto', gpus=2 or gpus=[0, 3]")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        pickled_initializer = None if initializer is None \
            else _pickling.dumps_task((initializer, tuple(initargs)))
        self._spread = workers_per_gpu is None
        self._per_gpu = 1 if workers_per_gpu is None else workers_per_gpu
        self._grants: list[Grant] = []
        # Kept to lease the same GPUs again after _park (the joblib backend's idle pool).
        from gpuwarden.pool.gpus import LeaseTerms

        self._lease_terms = LeaseTerms(min_free, allow_shared, label, inventory, mem_bytes)
        self._parked = False
        self._taken = self._take(gpus, max_workers, min_free, allow_shared, wait, label,
                                 inventory, mem_bytes)
        if mem_bytes and memory_fraction is None and self._taken.gpus:
            # Pool workers are gpuwarden's own processes: each caps torch's allocator so that
            # it stays inside its share of the lease (its CUDA context is outside the cap).
            memory_fraction = _fraction_for(mem_bytes, self._taken.gpus)
        try:
            self._start(max_workers=max_workers, cpu_workers=cpu_workers,
                        memory_fraction=memory_fraction, initializer=pickled_initializer,
                        start_method=start_method, preload=preload,
                        exit_timeout_s=exit_timeout_s)
        except BaseException:
            self._taken.release()
            raise

    def _take(self, gpus: str | int | Sequence[int | str], max_workers: int | None,
              min_free: int | str | None, allow_shared: bool, wait: float | str | None,
              label: str, inventory: Inventory | None, mem_per_worker_bytes: int = 0) -> Any:
        from gpuwarden.pool.gpus import TakenGPUs, take_gpus

        if gpus == 0:
            # An explicit CPU pool, whatever the host has: no NVML read, no lease, no warning.
            return TakenGPUs((), _no_release)
        from gpuwarden.lease.grant import make_request

        # make_request validates and parses min_free (str or int) as every lease does.
        min_free_bytes = make_request(1, min_free=min_free).constraints.min_free_bytes
        # GPUs held by joblib's warm pool in this process, idle now, go to this pool.
        _release_idle_warm_pool()
        def take() -> Any:
            return take_gpus(gpus, self._per_gpu, max_workers=max_workers,
                             min_free_bytes=min_free_bytes, allow_shared=allow_shared,
                             wait=wait, label=label, inventory=inventory,
                             mem_per_worker_bytes=mem_per_worker_bytes)

        try:
            try:
                taken = take()
            except ConstraintError:
                # Refused while this process's own pools are closing (a warm pool expiring
                # on its timer thread): their GPUs are on their way back; wait, ask again.
                if not _wait_for_closing_pools():
                    raise
                taken = take()
        except ConstraintError as exc:
            _blame_own_pools(exc)
            raise
        if not taken.gpus:
            _warn_cpu_once(taken.why_cpu)
        if taken.grant is not None:
            self._grants.append(taken.grant)
        return taken

    def _start(self, *, max_workers: int | None, cpu_workers: int | None,
               memory_fraction: float | None, initializer: bytes | None, start_method: str,
               preload: Sequence[str], exit_timeout_s: float) -> None:
        from gpuwarden.lease import jobstep

        self._gpus: tuple[GPUSnapshot, ...] = self._taken.gpus
        self._cpu_workers = cpu_workers or max_workers or os.cpu_count() or 1
        # Processes this pool's workers start are job steps of its lease, as are those this
        # process starts while the pool holds GPUs (_export_step).
        self._step_env = jobstep.env_for(self._grants)
        self._slots = self._plan(max_workers if max_workers is not None else None)
        self.start_method = start_method
        self.exit_timeout_s = exit_timeout_s
        self.notes: list[str] = []
        self._owner_pid = os.getpid()
        boot = {
            "sys_path": [p for p in sys.path if p],
            # multiprocessing's children share the parent's authkey, so that Manager() proxies
            # and other multiprocessing connections made by the caller work inside tasks.
            "authkey": bytes(multiprocessing.current_process().authkey),
            "preload": list(preload),
            "memory_fraction": memory_fraction,
            "initializer": initializer,
        }
        self._shutdown = False
        self._ids = itertools.count()
        self._box = Mailbox()
        self._manager = Manager(self._box, self._slots, start_method=start_method, boot=boot,
                                on_closed=self._closed_down)
        self._thread = self._manager.start()
        _live_pools.add(self)
        _export_step()

    def _plan(self, max_workers: int | None) -> tuple[WorkerSlot, ...]:
        if self._gpus:
            per_gpu = self._per_gpu
            if self._spread and max_workers is not None:
                per_gpu = -(-max_workers // len(self._gpus))
            elif max_workers is not None and max_workers > len(self._gpus) * per_gpu:
                raise UsageError(
                    f"max_workers={max_workers}: this pool has {len(self._gpus)} GPU(s) with "
                    f"{per_gpu} worker(s) each", fix="a new pool, or workers_per_gpu=None")
            return plan_slots(self._gpus, per_gpu, cpu_workers=0, max_workers=max_workers,
                              extra_env=self._step_env)
        count = max_workers or self._cpu_workers
        return plan_slots((), 1, cpu_workers=count, extra_env=self._step_env)

    # -- public API ------------------------------------------------------------------------

    @property
    def gpus(self) -> tuple[GPUSnapshot, ...]:
        """The GPUs this pool holds (empty for a CPU pool)."""
        return self._gpus

    @property
    def holds_gpus(self) -> bool:
        """Whether the pool holds its GPUs' lease now (a parked pool's workers keep their GPU
        pinning but hold nothing: see :meth:`_park`)."""
        return bool(self._gpus) and not self._parked

    @property
    def parked(self) -> bool:
        return self._parked

    @property
    def n_workers(self) -> int:
        return len(self._slots)

    @property
    def running(self) -> bool:
        """Not shut down, closed nor broken: it takes tasks."""
        return not (self._shutdown or self._box.closed or self._box.broken is not None)

    @property
    def capacity(self) -> int | None:
        """The most workers :meth:`resize` can give this pool (None: no limit)."""
        return None if self._spread or not self._gpus else len(self._gpus) * self._per_gpu

    def workers(self) -> list[WorkerInfo]:
        """The live workers (a snapshot the manager publishes), by slot."""
        return list(self._box.workers)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return self._submit(fn, args, kwargs, None)

    def _submit(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                reducers: Mapping[type, Callable[[Any], Any]] | None) -> Future[Any]:
        """submit(), pickling objects of the types in ``reducers`` with those reducers
        (the joblib backend's memory-mapping of large arrays)."""
        self._check_owner()
        self._check_open()
        future: Future[Any] = Future()
        try:
            payload = _pickling.dumps_task((fn, args, kwargs), reducers)
        except Exception as exc:  # noqa: BLE001 - as ProcessPoolExecutor: the future carries it
            future.set_exception(exc)
            return future
        task = Task(next(self._ids), future, payload, _describe_task(fn, args, kwargs))
        with self._box.lock:
            self._check_open()
            self._box.put_locked("task", task)
        return future

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any], timeout: float | None = None,
            chunksize: int = 1) -> Iterator[Any]:
        """As ProcessPoolExecutor.map: with ``chunksize`` > 1, the calls travel in chunks."""
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        if chunksize == 1:
            return super().map(fn, *iterables, timeout=timeout)
        results = super().map(_Chunk(fn), _chunks(iterables, chunksize), timeout=timeout)
        return _flatten(results)

    def resize(self, max_workers: int) -> None:
        """Grow or shrink to ``max_workers`` workers on the same GPUs, as loky's reusable
        executor does: new slots get workers at once; a slot that goes keeps its worker until
        its tasks are done. Raises UsageError beyond :attr:`capacity`."""
        self._check_owner()
        _check_count("max_workers", max_workers)
        slots = self._plan(max_workers)
        with self._box.lock:
            self._check_open()
            self._slots = slots
            self._box.put_locked("resize", slots)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False,
                 kill_workers: bool = False, timeout_s: float | None = None) -> None:
        """Stop the pool: no new tasks; running (and, unless cancelled, queued) tasks finish,
        then the workers stop, whatever they started is killed, and the GPUs are released.
        ``kill_workers=True`` kills at once (running tasks fail with PoolBrokenError);
        ``timeout_s`` bounds the wait (after it, running tasks fail the same way and queued
        ones are cancelled). Without it, as in concurrent.futures, tasks finish however long
        they take. With ``wait=True`` no future is left pending when this returns (called from
        a done-callback, which runs on the pool's own thread, it cannot wait and returns at
        once). In a process that inherited the pool through fork this does nothing."""
        if os.getpid() != self._owner_pid:
            return
        deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
        with self._box.lock:
            if not self._box.closed:
                self._shutdown = True
                self._box.put_locked("shutdown", cancel_futures, kill_workers, deadline)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _park(self) -> bool:
        """Release the GPUs' lease but keep the workers, when none of the pool's processes
        holds a context on any of its GPUs (NVML lists none of them): they then hold nothing
        another job could want. Whether it parked; False leaves the pool as it was (the
        caller shuts it down). For the joblib backend's warm pool, idle: GPUs are released
        soon, while the workers, with what their tasks imported, outlive the lease as loky's
        do. Only an idle pool is parked (no task in it), and :meth:`_unpark` is called before
        it runs another task."""
        if self._parked:
            return True
        if self._gpus:
            if self._holds_gpu_context():
                return False
            try:
                self._taken.release()
            except GpuwardenError as exc:
                log.warning("releasing the pool's GPUs failed: %s", exc)
                return False
            self._grants = []  # released: nothing of them may be passed on as a job step
        self._parked = True
        _export_step()
        return True

    def _unpark(self) -> bool:
        """Lease the parked pool's GPUs again (the same GPUs, every slot, no waiting), so that
        its workers, pinned to them, may run tasks, under the terms it first had (every slot,
        or its memory lease). Whether it did; False when another job
        took one meanwhile (the caller shuts the pool down and starts another)."""
        if not self._parked:
            return True
        if self._gpus:
            from gpuwarden.pool.gpus import take_again

            taken = take_again(self._gpus, self._per_gpu, self._lease_terms)
            if taken is None:
                return False
            # The workers' job-step variable names this process and these GPUs' slots (every
            # slot of each), which the new lease holds again: it stays true.
            self._taken = taken
            self._grants = [taken.grant] if taken.grant is not None else []
        self._parked = False
        _export_step()
        return True

    def _holds_gpu_context(self) -> bool:
        """Whether a process of this pool (a worker, or what a task started: everything under
        the process server) is on one of its GPUs; True when that cannot be told."""
        from gpuwarden.pool.gpus import tree_on_gpus

        server = self._manager.server
        if server is None:
            return True
        return tree_on_gpus(self._gpus, server.pid, self._lease_terms.inventory)

    def _check_owner(self) -> None:
        if os.getpid() != self._owner_pid:
            raise PoolError(
                f"this GPUPool belongs to process {self._owner_pid}; process {os.getpid()} "
                "inherited it through fork",
                why="its workers, sockets and GPU leases are the creator's; a forked copy "
                "would share them without any of its threads running",
                fix="create a new GPUPool in the child, or start children with 'spawn'",
            )

    def _check_open(self) -> None:
        broken = self._box.broken
        if broken is not None:
            raise PoolBrokenError("the pool is broken and runs no more tasks",
                                  why=str(broken)) from broken
        if self._shutdown or self._box.closed:
            raise RuntimeError("cannot schedule new futures after shutdown")
        if _global_shutdown:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    def _closed_down(self) -> None:
        """In the manager thread, once it resolved every future and every process is gone."""
        _live_pools.discard(self)
        _export_step()
        try:
            self._taken.release()
        except GpuwardenError as exc:
            log.warning("releasing the pool's GPUs failed: %s", exc)

    def _close_in_child(self) -> None:
        """After fork, in the child: the parent's descriptors are not the child's to use."""
        self._manager.close_in_child()

    def __repr__(self) -> str:
        where = ", ".join(g.label for g in self._gpus) or "CPU"
        return f"<GPUPool {self.n_workers} workers on {where}, {self.start_method}>"


def _check_count(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise PoolArgumentError(f"{name} must be greater than 0 (got {value!r})",
                                fix=f"{name}=1 or more, or None for the default")


def _no_release() -> None:
    pass


def _warn_cpu_once(why: str) -> None:
    global _warned_cpu
    if _warned_cpu:
        return
    _warned_cpu = True
    warnings.warn(f"gpuwarden pool: no GPU, running CPU workers ({why})", CPUFallbackWarning,
                  stacklevel=_callers_level())


def _callers_level() -> int:
    """The ``stacklevel`` that points a warning raised by the caller of this function at the
    user's line: the first frame outside gpuwarden and joblib. A fixed number pointed at
    gpuwarden's own joblib backend when the pool came from ``Parallel(backend="gpuwarden")``
    (or at a subclass's ``__init__``); ``warn(skip_file_prefixes=)`` needs Python 3.12."""
    inside = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep]
    joblib_file = getattr(sys.modules.get("joblib"), "__file__", None)
    if isinstance(joblib_file, str):
        inside.append(os.path.dirname(os.path.abspath(joblib_file)) + os.sep)
    frame = sys._getframe(1)  # the function that calls warnings.warn: level 1
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(tuple(inside)):
        frame = frame.f_back
        level += 1
    return level


_live_pools: weakref.WeakSet[GPUPool] = weakref.WeakSet()


def _export_step() -> None:
    """While this process's pools hold GPUs, processes it starts are their job steps (the
    way Slurm's job steps inherit SLURM_JOB_ID): the variable is in os.environ."""
    from gpuwarden.lease import jobstep

    grants = [g for p in list(_live_pools) if p._owner_pid == os.getpid() for g in p._grants]
    env = jobstep.env_for(grants)
    if env:
        os.environ.update(env)
    elif jobstep.STEP_ENV in os.environ and _exported[0]:
        del os.environ[jobstep.STEP_ENV]
    _exported[0] = bool(env)


# Whether this process wrote the variable (one it inherited, as a step itself, stays).
_exported = [False]


def _wait_for_closing_pools() -> bool:
    """Wait (bounded) for this process's pools that are shutting down and still hold GPUs;
    whether there were any."""
    closing = [p for p in list(_live_pools) if p._owner_pid == os.getpid() and p._shutdown
               and p.holds_gpus and p._thread.is_alive()]
    for pool in closing:
        pool._thread.join(2 * _core.STOP_GRACE_S + SERVER_EXIT_WAIT_S)
    return bool(closing)


def _release_idle_warm_pool() -> None:
    # Only when the joblib backend is in use (it is loaded then): no joblib import here.
    backend = sys.modules.get("gpuwarden.pool.joblib_backend")
    if backend is not None:
        backend.release_if_idle()


def _blame_own_pools(exc: ConstraintError) -> None:
    """Say so in ``exc`` when this process's own pools hold GPUs that were refused."""
    mine = [p for p in list(_live_pools) if p._owner_pid == os.getpid() and p.holds_gpus]
    if not mine:
        return
    held = ", ".join(f"{g.label} by {p!r}" for p in mine for g in p.gpus)
    exc.what = f"{exc.what} (this process's own pools hold GPUs: {held})"
    exc.args = (exc.what,)
    exc.fix = ("shut the other pool down first (pool.shutdown(); for joblib's warm pool "
               "gpuwarden.pool.joblib_backend.shutdown_reusable_pool()), or use it instead")
    exc.evidence = (*exc.evidence, f"held by this process (pid {os.getpid()}): {held}")


_global_shutdown = False


def _python_exit() -> None:
    """Before the interpreter joins its threads (threading._register_atexit, as
    concurrent.futures does; an atexit handler would run only after a thread waiting on a
    hung task's future had been joined, which never happens): every pool gets
    ``exit_timeout_s`` for its tasks, then what still runs is killed."""
    global _global_shutdown
    _global_shutdown = True
    pools = [p for p in list(_live_pools) if p._owner_pid == os.getpid()]
    for pool in pools:
        pool.shutdown(wait=False, timeout_s=pool.exit_timeout_s)
    for pool in pools:
        pool._thread.join(pool.exit_timeout_s + 2 * _core.STOP_GRACE_S + SERVER_EXIT_WAIT_S)


threading._register_atexit(_python_exit)  # type: ignore[attr-defined]


def _after_fork_in_child() -> None:
    for pool in list(_live_pools):
        pool._close_in_child()
    _live_pools.clear()
    _exported[0] = False


os.register_at_fork(after_in_child=_after_fork_in_child)
