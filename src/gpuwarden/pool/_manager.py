"""The manager thread of one GPUPool: the one owner of the pool's sockets and processes.

How a task flows (docs/pool.md, "How tasks flow")::

    caller's threads ── submit/resize/shutdown ──▶ Mailbox (one lock, held for an append)
                                                      │ wake pipe
    manager thread ◀─────────────────────────────────┘
      │ events ──▶ _core.Core (PURE: every state change) ──▶ actions
      │ spawn/kill ──▶ process server (_server.py) ── forked/exit ──▶ manager thread
      │ frames (_wire.py) ──▶ each worker's socket ── started/result/error ──▶ manager thread
      └ futures resolved after the event, outside any lock; workers published to the Mailbox

The caller's side is ``executor.py`` (:class:`~gpuwarden.pool.executor.GPUPool`): it pickles a
task, puts it in the :class:`Mailbox` and returns the future; it never touches a socket. The
manager drains the mailbox, feeds events to the state machine, carries out the actions it
returns and resolves futures outside any lock, so a done-callback may call ``submit``,
``workers`` or ``shutdown``. The process server is started with ``posix_spawn`` in the
caller's thread (the constructor): no thread of this process ever forks.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.inventory.snapshot import GPUSnapshot
from gpuwarden.pool import _core, _pickling, _wire
from gpuwarden.pool._core import Fault, Worker
from gpuwarden.pool._server import ServerLink
from gpuwarden.pool.errors import PoolBrokenError, TaskTransferError, WorkerDiedError
from gpuwarden.pool.plan import THREAD_LIMIT_VARS, WorkerSlot
from gpuwarden.procs import describe_exit

log = logging.getLogger("gpuwarden.pool")

SERVER_EXIT_WAIT_S = 8.0
# The most module names the pool learns from its workers for the warm start of later ones
# (_worker.py); scikit-learn with numpy and scipy is about 1500. What the pool keeps and sends
# each new worker stays bounded however many kinds of task it runs.
MAX_WARM_MODULES = 4000


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


@dataclass(eq=False)
class _Link:
    """The manager's side of one worker's socket."""

    worker: Worker
    sock: socket.socket
    reader: _wire.FrameReader = field(default_factory=_wire.FrameReader)
    writer: _wire.FrameWriter = field(default_factory=_wire.FrameWriter)
    writing: bool = False
    # The last task whose loading imported modules (IMPORTED), and how long loading took.
    load_task: int | None = None
    load_s: float = 0.0
    warmed: bool = False  # its boot named modules to import (a warm start)
    # The claims of tasks taken back from behind its running task: held until the worker says
    # it skipped them (or is gone), so that it never runs them.
    withdrawn: set[int] = field(default_factory=set)


class Mailbox:
    """Where the caller's threads and the manager thread meet. Entries in (``("task", task)``,
    ``("resize", slots)``, ``("shutdown", cancel, kill, deadline)``) under :attr:`lock`, held
    for an append, never while user code runs; what the manager publishes back (the workers,
    the pool broken, the pool closed); the pipe that wakes the manager."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: collections.deque[tuple[Any, ...]] = collections.deque()
        self.closed = False  # the manager ended: nothing put here is read any more
        self.broken: BaseException | None = None
        self.workers: tuple[WorkerInfo, ...] = ()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        # A wake byte was written since the manager last took the entries: the next put needs
        # none (a burst of submit() calls costs one write, not one each: the write was half
        # of submit()'s time in a profile of 20000 tiny tasks).
        self.wake_pending = False

    def put_locked(self, *entry: Any) -> None:
        """Under :attr:`lock`: hand ``entry`` to the manager and wake it."""
        self.entries.append(entry)
        # Under the lock, which the manager holds to close the pipe: never a write to a closed
        # (and maybe reused) descriptor. A full pipe means the manager is awake already.
        if not self.closed and not self.wake_pending:
            with contextlib.suppress(BlockingIOError):
                os.write(self.wake_w, b"x")
            self.wake_pending = True

    def take_locked(self) -> list[tuple[Any, ...]]:
        """Under :attr:`lock`, in the manager: every entry put so far. A put after this one
        wakes the manager again."""
        items = list(self.entries)
        self.entries.clear()
        self.wake_pending = False
        return items


