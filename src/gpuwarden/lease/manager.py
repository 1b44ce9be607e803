"""Lease manager: :func:`acquire` and :func:`lease`, attempt after attempt until a request is
granted or its wait runs out; what a request is and what it gets are ``grant.py``'s, one
attempt under the directory mutex is ``attempt.py``'s.

Protocol (every step on a local filesystem, see docs/leases.md):

1. Read the GPUs (NVML or the simulated host) and the records (bounded, scan.py)
   outside the directory mutex.
2. Under the mutex (a POSIX write lock, held for about a millisecond; ``attempt.py``): read the records
   again (what changed only), judge every GPU by NVML state with the processes of its lease
   holders (and their descendants) not counted as foreign, keep off GPUs an earlier waiting
   request could take, and take the slots: write locks on bytes of the GPU's lock file,
   non-blocking. Either all ``n`` GPUs get their slots, or every lock taken in this attempt
   is let go again. The holder record is written under a fresh random name.
3. Not granted and waiting: a ticket (fresh random name, locked) says what this request
   asks for. Its place in line is the file's birth time, which nobody can choose; which
   GPUs it holds back is judged by each later request from GPU state and the request, not
   taken from the ticket.
4. Waiting blocks on an inotify descriptor of the directory (``_watch.py``): woken when a
   record that stands in the way is deleted (a release) or closed by a dying process, plus a
   full attempt every :data:`REFRESH_S` for NVML changes.

A slot is free when no process holds its byte (the kernel says who does) *and* no live
holder record names it: in a directory another user can delete lock files from, the record
is what still says the slot is taken. Every wait has a deadline, the mutex's included.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gpuwarden.errors import LeaseDirError, LeaseTimeoutError, LeaseUnavailableError
from gpuwarden.lease import _fs, _locks
from gpuwarden.lease._watch import DirWatch
from gpuwarden.lease.attempt import attempt
from gpuwarden.lease.grant import Grant, LeaseRequest, make_request
from gpuwarden.lease.scan import Scanner
from gpuwarden.lease.status import GpuState, OnWait, WaitStatus
from gpuwarden.lease.waiter import Attempt, Waiter
from gpuwarden.select import Constraints
from gpuwarden.units import format_duration

if TYPE_CHECKING:
    from gpuwarden.inventory import Inventory
    from gpuwarden.inventory.snapshot import GPUSnapshot

REFRESH_S = 1.0  # how often a waiter re-reads NVML and retries in full regardless
MUTEX_PATIENCE_S = 1.0  # a waiting request's longest wait for the mutex in one attempt
SETTLE_S = (0.01, 0.05, 0.2)  # extra attempts after a change: a dying holder's locks go one by one
MIN_RETRY_S = 0.005  # attempts woken by an event flood are at least this far apart
FLOOD_WAKES, FLOOD_WINDOW_S = 10, 0.05  # a flood: this many wakes within this window


def _read_gpus(env: Mapping[str, str] | None, inventory: Inventory | None = None
               ) -> tuple[GPUSnapshot, ...]:
    from gpuwarden.inventory import Inventory

    _host, gpus = (inventory or Inventory.from_env(env)).read_visible()
    return gpus


def acquire(n: int | Literal["all"] | None = None, *, min_free: str | int | None = None,
            slots_per_gpu: int = 1, slots_each: int = 1, wait: str | float | None = None,
            constraints: Constraints | None = None, label: str | None = None,
            on_wait: OnWait | None = None, lease_dir: str | Path | None = None,
            env: Mapping[str, str] | None = None,
            visible: Sequence[GPUSnapshot] | None = None, up_to: int | None = None,
            inventory: Inventory | None = None, mem: str | int | None = None) -> Grant:
    """Lease ``n`` GPUs (``slots_each`` of ``slots_per_gpu`` slots on each, or ``mem`` bytes of
    each) and return the Grant.

    ``mem``: a memory lease, e.g. ``"20GiB"``: that much of each GPU, which other memory, slot
    and whole-GPU leases of the host account for; placed where it fits tightest (docs/leases.md,
    "Memory leases"). Not with ``slots_per_gpu``.

    ``n="all"``: every GPU that is acceptable and free at the moment of the attempt (at least
    one; waiting waits for the first), at most ``up_to``, decided under the lease lock, so
    GPUs another lease holds are left to it rather than failing the request.

    ``wait``: None or 0 tries once; a duration ("10m", seconds, ``math.inf``) waits in
    line that long. ``constraints`` are select.py's (memory, utilization, include/exclude,
    allow_shared); ``n`` and ``min_free`` override its count and raise its minimum.
    ``on_wait(WaitStatus)`` is called after every attempt that could not be served.
    ``visible``: the visible GPUs as the caller has just read them, used for the first attempt
    instead of reading NVML again (while waiting, GPU state is re-read).
    ``inventory``: where GPU state is read (default: ``Inventory.from_env(env)``, NVML or
    GPUWARDEN_SIMULATE).

    Raises:
        LeaseUnavailableError (exit 4): not served at once and no ``wait`` given, or the
            request can never be met (more GPUs than are visible).
        LeaseTimeoutError (exit 4): ``wait`` ran out; the evidence names what blocked each GPU.
        LeaseDirError (exit 2): the lease directory is missing its parent, not writable
            for this user, or world-writable without the sticky bit.
        UsageError (exit 2): a bad argument; NoGPUError (exit 3): GPU state cannot be read.
    """
    req = make_request(n, min_free=min_free, slots_per_gpu=slots_per_gpu,
                       slots_each=slots_each, wait=wait, constraints=constraints, label=label,
                       up_to=up_to, mem=mem)
    from gpuwarden.lease import jobstep  # started by a lease holder: its GPUs (jobstep.py)

    if (step := jobstep.serve(req, lease_dir, env, visible, inventory)) is not None:
        return step
    waiter = _new_waiter(req, lease_dir, env)

    def share() -> Grant | None:  # inside a Slurm job: what its other steps hold (jobstep.py)
        return jobstep.serve_slurm_job(req, waiter.directory, env, visible, inventory)

    try:
        return _acquire(waiter, env, on_wait, visible, inventory,
                        share if jobstep.own_slurm_job() is not None else None)
    except (LeaseUnavailableError, LeaseTimeoutError) as exc:
        jobstep.blame_slurm_job(exc, waiter.directory)
        raise
    finally:
        if waiter.ticket is not None:
            waiter.ticket.remove()


def usable_count(*, min_free: str | int | None = None, slots_per_gpu: int = 1,
                 slots_each: int = 1, constraints: Constraints | None = None,
                 lease_dir: str | Path | None = None, env: Mapping[str, str] | None = None,
                 visible: Sequence[GPUSnapshot] | None = None,
                 inventory: Inventory | None = None, mem: str | int | None = None) -> int:
    """How many GPUs ``acquire("all", ...)`` with these arguments would be granted now.

    The same judgement as an attempt, under the same lock, but nothing is taken: a
    prediction (another process may lease a GPU the next moment). Raises as :func:`acquire`.
    """
    req = make_request("all", min_free=min_free, slots_per_gpu=slots_per_gpu,
                       slots_each=slots_each, constraints=constraints, mem=mem)
    waiter = _new_waiter(req, lease_dir, env)
    gpus = tuple(visible) if visible is not None else _read_gpus(env, inventory)
    attempt = _attempt_mapped(waiter, gpus, will_wait=False, probe=True)
    if attempt.mutex_holders:
        raise _not_served(req, _status(req, attempt, 0.0, 0.0), 0.0)
    return attempt.usable


def _new_waiter(req: LeaseRequest, lease_dir: str | Path | None,
                env: Mapping[str, str] | None) -> Waiter:
    directory, prepared = _fs.check_dir(Path(lease_dir) if lease_dir else _fs.lease_dir_path(
        dict(env) if env is not None else None))
    config = _fs.prepared_config(directory) if prepared else None
    if prepared and (config is None or config.schema < _fs.PREPARED_SCHEMA):
        raise LeaseDirError(
            f"lease directory {str(directory)!r} was prepared by an older gpuwarden (one lock "
            "file per slot)",
            why="this gpuwarden locks one file per GPU, and must not share GPUs with requests "
            "that lock other files",
            fix=f"an admin runs `gpuwarden leases init --dir {directory}` again (and every "
            "user of the host upgrades gpuwarden)")
    return Waiter(req, directory, config=config, private=_fs.is_private(directory),
                   scanner=Scanner(directory))


def _acquire(waiter: Waiter, env: Mapping[str, str] | None, on_wait: OnWait | None,
             visible: Sequence[GPUSnapshot] | None, inventory: Inventory | None = None,
             share: Callable[[], Grant | None] | None = None) -> Grant:
    req = waiter.request
    start = time.monotonic()
    wait_s = req.wait_s or 0.0
    gpus = tuple(visible) if visible is not None else _read_gpus(env, inventory)
    if len(gpus) < req.gpus:
        raise LeaseUnavailableError(
            f"{req.describe()} requested, but only {len(gpus)} GPU(s) are visible",
            why="waiting cannot help: the request can never be met on this host",
            fix="ask for fewer GPUs, or check CUDA_VISIBLE_DEVICES / the Slurm allocation",
            evidence=[f"visible: {g.label} {g.uuid}" for g in gpus]
            or ["no GPU is visible to this process"])
    read_at = time.monotonic()
    settle: list[float] = []
    # Watch before the first attempt: a release between an attempt and the wait is not lost.
    watch = DirWatch(waiter.directory) if wait_s > 0 else None
    wakes: collections.deque[float] = collections.deque(maxlen=FLOOD_WAKES)
    try:
        while True:
            will_wait = time.monotonic() - start < wait_s
            # The mutex is held for about a millisecond per attempt; waiting longer for it than
            # the request's own deadline would let a hostile holder hang us.
            mutex_timeout_s = _fs.MUTEX_TIMEOUT_S if not wait_s else \
                min(MUTEX_PATIENCE_S, max(0.05, start + wait_s - time.monotonic()))
            attempted_at = time.monotonic()
            attempt = _attempt_mapped(waiter, gpus, will_wait=will_wait,
                                      mutex_timeout_s=mutex_timeout_s)
            if attempt.granted is not None:
                return attempt.granted
            # Not leased: GPUs that this Slurm job's other steps hold are shared instead.
            if share is not None and any(g.kind == "leased" for g in attempt.states) \
                    and (shared := share()) is not None:
                return shared
            waited = time.monotonic() - start
            status = _status(req, attempt, waited, wait_s)
            if not will_wait:
                raise _not_served(req, status, wait_s)
            if on_wait is not None:
                on_wait(status)
            assert watch is not None
            # Sleep until a change: a record that stands in the way deleted or closed by its
            # dying owner, a settle retry, the periodic refresh, or the deadline.
            wake_at = min(time.monotonic() + REFRESH_S, start + wait_s,
                          *(settle[:1] or [math.inf]))
            settle = settle[1:]
            names = set(attempt.watch)
            if attempt.mutex_holders:
                names.add(_fs.MUTEX_NAME)
            changed = watch.wait(names, max(0.0, wake_at - time.monotonic()))
            if changed:
                settle = [time.monotonic() + s for s in SETTLE_S]
                # A flood of events for the names we watch (someone opening and closing them
                # in a loop) costs at most one attempt per MIN_RETRY_S; a hand-off, at once.
                wakes.append(time.monotonic())
                if len(wakes) == wakes.maxlen and wakes[-1] - wakes[0] < FLOOD_WINDOW_S:
                    time.sleep(max(0.0, attempted_at + MIN_RETRY_S - time.monotonic()))
            # A holder that ended may leave NVML's process list a moment later: re-read then.
            if changed or time.monotonic() - read_at >= REFRESH_S:
                gpus, read_at = _read_gpus(env, inventory), time.monotonic()
    finally:
        if watch is not None:
            watch.close()


def _status(req: LeaseRequest, attempt: Attempt, waited: float, wait_s: float) -> WaitStatus:
    return WaitStatus(request=req.describe(), waited_s=waited, gpus=attempt.states,
                      ahead=attempt.ahead,
                      deadline_s=None if math.isinf(wait_s) else wait_s - waited,
                      directory_blocker=attempt.mutex_holders)


def _attempt_mapped(waiter: Waiter, gpus: Sequence[GPUSnapshot], *, will_wait: bool,
                    probe: bool = False, mutex_timeout_s: float = _fs.MUTEX_TIMEOUT_S
                    ) -> Attempt:
    try:
        return attempt(waiter, gpus, will_wait=will_wait, probe=probe,
                        mutex_timeout_s=mutex_timeout_s)
    except _locks.MutexBusyError as busy:
        # Nothing could be judged: say who holds the directory, GPU by GPU as "unknown".
        blocker = (f"the lease directory's mutex {busy.path} stayed held for "
                   f"{format_duration(busy.waited_s)} (an attempt holds it for about a "
                   f"millisecond) by {_locks.describe_owner(busy.holder)}")
        return Attempt(states=tuple(GpuState(g.index, g.uuid, g.label, "not judged", "unknown")
                                     for g in gpus), mutex_holders=blocker)
    except OSError as exc:
        raise _dir_error(waiter.directory, exc) from exc


def _dir_error(directory: Path, exc: OSError) -> LeaseDirError:
    if isinstance(exc, _fs.UnsafeFileError):
        return LeaseDirError(
            f"{exc.path} {exc.problem}",
            why="gpuwarden never locks, follows or waits on anything but a regular file in the "
            "lease directory",
            fix="remove it (its owner or root can); in a directory `gpuwarden leases init` "
            "prepared, no user can plant one")
    # The directory passed check_dir; this is a full disk, a read-only remount, a lock file
    # another user made unwritable, or a filesystem without record locks.
    return LeaseDirError(
        f"lease directory {str(directory)!r} cannot be used: "
        f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else ""),
        fix=f"check the directory and its files, or set {_fs.LEASE_DIR_ENV} to a local "
        "directory",
    )


def _not_served(req: LeaseRequest, status: WaitStatus, wait_s: float) -> Exception:
    evidence = [g.line() for g in status.gpus]
    fewer = "less memory (--mem) or fewer GPUs" if req.memory_bytes else \
        "fewer GPUs or slots"
    if wait_s > 0:
        return LeaseTimeoutError(
            f"waited {format_duration(status.waited_s)} for {req.describe()} and was not served",
            why=status.blockers(),
            fix=f"wait longer (--wait), ask for {fewer}, or see who holds them "
            "with `gpuwarden leases`",
            evidence=evidence)
    return LeaseUnavailableError(
        f"{req.describe()} cannot be leased now",
        why=status.blockers(),
        fix="wait in line for them (gpuwarden run --wait 10m, or lease(..., wait='10m')), "
        f"ask for {fewer}, or see who holds them with `gpuwarden leases`",
        evidence=evidence)


@contextlib.contextmanager
def lease(n: int | None = None, **kwargs: Any) -> Iterator[Grant]:
    """``with lease(2, min_free="20GiB", wait="10m") as grant:`` — :func:`acquire`, released
    on leaving the block (also on an exception)."""
    grant = acquire(n, **kwargs)
    try:
        yield grant
    finally:
        grant.release()
