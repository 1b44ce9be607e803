"""The pool's states and their one owner: every transition of a task or a worker happens here.

Pure: no process, socket or thread is touched. The pool's manager thread (_manager.py) is
the only caller; it turns what it reads from sockets into the events below (:meth:`Core.
on_ready`, :meth:`Core.on_exit`, ...) and carries out the :class:`Action` s each event
leaves in :attr:`Core.actions` (start a worker, send a task, kill a process, resolve a
future). Futures are resolved by the manager after the event, never inside it and never
under a lock, so a done-callback may call back into the pool.

Task: QUEUED [-> RESERVED] -> SENT -> RUNNING -> DONE | FAILED, or back to QUEUED (requeued)
when its worker died before starting it, or when the pool took it back from behind a running
task (a claim, :meth:`Core.on_withdraw`); CANCELLED when cancelled or shut down before it was
sent.
Worker: STARTING -> READY <-> BUSY -> DEAD (its slot gets a replacement), or RETIRING /
STOPPING (no new task; stops once its tasks are done) -> DEAD.

Every fault is one event with one outcome (docs/pool.md, "What happens when"):
``on_exit`` of a worker fails its RUNNING task (exactly one, named error) and puts its SENT
tasks back at the head of the queue; a worker that dies STARTING had no task; a server that
dies takes its workers with it and is started again; shutdown's deadline fails what still
runs; :meth:`Core.finish` resolves whatever is left, so no future stays PENDING.
"""

from __future__ import annotations

import collections
import enum
import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.pool.plan import WorkerSlot

# A slot whose worker dies this many times in a row before it is ready, or a server that
# dies this many times in a row before any worker of it was ready, breaks the pool: it would
# otherwise restart forever.
MAX_START_FAILURES = 3
# A task whose worker died before starting it is requeued; after this many such deaths it
# fails instead (a payload that kills whoever reads it must not go round forever).
MAX_REQUEUES = 3
# Pipelining: a second task may be sent to a worker running one, to hide the round trip of
# tiny tasks (~15 us of ~80 per task) — only when the pool's tasks have been finishing in under
# PIPELINE_BELOW_S and the payload sits in the socket buffer. No task's length is known before
# it ends: after many tiny tasks a 30 s one held a tiny one behind it while the other worker
# idled (joblib's test_parallel_unordered_generator_returns_fastest_first, beside a CPU hog).
# So a worker that goes idle takes back a task waiting behind a running one (Withdraw): the
# task's claim (_worker.py) decides atomically whether the busy worker started it first.
PIPELINE_BELOW_S = 0.005
PIPELINE_MAX_BYTES = 32 * 1024
# Workers told to stop get this long to exit before they are killed.
STOP_GRACE_S = 3.0
# A worker still starting may reserve a task when it sits on a less loaded GPU (spreading
# tasks over the GPUs beats starting a second sooner). An idle ready worker takes such a
# reservation back whenever moving it leaves the GPUs no less even, and at once, whatever the
# GPUs, once the starting worker has been starting this long: its initializer loads a model,
# or hangs, and no task waits for it while a worker that can start the task now is idle.
HOLD_FOR_STARTING_S = 3.0


class TaskState(enum.Enum):
    QUEUED = "queued"
    RESERVED = "reserved"  # taken by a worker still starting; not written to it yet
    SENT = "sent"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class WorkerState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    RETIRING = "retiring"  # resize made its slot go: finishes its tasks, then stops
    STOPPING = "stopping"  # shutdown: told to stop
    DEAD = "dead"


