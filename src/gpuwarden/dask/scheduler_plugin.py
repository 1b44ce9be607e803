"""On the Dask scheduler: a worker's death becomes a named error for the task it was running.

Where the facts are: the *scheduler* notices first (the dead worker's connection closes) and,
left alone, reschedules every task it had sent there, up to ``allowed-failures`` times, then
raises the generic ``KilledWorker``. Only the worker's *nanny*, on the worker's host, learns
how the process ended (SIGKILL, SIGSEGV, an exit code), and only the worker knew which of those
tasks it was executing (``_worker_plugin`` keeps that in a file its nanny reads). So:

1. each ``gpuwarden worker`` nanny announces its worker (host, GPU, pid) when it starts;
2. when such a worker is removed while tasks were processing on it, this plugin holds those
   tasks back (a worker restriction no worker meets: they wait in ``no-worker``) instead of
   letting them run elsewhere at once;
3. the nanny's report (within milliseconds) names the signal and the tasks being executed:
   those fail with :class:`~gpuwarden.errors.DaskWorkerDiedError` (host, GPU, signal, the
   OOM-killer hint); the others are scheduled again as Dask would have;
4. no report within ``hold_s`` (the whole host is gone): every held task is released to Dask's
   own retry.

A report that arrives before the scheduler noticed the death fails the task at once, as if
the worker had reported the error itself. With no gpuwarden worker, the plugin does nothing.

It also says when a task asks for a resource that no worker offers (``resources={"GPU": 1}``
sent to ``--cpu`` workers): Dask leaves such a task waiting in ``no-worker`` without a word, for
a worker that offers it may join later. The plugin keeps Dask's behaviour and warns at once,
on the scheduler's log and in every connected client (Dask's ``warn`` event, which a
``Client`` raises as a ``UserWarning``): :data:`UNOFFERED_CODE`, the task, the resource, the
workers there are and the fix; once per resource every :data:`WARN_EVERY_S`.

The nannies register the plugin themselves (``register_scheduler_plugin``, idempotent), which
needs gpuwarden importable where the scheduler runs; ``dask scheduler --preload
gpuwarden.dask.scheduler_plugin`` installs it from the start.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps, loads

from gpuwarden.errors import DaskWorkerDiedError

log = logging.getLogger("gpuwarden.dask")

PLUGIN_NAME = "gpuwarden"
HOLD_S = 10.0  # how long a dead worker's tasks wait for its nanny's report
HOLD_ENV = "GPUWARDEN_DASK_HOLD_S"  # read by the worker command that installs the plugin
# A worker restriction that no worker address can match: the task waits in ``no-worker``.
_HOLD_RESTRICTION = "gpuwarden-hold://waiting-for-the-nanny"
UNOFFERED_CODE = "DASK_RESOURCE_UNOFFERED"
WARN_EVERY_S = 60.0  # one warning per missing resource in this time, not one per task

OOM_HINT = ("usual causes: the host's OOM killer (SIGKILL; see `dmesg` on the worker's host), "
            "a segfault in a native library, a CUDA error that aborted the process, os._exit() "
            "in the task, or a kill from outside")


@dataclass
class _Hold:
    address: str
    since: float
    restrictions: dict[Any, tuple[Any, bool]] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None


def describe_death(info: dict[str, Any], exit_status: str, key: Any) -> DaskWorkerDiedError:
    """The error a task gets when its gpuwarden worker died while running it."""
    name, host, device = info.get("name", "?"), info.get("host", "?"), info.get("device", "?")
    cvd = info.get("cuda_visible_devices", "")
    return DaskWorkerDiedError(
        f"Dask worker {name} (pid {info.get('pid', '?')}, {device} on {host}) died with "
        f"{exit_status} while running task {key!r}",
        why=OOM_HINT,
        fix=f"check `dmesg` and the worker's log on {host}; the nanny restarted the worker and "
        "the other tasks run on",
        evidence=[f"host: {host}", f"worker: {name} at {info.get('address', '?')}, "
                  f"pid {info.get('pid', '?')}",
                  f"GPU: {device}, CUDA_VISIBLE_DEVICES={cvd!r}", f"exit: {exit_status}",
                  f"task: {key!r}"],
        worker=name, gpu=device, exit_status=exit_status, task=str(key), host=host)


class GpuwardenSchedulerPlugin(SchedulerPlugin):
    """See the module docstring. One instance per scheduler, named :data:`PLUGIN_NAME`."""

    name = PLUGIN_NAME

    def __init__(self, hold_s: float | None = None) -> None:
        if hold_s is None:
            hold_s = float(os.environ.get(HOLD_ENV) or HOLD_S)
        self.hold_s = hold_s

    def __getstate__(self) -> dict[str, Any]:
        return {"hold_s": self.hold_s}  # shipped to the scheduler before start()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.hold_s = state["hold_s"]

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.workers: dict[str, dict[str, Any]] = {}  # address -> what its nanny announced
        self.leaving: set[str] = set()  # closed on purpose: their tasks go on at once
        self.reported: dict[str, dict[str, Any]] = {}  # death reports, by worker address
        # Removals under way: worker -> the tasks processing there (the scheduler's own event).
        self.removing: dict[str, set[Any]] = {}
        self.held: dict[str, _Hold] = {}
        self.warned: dict[tuple[tuple[str, float], ...], float] = {}  # missing -> when warned
        scheduler.handlers["gpuwarden_worker_up"] = self.worker_up
        scheduler.handlers["gpuwarden_worker_leaving"] = self.worker_leaving
        scheduler.handlers["gpuwarden_worker_died"] = self.worker_died

    async def close(self) -> None:
        for hold in self.held.values():
            if hold.timer is not None:
                hold.timer.cancel()

    # -- messages from the nannies ---------------------------------------------------------

    def worker_up(self, info: dict[str, Any]) -> str:
        self.workers[info["address"]] = dict(info)
        return "OK"

    def worker_leaving(self, address: str) -> str:
        self.leaving.add(address)
        hold = self.held.pop(address, None)
        if hold is not None:
            self._release(hold, {}, executing=(), exit_status=None)
        return "OK"

    def worker_died(self, address: str, exit_status: str, executing: bytes,
                    info: dict[str, Any] | None = None) -> str:
        # The report carries the nanny's account of its worker (host, GPU, pid): the same as
        # its announcement, which the scheduler may never have taken or has dropped with the
        # worker's removal.
        info = info or self.workers.get(address)
        if info is None:
            return "unknown worker"
        keys = loads(executing)
        stimulus_id = f"gpuwarden-worker-died-{time.time()}"
        if address in self.scheduler.workers:
            # Remembered until the removal, so that it holds nothing back.
            self.reported[address] = {"exit_status": exit_status, "executing": keys}
            # The nanny was faster than the closed connection: fail the task as if the worker
            # had reported its error; the removal that follows reschedules the others.
            for key in keys:
                ts = self.scheduler.tasks.get(key)
                if ts is not None and ts.processing_on is not None \
                        and ts.processing_on.address == address:
                    self._fail(ts, describe_death(info, exit_status, key), stimulus_id)
            return "OK"
        hold = self.held.pop(address, None)
        if hold is not None:
            self._release(hold, info, executing=keys, exit_status=exit_status)
        else:
            # Removed with nothing held (the plugin did not know the worker then): Dask has
            # sent the task elsewhere already; it still fails with the death that ended it.
            asyncio.get_running_loop().call_soon(self._fail_moved, info, list(keys),
                                                 exit_status)
        return "OK"

    def _fail_moved(self, info: dict[str, Any], keys: list[Any], exit_status: str) -> None:
        stimulus_id = f"gpuwarden-worker-died-{time.time()}"
        for key in keys:
            ts = self.scheduler.tasks.get(key)
            if ts is None or ts.retries > 0:
                continue  # gone, or the caller asked for retries: Dask's retry stands
            exc = describe_death(info, exit_status, key)
            log.warning("gpuwarden: %s, reported after the worker's removal: the task, sent "
                        "elsewhere meanwhile, fails", exc.what)
            self._fail(ts, exc, stimulus_id)

    def _fail(self, ts: Any, exc: DaskWorkerDiedError, stimulus_id: str) -> None:
        """Fail ``ts`` with ``exc`` where it is: running on a worker (as if that worker had
        reported the error) or waiting for one. Anything else (done, gone) is left alone.
        Never called from inside a transition: erring a task re-enters the scheduler's
        transition machinery."""
        if ts.state == "processing" and ts.processing_on is not None:
            self.scheduler.handle_task_erred(
                key=ts.key, stimulus_id=stimulus_id, worker=ts.processing_on.address,
                run_id=ts.run_id, exception=dumps(exc), traceback=None,
                exception_text=exc.what, traceback_text="")
        elif ts.state in ("no-worker", "queued"):
            self.scheduler.transitions(self.scheduler.transition(
                ts.key, "erred", stimulus_id, cause=ts.key, exception=dumps(exc),
                traceback=None, exception_text=exc.what, traceback_text=""), stimulus_id)

    # -- the scheduler's own events --------------------------------------------------------

    def log_event(self, topic: str, msg: Any) -> None:
        # The scheduler's own account of a removal, logged just before it releases the tasks
        # that were processing on the worker. It is the one record that stays right when Dask's
        # work stealing has moved a task: stealing sets ``ts.processing_on`` without a
        # transition, so a worker remembered from the task's last transition can be the wrong
        # one (the task then ran again elsewhere instead of failing with its worker).
        if topic == "all" and isinstance(msg, dict) and msg.get("action") == "remove-worker":
            self.removing[str(msg.get("worker"))] = set(msg.get("processing-tasks") or ())

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish == "no-worker":
            self._unoffered(key)
            return
        if start != "processing" or finish != "released":
            return
        address = next((a for a, keys in self.removing.items() if key in keys), None)
        if address is None or address not in self.workers:
            return  # not a removal (finished, cancelled, stolen), or not a gpuwarden worker
        if address in self.leaving or address in self.reported:
            return  # closed on purpose, or its report already failed the right task
        # Its worker was removed while this task was processing there: hold the task until the
        # nanny says whether the worker was running it when it died. The hook runs before the
        # scheduler's next transition of the task, so the restriction keeps it off every worker.
        ts = self.scheduler.tasks[key]
        hold = self.held.get(address)
        if hold is None:
            hold = self.held[address] = _Hold(address, time.monotonic())
            loop = asyncio.get_running_loop()
            hold.timer = loop.call_later(self.hold_s, self._expire, address)
        hold.restrictions[key] = (ts.worker_restrictions, ts.loose_restrictions)
        ts.worker_restrictions = {_HOLD_RESTRICTION}
        ts.loose_restrictions = False

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        # Called after the removal's transitions (the holds are in place). The report still to
        # come names the worker itself.
        self.workers.pop(worker, None)
        self.leaving.discard(worker)
        self.reported.pop(worker, None)
        self.removing.pop(worker, None)

    def _unoffered(self, key: Any) -> None:
        """A task waits for a worker: warn when no worker offers a resource it asks for."""
        ts = self.scheduler.tasks.get(key)
        wants = getattr(ts, "resource_restrictions", None) if ts is not None else None
        if not wants or ts.worker_restrictions == {_HOLD_RESTRICTION}:
            return
        workers = list(self.scheduler.workers.values())
        missing = tuple(sorted((str(r), float(need)) for r, need in wants.items()
                               if not any(ws.resources.get(r, 0) >= need for ws in workers)))
        if not missing:
            return  # offered: the task waits for a busy worker, as Dask intends
        now = time.monotonic()
        if now - self.warned.get(missing, -math.inf) < WARN_EVERY_S:
            return
        self.warned[missing] = now
        text = unoffered_message(key, dict(missing), [(str(ws.name), dict(ws.resources))
                                                       for ws in workers])
        log.warning("%s", text)
        self.scheduler.log_event("warn", {"message": pickle.dumps(text),
                                          "category": pickle.dumps(UserWarning)})

    # -- releasing held tasks ----------------------------------------------------------------

    def _expire(self, address: str) -> None:
        hold = self.held.pop(address, None)
        if hold is not None:
            log.warning("gpuwarden: no report from the nanny of %s within %.0f s: its %d task(s) "
                        "go back to Dask's own retry", address, self.hold_s,
                        len(hold.restrictions))
            self._release(hold, {}, executing=(), exit_status=None)

    def _release(self, hold: _Hold, info: dict[str, Any], executing: Any,
                 exit_status: str | None) -> None:
        if hold.timer is not None:
            hold.timer.cancel()
        asyncio.get_running_loop().call_soon(self._release_now, hold, info, list(executing),
                                             exit_status)

    def _release_now(self, hold: _Hold, info: dict[str, Any], executing: list[Any],
                     exit_status: str | None) -> None:
        # Called from the event loop, never from inside a transition (see _fail).
        stimulus_id = f"gpuwarden-release-{time.time()}"
        again: dict[Any, str] = {}
        for key, (restrictions, loose) in hold.restrictions.items():
            ts = self.scheduler.tasks.get(key)
            if ts is None:
                continue
            ts.worker_restrictions = restrictions
            ts.loose_restrictions = loose
            if ts.state != "no-worker":
                continue
            if exit_status is not None and key in executing and ts.retries > 0:
                ts.retries -= 1  # the caller asked for retries (submit(..., retries=N))
                again[key] = "processing"
            elif exit_status is not None and key in executing:
                self._fail(ts, describe_death(info, exit_status, key), stimulus_id)
            else:
                again[key] = "processing"
        if again:
            self.scheduler.transitions(again, stimulus_id)


def unoffered_message(key: Any, missing: dict[str, float],
                      workers: list[tuple[str, dict[str, float]]]) -> str:
    """The warning for a task whose resources no worker offers (one line, the fix after it)."""
    asks = ", ".join(f"{r}={need:g}" for r, need in missing.items())
    seen = "; ".join(f"{name} ({', '.join(f'{r}={v:g}' for r, v in res.items()) or 'none'})"
                     for name, res in workers[:4])
    more = f" and {len(workers) - 4} more" if len(workers) > 4 else ""
    there = f"{len(workers)} worker(s): {seen}{more}" if workers else "no worker at all"
    fix = ("start `gpuwarden worker SCHEDULER` without --cpu on a host with GPUs (--cpu workers "
           "offer no GPU), or submit without resources= to run on any worker"
           if "GPU" in missing else
           "start a worker that offers it (`dask worker --resources NAME=N`), or submit without "
           "that resource")
    return (f"gpuwarden: warning[{UNOFFERED_CODE}]: task {key!r} asks for {asks}, which no "
            f"worker of this scheduler offers ({there}); Dask keeps it waiting until such a "
            f"worker joins. fix: {fix}")


async def dask_setup(scheduler: Any) -> None:
    """``dask scheduler --preload gpuwarden.dask.scheduler_plugin``: install the plugin at start."""
    await scheduler.register_scheduler_plugin(GpuwardenSchedulerPlugin(), name=PLUGIN_NAME,
                                              idempotent=True)
