"""Lease manager: pick GPUs and claim them in one atomic step; wait in line; release.

Protocol (every step on a local filesystem, see docs/leases.md):

1. Read the GPUs (NVML or the simulated host) outside any lock.
2. Under the directory mutex: scan the records (live holders and waiting tickets),
   judge every GPU by NVML state with the processes of its lease holders (and their
   descendants) not counted as foreign, keep off GPUs an earlier waiting request holds
   back, and take the slot locks non-blocking. Either all ``n`` GPUs get their slots,
   or every lock taken in this attempt is let go again.
3. Granted: a holder record (pid, user, host, command, start) is written for display.
   Not granted and waiting: a ticket records the arrival time and the GPUs this request
   could use; later requests keep off those GPUs, so requests are served in arrival
   order and a 4-GPU job is not starved by a stream of 1-GPU jobs.
4. Waiting blocks (in a thread per record, see _watch.py) on the flock of each holder
   or ticket record that stands in our way, so a release or a death wakes us at once,
   with no polling; plus a full attempt every :data:`REFRESH_S` for NVML changes.

A slot is free when its lock can be taken *and* no live holder record (believed only
under the kernel's word, see records.py) names it: in a directory another user can
delete lock files from, the record is what still says the slot is taken. Every wait has
a deadline, the directory mutex's included.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gpuwarden.errors import LeaseDirError, LeaseTimeoutError, LeaseUnavailableError, UsageError
from gpuwarden.inventory.snapshot import GPUSnapshot
from gpuwarden.lease import _fs, _watch
from gpuwarden.lease.records import (
    OwnedRecord,
    Record,
    SlotClaim,
    iter_holders,
    new_record_id,
    scan,
    this_process,
)
from gpuwarden.lease.status import GpuState, OnWait, WaitStatus, describe_request
from gpuwarden.select import Constraints, judge, preference_key
from gpuwarden.units import format_duration, parse_duration, parse_size
from gpuwarden.visibility import CHILD_ORDER_ENV

if TYPE_CHECKING:
    from gpuwarden.inventory import Inventory

REFRESH_S = 1.0  # how often a waiter re-reads NVML and retries in full regardless
MUTEX_PATIENCE_S = 1.0  # a waiting request's longest wait for the mutex in one attempt
SETTLE_S = (0.01, 0.05, 0.2)  # extra attempts after a change: a dying holder's locks go one by one


def _slot_counts_in_use(names: Sequence[str], uuid: str) -> set[int]:
    """Every slots_per_gpu some request has ever used on ``uuid`` (lock files stay)."""
    escaped = _fs.escape_uuid(uuid)
    return {parsed[1] for parsed in map(_fs.parse_slot_name, names)
            if parsed is not None and parsed[0] == escaped}


@dataclass(frozen=True)
class LeaseRequest:
    """A validated request. Build it with :func:`make_request` (or :func:`acquire`)."""

    constraints: Constraints
    slots_per_gpu: int = 1
    slots_each: int = 1
    wait_s: float | None = None
    label: str = ""
    # n="all": every GPU acceptable and free at the attempt (at least 1), decided under the
    # directory mutex; ``constraints.count`` is then 1, the least that serves the request.
    every_usable: bool = False
    up_to: int | None = None  # n="all" only: take at most this many

    @property
    def gpus(self) -> int:
        return self.constraints.count

    def describe(self) -> str:
        return describe_request(self.gpus, self.constraints.min_free_bytes, self.slots_per_gpu,
                                self.slots_each, every_usable=self.every_usable)


def make_request(n: int | Literal["all"] | None = None, *, min_free: str | int | None = None,
                 slots_per_gpu: int = 1, slots_each: int = 1,
                 wait: str | float | None = None, constraints: Constraints | None = None,
                 label: str | None = None, up_to: int | None = None) -> LeaseRequest:
    """Validate the arguments of :func:`acquire`; UsageError (exit 2) names the bad one."""
    base = constraints or Constraints()
    every_usable = n == "all"
    count = 1 if every_usable else base.count if n is None else n
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise UsageError(f"n={count!r}: a lease needs at least 1 GPU", fix="ask for n >= 1, or n='all' for every usable GPU")
    if not isinstance(slots_per_gpu, int) or slots_per_gpu < 1:
        raise UsageError(f"slots_per_gpu={slots_per_gpu!r} must be 1 or more",
                         fix="1 for a whole GPU, K to let K requests share each GPU")
    if not isinstance(slots_each, int) or not 1 <= slots_each <= slots_per_gpu:
        raise UsageError(f"slots_each={slots_each!r} must be between 1 and slots_per_gpu "
                         f"({slots_per_gpu})", fix="slots_each=slots_per_gpu takes whole GPUs")
    min_free_bytes = base.min_free_bytes
    if min_free is not None:
        given = min_free if isinstance(min_free, int) else parse_size(min_free, what="min_free")
        min_free_bytes = max(min_free_bytes, given)
    if up_to is not None and (not every_usable or not isinstance(up_to, int) or up_to < 1):
        raise UsageError(f"up_to={up_to!r}: only with n='all', and at least 1",
                         fix="lease(n='all', up_to=2) takes every usable GPU, at most 2")
    wait_s = None if wait is None else parse_duration(wait, what="wait")
    return LeaseRequest(
        constraints=replace(base, count=count, min_free_bytes=min_free_bytes),
        slots_per_gpu=slots_per_gpu, slots_each=slots_each, wait_s=wait_s, label=label or "",
        every_usable=every_usable, up_to=up_to,
    )


class Grant:
    """GPUs leased to this process. Release with :meth:`release` or by leaving ``with``.

    ``gpus`` are in the order the child will number them (``cuda:0`` first);
    ``visible_devices`` and ``env`` are what a child needs to see exactly them. The
    claim belongs to the process that called :func:`acquire`: children (fork or exec)
    never hold it, and it ends when that process ends, however it ends.
    """

    def __init__(self, gpus: tuple[GPUSnapshot, ...], claims: tuple[SlotClaim, ...],
                 fds: list[int], record: OwnedRecord, lease_dir: Path, request: LeaseRequest,
                 waited_s: float, lock_paths: tuple[Path, ...] = ()) -> None:
        self.gpus = gpus
        self.claims = claims
        self.lease_dir = lease_dir
        self.request = request
        self.waited_s = waited_s
        self.visible_devices = ",".join(g.cuda_id for g in gpus)
        self.env: dict[str, str] = {"CUDA_VISIBLE_DEVICES": self.visible_devices,
                                    **CHILD_ORDER_ENV}
        self._fds = fds
        self._lock_paths = lock_paths
        self._record = record
        # A shared flock on the directory: systemd-tmpfiles does not age a locked directory.
        self._dir_fd = _fs.hold_dir(lease_dir)  # the process's descriptor: never closed here
        self._owner_pid = os.getpid()
        self._lock = threading.Lock()
        _fs.track(self)

    @property
    def holder_id(self) -> str:
        return self._record.record.record_id

    @property
    def held(self) -> bool:
        return bool(self._fds) and os.getpid() == self._owner_pid

    def release(self) -> None:
        """Give the slots back. Idempotent; a no-op (beyond closing) in a forked child."""
        with self._lock:
            if os.getpid() != self._owner_pid:
                self._close_in_child()
                return
            fds, self._fds = self._fds, []
            # Slots first, then the record: a waiter woken by the record's removal finds
            # the slots already free.
            for fd in fds:
                _fs.unlock_close(fd)
            if fds:
                self._record.remove()
            self._dir_fd = -1  # the process's own (hold_dir): not closed here
        _fs.untrack(self)

    def verify(self) -> list[str]:
        """What has happened to this lease's files since it was granted (empty: nothing).

        In a directory `gpuwarden leases init` did not prepare, another user can delete a
        lock file this lease holds and create a new one at its path; the lease directory can
        be deleted (a tmp cleaner). The lease still stands (its live record keeps other
        gpuwarden requests off its slots) but its holder should know, and say so."""
        problems: list[str] = []
        if not self.held:
            return problems
        if not _fs.same_dir(self._dir_fd, self.lease_dir):
            problems.append(f"the lease directory {self.lease_dir} was deleted or replaced")
        for fd, path in zip(self._fds, self._lock_paths, strict=False):
            if not _fs.same_file(fd, path):
                problems.append(f"the lock file {path.name} was deleted or replaced")
        record_fd = self._record.fd
        if record_fd is not None and not _fs.same_file(record_fd, self._record.path):
            problems.append(f"the record {self._record.path.name} was deleted or replaced")
        return problems

    def _close_in_child(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        self._dir_fd = -1
        self._record._close_in_child()

    def __enter__(self) -> Grant:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()

    def __repr__(self) -> str:
        state = "held" if self.held else "released"
        return f"<Grant {self.visible_devices!r} {state} id={self.holder_id}>"


@dataclass
class _Attempt:
    granted: Grant | None = None
    states: tuple[GpuState, ...] = ()
    usable: int = 0  # probe only: GPUs that could be granted now
    watch: tuple[Path, ...] = ()  # records whose end may free what we need
    ahead: int = 0
    mutex_holders: str = ""  # set when the directory mutex could not be had in time


@dataclass
class _Waiter:
    """State a request keeps between attempts."""

    request: LeaseRequest
    directory: Path
    # A directory `gpuwarden leases init` prepared: its lock files are root's, and a user
    # never creates one (it could delete its own file under another user's lock).
    prepared: bool = False
    record_id: str = field(default_factory=new_record_id)
    arrival_ns: int | None = None
    ticket: OwnedRecord | None = None

    def order(self) -> tuple[int, str]:
        return (self.arrival_ns or 0, self.record_id)

    @property
    def lock_owner(self) -> int | None:
        return 0 if self.prepared else None


class _SlotProblem(Exception):
    """A slot file that cannot serve as a lock (a FIFO, a link, missing in a prepared dir)."""


def _holder_owned(gpu: GPUSnapshot, owners: set[int]) -> frozenset[int]:
    """Pids on ``gpu`` that are lease holders of it (or this process) or their descendants."""
    if not gpu.processes or not owners:
        return frozenset()
    import psutil

    out = set()
    for proc in gpu.processes:
        if proc.pid in owners:
            out.add(proc.pid)
            continue
        try:
            if any(parent.pid in owners for parent in psutil.Process(proc.pid).parents()):
                out.add(proc.pid)
        except (psutil.Error, OSError):
            pass  # gone, or in another PID namespace: judged as foreign, the safe side
    return frozenset(out)


def _attempt(waiter: _Waiter, gpus: Sequence[GPUSnapshot], *, will_wait: bool,
             probe: bool = False, mutex_timeout_s: float = _fs.MUTEX_TIMEOUT_S) -> _Attempt:
    """One try under the directory mutex. All-or-nothing: never keeps a partial claim.

    ``probe``: take nothing, only count the GPUs this request could be granted now.
    Raises MutexBusyError when the mutex stays held ``mutex_timeout_s``."""
    req = waiter.request
    directory = waiter.directory
    with _fs.dir_mutex(directory, mutex_timeout_s, owner=waiter.lock_owner,
                       create=not waiter.prepared):
        if waiter.arrival_ns is None:
            waiter.arrival_ns = time.monotonic_ns()
        records, _corrupt, names = scan(directory)
        holders = list(iter_holders(records))
        earlier = sorted((r for r in records if r.kind == "ticket"
                          and r.record_id != waiter.record_id
                          and (r.arrival_ns, r.record_id) < waiter.order()),
                         key=lambda r: (r.arrival_ns, r.record_id))
        holders_of: dict[str, list[Record]] = {}
        claimed: dict[tuple[str, int], set[int]] = {}
        for h in holders:
            for c in h.claims:
                holders_of.setdefault(c.uuid, []).append(h)
                claimed.setdefault((c.uuid, c.slots_per_gpu), set()).update(c.slots)
        # Per GPU: the earliest request holding it back (named in the reason) and the
        # latest one before us (watched: only its end can change our turn, so one release
        # wakes one waiter rather than the whole line).
        reserved_by: dict[str, Record] = {}
        next_ahead: dict[str, Record] = {}
        stopped: dict[int, bool] = {}
        for t in earlier:
            for uuid in t.eligible:
                next_ahead[uuid] = t
                # A stopped waiter (SIGSTOP, Ctrl-Z) could not take a GPU if one were free: it
                # holds nothing back until it runs again (its ticket keeps its arrival time).
                # Asked of /proc only for the ticket that would hold the GPU back.
                if uuid not in reserved_by and not stopped.setdefault(
                        t.pid, _fs.is_stopped(t.pid)):
                    reserved_by[uuid] = t

        states: dict[str, GpuState] = {}
        eligible: list[GPUSnapshot] = []
        me = {os.getpid(), *req.constraints.own_pids}
        for gpu in gpus:
            owners = me | {h.pid for h in holders_of.get(gpu.uuid, ())}
            verdict = judge(gpu, replace(req.constraints,
                                         own_pids=_holder_owned(gpu, owners) | frozenset(me)))
            if verdict.accepted:
                eligible.append(gpu)
            else:
                states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label,
                                            verdict.reason, "refused")
        eligible.sort(key=preference_key)

        chosen: list[tuple[GPUSnapshot, list[tuple[int, int]]]] = []
        watch: list[Path] = []
        for gpu in eligible:
            if len(chosen) == (req.up_to if req.every_usable else req.gpus):
                states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label,
                                            "free (not needed)", "free")
                continue
            blocked = _blocked_by(gpu, req, reserved_by, holders_of, names, waiter)
            if blocked is not None:
                reason, kind, blockers = blocked
                if kind == "queued":
                    blockers = [next_ahead[gpu.uuid]]
                watch.extend(b.path for b in blockers if b.path)
                states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label, reason, kind,
                                            tuple(b.record_id for b in blockers))
                continue
            try:
                taken = _take_slots(gpu, req, waiter,
                                    claimed.get((gpu.uuid, req.slots_per_gpu), set()))
            except _SlotProblem as problem:
                states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label, str(problem),
                                            "refused")
                continue
            if taken is None:
                holders_here = holders_of.get(gpu.uuid, [])
                watch.extend(h.path for h in holders_here if h.path)
                states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label,
                                            _leased_reason(gpu, req, holders_here), "leased",
                                            tuple(h.record_id for h in holders_here))
                continue
            chosen.append((gpu, taken))
            states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label, "free", "free")

        ordered_states = tuple(states[g.uuid] for g in gpus)
        if probe:
            for _gpu, taken in chosen:
                for _slot, fd in taken:
                    _fs.unlock_close(fd)
            return _Attempt(states=ordered_states, usable=len(chosen))
        if chosen and (req.every_usable or len(chosen) == req.gpus):
            grant = _grant(waiter, chosen)
            return _Attempt(granted=grant, states=ordered_states)
        for _gpu, taken in chosen:
            for _slot, fd in taken:
                _fs.unlock_close(fd)
        # Hold back GPUs from later requests only when leases alone stand in our way:
        # a request the hardware state cannot meet keeps nothing from anyone.
        eligible_ids = tuple(g.uuid for g in eligible) if len(eligible) >= req.gpus else ()
        mine = {g.uuid for g in eligible}
        ahead = sum(1 for t in earlier if mine.intersection(t.eligible))
        if will_wait:
            _write_ticket(waiter, eligible_ids)
        return _Attempt(states=ordered_states, watch=tuple(watch), ahead=ahead)


def _blocked_by(gpu: GPUSnapshot, req: LeaseRequest, reserved_by: Mapping[str, Record],
                holders_of: Mapping[str, list[Record]], names: Sequence[str], waiter: _Waiter
                ) -> tuple[str, str, list[Record]] | None:
    """Why ``gpu`` cannot be leased to ``req`` for a reason other than its own slots."""
    ticket = reserved_by.get(gpu.uuid)
    if ticket is not None:
        waited = format_duration(max(0.0, time.time() - ticket.started_at))
        return (f"held back for an earlier request: {ticket.who()} waiting for "
                f"{ticket.gpus_wanted} GPU(s) for {waited}", "queued", [ticket])
    recorded_ks = {c.slots_per_gpu for h in holders_of.get(gpu.uuid, []) for c in h.claims
                   if c.uuid == gpu.uuid}
    for other_k in sorted((_slot_counts_in_use(names, gpu.uuid) | recorded_ks)
                          - {req.slots_per_gpu}):
        holders = [h for h in holders_of.get(gpu.uuid, [])
                   if any(c.uuid == gpu.uuid and c.slots_per_gpu == other_k for c in h.claims)]
        if holders or _any_slot_held(waiter, gpu.uuid, other_k):
            who = "; ".join(h.who() for h in holders) or "a process that left no record"
            return (f"leased in {other_k} slot(s) per GPU by {who}; this request uses "
                    f"{req.slots_per_gpu}, so it waits until the GPU has no lease",
                    "leased", holders)
    return None


def _any_slot_held(waiter: _Waiter, uuid: str, slots_per_gpu: int) -> bool:
    for slot in range(slots_per_gpu):
        path = waiter.directory / _fs.slot_file_name(uuid, slots_per_gpu, slot)
        try:
            fd = _fs.open_lock_file(path, create=False, owner=waiter.lock_owner)
        except OSError:
            continue  # missing, or not a lock file (a FIFO...): no lease was made with it
        try:
            if not _fs.try_lock(fd):
                return True
        finally:
            _fs.unlock_close(fd)
    return False


def _take_slots(gpu: GPUSnapshot, req: LeaseRequest, waiter: _Waiter, claimed: set[int]
                ) -> list[tuple[int, int]] | None:
    """``slots_each`` free slots of ``gpu`` (slot number, locked fd), or None.

    A slot named by a live holder record is not free even when its lock can be taken: the
    holder's lock file may have been deleted and replaced (an unprepared directory).
    Raises _SlotProblem when no slot is held and some slot file cannot be a lock."""
    taken: list[tuple[int, int]] = []
    problem = None
    for slot in range(req.slots_per_gpu):
        if slot in claimed:
            continue
        path = waiter.directory / _fs.slot_file_name(gpu.uuid, req.slots_per_gpu, slot)
        try:
            fd = _fs.open_lock_file(path, create=not waiter.prepared, owner=waiter.lock_owner)
        except _fs.UnsafeFileError as exc:
            problem = f"its slot file {path.name} {exc.problem}: remove it (as root)"
            continue
        except FileNotFoundError:
            problem = (f"{waiter.directory} has no lock file for {req.slots_per_gpu} slot(s) "
                       f"per GPU on it: an admin runs `gpuwarden leases init --dir "
                       f"{waiter.directory} --slots-per-gpu {req.slots_per_gpu}`")
            continue
        # same_file: a lock on a file someone deleted and replaced would guard nothing.
        if _fs.try_lock(fd) and _fs.same_file(fd, path):
            taken.append((slot, fd))
            if len(taken) == req.slots_each:
                return taken
        else:
            _fs.unlock_close(fd)
    for _slot, fd in taken:
        _fs.unlock_close(fd)
    if problem is not None and not claimed:
        raise _SlotProblem(problem)
    return None


def _leased_reason(gpu: GPUSnapshot, req: LeaseRequest, holders: Sequence[Record]) -> str:
    now = time.time()
    if not holders:
        return "leased by a process that left no record (it may be starting)"
    # Whether a holder is stopped (Ctrl-Z) is asked of /proc only here, for a blocked GPU.
    parts = [f"{replace(h, stopped=_fs.is_stopped(h.pid, max_age_s=0.5)).who()} for "
             f"{format_duration(max(0.0, now - h.started_at))}" for h in holders]
    if req.slots_per_gpu > 1:
        used = sum(len(c.slots) for h in holders for c in h.claims if c.uuid == gpu.uuid)
        return f"{used}/{req.slots_per_gpu} slots leased by " + "; ".join(parts)
    return "leased by " + "; ".join(parts)


def _grant(waiter: _Waiter, chosen: list[tuple[GPUSnapshot, list[tuple[int, int]]]]) -> Grant:
    req = waiter.request
    # CUDA order for the child: PCI order, as CUDA_DEVICE_ORDER=PCI_BUS_ID numbers them.
    chosen = sorted(chosen, key=lambda item: (item[0].index, item[0].uuid))
    claims = tuple(SlotClaim(uuid=g.uuid, index=g.index, slots_per_gpu=req.slots_per_gpu,
                             slots=tuple(s for s, _fd in taken)) for g, taken in chosen)
    fds = [fd for _g, taken in chosen for _s, fd in taken]
    lock_paths = tuple(waiter.directory / _fs.slot_file_name(g.uuid, req.slots_per_gpu, s)
                       for g, taken in chosen for s, _fd in taken)
    try:
        record = OwnedRecord(waiter.directory, this_process(
            "holder", waiter.record_id, req.label, claims=claims))
    except BaseException:
        for fd in fds:
            _fs.unlock_close(fd)
        raise
    waited = 0.0
    if waiter.arrival_ns is not None:
        waited = (time.monotonic_ns() - waiter.arrival_ns) / 1e9
    if waiter.ticket is not None:
        waiter.ticket.remove()
        waiter.ticket = None
    return Grant(tuple(g for g, _t in chosen), claims, fds, record, waiter.directory, req, waited,
                 lock_paths)


def _write_ticket(waiter: _Waiter, eligible: tuple[str, ...]) -> None:
    req = waiter.request
    if waiter.ticket is not None and waiter.ticket.record.eligible == eligible:
        return
    record = this_process(
        "ticket", waiter.record_id, req.label, arrival_ns=waiter.arrival_ns or 0,
        gpus_wanted=req.gpus, slots_per_gpu=req.slots_per_gpu, slots_each=req.slots_each,
        eligible=eligible)
    if waiter.ticket is None:
        waiter.ticket = OwnedRecord(waiter.directory, record)
    else:
        # Keep the first start time: `gpuwarden leases` shows how long it has waited.
        waiter.ticket.write(replace(record, started_at=waiter.ticket.record.started_at))


def _read_gpus(env: Mapping[str, str] | None, inventory: Inventory | None = None
               ) -> tuple[GPUSnapshot, ...]:
    from gpuwarden.inventory import Inventory

    _host, gpus = (inventory or Inventory.from_env(env)).read_visible()
    return gpus


def acquire(n: int | Literal["all"] | None = None, *, min_free: str | int | None = None, slots_per_gpu: int = 1,
            slots_each: int = 1, wait: str | float | None = None,
            constraints: Constraints | None = None, label: str | None = None,
            on_wait: OnWait | None = None, lease_dir: str | Path | None = None,
            env: Mapping[str, str] | None = None,
            visible: Sequence[GPUSnapshot] | None = None, up_to: int | None = None,
            inventory: Inventory | None = None) -> Grant:
    """Lease ``n`` GPUs (``slots_each`` of ``slots_per_gpu`` slots on each) and return the Grant.

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
                       up_to=up_to)
    from gpuwarden.lease import jobstep  # started by a lease holder: its GPUs (jobstep.py)

    if (step := jobstep.serve(req, lease_dir, env, visible, inventory)) is not None:
        return step
    waiter = _new_waiter(req, lease_dir, env)
    try:
        return _acquire(waiter, env, on_wait, visible, inventory)
    finally:
        if waiter.ticket is not None:
            waiter.ticket.remove()


