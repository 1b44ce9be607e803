"""GPUPool: a concurrent.futures.Executor whose workers are each pinned to one GPU.

Three parts, one owner each (docs/pool.md, "How tasks flow"):

- the caller's threads pickle a task and put it in the pool's inbox (under a lock held for
  an append, never while user code runs); ``shutdown`` and ``resize`` are inbox entries too;
- the manager thread owns every socket: it drains the inbox, feeds events to the state
  machine (``_core.Core``: the one place a task's or a worker's state changes), carries out
  the actions the machine returns, and resolves futures — outside any lock, so a
  done-callback may call ``submit``, ``workers`` or ``shutdown``;
- the process server (``_server.py``), started with ``posix_spawn`` in the constructor,
  starts every worker and reports every exit; no thread of this process ever forks.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import multiprocessing
import os
import selectors
import signal
import socket
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuwarden.errors import ConstraintError, GpuwardenError, PoolError, UsageError
from gpuwarden.inventory.snapshot import GPUSnapshot
from gpuwarden.pool import _core, _pickling, _wire
from gpuwarden.pool._core import Fault, Task, Worker
from gpuwarden.pool.errors import (
    PoolArgumentError,
    PoolBrokenError,
    TaskTransferError,
    WorkerDiedError,
)
from gpuwarden.pool.plan import THREAD_LIMIT_VARS, WorkerSlot, plan_slots
from gpuwarden.procs import describe_exit

if TYPE_CHECKING:
    from gpuwarden.inventory import Inventory
    from gpuwarden.lease import Grant

log = logging.getLogger("gpuwarden.pool")

START_METHODS = ("forkserver", "spawn")
# At interpreter exit, queued and running tasks get this long (GPUPool(exit_timeout_s=...)),
# then what still runs is killed: exit is never held up forever by a task that hangs.
EXIT_TIMEOUT_S = 5.0
SERVER_EXIT_WAIT_S = 8.0
_RESET_SIGNALS = tuple(getattr(signal, n) for n in ("SIGPIPE", "SIGXFSZ", "SIGXFZ")
                       if hasattr(signal, n))


class CPUFallbackWarning(UserWarning):
    """The pool found no GPU and runs its workers on the CPU."""


_warned_cpu = False


@dataclass(frozen=True)
class WorkerInfo:
    """What a pool says about one of its workers (a snapshot)."""

    index: int
    pid: int | None
    gpu: GPUSnapshot | None
    cuda_visible_devices: str
    state: str  # starting, ready, busy, retiring, stopping

    @property
    def ready(self) -> bool:
        return self.state in ("ready", "busy")


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


@dataclass(eq=False)
class _Link:
    """The manager's side of one worker's socket."""

    worker: Worker
    sock: socket.socket
    reader: _wire.FrameReader = field(default_factory=_wire.FrameReader)
    writer: _wire.FrameWriter = field(default_factory=_wire.FrameWriter)
    writing: bool = False


class _ServerLink:
    """The manager's side of the process server: its control socket and its pid."""

    def __init__(self, boot: dict[str, Any], env: Mapping[str, str]) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.pid = os.posix_spawn(
                sys.executable,
                [sys.executable, "-m", "gpuwarden.pool._server", "3", str(os.getpid())],
                dict(env),
                file_actions=[(os.POSIX_SPAWN_DUP2, child.fileno(), 3),
                              (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)],
                setsigdef=_RESET_SIGNALS, setsigmask=(),
            )
        finally:
            child.close()
        self.sock = parent
        self.sock.setblocking(False)
        self.outbox: collections.deque[tuple[bytes, list[int]]] = collections.deque()
        self.returncode: int | None = None
        self.gone = False
        self.send(boot)

    def send(self, message: Any, fds: Sequence[int] = ()) -> None:
        import pickle

        self.outbox.append((pickle.dumps(message), list(fds)))
        self.flush()

    def flush(self) -> None:
        while self.outbox and not self.gone:
            data, fds = self.outbox[0]
            try:
                if fds:
                    socket.send_fds(self.sock, [data], fds)
                else:
                    self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.gone = True
            self.outbox.popleft()
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self.gone:
            while self.outbox:
                for fd in self.outbox.popleft()[1]:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def receive(self) -> list[tuple[Any, ...]] | None:
        """Messages the server sent; None when it is gone (end of input)."""
        import pickle

        out: list[tuple[Any, ...]] = []
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError:
                data = b""
            if not data:
                self.gone = True
                return out or None
            out.append(pickle.loads(data))

    def reap(self, timeout_s: float) -> int | None:
        """Wait (bounded) for the server to exit; kill it if it does not; its returncode."""
        from gpuwarden.procs import status_to_returncode

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else (SIGCHLD ignored, a reaper)
                return None
            if pid:
                self.returncode = status_to_returncode(status)
                return self.returncode
            if time.monotonic() >= deadline:
                self.kill_tree()
                deadline = time.monotonic() + timeout_s
            time.sleep(0.005)

    def kill_tree(self) -> None:
        """SIGKILL the server and everything under it. Its pid is ours until we reap it; its
        descendants are not reaped by anyone while it is stopped or stuck."""
        import psutil

        try:
            tree = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)

    def close(self) -> None:
        self.gone = True
        self.flush()  # closes the descriptors of what was never sent
        self.sock.close()


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
        self._taken = self._take(gpus, max_workers, min_free, allow_shared, wait, label,
                                 inventory)
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
              label: str, inventory: Inventory | None) -> Any:
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
                             wait=wait, label=label, inventory=inventory)

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
        self._boot_common = {
            "sys_path": [p for p in sys.path if p],
            # multiprocessing's children share the parent's authkey, so that Manager() proxies
            # and other multiprocessing connections made by the caller work inside tasks.
            "authkey": bytes(multiprocessing.current_process().authkey),
            "preload": list(preload),
            "memory_fraction": memory_fraction,
            "initializer": initializer,
        }
        self._lock = threading.Lock()
        self._inbox: collections.deque[tuple[Any, ...]] = collections.deque()
        self._shutdown = False
        self._closed = False
        self._broken: BaseException | None = None
        self._ids = itertools.count()
        self._snapshot: tuple[WorkerInfo, ...] = ()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._core = _core.Core(self._slots, make_error=self._make_error)
        self._selector = selectors.DefaultSelector()
        self._links: dict[int, _Link] = {}
        self._server: _ServerLink | None = None
        # The server is started here, in the caller's thread, with posix_spawn: no pipe for
        # a concurrent fork() to inherit and hold open (what made subprocess hang).
        self._start_server()
        self._thread = threading.Thread(target=self._manage, name="gpuwarden-pool-manager",
                                        daemon=True)
        self._thread.start()
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
    def n_workers(self) -> int:
        return len(self._slots)

    @property
    def running(self) -> bool:
        """Not shut down, closed nor broken: it takes tasks."""
        return not (self._shutdown or self._closed or self._broken is not None)

    @property
    def capacity(self) -> int | None:
        """The most workers :meth:`resize` can give this pool (None: no limit)."""
        return None if self._spread or not self._gpus else len(self._gpus) * self._per_gpu

    def workers(self) -> list[WorkerInfo]:
        """The live workers (a snapshot the manager publishes), by slot."""
        return list(self._snapshot)

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
        with self._lock:
            self._check_open()
            self._inbox.append(("task", task))
            self._wake_locked()
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
        with self._lock:
            self._check_open()
            self._slots = slots
            self._inbox.append(("resize", slots))
            self._wake_locked()

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
        with self._lock:
            if not self._closed:
                self._shutdown = True
                self._inbox.append(("shutdown", cancel_futures, kill_workers, deadline))
                self._wake_locked()
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

    def _check_open(self) -> None:
        if self._broken is not None:
            raise PoolBrokenError("the pool is broken and runs no more tasks",
                                  why=str(self._broken)) from self._broken
        if self._shutdown or self._closed:
            raise RuntimeError("cannot schedule new futures after shutdown")
        if _global_shutdown:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    def _wake_locked(self) -> None:
        # Under self._lock, which _close holds to close the pipe: never a write to a closed
        # (and maybe reused) descriptor. A full pipe means the manager is awake already.
        if not self._closed:
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"x")

    # -- the manager thread ---------------------------------------------------------------

    def _manage(self) -> None:
        core = self._core
        try:
            self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
            core.start()
            while True:
                self._drain_inbox()
                self._perform()
                self._publish()
                if core.done:
                    break
                now = time.monotonic()
                due = [t for t in (core.deadline, core.stop_deadline, core.hold_deadline)
                       if t is not None]
                timeout = max(0.0, min(due) - now) if due else None
                for key, mask in self._selector.select(timeout):
                    self._on_event(key.data, mask)
                    self._perform()
                now = time.monotonic()
                if core.deadline is not None and now >= core.deadline:
                    core.on_deadline()
                if core.stop_deadline is not None and now >= core.stop_deadline:
                    core.on_stop_deadline()
                if core.hold_deadline is not None and now >= core.hold_deadline:
                    core.dispatch()
        except BaseException:  # noqa: BLE001 - a bug here must not leave futures pending
            log.exception("gpuwarden pool manager failed; the pool is closed")
            core.break_(PoolBrokenError("the pool's manager thread failed (a gpuwarden bug; "
                                        "see the log)"))
        finally:
            self._close()

    def _drain_inbox(self) -> None:
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        for item in items:
            if item[0] == "task":
                self._core.submit(item[1])
            elif item[0] == "shutdown":
                self._core.shutdown(cancel=item[1], kill=item[2], deadline=item[3])
            elif item[0] == "resize":
                self._core.resize(item[1])

    def _perform(self) -> None:
        """Carry out the core's actions; futures last, outside any lock."""
        core = self._core
        while core.actions:
            actions, core.actions = core.actions, []
            resolves = []
            for action in actions:
                if isinstance(action, _core.Resolve):
                    resolves.append(action)
                elif isinstance(action, _core.SendTask):
                    link = self._links.get(action.worker.key)
                    if link is not None:
                        link.writer.put(_wire.Kind.TASK, action.task.id, action.task.payload)
                        self._flush(link)
                elif isinstance(action, _core.StartWorker):
                    self._start_worker(action.worker)
                elif isinstance(action, _core.StopWorker):
                    link = self._links.get(action.worker.key)
                    if link is not None:
                        link.writer.put(_wire.Kind.STOP, -1)
                        self._flush(link)
                elif isinstance(action, _core.KillWorker):
                    if self._server is not None and action.worker.pid is not None:
                        self._server.send(("kill", action.worker.pid))
                elif isinstance(action, _core.StartServer):
                    self._start_server()
                elif isinstance(action, _core.KillServer) and self._server is not None:
                    self._server.kill_tree()
            if core.broken is not None and self._broken is None:
                with self._lock:
                    self._broken = core.broken
            for resolve in resolves:
                _settle(resolve)
            self._forget_dead_links()
        self._watch_server()

    def _watch_server(self) -> None:
        """Read the server's socket always; write to it while messages wait (a full socket
        buffer: the server is busy forking)."""
        server = self._server
        if server is None or not self._registered(server.sock):
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if server.outbox else 0)
        if self._selector.get_key(server.sock).events != events:
            self._selector.modify(server.sock, events, ("server", None))

    def _publish(self) -> None:
        self._snapshot = tuple(
            WorkerInfo(w.slot.index, w.pid, w.slot.gpu,
                       w.slot.env.get("CUDA_VISIBLE_DEVICES", ""), w.state.value)
            for w in sorted(self._core.workers.values(), key=lambda w: w.slot.index))

    def _start_server(self) -> None:
        if self._server is not None:
            self._drop_server()
        env = dict(os.environ)
        # The server must not pick a GPU for anyone (each worker sets its own), and what it
        # preloads must start with the workers' thread caps.
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if self._slots:
            for var in THREAD_LIMIT_VARS:
                env[var] = self._slots[0].env[var]
        boot = {"method": self.start_method, "sys_path": self._boot_common["sys_path"],
                "preload": self._boot_common["preload"]}
        self._server = _ServerLink(boot, env)
        if self._thread_started():
            self._selector.register(self._server.sock, selectors.EVENT_READ, ("server", None))

    def _thread_started(self) -> bool:
        return getattr(self, "_thread", None) is not None and self._thread.is_alive()

    def _drop_server(self) -> None:
        server = self._server
        if server is None:
            return
        self._server = None
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(server.sock)
        server.close()

    def _start_worker(self, worker: Worker) -> None:
        server = self._server
        if server is None:
            self._core.on_spawn_failed(worker.key, "the pool's process server is not running")
            return
        if not self._registered(server.sock):
            self._selector.register(server.sock, selectors.EVENT_READ, ("server", None))
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        parent.setblocking(False)
        link = _Link(worker, parent)
        self._links[worker.key] = link
        self._selector.register(parent, selectors.EVENT_READ, ("worker", link))
        boot = {**self._boot_common, "env": dict(worker.slot.env), "index": worker.slot.index,
                "device": worker.slot.device_label, "threads": worker.slot.threads}
        link.writer.put(_wire.Kind.BOOT, -1, _pickling.dumps_task(boot))
        self._flush(link)
        # The child's end goes to the server (closed here once sent).
        server.send(("spawn", worker.key, dict(worker.slot.env)), [child.detach()])

    def _registered(self, sock: socket.socket) -> bool:
        try:
            self._selector.get_key(sock)
            return True
        except (KeyError, ValueError):
            return False

    def _flush(self, link: _Link) -> None:
        link.writer.flush(link.sock)
        want = bool(link.writer)
        if want != link.writing:
            link.writing = want
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.modify(link.sock, events, ("worker", link))
        if link.writer.broken:
            self._lost(link, f"writing to it failed ({link.writer.error})")

    def _on_event(self, data: tuple[str, Any], mask: int) -> None:
        kind, link = data
        if kind == "wake":
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 65536):
                    pass
        elif kind == "server":
            self._on_server()
        elif kind == "worker":
            if mask & selectors.EVENT_WRITE:
                self._flush(link)
            if mask & selectors.EVENT_READ:
                self._read_worker(link)

    def _on_server(self) -> None:
        server = self._server
        if server is None:
            return
        server.flush()
        messages = server.receive()
        for message in messages or []:
            what = message[0]
            if what == "ready":
                for note in message[2]:
                    log.warning("gpuwarden pool: %s", note)
            elif what == "forked":
                self._core.on_forked(message[1], message[2])
            elif what == "spawn_failed":
                self._core.on_spawn_failed(message[1], message[2])
            elif what == "exit":
                pid = message[1]
                link = next((ln for ln in self._links.values() if ln.worker.pid == pid), None)
                if link is not None:
                    # Everything the worker wrote is in its socket by now: read it before
                    # its death decides what happened to its tasks.
                    self._read_worker(link, final=True)
                self._core.on_exit(pid, message[2])
        if messages is None or server.gone:
            returncode = server.reap(SERVER_EXIT_WAIT_S)
            self._drop_server()
            for link in list(self._links.values()):
                self._read_worker(link, final=True)
            self._core.on_server_exit(returncode)

    def _read_worker(self, link: _Link, *, final: bool = False) -> None:
        for kind, task_id, payload in link.reader.read(link.sock):
            self._on_frame(link, kind, task_id, payload)
        if link.reader.eof and not final:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(link.sock)
            self._lost(link, f"its socket ended ({link.reader.error or 'end of input'})")

    def _lost(self, link: _Link, why: str) -> None:
        worker = link.worker
        if worker.state not in (_core.WorkerState.STOPPING, _core.WorkerState.DEAD):
            log.info("%s: %s before its exit was reported; it is killed and replaced",
                     worker.name, why)
        self._core.on_lost(worker.key)

    def _on_frame(self, link: _Link, kind: _wire.Kind, task_id: int, payload: bytearray) -> None:
        core, worker = self._core, link.worker
        if kind is _wire.Kind.STARTED:
            core.on_started(worker.key, task_id)
        elif kind in (_wire.Kind.RESULT, _wire.Kind.ERROR):
            task = next((t for t in worker.inflight if t.id == task_id), None)
            failed = kind is _wire.Kind.ERROR
            try:
                value = _pickling.loads(payload)
            except BaseException as exc:  # noqa: BLE001 - SystemExit in a __reduce__ too
                failed = True
                value = TaskTransferError(
                    f"the {'exception' if kind is _wire.Kind.ERROR else 'result'} of task "
                    f"{task_id} ({task.description if task else '?'}) cannot be unpickled here",
                    why=f"{type(exc).__name__}: {exc}",
                    fix="return objects whose classes the caller can import")
                value.__cause__ = exc
            if failed and _is_load_error(value):
                load_error = value
                value = TaskTransferError(
                    f"task {task_id} ({task.description if task else '?'}) could not be "
                    f"unpickled in {worker.name}",
                    why=str(load_error), fix="send functions and arguments the worker can "
                    "import (the worker gets the caller's sys.path; lambdas travel by value)")
                value.__cause__ = load_error
            core.on_result(worker.key, task_id, value, failed=failed)
        elif kind is _wire.Kind.READY:
            for note in _pickling.loads(payload):
                log.warning("%s: %s", worker.name, note)
            core.on_ready(worker.key)
        elif kind is _wire.Kind.INIT_ERROR:
            try:
                cause: BaseException = _pickling.loads(payload)
            except BaseException as exc:  # noqa: BLE001
                cause = exc
            error = PoolBrokenError(
                f"{worker.name} failed to start: {cause!r}",
                why="the initializer or a preload import raised in the worker",
                fix="fix the initializer; its traceback is this error's __cause__")
            error.__cause__ = cause
            core.on_init_error(worker.key, error)

    def _forget_dead_links(self) -> None:
        for key in [k for k in self._links if k not in self._core.workers]:
            link = self._links.pop(key)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(link.sock)
            link.sock.close()

    def _make_error(self, fault: Fault) -> BaseException:
        task, worker = fault.task, fault.worker
        if fault.kind in ("died", "server_died", "requeues"):
            assert worker is not None
            exit_text = describe_exit(fault.exit_status)
            slot = worker.slot
            if fault.kind == "requeues":
                what = (f"{worker.name} died with {exit_text} before it started task "
                        f"{task.id} ({task.description}); {_core.MAX_REQUEUES} workers have "
                        "died with this task unstarted")
            elif fault.kind == "server_died":
                what = (f"{worker.name} died with the pool's process server "
                        f"({describe_exit(fault.exit_status)}) while running task {task.id} "
                        f"({task.description})")
            else:
                what = (f"{worker.name} died with {exit_text} while running task {task.id} "
                        f"({task.description})")
            log.warning("%s; the pool replaces the worker", what)
            return WorkerDiedError(
                what,
                why="usual causes: the host's OOM killer (SIGKILL; see `dmesg`), a segfault in "
                "a native library, a CUDA error that aborted the process, os._exit() in the "
                "task, or a kill from outside",
                fix="check `dmesg` and the worker's output above; the pool replaced the worker "
                "and runs the other tasks",
                evidence=[f"worker {slot.index}, pid {worker.pid}",
                          f"GPU: {slot.device_label}, CUDA_VISIBLE_DEVICES="
                          f"{slot.env.get('CUDA_VISIBLE_DEVICES', '')!r}",
                          f"exit: {exit_text}", f"task {task.id}: {task.description}"],
                worker=worker.name, gpu=slot.device_label, exit_status=exit_text,
                task=task.description, fields={"pid": worker.pid},
            )
        if fault.kind == "broken":
            return PoolBrokenError(
                f"the pool cannot start its workers: {fault.detail} "
                f"(last: {describe_exit(fault.exit_status)})",
                why="a preload import or the initializer crashes the worker process, or the "
                "host kills it (memory)",
                fix="run the initializer in a plain process to see the crash; try "
                "preload=() or start_method='spawn'")
        if fault.kind == "deadline" and task.state is _core.TaskState.RESERVED:
            return PoolBrokenError(
                f"task {task.id} ({task.description}) did not run: shutdown's timeout ran out "
                "while it waited for a worker that was still starting",
                fix="give shutdown() a longer timeout_s, or look at the workers' start-up "
                "(initializer, preload)")
        why = {"deadline": "it still ran when shutdown's timeout ran out",
               "killed": "the pool was shut down with kill_workers=True (or killed at exit)",
               "shutdown": "the pool was shut down before it could run again (its first "
                           "worker died before starting it)"}[fault.kind]
        return PoolBrokenError(f"task {task.id} ({task.description}) did not finish: {why}",
                               fix="give shutdown() a longer timeout_s, or let it wait")

    def _close(self) -> None:
        """Resolve what is left, stop the server (it kills everything under it), release."""
        core = self._core
        with self._lock:
            self._closed = True
            items = list(self._inbox)
            self._inbox.clear()
            os.close(self._wake_w)
        for item in items:
            if item[0] == "task":
                core.submit(item[1])
        core.finish()
        self._perform()
        self._publish()
        server = self._server
        if server is not None:
            server.send(("stop",))
            server.reap(SERVER_EXIT_WAIT_S)
            self._drop_server()
        for link in self._links.values():
            link.sock.close()
        self._links.clear()
        self._selector.close()
        os.close(self._wake_r)
        _live_pools.discard(self)
        _export_step()
        try:
            self._taken.release()
        except GpuwardenError as exc:
            log.warning("releasing the pool's GPUs failed: %s", exc)

    def _close_in_child(self) -> None:
        """After fork, in the child: the parent's descriptors are not the child's to use."""
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        for link in self._links.values():
            with contextlib.suppress(OSError):
                link.sock.close()
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.sock.close()

    def __repr__(self) -> str:
        where = ", ".join(g.label for g in self._gpus) or "CPU"
        return f"<GPUPool {self.n_workers} workers on {where}, {self.start_method}>"


def _check_count(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise PoolArgumentError(f"{name} must be greater than 0 (got {value!r})",
                                fix=f"{name}=1 or more, or None for the default")


def _is_load_error(value: Any) -> bool:
    return isinstance(value, _pickling.TaskLoadError)


def _settle(resolve: _core.Resolve) -> None:
    future = resolve.task.future
    try:
        if resolve.cancel:
            future.cancel()
        elif resolve.failed:
            future.set_exception(resolve.value)
        else:
            future.set_result(resolve.value)
    except InvalidStateError:
        pass  # cancelled by its owner meanwhile: nobody waits for this outcome


def _no_release() -> None:
    pass


def _warn_cpu_once(why: str) -> None:
    global _warned_cpu
    if _warned_cpu:
        return
    _warned_cpu = True
    warnings.warn(f"gpuwarden pool: no GPU, running CPU workers ({why})", CPUFallbackWarning,
                  stacklevel=4)


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
               and p.gpus and p._thread.is_alive()]
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
    mine = [p for p in list(_live_pools) if p._owner_pid == os.getpid() and p.gpus]
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
