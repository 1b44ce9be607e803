"""GPUPool: a concurrent.futures.Executor whose workers are each pinned to one GPU.

One manager thread owns every process and connection: it starts the workers, sends
each task to one worker over that worker's own socket, reads results, notices deaths
(EOF on the socket, then the exit status) and replaces dead workers. Callers' threads
only pickle their task and queue it, so a CUDA tensor in the arguments is refused before
anything is sent. See docs/pool.md for the design and its trade-offs.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from gpuwarden.errors import (
    ConstraintError,
    GpuwardenError,
    PoolBrokenError,
    PoolError,
    UsageError,
    WorkerDiedError,
)
from gpuwarden.inventory.snapshot import GPUSnapshot
from gpuwarden.pool import _pickling, _worker
from gpuwarden.pool._launch import ForkServerLauncher, Launcher, SpawnLauncher
from gpuwarden.pool.plan import WorkerSlot, plan_slots

if TYPE_CHECKING:
    from gpuwarden.inventory import Inventory
from gpuwarden.procs import describe_exit

log = logging.getLogger("gpuwarden.pool")

START_METHODS = ("forkserver", "spawn")
# Pipelining a second task to a busy worker hides the round trip of tiny tasks, but a task
# queued behind a long one waits even when another worker is idle. So only tasks that have
# been finishing in under this time are pipelined, and only payloads small enough to sit in
# the socket buffer (a larger send could block while the worker blocks sending its result).
PIPELINE_BELOW_S = 0.005
PIPELINE_MAX_BYTES = 32 * 1024
# A slot whose worker dies this many times in a row before it is ready breaks the pool,
# rather than respawning forever.
MAX_START_FAILURES = 3
STOP_GRACE_S = 3.0
# At interpreter exit a task still running gets this long before its worker is killed
# (GPUPool(exit_timeout_s=...)): exit is never held up forever by a task that hangs.
EXIT_TIMEOUT_S = 5.0


class CPUFallbackWarning(UserWarning):
    """The pool found no GPU and runs its workers on the CPU."""


_warned_cpu = False


def _no_release() -> None:
    pass


@dataclass
class _Task:
    id: int
    future: Future[Any]
    payload: bytes
    description: str
    sent_at: float = 0.0


@dataclass
class _Worker:
    slot: WorkerSlot
    conn: Connection
    pid: int
    inflight: collections.deque[_Task] = field(default_factory=collections.deque)
    ready: bool = False

    @property
    def name(self) -> str:
        return f"worker {self.slot.index} (pid {self.pid}, {self.slot.device_label})"


@dataclass(frozen=True)
class WorkerInfo:
    """What a pool says about one of its workers."""

    index: int
    pid: int
    gpu: GPUSnapshot | None
    cuda_visible_devices: str
    ready: bool


def _describe_task(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    items = getattr(fn, "items", None)
    if type(fn).__name__ == "BatchedCalls" and items:
        # joblib's batch of delayed calls: name the function the user wrote.
        inner = getattr(items[0][0], "__qualname__", repr(items[0][0]))
        return f"a joblib batch of {len(items)} call(s) to {inner}"
    name = getattr(fn, "__qualname__", None) or repr(fn)
    shown = ", ".join([*(repr(a) for a in args), *(f"{k}={v!r}" for k, v in kwargs.items())])
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{name}({shown})"


class GPUPool(Executor):
    """A process pool with ``workers_per_gpu`` workers on each GPU, each pinned before start.

    Every worker runs with its own ``CUDA_VISIBLE_DEVICES`` (one GPU, so inside it the GPU is
    ``cuda:0``) and ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, in place before the worker runs any
    code. GPUs are chosen by ``gpus``: ``"auto"`` (every usable GPU), a count, or a list of
    indices/UUIDs; they are taken through :func:`gpuwarden.pool.gpus.take_gpus` and released
    at shutdown. Without a GPU (no driver, none visible) ``gpus="auto"`` runs ``cpu_workers``
    CPU workers and warns once; ``gpus=0`` is a CPU pool on any host, without a warning.
    ``max_workers`` also caps the GPUs taken: only the GPUs those workers fill are leased.
    ``inventory``: where GPU state is read (default: NVML, or GPUWARDEN_SIMULATE's host).
    ``workers_per_gpu=None`` spreads ``max_workers`` workers over the GPUs taken (what the
    joblib backend does for ``n_jobs`` when no ``workers_per_gpu`` is given).

    Raises (from the constructor): UsageError for a bad argument; ConstraintError (exit 4)
    when fewer GPUs than requested are usable (busy, too little free memory, prohibited
    compute mode; the error lists every GPU's verdict); NoGPUError when GPUs are requested
    explicitly on a host without NVML. Futures fail with the task's own exception (the
    worker's traceback as ``__cause__``), WorkerDiedError when the worker died during the
    task, CudaTensorArgumentError for CUDA tensors in arguments, PoolBrokenError when the
    workers cannot start (initializer error).

    The pool belongs to the process that created it: inherited through ``fork`` it refuses
    work in the child (PoolError). At interpreter exit a task still running gets
    ``exit_timeout_s`` seconds, then its worker is killed.
    """

    def __init__(
        self,
        gpus: str | int | Sequence[int | str] = "auto",
        workers_per_gpu: int | None = 1,
        *,
        max_workers: int | None = None,
        cpu_workers: int | None = None,
        memory_fraction: float | None = None,
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
        if workers_per_gpu is not None and workers_per_gpu < 1:
            raise UsageError(f"workers_per_gpu={workers_per_gpu}: must be at least 1",
                             fix="workers_per_gpu=1 or more, or None to spread max_workers "
                             "over the GPUs")
        # None: as many per GPU as it takes to run max_workers workers on the GPUs taken.
        spread = workers_per_gpu is None
        per_gpu = 1 if workers_per_gpu is None else workers_per_gpu
        if start_method not in START_METHODS:
            raise UsageError(f"start_method={start_method!r} is not one of {START_METHODS}",
                             fix="'forkserver' (fast starts, preloads once) or 'spawn'")
        if memory_fraction is not None and not 0 < memory_fraction <= 1:
            raise UsageError(f"memory_fraction={memory_fraction}: must be in (0, 1]",
                             fix="a fraction of the GPU, e.g. 0.45 with two workers per GPU")
        if max_workers is not None and max_workers < 1:
            raise UsageError(f"max_workers={max_workers}: must be at least 1",
                             fix="max_workers=1 or more, or None for every GPU's workers")
        from gpuwarden.pool.gpus import TakenGPUs, take_gpus

        if isinstance(gpus, bool) or (isinstance(gpus, int) and gpus < 0):
            raise UsageError(f"gpus={gpus!r}: expected 'auto', a count >= 0, or a list of ids",
                             fix="gpus='auto', gpus=2 or gpus=[0, 3]")
        if gpus == 0:
            # An explicit CPU pool, whatever the host has: no NVML read, no lease, no warning.
            taken = TakenGPUs((), _no_release)
        else:
            from gpuwarden.lease.manager import make_request

            # make_request validates and parses min_free (str or int) as every lease does.
            min_free_bytes = make_request(1, min_free=min_free).constraints.min_free_bytes
            # GPUs held by joblib's warm pool in this process, idle now, go to this pool.
            _release_idle_warm_pool()
            try:
                taken = take_gpus(gpus, per_gpu, max_workers=max_workers,
                                  min_free_bytes=min_free_bytes, allow_shared=allow_shared,
                                  wait=wait, label=label, inventory=inventory)
            except ConstraintError as exc:
                _blame_own_pools(exc)
                raise
            if not taken.gpus:
                _warn_cpu_once(taken.why_cpu)
        self._release = taken.release
        n_cpu = cpu_workers or max_workers or os.cpu_count() or 1
        if spread and max_workers is not None and taken.gpus:
            per_gpu = -(-max_workers // len(taken.gpus))
        slots = plan_slots(taken.gpus, per_gpu, cpu_workers=n_cpu)
        if max_workers is not None:
            slots = slots[:max_workers]
        self._slots = slots
        self._gpus = taken.gpus
        self._boot_common = {
            "sys_path": [p for p in sys.path if p],
            # multiprocessing's children share the parent's authkey, so that Manager() proxies
            # and other multiprocessing connections made by the caller work inside tasks.
            "authkey": bytes(multiprocessing.current_process().authkey),
            "preload": list(preload),
            "memory_fraction": memory_fraction,
            "initializer": None if initializer is None
            else _pickling.dumps_task((initializer, tuple(initargs))),
        }
        self._launcher: Launcher = (
            ForkServerLauncher(self._boot_common["sys_path"], preload)  # type: ignore[arg-type]
            if start_method == "forkserver" else SpawnLauncher()
        )
        self.start_method = start_method
        self.exit_timeout_s = exit_timeout_s
        self._owner_pid = os.getpid()
        self._deadline: float | None = None
        self._lock = threading.Lock()
        self._pending: collections.deque[_Task] = collections.deque()
        self._workers: dict[int, _Worker] = {}  # by slot index
        self._start_failures: dict[int, int] = collections.Counter()
        self._ids = itertools.count()
        self._shutdown = False
        self._kill = False
        self._broken: BaseException | None = None
        self._task_s: float | None = None
        self._killed_why = "the pool was shut down while this task ran"
        self.notes: list[str] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._manage, name="gpuwarden-pool-manager",
                                        daemon=True)
        self._thread.start()
        _live_pools.add(self)

    # -- public API ------------------------------------------------------------------------

    @property
    def gpus(self) -> tuple[GPUSnapshot, ...]:
        """The GPUs this pool holds (empty for a CPU pool)."""
        return self._gpus

    @property
    def n_workers(self) -> int:
        return len(self._slots)

    def workers(self) -> list[WorkerInfo]:
        """The live workers, by slot."""
        with self._lock:
            return [WorkerInfo(w.slot.index, w.pid, w.slot.gpu,
                               w.slot.env.get("CUDA_VISIBLE_DEVICES", ""), w.ready)
                    for w in sorted(self._workers.values(), key=lambda w: w.slot.index)]

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return self._submit(fn, args, kwargs, None)

    def _submit(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                reducers: Mapping[type, Callable[[Any], Any]] | None) -> Future[Any]:
        """submit(), pickling objects of the types in ``reducers`` with those reducers
        (the joblib backend's memory-mapping of large arrays)."""
        self._check_owner()
        with self._lock:
            if self._broken is not None:
                raise PoolBrokenError("the pool is broken and runs no more tasks",
                                      why=str(self._broken)) from self._broken
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            task_id = next(self._ids)
        future: Future[Any] = Future()
        description = _describe_task(fn, args, kwargs)
        try:
            payload = _worker.HEADER.pack(task_id, 0) + _pickling.dumps_task((fn, args, kwargs),
                                                                          reducers)
        except Exception as exc:  # noqa: BLE001 - as ProcessPoolExecutor: the future carries it
            future.set_exception(exc)
            return future
        with self._lock:
            self._pending.append(_Task(task_id, future, payload, description))
        self._wake()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False,
                 kill_workers: bool = False, timeout_s: float | None = None) -> None:
        """Stop the pool: no new tasks; running (and, unless cancelled, queued) tasks finish,
        then every worker and the fork server are stopped, leftovers killed with their whole
        process tree, and the GPUs released. ``kill_workers=True`` kills at once: the futures
        of running tasks fail with PoolBrokenError. ``timeout_s`` bounds the wait for running
        tasks: the workers of tasks still running after it are killed (their futures fail
        with PoolBrokenError). Without it, as in concurrent.futures, running tasks finish
        however long they take. In a process that inherited the pool through fork this does
        nothing: the pool belongs to its creator."""
        if os.getpid() != self._owner_pid:
            return
        with self._lock:
            self._shutdown = True
            self._kill = self._kill or kill_workers
            if timeout_s is not None:
                deadline = time.monotonic() + max(0.0, timeout_s)
                self._deadline = deadline if self._deadline is None \
                    else min(self._deadline, deadline)
            if cancel_futures or kill_workers:
                while self._pending:
                    self._pending.popleft().future.cancel()
        self._wake()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _check_owner(self) -> None:
        if os.getpid() != self._owner_pid:
            raise PoolError(
                f"this GPUPool belongs to process {self._owner_pid}; process {os.getpid()} "
                "inherited it through fork",
                why="its workers, sockets and GPU leases are the creator's; a forked copy "
                "would share them without any of its threads running",
                fix="create a new GPUPool in the child, or start children with 'spawn'",
            )

    # -- manager thread ----------------------------------------------------------------------

    def _wake(self) -> None:
        # A full pipe means already awake; a closed one, the very end.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _manage(self) -> None:
        try:
            try:
                self.notes.extend(self._launcher.start())
                for slot in self._slots:
                    self._spawn(slot)
            except BaseException as exc:  # noqa: BLE001 - reported through the futures
                self._break(exc)
            while True:
                if self._broken is None:
                    self._dispatch()
                with self._lock:
                    busy = any(w.inflight for w in self._workers.values())
                    if self._shutdown and busy and self._deadline is not None \
                            and time.monotonic() >= self._deadline:
                        self._kill = True
                        self._killed_why = "it still ran when shutdown's timeout ran out"
                    done = self._shutdown and (self._kill or self._broken is not None
                                               or not (self._pending or busy))
                    left = None if self._deadline is None \
                        else max(0.0, self._deadline - time.monotonic())
                if done:
                    break
                self._poll(left)
        finally:
            self._close()

    def _spawn(self, slot: WorkerSlot) -> None:
        conn, pid = self._launcher.launch(slot.env)
        worker = _Worker(slot, conn, pid)
        name = worker.name
        boot = {**self._boot_common, "env": dict(slot.env), "name": name}
        with contextlib.suppress(OSError):  # died at once: the EOF on its socket reports it
            conn.send_bytes(_pickling.dumps_task(boot))
        with self._lock:
            self._workers[slot.index] = worker

    def _capacity(self, worker: _Worker, task: _Task) -> bool:
        if not worker.inflight:
            return True
        return (len(worker.inflight) == 1 and worker.ready and self._task_s is not None
                and self._task_s < PIPELINE_BELOW_S and len(task.payload) <= PIPELINE_MAX_BYTES)

    def _dispatch(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                task = self._pending[0]
                busy_per_gpu = collections.Counter(
                    w.slot.gpu.uuid if w.slot.gpu else "" for w in self._workers.values()
                    if w.inflight)
                candidates = [w for w in self._workers.values() if self._capacity(w, task)]
                if not candidates:
                    return
                # Fewest tasks first, then the least busy GPU: tasks spread over the GPUs.
                worker = min(candidates, key=lambda w: (
                    len(w.inflight), busy_per_gpu[w.slot.gpu.uuid if w.slot.gpu else ""],
                    w.slot.index))
                self._pending.popleft()
                if not task.future.set_running_or_notify_cancel():
                    continue
                task.sent_at = time.monotonic()
                worker.inflight.append(task)
            # A worker that died: its EOF comes next and fails or requeues the task.
            with contextlib.suppress(OSError):
                worker.conn.send_bytes(task.payload)

    def _poll(self, timeout_s: float | None = None) -> None:
        with self._lock:
            by_conn = {w.conn: w for w in self._workers.values()}
        ready = wait([self._wake_r, *by_conn, *([self._launcher.control]
                                                if self._launcher.control else [])],
                     timeout=timeout_s)
        for item in ready:
            if item == self._wake_r:
                os.read(self._wake_r, 65536)
            elif item is self._launcher.control:
                self._launcher.on_control()
            else:
                self._receive(by_conn[item])  # type: ignore[index]

    def _receive(self, worker: _Worker) -> None:
        try:
            data = worker.conn.recv_bytes()
        except (EOFError, OSError):
            self._on_death(worker)
            return
        task_id, kind = _worker.HEADER.unpack_from(data)
        payload = memoryview(data)[_worker.HEADER.size:]
        if kind == _worker.READY:
            worker.ready = True
            self._start_failures[worker.slot.index] = 0
            for note in _pickling.loads(payload):
                log.warning("%s: %s", worker.name, note)
            return
        if kind == _worker.INIT_ERROR:
            exc = _safe_loads(payload)
            self._break(PoolBrokenError(
                f"{worker.name} failed to start: {exc!r}",
                why="the initializer or a preload import raised in the worker",
                fix="fix the initializer; its traceback is this error's __cause__",
            ), cause=exc)
            return
        with self._lock:
            task = worker.inflight.popleft()
        assert task.id == task_id, (task.id, task_id)
        elapsed = time.monotonic() - task.sent_at
        self._task_s = elapsed if self._task_s is None else 0.8 * self._task_s + 0.2 * elapsed
        try:
            value = _pickling.loads(payload)
        except BaseException as exc:  # noqa: BLE001
            task.future.set_exception(PoolError(
                f"the result of task {task.id} ({task.description}) cannot be unpickled here",
                why=f"{type(exc).__name__}: {exc}",
                fix="return objects whose classes the caller can import",
            ))
            return
        if kind == _worker.RESULT:
            task.future.set_result(value)
        else:
            task.future.set_exception(value)

    def _on_death(self, worker: _Worker) -> None:
        returncode = self._launcher.wait_exit(worker.pid)
        worker.conn.close()
        exit_text = describe_exit(returncode)
        with self._lock:
            self._workers.pop(worker.slot.index, None)
            lost = list(worker.inflight)
            worker.inflight.clear()
            if lost:
                # The worker runs its tasks in order: the first was running; the others were
                # still unread in its socket and go back to the front of the queue.
                self._pending.extendleft(reversed(lost[1:]))
            stopping = self._shutdown
        if lost:
            task = lost[0]
            error = WorkerDiedError(
                f"{worker.name} died with {exit_text} while running task {task.id} "
                f"({task.description})",
                why="usual causes: the host's OOM killer (SIGKILL; see `dmesg`), a segfault in "
                "a native library, a CUDA error that aborted the process, os._exit() in the "
                "task, or a kill from outside",
                fix="check `dmesg` and the worker's output above; the pool replaced the worker "
                "and runs the other tasks",
                evidence=[f"worker {worker.slot.index}, pid {worker.pid}",
                          f"GPU: {worker.slot.device_label}, CUDA_VISIBLE_DEVICES="
                          f"{worker.slot.env.get('CUDA_VISIBLE_DEVICES', '')!r}",
                          f"exit: {exit_text}", f"task {task.id}: {task.description}"],
                worker=worker.name, gpu=worker.slot.device_label, exit_status=exit_text,
                task=task.description, fields={"pid": worker.pid},
            )
            log.warning("%s; the pool replaces the worker", error.what)
            task.future.set_exception(error)
        if stopping and not (self._pending and not self._kill):
            return
        if self._broken is not None:
            return
        if not worker.ready:
            self._start_failures[worker.slot.index] += 1
            if self._start_failures[worker.slot.index] >= MAX_START_FAILURES:
                self._break(PoolBrokenError(
                    f"{worker.name} died {MAX_START_FAILURES} times before it was ready "
                    f"(last: {exit_text})",
                    why="a preload import or the initializer crashes the worker process",
                    fix="run the initializer in a plain process to see the crash; try "
                    "preload=() or start_method='spawn'",
                ))
                return
        try:
            self._spawn(worker.slot)
        except BaseException as exc:  # noqa: BLE001
            self._break(exc)

    def _break(self, exc: BaseException, cause: BaseException | None = None) -> None:
        if cause is not None:
            exc.__cause__ = cause
        with self._lock:
            if self._broken is not None:
                return
            self._broken = exc
            self._shutdown = True
            failed = [*self._pending, *(t for w in self._workers.values() for t in w.inflight)]
            self._pending.clear()
            for w in self._workers.values():
                w.inflight.clear()
        for task in failed:
            if not task.future.done() and (task.future.running()
                                           or task.future.set_running_or_notify_cancel()):
                task.future.set_exception(exc)

    def _close(self) -> None:
        """Stop every worker and the fork server; kill leftovers with their process trees."""
        import psutil

        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
            gone = PoolBrokenError(f"the task's worker was killed: {self._killed_why}")
            for w in workers:
                for task in w.inflight:
                    if not task.future.done():
                        task.future.set_exception(gone)
                w.inflight.clear()
        tree: list[psutil.Process] = []
        for pid in [w.pid for w in workers] + self._launcher.pids():
            try:
                proc = psutil.Process(pid)
                tree.extend([proc, *proc.children(recursive=True)])
            except psutil.Error:
                pass
        if not self._kill:
            for w in workers:
                with contextlib.suppress(OSError):
                    w.conn.send_bytes(b"stop")
            _wait_gone([p for p in tree if p.pid in {w.pid for w in workers}], STOP_GRACE_S)
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)
        for w in workers:
            w.conn.close()
        self._launcher.stop()
        _wait_gone(tree, STOP_GRACE_S)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        _live_pools.discard(self)
        try:
            self._release()
        except GpuwardenError as exc:
            log.warning("releasing the pool's GPUs failed: %s", exc)

    def __repr__(self) -> str:
        where = ", ".join(g.label for g in self._gpus) or "CPU"
        return f"<GPUPool {self.n_workers} workers on {where}, {self.start_method}>"


def _wait_gone(procs: list[Any], timeout_s: float) -> None:
    """Wait until every process in ``procs`` has exited, up to ``timeout_s``.

    A worker forked by the fork server is not this process's child: once dead it stays a
    zombie until its parent (or init) reaps it, and psutil.wait_procs would count that
    zombie as alive until the timeout. Dead is what matters here.
    """
    import psutil

    deadline = time.monotonic() + timeout_s
    alive = list(procs)
    while alive and time.monotonic() < deadline:
        still = []
        for proc in alive:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    still.append(proc)
            except psutil.Error:
                pass
        alive = still
        if alive:
            time.sleep(0.01)


def _safe_loads(payload: Any) -> BaseException:
    try:
        value = _pickling.loads(payload)
    except BaseException as exc:  # noqa: BLE001
        return exc
    return value if isinstance(value, BaseException) else RuntimeError(repr(value))


def _warn_cpu_once(why: str) -> None:
    global _warned_cpu
    if _warned_cpu:
        return
    _warned_cpu = True
    warnings.warn(f"gpuwarden pool: no GPU, running CPU workers ({why})", CPUFallbackWarning,
                  stacklevel=3)


_live_pools: weakref.WeakSet[GPUPool] = weakref.WeakSet()


def _release_idle_warm_pool() -> None:
    # Only when the joblib backend is in use (it is loaded then): no joblib import here.
    backend = sys.modules.get("gpuwarden.pool.joblib_backend")
    if backend is not None:
        backend.release_if_idle()


def _blame_own_pools(exc: ConstraintError) -> None:
    """Say so in ``exc`` when this process's own pools hold GPUs that were refused."""
    mine = [p for p in list(_live_pools) if p._owner_pid == os.getpid() and p.gpus]
    if not mine:
        return
    held = ", ".join(f"{g.label} by {p!r}" for p in mine for g in p.gpus)
    exc.what = f"{exc.what} (this process's own pools hold GPUs: {held})"
    exc.args = (exc.what,)
    exc.fix = ("shut the other pool down first (pool.shutdown(); for joblib's warm pool "
               "gpuwarden.pool.joblib_backend.shutdown_reusable_pool()), or use it instead")
    exc.evidence = (*exc.evidence, f"held by this process (pid {os.getpid()}): {held}")


@atexit.register
def _shutdown_all() -> None:
    # Daemon manager threads would be frozen mid-way at interpreter exit: stop them first,
    # giving running tasks exit_timeout_s. A forked child's copies are not its own to stop.
    pools = [p for p in list(_live_pools) if p._owner_pid == os.getpid()]
    for pool in pools:
        pool.shutdown(wait=False, cancel_futures=True, timeout_s=pool.exit_timeout_s)
    for pool in pools:
        pool.shutdown(wait=True)