class Phase(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"  # shutdown asked: run what is queued, then stop the workers
    STOPPING = "stopping"  # every task resolved: workers are being stopped
    CLOSED = "closed"      # the manager closes the server and releases the GPUs


LIVE_TASK = (TaskState.QUEUED, TaskState.RESERVED, TaskState.SENT, TaskState.RUNNING)


@dataclass(eq=False)
class Task:
    id: int
    future: Future[Any]
    payload: bytes
    description: str
    state: TaskState = TaskState.QUEUED
    worker: int | None = None  # key of the worker it was sent to
    requeues: int = 0
    future_running: bool = False  # set_running_or_notify_cancel() done (once, ever)
    sent_at: float = 0.0
    withdrawing: bool = False  # a Withdraw is out for it (one at a time)
    # The claim of its latest send behind a running task (0: none): each such send has its
    # own, so a copy left in one worker's socket never shares a claim with a later copy.
    claim: int = 0


@dataclass(eq=False)
class Worker:
    key: int
    slot: WorkerSlot
    state: WorkerState = WorkerState.STARTING
    pid: int | None = None
    inflight: collections.deque[Task] = field(default_factory=collections.deque)
    started_at: float = 0.0
    kill_requested: bool = False
    on_purpose: bool = False  # stopped or killed by the pool (shutdown, resize), not lost

    @property
    def name(self) -> str:
        pid = "starting" if self.pid is None else f"pid {self.pid}"
        return f"worker {self.slot.index} ({pid}, {self.slot.device_label})"


# -- actions: what the manager must do after an event -------------------------------------

@dataclass(frozen=True)
class StartWorker:
    worker: Worker


@dataclass(frozen=True)
class SendTask:
    worker: Worker
    task: Task
    behind: bool = False  # the worker runs another task: it must claim this one (TASK_BEHIND)


@dataclass(frozen=True)
class Withdraw:
    """Take ``claim`` of ``task``, pipelined behind the running task of ``worker``, read what
    the worker sent, and report with :meth:`Core.on_withdraw` (always, whatever happened)."""

    worker: Worker
    task: Task
    claim: int


@dataclass(frozen=True)
class StopWorker:
    worker: Worker


@dataclass(frozen=True)
class KillWorker:
    worker: Worker


@dataclass(frozen=True)
class StartServer:
    pass


@dataclass(frozen=True)
class KillServer:
    """SIGKILL the server and every process under it (its workers die with it)."""


@dataclass(frozen=True)
class Resolve:
    """Settle ``task``'s future: ``value`` is the result, or the exception when ``failed``;
    ``cancel`` cancels it instead. ``notify``: the pool never called the future's
    ``set_running_or_notify_cancel()``; if the future ends up cancelled (here, or by its
    owner before), that call is still owed: ``concurrent.futures.wait()`` and
    ``as_completed()`` see a cancelled future only once it is made."""

    task: Task
    value: Any = None
    failed: bool = False
    cancel: bool = False
    notify: bool = False


Action = StartWorker | SendTask | Withdraw | StopWorker | KillWorker | StartServer | KillServer | Resolve


# Named errors are made by the caller of Core (it knows the exception classes and the
# texts); Core says which fault happened to which task.
@dataclass(frozen=True)
class Fault:
    kind: str  # "died" | "server_died" | "deadline" | "killed" | "broken" | "requeues" | "shutdown"
    task: Task
    worker: Worker | None = None
    exit_status: int | None = None
    detail: str = ""


class Core:
    """The pool's state, changed only by the events below, from one thread."""

    def __init__(self, slots: Sequence[WorkerSlot], *,
                 make_error: Callable[[Fault], BaseException],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.slots: dict[int, WorkerSlot] = {s.index: s for s in slots}
        self.make_error = make_error
        self.clock = clock
        self.phase = Phase.RUNNING
        self.broken: BaseException | None = None
        self.queue: collections.deque[Task] = collections.deque()
        self.workers: dict[int, Worker] = {}       # live (not DEAD), by key
        self.by_slot: dict[int, Worker] = {}       # the current worker of each planned slot
        self.start_failures: collections.Counter[int] = collections.Counter()
        self.server_failures = 0
        self.cancel_queued = False
        self.deadline: float | None = None
        self.stop_deadline: float | None = None
        self.stop_stage = 0
        self.hold_deadline: float | None = None
        self.task_s: float | None = None  # recent task time (EWMA): how long a reservation may wait
        self.actions: list[Action] = []
        self._keys = itertools.count()
        self._claims = itertools.count(1)

    # -- start ---------------------------------------------------------------------------

    def start(self) -> None:
        """The server is being started (by the pool's constructor): start every worker."""
        for slot in self.slots.values():
            self._start_worker(slot)

    def _start_worker(self, slot: WorkerSlot) -> Worker:
        worker = Worker(next(self._keys), slot, started_at=self.clock())
        self.workers[worker.key] = worker
        self.by_slot[slot.index] = worker  # a dead worker's slot: its replacement
        self.actions.append(StartWorker(worker))
        return worker

    # -- events from callers (drained from the pool's inbox) -------------------------------

    def submit(self, task: Task) -> None:
        if self.broken is not None:
            self._fail(task, self.broken)
        elif self.phase is not Phase.RUNNING and self.phase is not Phase.DRAINING:
            self._cancel_or_fail(task, "shutdown")
        else:
            self.queue.append(task)
            self.dispatch()

    def shutdown(self, *, cancel: bool, kill: bool, deadline: float | None) -> None:
        if self.phase is Phase.RUNNING:
            self.phase = Phase.DRAINING
        if deadline is not None:
            self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)
        if cancel or kill:
            self.cancel_queued = True
            while self.queue:
                self._cancel_or_fail(self.queue.popleft(), "shutdown")
        if kill:
            self._kill_everything("killed")
        self._maybe_stop()

    def resize(self, slots: Sequence[WorkerSlot]) -> None:
        """The plan is now ``slots``: start workers on new slots; workers of slots that went
        finish their tasks (no new one) and stop."""
        if self.phase is not Phase.RUNNING:
            return
        wanted = {s.index: s for s in slots}
        for index in list(self.slots):
            if index not in wanted:
                del self.slots[index]
                worker = self.by_slot.pop(index, None)
                if worker is None or worker.state is WorkerState.DEAD:
                    continue
                if worker.state is WorkerState.STARTING:
                    for task in reversed(worker.inflight):  # its reservation goes back
                        task.state = TaskState.QUEUED
                        self.queue.appendleft(task)
                    worker.inflight.clear()
                    self._stop(worker)
                    continue
                worker.state = WorkerState.RETIRING
                if not worker.inflight:
                    self._stop(worker)
        for index, slot in wanted.items():
            if index not in self.slots:
                self.slots[index] = slot
                self._start_worker(slot)
        self.dispatch()

    # -- events from the server and the workers ------------------------------------------

    def on_forked(self, key: int, pid: int) -> None:
        worker = self.workers.get(key)
        if worker is None:
            return
        worker.pid = pid
        if worker.kill_requested:
            self.actions.append(KillWorker(worker))

    def on_ready(self, key: int) -> None:
        worker = self.workers.get(key)
        if worker is None or worker.state is not WorkerState.STARTING or worker.kill_requested:
            return
        self.start_failures[worker.slot.index] = 0
        self.server_failures = 0
        worker.state = WorkerState.READY
        for task in worker.inflight:  # its reservation, now written to it
            task.state = TaskState.SENT
            worker.state = WorkerState.BUSY
            self.actions.append(SendTask(worker, task))
        if self.phase is not Phase.RUNNING and self.phase is not Phase.DRAINING:
            self._stop(worker)
        self.dispatch()
        self._maybe_stop()

    def on_init_error(self, key: int, error: BaseException) -> None:
        """The initializer (or the worker's start-up) raised: as in concurrent.futures, the
        pool is broken; ``error`` is the named error every unfinished task gets."""
        if key in self.workers:
            self.break_(error)

    def on_started(self, key: int, task_id: int) -> None:
        worker = self.workers.get(key)
        if worker is None:
            return
        for task in worker.inflight:
            if task.id == task_id and task.state is TaskState.SENT:
                task.state = TaskState.RUNNING
                return

    def on_result(self, key: int, task_id: int, value: Any, *, failed: bool,
                  load_s: float = 0.0) -> None:
        """A task's result or error. ``load_s``: how long loading it took when that imported
        modules (a worker's first task of a kind): the import's time, not the task's, so not
        counted in ``task_s``."""
        worker = self.workers.get(key)
        if worker is None or not worker.inflight or worker.inflight[0].id != task_id:
            return  # from a worker already declared dead: its task was resolved then
        task = worker.inflight.popleft()
        elapsed = max(0.0, self.clock() - task.sent_at - load_s)
        self.task_s = elapsed if self.task_s is None else 0.8 * self.task_s + 0.2 * elapsed
        task.state = TaskState.FAILED if failed else TaskState.DONE
        self.actions.append(Resolve(task, value, failed=failed))
        self._task_left(worker)

    def on_withdraw(self, key: int, task_id: int, claim: int, claimed: bool) -> bool:
        """The manager took (``claimed``) or failed to take ``claim`` of a task pipelined to
        worker ``key``, and has read everything the worker sent since. A task claimed and
        still SENT was not started (a worker that claims first says STARTED before it lets the
        claim go): it goes back to the head of the queue. True when it did."""
        task = self._sent_behind(key, task_id, claim)
        if task is None:
            return False  # finished, or its worker died meanwhile (the death requeued it)
        task.withdrawing = False
        if not claimed or task.state is not TaskState.SENT:
            return False
        self._take_off(self.workers[key], task)
        return True

    def on_skipped(self, key: int, task_id: int, claim: int) -> None:
        """The worker did not run a pipelined task whose ``claim`` it could not take, and the
        pool had not taken it back: the worker's claim file is unusable (a task closed it). The
        task runs elsewhere."""
        task = self._sent_behind(key, task_id, claim)
        if task is not None and task.state is TaskState.SENT:
            task.withdrawing = False
            self._take_off(self.workers[key], task)

    def _sent_behind(self, key: int, task_id: int, claim: int) -> Task | None:
        """The task of that send, if it is still the task's latest, on that live worker."""
        worker = self.workers.get(key)
        if worker is None:
            return None
        return next((t for t in worker.inflight if t.id == task_id and t.claim == claim), None)

    def _take_off(self, worker: Worker, task: Task) -> None:
        worker.inflight.remove(task)
        task.state, task.worker = TaskState.QUEUED, None
        self.queue.appendleft(task)
        self._task_left(worker)

    def _task_left(self, worker: Worker) -> None:
        """A task left ``worker`` (done, or taken back): idle again, or stopped when retiring;
        then the queue goes on."""
        if not worker.inflight:
            if worker.state is WorkerState.BUSY:
                worker.state = WorkerState.READY
            elif worker.state is WorkerState.RETIRING:
                self._stop(worker)
        self.dispatch()
        self._maybe_stop()

    def on_lost(self, key: int) -> None:
        """The worker's socket ended (or broke) before its exit was reported: it cannot be
        used any more; kill it and let its exit report decide its tasks."""
        worker = self.workers.get(key)
        if worker is None or worker.state is WorkerState.STOPPING:
            return
        self._kill(worker, on_purpose=False)

    def on_exit(self, pid: int, returncode: int | None, *, server: bool = False) -> None:
        """Worker ``pid`` is dead (reported by the server, which reaps it; or the server
        itself died, taking its workers with it: ``server=True``)."""
        worker = next((w for w in self.workers.values() if w.pid == pid), None)
        if worker is None:
            return  # not ours (an orphan the server adopted), or already handled
        self._dead(worker, returncode, server=server)

    def on_spawn_failed(self, key: int, detail: str) -> None:
        worker = self.workers.get(key)
        if worker is not None:
            self._dead(worker, None, detail=detail)

    def on_server_exit(self, returncode: int | None) -> None:
        """The server is gone: every worker dies with it (PR_SET_PDEATHSIG)."""
        for worker in list(self.workers.values()):
            self._dead(worker, returncode, server=True, replace=False)
        if self.phase in (Phase.STOPPING, Phase.CLOSED) or self.broken is not None:
            self._maybe_stop()
            return
        self.server_failures += 1
        if self.server_failures >= MAX_START_FAILURES:
            self.break_(self.make_error(Fault("broken", _NO_TASK, detail=(
                f"the pool's process server died {self.server_failures} times before any "
                "worker was ready"))))
            return
        self.actions.append(StartServer())
        for slot in self.slots.values():
            if self._wanted(slot):
                self._start_worker(slot)
        self.dispatch()
        self._maybe_stop()

    def on_deadline(self) -> None:
        """Shutdown's timeout ran out: what still runs fails, its workers are killed."""
        self.deadline = None
        self._kill_everything("deadline")
        self._maybe_stop()

    def on_stop_deadline(self) -> None:
        """Workers told to stop did not exit in time: kill them; if even their deaths are
        not reported in time (a stuck server), kill the server with everything under it."""
        if self.stop_stage == 0:
            for worker in self.workers.values():
                self._kill(worker)
            self.stop_stage = 1
            self.stop_deadline = self.clock() + STOP_GRACE_S
        else:
            self.stop_deadline = None
            self.actions.append(KillServer())

    def break_(self, error: BaseException) -> None:
        """The pool cannot run tasks: every unfinished task fails with ``error``."""
        if self.broken is not None:
            return
        self.broken = error
        if self.phase is Phase.RUNNING:
            self.phase = Phase.DRAINING
        while self.queue:
            self._fail(self.queue.popleft(), error)
        for worker in list(self.workers.values()):
            while worker.inflight:
                self._fail(worker.inflight.popleft(), error)
            self._kill(worker)
        self._maybe_stop()

    def finish(self) -> None:
        """The manager is closing: nothing may stay unresolved (a future left PENDING or
        RUNNING would hang whoever waits for it)."""
        while self.queue:
            self._cancel_or_fail(self.queue.popleft(), "shutdown")
        for worker in list(self.workers.values()):
            while worker.inflight:
                task = worker.inflight.popleft()
                self._fail(task, self.make_error(Fault("killed", task, worker)))
        self.workers.clear()
        self.phase = Phase.CLOSED

    # -- queries -------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Every task resolved and every worker dead: the manager may close."""
        return self.phase is Phase.STOPPING and not self.workers

    # -- internals -----------------------------------------------------------------------

    def _wanted(self, slot: WorkerSlot) -> bool:
        return self.phase is Phase.RUNNING or (self.phase is Phase.DRAINING and bool(self.queue))

    def _capacity(self, worker: Worker, task: Task) -> bool:
        if worker.kill_requested:
            return False  # about to die: what it took would fail with it
        if worker.state is WorkerState.READY:
            return True
        if worker.state is WorkerState.STARTING:
            return not worker.inflight  # one task may be reserved by a worker still starting
        return (worker.state is WorkerState.BUSY and len(worker.inflight) == 1
                and self.task_s is not None and self.task_s < PIPELINE_BELOW_S
                and len(task.payload) <= PIPELINE_MAX_BYTES)

    def _load(self) -> collections.Counter[str]:
        load: collections.Counter[str] = collections.Counter()
        for w in self.workers.values():
            load[_gpu_key(w)] += len(w.inflight)
        return load

    def dispatch(self) -> None:
        """Give queued tasks to workers: an idle worker first, on the least loaded GPU (so
        that tasks spread over the GPUs), a ready one before one still starting at equal
        load. A worker still starting may reserve one task: it is written to the worker when
        it is ready. A worker that can start a task now always beats one that has been
        starting for HOLD_FOR_STARTING_S or longer, and an idle ready worker takes a
        reservation back when moving it leaves the GPUs no less even, or once its worker has
        been starting that long (see :meth:`_take_back`)."""
        self.hold_deadline = None
        if self.broken is not None:
            return
        now = self.clock()
        while self.queue:
            task = self.queue[0]
            candidates = [w for w in self.workers.values() if self._capacity(w, task)]
            if any(w.state is not WorkerState.STARTING for w in candidates):
                candidates = [w for w in candidates if not self._slow(w, now)]
            if not candidates:
                break
            load = self._load()
            worker = min(candidates, key=lambda w: (
                len(w.inflight), load[_gpu_key(w)], w.state is not WorkerState.READY,
                w.slot.index))
            self.queue.popleft()
            if not task.future_running:
                # Once the future is RUNNING it cannot be cancelled; a cancelled one is
                # dropped here (its callbacks ran when it was cancelled).
                if not task.future.set_running_or_notify_cancel():
                    task.state = TaskState.CANCELLED
                    continue
                task.future_running = True
            task.sent_at = now
            self._give(worker, task)
        if not self.queue:
            self._take_back(now)
            self._withdraw_behind()
        # When a reservation is looked at again: once its worker is slow, or once it has been
        # starting longer than tasks take (then an idle ready worker takes the task).
        young = [self._review_at(w, now) for w in self.workers.values()
                 if w.state is WorkerState.STARTING and w.inflight and not self._slow(w, now)]
        if young:
            self.hold_deadline = min(young)

    @staticmethod
    def _slow(worker: Worker, now: float) -> bool:
        """Starting for HOLD_FOR_STARTING_S or longer (a forked worker is ready in ~10 ms, a
        spawned one importing torch in ~1-2 s): no task waits for it."""
        return worker.state is WorkerState.STARTING \
            and now >= worker.started_at + HOLD_FOR_STARTING_S

    def _review_at(self, worker: Worker, now: float) -> float:
        if self.task_s is not None and not self._outrun(worker, now):
            return worker.started_at + min(HOLD_FOR_STARTING_S, self.task_s)
        return worker.started_at + HOLD_FOR_STARTING_S

    def _outrun(self, worker: Worker, now: float) -> bool:
        """Starting for longer than the pool's tasks take: a ready worker would have finished
        the task it reserved by now (short tasks are not held for a worker importing its
        modules; long GPU tasks still are, to spread over the GPUs)."""
        return self.task_s is not None and now - worker.started_at >= self.task_s

    def _give(self, worker: Worker, task: Task) -> None:
        task.worker = worker.key
        worker.inflight.append(task)
        if worker.state is WorkerState.STARTING:
            task.state = TaskState.RESERVED
            return
        behind = worker.state is WorkerState.BUSY
        task.claim = next(self._claims) if behind else 0
        task.state = TaskState.SENT
        worker.state = WorkerState.BUSY
        self.actions.append(SendTask(worker, task, behind=behind))

    def _take_back(self, now: float) -> None:
        """An idle ready worker runs a task a starting worker reserved, when moving it leaves
        the GPUs no less even (the idle worker's GPU is the less loaded one: the imbalance
        after the move is at most what it was) or that worker is slow to start. Only at an
        equal load does the reservation stay, and only while its worker is young: there it
        keeps two tasks on two GPUs rather than on one."""
        for idle in [w for w in self.workers.values()
                     if w.state is WorkerState.READY and not w.inflight]:
            load = self._load()
            waiting = [w for w in self.workers.values() if w.state is WorkerState.STARTING
                       and w.inflight and (self._slow(w, now) or self._outrun(w, now)
                                           or load[_gpu_key(idle)] < load[_gpu_key(w)])]
            if not waiting:
                return
            starting = min(waiting, key=lambda w: w.inflight[0].sent_at)
            self._give(idle, starting.inflight.popleft())

    def _withdraw_behind(self) -> None:
        """Each idle ready worker asks for one task pipelined behind a running one, the
        longest waiting first: the running task may be long, and the idle worker can start
        the waiting one now. The claim decides (:meth:`on_withdraw`)."""
        idle = sum(1 for w in self.workers.values()
                   if w.state is WorkerState.READY and not w.inflight and not w.kill_requested)
        if not idle:
            return
        behind = [(w, w.inflight[-1]) for w in self.workers.values() if len(w.inflight) > 1
                  and w.inflight[-1].state is TaskState.SENT and not w.inflight[-1].withdrawing]
        for worker, task in sorted(behind, key=lambda wt: wt[1].sent_at)[:idle]:
            task.withdrawing = True
            self.actions.append(Withdraw(worker, task, task.claim))

    def _dead(self, worker: Worker, returncode: int | None, *, server: bool = False,
              replace: bool = True, detail: str = "") -> None:
        was = worker.state
        worker.state = WorkerState.DEAD
        self.workers.pop(worker.key, None)
        lost = list(worker.inflight)
        worker.inflight.clear()
        if lost and lost[0].state is TaskState.RUNNING:
            # It ran its tasks in order: only the first can have started.
            task = lost.pop(0)
            kind = "server_died" if server else "died"
            self._fail(task, self.make_error(Fault(kind, task, worker, returncode, detail)))
        requeued = []
        for task in lost:
            # A worker that dies while starting says nothing about the tasks waiting for it.
            task.requeues += was is not WorkerState.STARTING
            if task.requeues >= MAX_REQUEUES:
                self._fail(task, self.make_error(Fault("requeues", task, worker, returncode)))
            else:
                task.state = TaskState.QUEUED
                task.worker = None
                task.withdrawing = False  # the Withdraw out for it finds it gone
                requeued.append(task)
        self.queue.extendleft(reversed(requeued))
        if was is WorkerState.STARTING and self.broken is None and not server \
                and not worker.on_purpose:
            self.start_failures[worker.slot.index] += 1
            if self.start_failures[worker.slot.index] >= MAX_START_FAILURES:
                self.break_(self.make_error(Fault("broken", _NO_TASK, worker, returncode, detail=(
                    f"{worker.name} died {MAX_START_FAILURES} times before it was ready"))))
                return
        slot = self.slots.get(worker.slot.index)
        if (replace and slot is not None and self.by_slot.get(slot.index) is worker
                and was not in (WorkerState.RETIRING, WorkerState.STOPPING)
                and self.broken is None and self._wanted(slot)):
            self._start_worker(slot)
        self.dispatch()
        self._maybe_stop()

    def _stop(self, worker: Worker) -> None:
        if worker.state is WorkerState.DEAD or worker.kill_requested:
            return
        worker.on_purpose = True
        if worker.state is WorkerState.STARTING:
            worker.state = WorkerState.STOPPING
            self._kill(worker)  # it may be stuck in its initializer: no point waiting
            return
        worker.state = WorkerState.STOPPING
        self.actions.append(StopWorker(worker))

    def _kill(self, worker: Worker, *, on_purpose: bool = True) -> None:
        if worker.kill_requested or worker.state is WorkerState.DEAD:
            return
        worker.kill_requested = True
        worker.on_purpose = worker.on_purpose or on_purpose
        if worker.pid is not None:
            self.actions.append(KillWorker(worker))

    def _kill_everything(self, why: str) -> None:
        while self.queue:
            self._cancel_or_fail(self.queue.popleft(), "shutdown")
        for worker in list(self.workers.values()):
            while worker.inflight:
                task = worker.inflight.popleft()
                self._fail(task, self.make_error(Fault(why, task, worker)))
            worker.state = WorkerState.STOPPING
            self._kill(worker)

    def _maybe_stop(self) -> None:
        """Draining and nothing left to run: stop every worker (once)."""
        if self.phase is not Phase.DRAINING:
            return
        if self.queue or any(w.inflight for w in self.workers.values()):
            return
        self.phase = Phase.STOPPING
        self.stop_deadline = self.clock() + STOP_GRACE_S
        for worker in list(self.workers.values()):
            self._stop(worker)

    def _fail(self, task: Task, error: BaseException) -> None:
        task.state = TaskState.FAILED
        # A queued task failing (a broken pool) may have been cancelled by its owner: the
        # failure cannot be set then, and the cancellation is still to be notified.
        self.actions.append(Resolve(task, error, failed=True, notify=not task.future_running))

    def _cancel_or_fail(self, task: Task, kind: str) -> None:
        """A task that never ran is cancelled; one whose future is already RUNNING (a
        requeued task) cannot be, and fails with a named error instead."""
        if task.future_running:
            self._fail(task, self.make_error(Fault(kind, task)))
        else:
            task.state = TaskState.CANCELLED
            self.actions.append(Resolve(task, cancel=True, notify=True))


def _gpu_key(worker: Worker) -> str:
    return worker.slot.gpu.uuid if worker.slot.gpu is not None else ""


# A placeholder task for faults that concern the pool rather than one task.
_NO_TASK = Task(-1, Future(), b"", "")