def usable_count(*, min_free: str | int | None = None, slots_per_gpu: int = 1,
                 slots_each: int = 1, constraints: Constraints | None = None,
                 lease_dir: str | Path | None = None, env: Mapping[str, str] | None = None,
                 visible: Sequence[GPUSnapshot] | None = None,
                 inventory: Inventory | None = None) -> int:
    """How many GPUs ``acquire("all", ...)`` with these arguments would be granted now.

    The same judgement as an attempt, under the same lock, but nothing is taken: a
    prediction (another process may lease a GPU the next moment). Raises as :func:`acquire`.
    """
    req = make_request("all", min_free=min_free, slots_per_gpu=slots_per_gpu,
                       slots_each=slots_each, constraints=constraints)
    waiter = _new_waiter(req, lease_dir, env)
    gpus = tuple(visible) if visible is not None else _read_gpus(env, inventory)
    attempt = _attempt_mapped(waiter, gpus, will_wait=False, probe=True)
    if attempt.mutex_holders:
        raise _not_served(req, _status(req, attempt, 0.0, 0.0), 0.0)
    return attempt.usable


def _new_waiter(req: LeaseRequest, lease_dir: str | Path | None,
                env: Mapping[str, str] | None) -> _Waiter:
    directory, prepared = _fs.check_dir(Path(lease_dir) if lease_dir else _fs.lease_dir_path(
        dict(env) if env is not None else None))
    return _Waiter(req, directory, prepared=prepared)


