"""The pool's state machine (pool/_core.py) driven by events, without processes: each fault at
each position has its one outcome, and no sequence of events resolves a task twice or leaves
one unresolved. The same faults with real processes are in test_pool_faults.py."""

from __future__ import annotations

import random
from concurrent.futures import Future

import pytest

from gpuwarden.inventory.snapshot import ComputeMode, GPUSnapshot
from gpuwarden.pool import _core
from gpuwarden.pool._core import (
    Core,
    Fault,
    KillServer,
    KillWorker,
    Resolve,
    SendTask,
    StartServer,
    StartWorker,
    StopWorker,
    Task,
    TaskState,
    Withdraw,
    WorkerState,
)
from gpuwarden.pool.plan import plan_slots


class Named(Exception):
    def __init__(self, fault: Fault) -> None:
        super().__init__(fault.kind)
        self.kind = fault.kind
        self.task_id = fault.task.id


def gpu(i: int) -> GPUSnapshot:
    return GPUSnapshot(index=i, uuid=f"GPU-{i}", name="sim", pci_bus_id=f"0:{i}",
                       memory_total_bytes=1 << 30, memory_used_bytes=0, utilization_gpu_pct=0,
                       compute_mode=ComputeMode.DEFAULT, mig_enabled=False)


class Harness:
    """A Core plus the bookkeeping a manager would do: pids, futures settled."""

    def __init__(self, workers: int = 2, gpus: int = 2) -> None:
        slots = plan_slots([gpu(i) for i in range(gpus)], -(-workers // gpus), cpu_workers=0,
                           max_workers=workers)
        self.core = Core(slots, make_error=Named, clock=lambda: 0.0)
        self.settled: dict[int, list[str]] = {}
        self.tasks: list[Task] = []
        self.pids = iter(range(1000, 100000))
        self.withdraws: list[Withdraw] = []  # asked, not yet answered with on_withdraw
        self.core.start()
        self.take()

    def take(self) -> list[object]:
        actions, self.core.actions = self.core.actions, []
        for action in actions:
            if isinstance(action, Resolve):
                future = action.task.future
                if action.cancel:
                    future.cancel()
                elif action.failed:
                    future.set_exception(action.value)  # raises if settled twice
                else:
                    future.set_result(action.value)
                self.settled.setdefault(action.task.id, []).append(
                    "cancelled" if action.cancel else
                    getattr(action.value, "kind", "error") if action.failed else "result")
            elif isinstance(action, Withdraw):
                self.withdraws.append(action)
        return actions

    def start_all(self) -> None:
        for w in list(self.core.workers.values()):
            if w.state is WorkerState.STARTING:
                if w.pid is None:
                    self.core.on_forked(w.key, next(self.pids))
                self.core.on_ready(w.key)
        self.take()

    def submit(self, n: int) -> list[Task]:
        new = [Task(len(self.tasks) + i, Future(), b"x", f"t{len(self.tasks) + i}")
               for i in range(n)]
        self.tasks.extend(new)
        for t in new:
            self.core.submit(t)
        self.take()
        return new

    def worker_of(self, task: Task) -> _core.Worker:
        return self.core.workers[task.worker]  # type: ignore[index]


def test_a_worker_killed_while_running_fails_that_task_and_requeues_the_pipelined_one() -> None:
    h = Harness(workers=1, gpus=1)
    h.start_all()
    h.core.task_s = 0.001  # tiny tasks: a second one is pipelined behind the first
    first, second, third = h.submit(3)
    w = h.worker_of(first)
    assert [t.id for t in w.inflight] == [first.id, second.id]
    h.core.on_started(w.key, first.id)
    h.core.on_exit(w.pid, -9)
    actions = h.take()
    assert h.settled == {first.id: ["died"]}
    assert first.state is TaskState.FAILED and second.requeues == 1
    # Back at the head of the queue, in order: the replacement, still starting, reserves it.
    replacement = next(a.worker for a in actions if isinstance(a, StartWorker))
    assert [t.id for t in replacement.inflight] == [second.id]
    assert second.state is TaskState.RESERVED and [t.id for t in h.core.queue] == [third.id]
    assert not any(isinstance(a, SendTask) and a.task is second for a in actions)
    h.start_all()
    new = h.worker_of(second)
    assert second.future_running and second.state is TaskState.SENT  # not set running twice
    h.core.on_started(new.key, second.id)
    h.core.on_result(new.key, second.id, 2, failed=False)
    h.take()
    assert second.future.result() == 2


def pipelined_behind_a_running_task() -> tuple[Harness, Task, Task, Task]:
    """Two ready workers on one GPU, tiny tasks: a and b run, c is pipelined behind one of
    them; then b's worker finishes and goes idle with nothing queued."""
    h = Harness(workers=2, gpus=1)
    h.start_all()
    h.core.task_s = 0.001
    a, b, c = h.submit(3)
    busy = h.worker_of(c)
    assert [t.id for t in busy.inflight][1:] == [c.id] and c.state is TaskState.SENT
    first = busy.inflight[0]
    other = b if first is a else a
    h.core.on_started(busy.key, first.id)
    h.core.on_started(h.worker_of(other).key, other.id)
    h.core.on_result(h.worker_of(other).key, other.id, other.id, failed=False)
    h.take()
    return h, first, other, c


def test_a_pipelined_task_is_sent_behind_and_must_be_claimed() -> None:
    h = Harness(workers=1, gpus=1)
    h.start_all()
    h.core.task_s = 0.001
    a, b, c = [Task(i, Future(), b"x", f"t{i}") for i in range(3)]
    h.tasks.extend((a, b, c))
    for t in (a, b, c):
        h.core.submit(t)
    sends = [x for x in h.take() if isinstance(x, SendTask)]
    w = h.worker_of(a)
    assert [(x.task, x.behind) for x in sends] == [(a, False), (b, True)]
    assert [t.id for t in w.inflight] == [a.id, b.id] and [t.id for t in h.core.queue] == [c.id]
    h.core.task_s = 0.5  # slower tasks: none is pipelined any more
    h.core.on_started(w.key, a.id)
    h.core.on_result(w.key, a.id, 1, failed=False)
    h.take()
    assert [t.id for t in w.inflight] == [b.id] and [t.id for t in h.core.queue] == [c.id]


def test_an_idle_worker_takes_back_a_task_waiting_behind_a_running_one() -> None:
    h, first, _, c = pipelined_behind_a_running_task()
    busy = h.worker_of(first)
    (ask,) = h.withdraws
    assert ask.worker is busy and ask.task is c and c.withdrawing
    assert h.core.on_withdraw(busy.key, c.id, ask.claim, claimed=True)
    sends = [x for x in h.take() if isinstance(x, SendTask)]
    idle = next(w for w in h.core.workers.values() if w is not busy)
    # The idle worker runs it now, as an ordinary task; the busy one keeps its running task.
    assert [(x.worker, x.task, x.behind) for x in sends] == [(idle, c, False)]
    assert [t.id for t in busy.inflight] == [first.id] and not c.withdrawing
    assert c.requeues == 0 and c.state is TaskState.SENT


def test_a_task_its_worker_claimed_first_stays_with_it() -> None:
    h, first, _, c = pipelined_behind_a_running_task()
    busy = h.worker_of(first)
    # The worker finished the first task and claimed c: the claim failed, or succeeded after
    # the worker let go — then its STARTED was read before the core decides.
    h.core.on_result(busy.key, first.id, 1, failed=False)
    assert not h.core.on_withdraw(busy.key, c.id, c.claim, claimed=False)
    assert [t.id for t in busy.inflight] == [c.id] and not c.withdrawing
    h.core.on_started(busy.key, c.id)
    assert not h.core.on_withdraw(busy.key, c.id, c.claim, claimed=True)  # RUNNING: started
    h.core.on_result(busy.key, c.id, 3, failed=False)
    h.take()
    assert h.settled[c.id] == ["result"] and not any(isinstance(x, SendTask) and x.task is c
                                                     for x in h.take())


def test_a_pipelined_task_its_worker_skipped_runs_elsewhere() -> None:
    h, first, _, c = pipelined_behind_a_running_task()
    busy = h.worker_of(first)
    # A claim file a task closed: the worker cannot claim and skips; the task is not lost.
    claim = c.claim
    h.core.on_skipped(busy.key, c.id, claim)
    sends = [x for x in h.take() if isinstance(x, SendTask)]
    assert [x.task for x in sends] == [c] and sends[0].worker is not busy
    assert not h.core.on_withdraw(busy.key, c.id, claim, claimed=True)  # the late answer: nothing


def test_a_task_sent_behind_again_has_a_new_claim_the_old_copys_answers_do_not_touch() -> None:
    """Taken back from behind a long task, then (the idle worker busy again meanwhile) sent
    behind the same long task once more: its worker's socket holds two copies. The first
    copy's claim stays the pool's until the worker skips it; the second has its own."""
    h, first, _, c = pipelined_behind_a_running_task()
    busy = h.worker_of(first)
    old = c.claim
    idle = next(w for w in h.core.workers.values() if w is not busy)
    h.core.submit(d := Task(10, Future(), b"x", "t10"))  # the idle worker takes d first
    h.take()
    assert h.worker_of(d) is idle
    assert h.core.on_withdraw(busy.key, c.id, old, claimed=True)
    sends = [x for x in h.take() if isinstance(x, SendTask)]
    assert [(x.task, x.behind) for x in sends] == [(c, True)] and c.claim not in (0, old)
    # The old copy's skip (the manager keeps it when the claim was its own; a skip the
    # worker made for a claim file it could not use) never moves the new copy.
    h.core.on_skipped(sends[0].worker.key, c.id, old)
    assert not h.core.on_withdraw(sends[0].worker.key, c.id, old, claimed=True)
    assert c.state is TaskState.SENT and c in sends[0].worker.inflight


def test_a_worker_killed_before_it_reads_its_task_requeues_it() -> None:
    h = Harness(workers=1, gpus=1)
    h.start_all()
    (task,) = h.submit(1)
    dead = h.worker_of(task)
    h.core.on_exit(dead.pid, -9)
    h.take()
    # Requeued, not failed (it never started); reserved by the slot's replacement.
    assert task.requeues == 1 and not h.settled
    assert task.state is TaskState.RESERVED and task.worker != dead.key


def test_a_task_whose_readers_keep_dying_unstarted_fails_after_max_requeues() -> None:
    """A payload that kills whoever reads it must not go round forever: after MAX_REQUEUES
    ready workers died with it unstarted it fails, alone; the pool goes on."""
    h = Harness(workers=1, gpus=1)
    h.start_all()
    (task,) = h.submit(1)
    for death in range(_core.MAX_REQUEUES):
        h.start_all()
        w = h.worker_of(task)
        assert w.state is not WorkerState.STARTING
        h.core.on_exit(w.pid, -9)
        h.take()
        if death < _core.MAX_REQUEUES - 1:
            assert not h.settled and task.requeues == death + 1
    assert h.settled == {task.id: ["requeues"]}
    assert h.core.broken is None
    (after,) = h.submit(1)
    h.start_all()
    w = h.worker_of(after)
    h.core.on_started(w.key, after.id)
    h.core.on_result(w.key, after.id, 1, failed=False)
    h.take()
    assert h.settled[after.id] == ["result"]


def test_a_worker_that_dies_while_starting_had_no_task_and_three_deaths_break_the_pool() -> None:
    h = Harness(workers=1, gpus=1)
    (task,) = h.submit(1)  # reserved by the worker still starting, never written to it
    for death in range(_core.MAX_START_FAILURES):
        (w,) = h.core.workers.values()
        assert w.state is WorkerState.STARTING
        h.core.on_forked(w.key, next(h.pids))
        h.core.on_exit(w.pid, -9)
        h.take()
        if death < _core.MAX_START_FAILURES - 1:
            assert not h.settled and task.state is TaskState.RESERVED
    assert h.settled == {task.id: ["broken"]}
    assert h.core.broken is not None and not h.core.workers


def test_an_exit_after_the_result_fails_nothing() -> None:
    h = Harness(workers=1, gpus=1)
    h.start_all()
    (task,) = h.submit(1)
    w = h.worker_of(task)
    h.core.on_started(w.key, task.id)
    h.core.on_result(w.key, task.id, "ok", failed=False)
    h.core.on_exit(w.pid, 0)
    h.take()
    assert h.settled == {task.id: ["result"]}


def test_the_server_dying_fails_running_tasks_requeues_the_rest_and_starts_again() -> None:
    h = Harness(workers=2, gpus=2)
    h.core.clock = lambda: 100.0  # workers started long ago: no task waits for one
    h.start_all()
    a, b, c = h.submit(3)
    h.core.on_started(h.worker_of(a).key, a.id)
    h.core.on_server_exit(-9)
    actions = h.take()
    assert h.settled == {a.id: ["server_died"]}
    assert b.requeues == 1 and TaskState.FAILED not in (b.state, c.state)
    kinds = [type(x) for x in actions if not isinstance(x, Resolve)]
    assert kinds[:3] == [StartServer, StartWorker, StartWorker]  # a new server first
    for _ in range(_core.MAX_START_FAILURES - 1):
        h.core.on_server_exit(-9)
        h.take()
    assert h.core.broken is not None
    assert h.settled[b.id] == ["broken"] and h.settled[c.id] == ["broken"]


def test_shutdown_with_cancel_cancels_the_queued_and_fails_a_requeued_one() -> None:
    h = Harness(workers=1, gpus=1)
    h.start_all()
    first, second, third = h.submit(3)
    w = h.worker_of(first)
    h.core.on_exit(w.pid, -9)  # first was sent, not started: requeued (to the replacement)
    h.take()
    # A requeued task whose future is RUNNING cannot be cancelled: if it waits in the queue
    # at shutdown(cancel_futures=True), it fails with a named error instead.
    stuck = Task(99, Future(), b"x", "t99", future_running=True)
    assert stuck.future.set_running_or_notify_cancel()
    h.core.queue.append(stuck)
    h.core.shutdown(cancel=True, kill=False, deadline=None)
    h.take()
    assert h.settled == {second.id: ["cancelled"], third.id: ["cancelled"],
                         stuck.id: ["shutdown"]}
    assert first.state is TaskState.RESERVED  # taken before the shutdown: it still runs


def test_a_resolve_owes_the_notification_exactly_for_tasks_never_set_running() -> None:
    """Every way a task ends without having been handed to a worker (cancelled by shutdown,
    failed by a broken pool) tells the manager to notify a cancellation; a task that was set
    running (reserved, sent) never is: set_running_or_notify_cancel() runs once per future."""
    h = Harness(workers=1, gpus=1)  # the worker is still starting
    reserved, queued, owner_cancelled = h.submit(3)
    assert reserved.future_running and reserved.state is TaskState.RESERVED
    assert owner_cancelled.future.cancel()
    h.core.break_(RuntimeError("initializer failed"))
    resolves = [a for a in h.core.actions if isinstance(a, Resolve)]
    assert {a.task.id: a.notify for a in resolves} == {
        reserved.id: False, queued.id: True, owner_cancelled.id: True}
    h2 = Harness(workers=1, gpus=1)
    h2.start_all()
    running, waiting = h2.submit(2)
    h2.core.shutdown(cancel=True, kill=False, deadline=None)
    [cancel] = [a for a in h2.core.actions if isinstance(a, Resolve)]
    assert cancel.task is waiting and cancel.cancel and cancel.notify


def test_shutdown_runs_the_queue_then_stops_the_workers() -> None:
    h = Harness(workers=1, gpus=1)
    h.start_all()
    a, b = h.submit(2)
    h.core.shutdown(cancel=False, kill=False, deadline=None)
    w = h.worker_of(a)
    for t in (a, b):
        h.core.on_started(w.key, t.id)
        h.core.on_result(w.key, t.id, t.id, failed=False)
    actions = h.take()
    assert any(isinstance(x, StopWorker) for x in actions)
    assert h.core.phase is _core.Phase.STOPPING and not h.core.done
    h.core.on_exit(w.pid, 0)
    h.take()
    assert h.core.done and h.settled == {a.id: ["result"], b.id: ["result"]}


def test_shutdown_deadline_fails_what_runs_and_a_stuck_stop_kills_the_server() -> None:
    h = Harness(workers=1, gpus=1)
    h.start_all()
    a, b = h.submit(2)
    h.core.on_started(h.worker_of(a).key, a.id)
    h.core.shutdown(cancel=False, kill=False, deadline=5.0)
    h.core.on_deadline()
    actions = h.take()
    assert h.settled[a.id] == ["deadline"]
    assert h.settled[b.id] in (["cancelled"], ["deadline"])
    assert any(isinstance(x, KillWorker) for x in actions)
    h.core.on_stop_deadline()
    h.core.on_stop_deadline()
    assert any(isinstance(x, KillServer) for x in h.take())


def test_kill_workers_fails_running_tasks_and_cancels_queued_ones() -> None:
    h = Harness(workers=1, gpus=1)
    h.start_all()
    a, b = h.submit(2)
    h.core.shutdown(cancel=False, kill=True, deadline=None)
    h.take()
    assert h.settled == {a.id: ["killed"], b.id: ["cancelled"]}


def test_a_future_cancelled_by_its_owner_is_never_sent() -> None:
    h = Harness(workers=1, gpus=1)
    h.start_all()
    task = Task(0, Future(), b"x", "t0")
    task.future.cancel()
    h.core.submit(task)
    assert not any(isinstance(x, SendTask) for x in h.take())
    assert task.state is TaskState.CANCELLED


def test_resize_retires_a_busy_worker_after_its_task_and_grows_on_new_slots() -> None:
    h = Harness(workers=2, gpus=2)
    h.start_all()
    a, b = h.submit(2)
    busy = h.worker_of(b)
    slots = plan_slots([gpu(0), gpu(1)], 1, cpu_workers=0, max_workers=1)
    h.core.resize(slots)
    assert busy.state is WorkerState.RETIRING
    (c,) = h.submit(1)
    assert c.worker != busy.key
    h.core.on_started(busy.key, b.id)
    h.core.on_result(busy.key, b.id, 1, failed=False)
    assert any(isinstance(x, StopWorker) and x.worker is busy for x in h.take())
    h.core.resize(plan_slots([gpu(0), gpu(1)], 2, cpu_workers=0, max_workers=3))
    assert sum(isinstance(x, StartWorker) for x in h.take()) == 2


def test_an_idle_ready_worker_takes_a_reservation_back_at_once() -> None:
    """Issue 39: w0 ready, w1 starting (an initializer loading a model). b was reserved by w1
    while w0 ran a; once w0 is idle it runs b at once: the move leaves the GPUs as even as
    they were, and a worker that can start b now beats one that cannot (it held 3 s)."""
    h = Harness(workers=2, gpus=2)
    (w0, w1) = sorted(h.core.workers.values(), key=lambda w: w.slot.index)
    h.core.on_forked(w0.key, 1)
    h.core.on_forked(w1.key, 2)
    h.core.on_ready(w0.key)
    a, b = h.submit(2)
    assert a.worker == w0.key and b.state is TaskState.RESERVED and b.worker == w1.key
    h.core.on_started(w0.key, a.id)
    h.core.on_result(w0.key, a.id, 1, failed=False)
    assert any(isinstance(x, SendTask) and x.task is b for x in h.take())
    assert b.worker == w0.key and b.state is TaskState.SENT and not w1.inflight


def test_a_reservation_that_spreads_the_gpus_waits_only_for_a_young_worker() -> None:
    """Two workers per GPU; GPU 1's are still starting. b, reserved on GPU 1 while GPU 0 runs a,
    stays there while GPU 0's other worker idles (moving it would put both tasks on GPU 0),
    but only until its worker has been starting HOLD_FOR_STARTING_S: then it runs on GPU 0.
    A new task no longer waits for that worker at all."""
    now = [0.0]
    h = Harness(workers=4, gpus=2)
    h.core.clock = lambda: now[0]
    workers = sorted(h.core.workers.values(), key=lambda w: w.slot.index)
    on_gpu0 = [w for w in workers if w.slot.gpu.index == 0]  # type: ignore[union-attr]
    on_gpu1 = [w for w in workers if w.slot.gpu.index == 1]  # type: ignore[union-attr]
    for w in on_gpu0:
        h.core.on_forked(w.key, next(h.pids))
        h.core.on_ready(w.key)
    a, b = h.submit(2)
    assert h.worker_of(a) in on_gpu0 and b.state is TaskState.RESERVED
    assert h.worker_of(b) in on_gpu1
    now[0] = 1.0
    h.core.dispatch()
    assert not h.take() and b.state is TaskState.RESERVED
    assert h.core.hold_deadline == _core.HOLD_FOR_STARTING_S
    now[0] = h.core.hold_deadline
    h.core.dispatch()
    assert any(isinstance(x, SendTask) and x.task is b for x in h.take())
    assert h.worker_of(b) in on_gpu0 and b.state is TaskState.SENT
    # c, with GPU 0's workers both busy, may be reserved on GPU 1 (nobody can start it now),
    # but the first worker of GPU 0 to be idle runs it: GPU 1's are slow to start.
    (c,) = h.submit(1)
    assert c.state is TaskState.RESERVED and h.worker_of(c) in on_gpu1
    h.core.on_started(h.worker_of(a).key, a.id)
    h.core.on_result(h.worker_of(a).key, a.id, 1, failed=False)
    assert any(isinstance(x, SendTask) and x.task is c for x in h.take())
    assert h.worker_of(c) in on_gpu0 and all(not w.inflight for w in on_gpu1)


def test_a_reservation_waits_no_longer_than_the_pools_tasks_take() -> None:
    """Issue 39, scikit-learn's sequence: a worker added by a resize imports what the pool's
    tasks need before it is ready (a second for scikit-learn). A short task it reserved goes to
    the first idle ready worker once the new one has been starting longer than tasks take, not
    after HOLD_FOR_STARTING_S. The time loading a task took when it imported modules does not
    count: it is the import's."""
    now = [0.0]
    h = Harness(workers=2, gpus=1)  # one GPU: spreading over GPUs plays no part
    h.core.clock = lambda: now[0]
    h.start_all()
    (a,) = h.submit(1)
    now[0] = 1.0
    h.core.on_started(a.worker, a.id)  # type: ignore[arg-type]
    h.core.on_result(a.worker, a.id, 1, failed=False, load_s=0.95)  # type: ignore[arg-type]
    assert h.core.task_s == pytest.approx(0.05)
    h.core.resize(plan_slots([gpu(0)], 3, cpu_workers=0, max_workers=3))
    (new,) = [x.worker for x in h.take() if isinstance(x, StartWorker)]
    c, d, e = h.submit(3)
    assert e.state is TaskState.RESERVED and e.worker == new.key
    now[0] = 1.01
    h.core.on_result(c.worker, c.id, 1, failed=False)  # type: ignore[arg-type]
    assert not any(isinstance(x, SendTask) for x in h.take())
    assert e.state is TaskState.RESERVED  # young: it may be ready soon
    assert h.core.task_s is not None
    assert h.core.hold_deadline == pytest.approx(new.started_at + h.core.task_s)
    now[0] = h.core.hold_deadline
    h.core.dispatch()
    assert any(isinstance(x, SendTask) and x.task is e for x in h.take())
    assert e.worker == c.worker and not new.inflight


def test_a_starting_worker_retired_by_resize_gets_no_task_even_if_it_becomes_ready() -> None:
    """Seen in joblib's suite: a resize killed a worker still starting, which then said
    READY before the kill landed, took a task, and the task failed with its death."""
    h = Harness(workers=2, gpus=2)
    (w0, w1) = sorted(h.core.workers.values(), key=lambda w: w.slot.index)
    h.core.on_forked(w0.key, 1)
    h.core.on_forked(w1.key, 2)
    h.core.on_ready(w0.key)
    h.core.resize(plan_slots([gpu(0), gpu(1)], 1, cpu_workers=0, max_workers=1))
    assert any(isinstance(x, KillWorker) and x.worker is w1 for x in h.take())
    h.core.on_ready(w1.key)  # its READY was on its way when the kill was sent
    tasks = h.submit(4)
    assert all(t.worker in (None, w0.key) for t in tasks)
    assert not w1.inflight


def test_finish_leaves_nothing_unresolved() -> None:
    h = Harness(workers=1, gpus=1)
    h.start_all()
    tasks = h.submit(4)
    h.core.on_started(h.worker_of(tasks[0]).key, tasks[0].id)
    h.core.finish()
    h.take()
    assert sorted(h.settled) == [t.id for t in tasks]
    assert all(t.future.done() for t in tasks)


@pytest.mark.parametrize("seed", range(80))
def test_random_faults_resolve_every_task_exactly_once(seed: int) -> None:
    """Random interleavings of starts, results, deaths, server deaths, resizes and shutdown:
    every future settles exactly once (a second set_* raises InvalidStateError), and once
    the machine is finished nothing is pending."""
    rng = random.Random(seed)
    now = [0.0]
    h = Harness(workers=rng.randint(1, 4), gpus=rng.randint(1, 2))
    h.core.clock = lambda: now[0]
    tiny = rng.random() < 0.5  # tasks pipelined behind running ones, and taken back
    h.core.task_s = rng.choice([None, 0.001])
    steps = rng.randint(30, 120)
    for step in range(steps + 150):
        now[0] += rng.choice([0.0, 0.5, 2.0])
        if tiny:
            h.core.task_s = 0.001
        if h.core.hold_deadline is not None and now[0] >= h.core.hold_deadline:
            h.core.dispatch()
        live = list(h.core.workers.values())
        # Then the tail, nothing submitted: workers fall idle while others still have tasks
        # pipelined behind running ones — where tasks are taken back.
        roll = rng.random() if step < steps else \
            rng.uniform(0.25, 0.45) if rng.random() < 0.7 else rng.uniform(0.63, 0.72)
        if roll < 0.25:
            h.submit(rng.randint(1, 3))
        elif roll < 0.45 and live:
            w = rng.choice(live)
            if w.pid is None:
                h.core.on_forked(w.key, next(h.pids))
            elif w.state is WorkerState.STARTING:
                h.core.on_ready(w.key)
            elif w.inflight:
                t = w.inflight[0]
                if t.state is TaskState.SENT:
                    h.core.on_started(w.key, t.id)
                else:
                    h.core.on_result(w.key, t.id, t.id, failed=rng.random() < 0.2)
        elif roll < 0.55 and live:
            w = rng.choice(live)
            if w.pid is not None:
                h.core.on_exit(w.pid, rng.choice([-9, -11, 3]))
        elif roll < 0.57:
            h.core.on_server_exit(-9)
        elif roll < 0.60 and h.core.phase is _core.Phase.RUNNING:
            n = rng.randint(1, 4)
            h.core.resize(plan_slots([gpu(0), gpu(1)], -(-n // 2), cpu_workers=0,
                                     max_workers=n))
        elif roll < 0.62:
            h.core.shutdown(cancel=rng.random() < 0.5, kill=rng.random() < 0.2,
                            deadline=None)
        elif roll < 0.63:
            h.core.on_deadline()
        elif roll < 0.70 and h.withdraws:
            ask = h.withdraws.pop(rng.randrange(len(h.withdraws)))
            h.core.on_withdraw(ask.worker.key, ask.task.id, ask.claim,
                               claimed=rng.random() < 0.6)
        elif roll < 0.72 and live:
            w = rng.choice(live)
            if w.inflight and w.inflight[-1].state is TaskState.SENT and w.inflight[-1].claim:
                h.core.on_skipped(w.key, w.inflight[-1].id, w.inflight[-1].claim)
        for action in h.core.actions:
            # A worker the pool decided to kill never gets a task (it would fail with it).
            assert not (isinstance(action, SendTask) and action.worker.kill_requested), action
        h.take()
        for t in h.tasks:
            assert len(h.settled.get(t.id, [])) <= 1, (t.id, h.settled[t.id])
        # A task is in one place at a time: the queue or one worker's (a task taken back from
        # behind a running one is nowhere else).
        places = [t.id for t in h.core.queue] + [
            t.id for w in h.core.workers.values() for t in w.inflight]
        assert len(places) == len(set(places)), places
    h.core.finish()
    h.take()
    for t in h.tasks:
        assert h.settled.get(t.id) and len(h.settled[t.id]) == 1, (t.id, t.state)
        assert t.future.done()
        assert t.state not in _core.LIVE_TASK