class Manager:
    """The thread that owns one pool's sockets and processes (see the top of this module).
    Made in the caller's thread, which starts the process server; :meth:`start` starts the
    thread. ``on_closed`` runs in the thread once every future is resolved and every process
    is gone (the pool releases its GPUs there)."""

    def __init__(self, box: Mailbox, slots: tuple[WorkerSlot, ...], *, start_method: str,
                 boot: dict[str, Any], on_closed: Callable[[], None]) -> None:
        self._box = box
        self.slots = slots
        self._start_method = start_method
        self._boot = boot
        self._on_closed = on_closed
        # What loading tasks imported in the workers, in import order: later workers import
        # it before they are ready (a warm start, _worker.py).
        self._warm: dict[str, None] = {}
        self._warm_off = False  # a worker died importing them: later ones start cold
        self.core = _core.Core(slots, make_error=error_of)
        # One byte per task of a file only this pool's processes hold: the claim that decides
        # whether a pipelined task runs on its worker or is taken back (_worker.py).
        self._claims = os.memfd_create("gpuwarden-pool-claims", os.MFD_CLOEXEC)
        self.taken_back = 0  # tasks taken back from behind running ones (for tests, benchmarks)
        self._selector = selectors.DefaultSelector()
        self._links: dict[int, _Link] = {}
        self.server: ServerLink | None = None
        self.thread: threading.Thread | None = None
        # The server is started here, in the caller's thread, with posix_spawn: no pipe for
        # a concurrent fork() to inherit and hold open (what made subprocess hang).
        self._start_server()

    def start(self) -> threading.Thread:
        self.thread = threading.Thread(target=self.run, name="gpuwarden-pool-manager",
                                       daemon=True)
        self.thread.start()
        return self.thread

    def run(self) -> None:
        """The thread's body: until every future is resolved and every process is gone."""
        core = self.core
        try:
            self._selector.register(self._box.wake_r, selectors.EVENT_READ, ("wake", None))
            core.start()
            while True:
                self._drain_mailbox()
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

    def _drain_mailbox(self) -> None:
        box = self._box
        with box.lock:
            items = box.take_locked()
        for item in items:
            if item[0] == "task":
                self.core.submit(item[1])
            elif item[0] == "shutdown":
                self.core.shutdown(cancel=item[1], kill=item[2], deadline=item[3])
            elif item[0] == "resize":
                self.slots = item[1]
                self.core.resize(item[1])

    def _perform(self) -> None:
        """Carry out the core's actions; futures last, outside any lock."""
        core = self.core
        while core.actions:
            actions, core.actions = core.actions, []
            resolves = []
            for action in actions:
                if isinstance(action, _core.Resolve):
                    resolves.append(action)
                elif isinstance(action, _core.SendTask):
                    link = self._links.get(action.worker.key)
                    if link is not None:
                        task = action.task
                        if action.behind:  # its claim first (the payload is at most 32 KiB)
                            link.writer.put(_wire.Kind.TASK_BEHIND, task.id,
                                            _wire.CLAIM.pack(task.claim) + task.payload)
                        else:
                            link.writer.put(_wire.Kind.TASK, task.id, task.payload)
                        self._flush(link)
                elif isinstance(action, _core.Withdraw):
                    self._withdraw(action.worker, action.task.id, action.claim)
                elif isinstance(action, _core.StartWorker):
                    self._start_worker(action.worker)
                elif isinstance(action, _core.StopWorker):
                    link = self._links.get(action.worker.key)
                    if link is not None:
                        link.writer.put(_wire.Kind.STOP, -1)
                        self._flush(link)
                elif isinstance(action, _core.KillWorker):
                    if self.server is not None and action.worker.pid is not None:
                        self.server.send(("kill", action.worker.pid))
                elif isinstance(action, _core.StartServer):
                    self._start_server()
                elif isinstance(action, _core.KillServer) and self.server is not None:
                    self.server.kill_tree()
            if core.broken is not None and self._box.broken is None:
                with self._box.lock:
                    self._box.broken = core.broken
            for resolve in resolves:
                _settle(resolve)
            self._forget_dead_links()
        self._watch_server()

    def _watch_server(self) -> None:
        """Read the server's socket always; write to it while messages wait (a full socket
        buffer: the server is busy forking)."""
        server = self.server
        if server is None or not self._registered(server.sock):
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if server.outbox else 0)
        if self._selector.get_key(server.sock).events != events:
            self._selector.modify(server.sock, events, ("server", None))

    def _publish(self) -> None:
        self._box.workers = tuple(
            WorkerInfo(w.slot.index, w.pid, w.slot.gpu,
                       w.slot.env.get("CUDA_VISIBLE_DEVICES", ""), w.state.value)
            for w in sorted(self.core.workers.values(), key=lambda w: w.slot.index))

    def _start_server(self) -> None:
        if self.server is not None:
            self._drop_server()
        env = dict(os.environ)
        # The server must not pick a GPU for anyone (each worker sets its own), and what it
        # preloads must start with the workers' thread caps.
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if self.slots:
            for var in THREAD_LIMIT_VARS:
                env[var] = self.slots[0].env[var]
        boot = {"method": self._start_method, "sys_path": self._boot["sys_path"],
                "preload": self._boot["preload"]}
        self.server = ServerLink(boot, env)
        if self._thread_started():
            self._selector.register(self.server.sock, selectors.EVENT_READ, ("server", None))

    def _thread_started(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def _drop_server(self) -> None:
        server = self.server
        if server is None:
            return
        self.server = None
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(server.sock)
        server.close()

    def _start_worker(self, worker: Worker) -> None:
        server = self.server
        if server is None:
            self.core.on_spawn_failed(worker.key, "the pool's process server is not running")
            return
        if not self._registered(server.sock):
            self._selector.register(server.sock, selectors.EVENT_READ, ("server", None))
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        parent.setblocking(False)
        link = _Link(worker, parent)
        self._links[worker.key] = link
        self._selector.register(parent, selectors.EVENT_READ, ("worker", link))
        boot = {**self._boot, "env": dict(worker.slot.env), "index": worker.slot.index,
                "device": worker.slot.device_label, "threads": worker.slot.threads,
                "warm": list(self._warm)}
        link.warmed = bool(self._warm)
        # The claim file first, on the fresh socket's first byte (it cannot block).
        socket.send_fds(parent, [b"C"], [self._claims])
        link.writer.put(_wire.Kind.BOOT, -1, _pickling.dumps_task(boot))
        self._flush(link)
        # The child's end goes to the server (closed here once sent).
        server.send(("spawn", worker.key, dict(worker.slot.env)), [child.detach()])

    def _withdraw(self, worker: Worker, task_id: int, claim: int) -> None:
        """Take back a task pipelined to ``worker`` if the worker has not claimed it. Once
        the claim is ours, everything the worker sent is in its socket: a STARTED for the task
        there means it claimed first (and let go after); read it all before the core decides."""
        link = self._links.get(worker.key)
        claimed = link is not None and _lock(self._claims, claim)
        if link is not None and claimed:
            self._read_worker(link)
            while link.reader.more:
                self._read_worker(link)
        if self.core.on_withdraw(worker.key, task_id, claim, claimed):
            assert link is not None
            link.withdrawn.add(claim)
            self.taken_back += 1
        elif claimed:
            _unlock(self._claims, claim)

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
                while os.read(self._box.wake_r, 65536):
                    pass
        elif kind == "server":
            self._on_server()
        elif kind == "worker":
            if mask & selectors.EVENT_WRITE:
                self._flush(link)
            if mask & selectors.EVENT_READ:
                self._read_worker(link)

    def _on_server(self) -> None:
        server = self.server
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
                self.core.on_forked(message[1], message[2])
            elif what == "spawn_failed":
                self.core.on_spawn_failed(message[1], message[2])
            elif what == "exit":
                pid = message[1]
                link = next((ln for ln in self._links.values() if ln.worker.pid == pid), None)
                if link is not None:
                    # Everything the worker wrote is in its socket by now: read it before
                    # its death decides what happened to its tasks.
                    self._read_worker(link, final=True)
                    self._warm_start_failed(link)
                self.core.on_exit(pid, message[2])
        if messages is None or server.gone:
            returncode = server.reap(SERVER_EXIT_WAIT_S)
            self._drop_server()
            for link in list(self._links.values()):
                self._read_worker(link, final=True)
            self.core.on_server_exit(returncode)

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
        self._warm_start_failed(link)
        self.core.on_lost(worker.key)

    def _on_frame(self, link: _Link, kind: _wire.Kind, task_id: int, payload: bytearray) -> None:
        core, worker = self.core, link.worker
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
            load_s = link.load_s if link.load_task == task_id else 0.0
            core.on_result(worker.key, task_id, value, failed=failed, load_s=load_s)
        elif kind is _wire.Kind.SKIPPED:
            (claim,) = _wire.CLAIM.unpack(payload)
            if claim in link.withdrawn:  # taken back: the claim has done its work
                link.withdrawn.discard(claim)
                _unlock(self._claims, claim)
            else:
                core.on_skipped(worker.key, task_id, claim)
        elif kind is _wire.Kind.IMPORTED:
            link.load_task, link.load_s = task_id, self._learn(payload)
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

    def _warm_start_failed(self, link: _Link) -> None:
        """A worker that dies while it imports what earlier tasks loaded (a module that
        crashes a fresh process) would die again in every replacement, and three deaths in a
        row break the pool: later workers start without the warm start, as they did before."""
        worker = link.worker
        if link.warmed and worker.state is _core.WorkerState.STARTING \
                and not worker.kill_requested and not self._warm_off:
            log.warning("%s died while importing the %d module(s) earlier tasks loaded; later "
                        "workers import them when a task needs them", worker.name,
                        len(self._warm))
            self._warm_off = True
            self._warm.clear()

    def _learn(self, payload: bytearray) -> float:
        """Take in an IMPORTED frame: learn the names; the seconds loading took."""
        try:
            load_s, names = _pickling.loads(payload)
            load_s = max(0.0, float(load_s))
        except Exception:  # noqa: BLE001 - a hint for later workers, never a fault
            return 0.0
        if isinstance(names, list) and not self._warm_off:
            for name in names[:max(0, MAX_WARM_MODULES - len(self._warm))]:
                if isinstance(name, str):
                    self._warm[name] = None
        return load_s

    def _forget_dead_links(self) -> None:
        for key in [k for k in self._links if k not in self.core.workers]:
            link = self._links.pop(key)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(link.sock)
            link.sock.close()
            for claim in link.withdrawn:  # a dead worker runs nothing
                _unlock(self._claims, claim)

    def _close(self) -> None:
        """Resolve what is left, stop the server (it kills everything under it), release."""
        core, box = self.core, self._box
        with box.lock:
            box.closed = True
            items = box.take_locked()
            os.close(box.wake_w)
        for item in items:
            if item[0] == "task":
                core.submit(item[1])
        core.finish()
        self._perform()
        self._publish()
        server = self.server
        if server is not None:
            server.send(("stop",))
            server.reap(SERVER_EXIT_WAIT_S)
            self._drop_server()
        for link in self._links.values():
            link.sock.close()
        self._links.clear()
        self._selector.close()
        os.close(box.wake_r)
        os.close(self._claims)
        self._on_closed()

    def close_in_child(self) -> None:
        """After fork, in the child: the parent's descriptors are not the child's to use."""
        for fd in (self._box.wake_r, self._box.wake_w, self._claims):
            with contextlib.suppress(OSError):
                os.close(fd)
        for link in self._links.values():
            with contextlib.suppress(OSError):
                link.sock.close()
        if self.server is not None:
            with contextlib.suppress(OSError):
                self.server.sock.close()


def error_of(fault: Fault) -> BaseException:
    """The exception a task's future fails with for ``fault`` (the core's ``make_error``)."""
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


def _lock(fd: int, claim: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, claim)
        return True
    except OSError:
        return False  # the worker holds it: it is starting the task


def _unlock(fd: int, claim: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, claim)


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
    if resolve.notify and future.cancelled():
        # CANCELLED -> CANCELLED_AND_NOTIFIED: wait() and as_completed() count a cancelled
        # future only then, and only its executor makes the call (CPython 3.11's own
        # executors leave the futures shutdown(cancel_futures=True) cancels un-notified).
        # Once per future: a task is resolved once, and one set running was never queued.
        future.set_running_or_notify_cancel()