def _acquire(waiter: _Waiter, env: Mapping[str, str] | None, on_wait: OnWait | None,
             visible: Sequence[GPUSnapshot] | None, inventory: Inventory | None = None
             ) -> Grant:
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
    woken = threading.Event()
    while True:
        will_wait = time.monotonic() - start < wait_s
        # The mutex is held for a fraction of a millisecond per attempt; waiting longer for it
        # than the request's own deadline would let a hostile holder hang us.
        mutex_timeout_s = _fs.MUTEX_TIMEOUT_S if not wait_s else \
            min(MUTEX_PATIENCE_S, max(0.05, start + wait_s - time.monotonic()))
        attempt = _attempt_mapped(waiter, gpus, will_wait=will_wait,
                                  mutex_timeout_s=mutex_timeout_s)
        if attempt.granted is not None:
            return attempt.granted
        waited = time.monotonic() - start
        status = _status(req, attempt, waited, wait_s)
        if not will_wait:
            raise _not_served(req, status, wait_s)
        if on_wait is not None:
            on_wait(status)
        # Sleep until a change: a blocking holder or ticket ending (the watch threads see
        # it the moment the kernel drops its lock), a settle retry, the periodic
        # refresh, or the deadline.
        wake_at = min(time.monotonic() + REFRESH_S, start + wait_s, *(settle[:1] or [math.inf]))
        settle = settle[1:]
        woken.clear()
        _watch.watch(attempt.watch, woken)
        changed = woken.wait(max(0.0, wake_at - time.monotonic()))
        _watch.unwatch(woken)
        if changed:
            base = time.monotonic()
            settle = [base + s for s in SETTLE_S]
        # A holder that ended may leave NVML's process list a moment later: re-read then.
        if changed or time.monotonic() - read_at >= REFRESH_S:
            gpus, read_at = _read_gpus(env, inventory), time.monotonic()


def _status(req: LeaseRequest, attempt: _Attempt, waited: float, wait_s: float) -> WaitStatus:
    return WaitStatus(request=req.describe(), waited_s=waited, gpus=attempt.states,
                      ahead=attempt.ahead,
                      deadline_s=None if math.isinf(wait_s) else wait_s - waited,
                      directory_blocker=attempt.mutex_holders)


def _attempt_mapped(waiter: _Waiter, gpus: Sequence[GPUSnapshot], *, will_wait: bool,
                    probe: bool = False, mutex_timeout_s: float = _fs.MUTEX_TIMEOUT_S
                    ) -> _Attempt:
    try:
        return _attempt(waiter, gpus, will_wait=will_wait, probe=probe,
                        mutex_timeout_s=mutex_timeout_s)
    except _fs.MutexBusyError as busy:
        # Nothing could be judged: say who holds the directory, GPU by GPU as "unknown".
        blocker = (f"the lease directory's mutex {busy.path} stayed held for "
                   f"{format_duration(busy.waited_s)} (an attempt holds it for under a "
                   f"millisecond) by {busy.holders}")
        return _Attempt(states=tuple(GpuState(g.index, g.uuid, g.label, "not judged", "unknown")
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
    # The directory passed prepare_dir; this is a full disk, a read-only remount, a
    # lock file another user made unreadable, or a filesystem without flock.
    return LeaseDirError(
        f"lease directory {str(directory)!r} cannot be used: "
        f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else ""),
        fix=f"check the directory and its files, or set {_fs.LEASE_DIR_ENV} to a local "
        "directory",
    )


def _not_served(req: LeaseRequest, status: WaitStatus, wait_s: float) -> Exception:
    evidence = [g.line() for g in status.gpus]
    if wait_s > 0:
        return LeaseTimeoutError(
            f"waited {format_duration(status.waited_s)} for {req.describe()} and was not served",
            why=status.blockers(),
            fix="wait longer (--wait), ask for fewer GPUs or slots, or see who holds them "
            "with `gpuwarden leases`",
            evidence=evidence)
    return LeaseUnavailableError(
        f"{req.describe()} cannot be leased now",
        why=status.blockers(),
        fix="wait in line for them (gpuwarden run --wait 10m, or lease(..., wait='10m')), "
        "ask for fewer GPUs or slots, or see who holds them with `gpuwarden leases`",
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
