"""Lease manager: pick GPUs and claim them in one atomic step; wait in line; release.

Protocol (every step on a local filesystem, see docs/leases.md):

1. Read the GPUs (NVML or the simulated host) and the records (bounded, records.py)
   outside the directory mutex.
2. Under the mutex (a POSIX write lock, held for about a millisecond): read the records
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
import functools
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gpuwarden.errors import LeaseDirError, LeaseTimeoutError, LeaseUnavailableError, UsageError
from gpuwarden.inventory.snapshot import GPUSnapshot
from gpuwarden.lease import _fs, _locks
from gpuwarden.lease._watch import DirWatch
from gpuwarden.lease.records import (
    OwnedRecord,
    Record,
    Scanner,
    SlotClaim,
    entries_seen,
    this_process,
)
from gpuwarden.lease.status import GpuState, OnWait, WaitStatus, describe_request
from gpuwarden.select import Constraints, Refusal, judge, preference_key
from gpuwarden.units import format_duration, parse_duration, parse_size
from gpuwarden.visibility import CHILD_ORDER_ENV

if TYPE_CHECKING:
    from gpuwarden.inventory import Inventory

REFRESH_S = 1.0  # how often a waiter re-reads NVML and retries in full regardless
MUTEX_PATIENCE_S = 1.0  # a waiting request's longest wait for the mutex in one attempt
SETTLE_S = (0.01, 0.05, 0.2)  # extra attempts after a change: a dying holder's locks go one by one
MIN_RETRY_S = 0.005  # attempts woken by an event flood are at least this far apart
FLOOD_WAKES, FLOOD_WINDOW_S = 10, 0.05  # a flood: this many wakes within this window
# An earlier request that could take free GPUs and has not for this long is not waiting like
# a gpuwarden request (which is woken within milliseconds): it holds nothing back.
IDLE_TURN_S = 3.0
# The most slots per GPU a request may ask for where no prepared directory sets the limit.
MAX_SLOTS_PER_GPU = 1024
# A directory this small (as its last scan saw it) is read once per attempt, under the mutex;
# a larger one is read outside it first, so that the read under it finds everything parsed.
WARM_SCAN_NAMES = 64


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
        raise UsageError(f"n={count!r}: a lease needs at least 1 GPU",
                         fix="ask for n >= 1, or n='all' for every usable GPU")
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


@dataclass(frozen=True)
class _Held:
    """One slot this process holds: a byte of a GPU's lock file."""

    lock_file: _locks._Inode
    byte: int
    path: Path


class Grant:
    """GPUs leased to this process. Release with :meth:`release` or by leaving ``with``.

    ``gpus`` are in the order the child will number them (``cuda:0`` first);
    ``visible_devices`` and ``env`` are what a child needs to see exactly them. The
    claim belongs to the process that called :func:`acquire`: children (fork or exec)
    never hold it, and it ends when that process ends, however it ends.
    """

    def __init__(self, gpus: tuple[GPUSnapshot, ...], claims: tuple[SlotClaim, ...],
                 held: list[_Held], record: OwnedRecord, lease_dir: Path, request: LeaseRequest,
                 waited_s: float) -> None:
        self.gpus = gpus
        self.claims = claims
        self.lease_dir = lease_dir
        self.request = request
        self.waited_s = waited_s
        self.visible_devices = ",".join(g.cuda_id for g in gpus)
        self.env: dict[str, str] = {"CUDA_VISIBLE_DEVICES": self.visible_devices,
                                    **CHILD_ORDER_ENV}
        self._held = held
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
        return bool(self._held) and os.getpid() == self._owner_pid

    def release(self) -> None:
        """Give the slots back. Idempotent; a no-op (beyond forgetting) in a forked child."""
        with self._lock:
            if os.getpid() != self._owner_pid:
                self._close_in_child()
                return
            held, self._held = self._held, []
            # Slots first, then the record: a waiter woken by the record's deletion finds
            # the slots already free.
            for h in held:
                _locks.give_back(h.lock_file, h.byte)
            if held:
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
        for path in dict.fromkeys(h.path for h in self._held if not _locks.names_inode(
                h.lock_file, h.path)):
            problems.append(f"the lock file {path.name} was deleted or replaced")
        record_fd = self._record.fd
        if record_fd is not None and not _fs.same_file(record_fd, self._record.path):
            problems.append(f"the record {self._record.path.name} was deleted or replaced")
        return problems

    def _close_in_child(self) -> None:
        # The child holds none of the parent's POSIX locks: forget them, never unlock.
        self._held = []
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
    watch: frozenset[str] = frozenset()  # names whose end may free what we need
    ahead: int = 0
    mutex_holders: str = ""  # set when the directory mutex could not be had in time


@dataclass
class _Waiter:
    """State a request keeps between attempts."""

    request: LeaseRequest
    directory: Path
    # A directory `gpuwarden leases init` prepared: its lock files are root's, and a user
    # never creates one (it could delete its own file under another user's lock).
    config: _fs.PreparedConfig | None = None
    # This user's own directory (nobody else can write in it): a planted name left from
    # before is replaced rather than refused.
    private: bool = False
    scanner: Scanner | None = None
    ticket: OwnedRecord | None = None
    started_ns: int = field(default_factory=time.time_ns)
    # Earlier tickets seen able to take free GPUs, and since when (see IDLE_TURN_S).
    turn_since: dict[tuple[int, int, str], float] = field(default_factory=dict)

    @property
    def prepared(self) -> bool:
        return self.config is not None

    @property
    def recheck(self) -> bool:
        """Whether lock files may be replaced under us (a shared directory not prepared):
        then every use checks the path still names the file locked."""
        return not (self.prepared or self.private)

    @property
    def lock_owner(self) -> int | None:
        """Whose lock files alone are used: root's in a prepared directory, ours in our own."""
        if self.prepared:
            return 0
        return os.geteuid() if self.private else None


class _SlotProblem(Exception):
    """A GPU lock file that cannot serve (a FIFO, a link, missing in a prepared dir)."""


def _holder_owned(gpu: GPUSnapshot, owners: AbstractSet[int]) -> frozenset[int]:
    """Pids on ``gpu`` that are lease holders of it (or this process) or their descendants."""
    if not gpu.processes or not owners:
        return frozenset()
    import psutil

    out = set()
    for proc in gpu.processes[:256]:
        if proc.pid in owners:
            out.add(proc.pid)
            continue
        try:
            if any(parent.pid in owners for parent in psutil.Process(proc.pid).parents()):
                out.add(proc.pid)
        except (psutil.Error, OSError):
            pass  # gone, or in another PID namespace: judged as foreign, the safe side
    return frozenset(out)


@functools.lru_cache(maxsize=64)
def _mutex_path(directory: Path) -> Path:
    return directory / _fs.MUTEX_NAME


@functools.lru_cache(maxsize=1024)
def _gpu_path(directory: Path, uuid: str) -> Path:
    return directory / _fs.gpu_file_name(uuid)


def _lock_file(waiter: _Waiter, uuid: str) -> _locks._Inode:
    """This process's handle of ``uuid``'s lock file. Raises _SlotProblem when it cannot be
    one (a FIFO, a link, another user's file in a prepared dir, missing there)."""
    path = _gpu_path(waiter.directory, uuid)
    config = waiter.config
    if config is not None and uuid not in config.gpus:
        raise _SlotProblem(
            f"{waiter.directory} has no lock file for it (prepared before this GPU appeared): "
            f"an admin runs `gpuwarden leases init --dir {waiter.directory}` again")
    try:
        return _locks.open_lock_file(path, create=not waiter.prepared, owner=waiter.lock_owner,
                                     replace_planted=waiter.private, recheck=waiter.recheck)
    except _fs.UnsafeFileError as exc:
        raise _SlotProblem(f"its lock file {path.name} {exc.problem}: remove it (as root)"
                           ) from None
    except FileNotFoundError:
        raise _SlotProblem(f"{waiter.directory} has no lock file {path.name}: an admin runs "
                           f"`gpuwarden leases init --dir {waiter.directory}` again") from None
    except PermissionError:
        raise _SlotProblem(
            f"its lock file {path.name} is not writable for {_fs.user_name(os.geteuid())} "
            f"(a lock needs a writable descriptor): an admin runs `gpuwarden leases init --dir "
            f"{waiter.directory}` again") from None


@dataclass
class _GpuLocks:
    """One GPU's locks as the kernel and the records tell them, in one attempt."""

    gpu: GPUSnapshot
    lock_file: _locks._Inode | None = None
    problem: str = ""
    holders: list[Record] = field(default_factory=list)  # live holder records naming it
    _idle: bool | None = None

    def claimed(self, slots_per_gpu: int) -> set[int]:
        return {s for h in self.holders for c in h.claims
                if c.uuid == self.gpu.uuid and c.slots_per_gpu == slots_per_gpu for s in c.slots}

    def idle(self) -> bool:
        """No slot of any split held by anyone (records or kernel): any request could use it."""
        if self._idle is None:
            f = self.lock_file
            self._idle = not self.holders and f is not None and \
                _locks.test_lock(f.fd, 0, 0) is None and not _locks.held_here(f, 0, 0)
        return self._idle


def _attempt(waiter: _Waiter, gpus: Sequence[GPUSnapshot], *, will_wait: bool,
             probe: bool = False, mutex_timeout_s: float = _fs.MUTEX_TIMEOUT_S) -> _Attempt:
    """One try under the directory mutex. All-or-nothing: never keeps a partial claim.

    ``probe``: take nothing, only count the GPUs this request could be granted now.
    Raises MutexBusyError when the mutex stays held ``mutex_timeout_s``."""
    req = waiter.request
    scanner = waiter.scanner
    assert scanner is not None
    if entries_seen(waiter.directory) > WARM_SCAN_NAMES:
        scanner.scan()  # outside the mutex: parses what is new, so the scan below is quick
    with _locks.dir_mutex(_mutex_path(waiter.directory), mutex_timeout_s,
                          owner=waiter.lock_owner, create=not waiter.prepared,
                          replace_planted=waiter.private, recheck=waiter.recheck):
        view = scanner.scan(cleanup=True)
        mine = waiter.ticket.record if waiter.ticket is not None else None
        earlier = [t for t in view.tickets() if mine is None or t.order() < mine.order()]
        locks: dict[str, _GpuLocks] = {g.uuid: _GpuLocks(g) for g in gpus}
        for holder in view.holders():
            for c in holder.claims:
                if c.uuid in locks and holder not in locks[c.uuid].holders:
                    locks[c.uuid].holders.append(holder)
        for gl in locks.values():
            try:
                gl.lock_file = _lock_file(waiter, gl.gpu.uuid)
            except _SlotProblem as problem:
                gl.problem = str(problem)

        me = frozenset({os.getpid(), *req.constraints.own_pids})
        # Kernel pids only: an older gpuwarden's record names a pid nobody vouches for.
        owned = {g.uuid: _holder_owned(g, me | {h.pid for h in locks[g.uuid].holders
                                                if not h.legacy}
                                       | {t.pid for t in earlier}) | me
                 for g in gpus}
        mine_only = replace(req.constraints, own_pids=me)  # a GPU without a holder's process
        states: dict[str, GpuState] = {}
        eligible: list[GPUSnapshot] = []
        for gpu in gpus:
            constraints = mine_only if owned[gpu.uuid] == me else \
                replace(req.constraints, own_pids=owned[gpu.uuid])
            verdict = judge(gpu, constraints)
            if verdict.accepted and locks[gpu.uuid].problem:
                states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label,
                                            locks[gpu.uuid].problem, "refused")
            elif verdict.accepted:
                eligible.append(gpu)
            else:
                states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label,
                                            verdict.reason, "refused")
        eligible.sort(key=preference_key)
        limit = _slot_limit(waiter)
        if req.slots_per_gpu > limit:
            for gpu in eligible:
                states[gpu.uuid] = GpuState(
                    gpu.index, gpu.uuid, gpu.label,
                    f"{waiter.directory} allows at most {limit} slots per GPU: an admin runs "
                    f"`gpuwarden leases init --dir {waiter.directory} --slots-per-gpu "
                    f"{req.slots_per_gpu}`", "refused")
            eligible = []

        reserved_by, next_ahead = _line(waiter, gpus, earlier, locks, owned)
        chosen: list[tuple[GPUSnapshot, list[_Held]]] = []
        watch: set[str] = set()
        try:
            for gpu in eligible:
                if len(chosen) == (req.up_to if req.every_usable else req.gpus):
                    states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label,
                                                "free (not needed)", "free")
                    continue
                gl = locks[gpu.uuid]
                assert gl.lock_file is not None
                watch.add(_fs.gpu_file_name(gpu.uuid))
                ticket = reserved_by.get(gpu.uuid)
                if ticket is not None:
                    just_ahead = next_ahead[gpu.uuid]
                    if just_ahead.path is not None:
                        watch.add(just_ahead.path.name)
                    waited = format_duration(max(0.0, time.time() - ticket.started_at))
                    states[gpu.uuid] = GpuState(
                        gpu.index, gpu.uuid, gpu.label,
                        f"held back for an earlier request: {ticket.who()} waiting for "
                        f"{ticket.gpus_wanted} GPU(s) for {waited}", "queued", (ticket.record_id,))
                    continue
                watch.update(h.path.name for h in gl.holders if h.path is not None)
                split = _other_split(gl, req.slots_per_gpu)
                if split is not None:
                    states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label, split, "leased",
                                                tuple(h.record_id for h in gl.holders))
                    continue
                taken = _take_slots(gl, req, waiter)
                if taken is None:
                    states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label,
                                                _leased_reason(gl, req), "leased",
                                                tuple(h.record_id for h in gl.holders))
                    continue
                chosen.append((gpu, taken))
                states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label, "free", "free")

            ordered_states = tuple(states[g.uuid] for g in gpus)
            if probe:
                return _Attempt(states=ordered_states, usable=len(chosen))
            if chosen and (req.every_usable or len(chosen) == req.gpus):
                grant = _grant(waiter, chosen)
                chosen = []  # the grant holds them now
                return _Attempt(granted=grant, states=ordered_states)
        finally:
            for _gpu, taken in chosen:
                for slot in taken:
                    _locks.give_back(slot.lock_file, slot.byte)
        wanted = {g.uuid for g in eligible}
        ahead = sum(1 for t in earlier if wanted.intersection(t.uuids))
        if will_wait and waiter.ticket is None:
            _write_ticket(waiter, gpus, earlier)
        return _Attempt(states=ordered_states, watch=frozenset(watch), ahead=ahead)


def _slot_limit(waiter: _Waiter) -> int:
    """K from the prepared directory's own configuration, never from file names."""
    if waiter.config is not None:
        return waiter.config.max_slots_per_gpu
    return MAX_SLOTS_PER_GPU


def _line(waiter: _Waiter, gpus: Sequence[GPUSnapshot], earlier: list[Record],
          locks: Mapping[str, _GpuLocks], owned: Mapping[str, frozenset[int]]
          ) -> tuple[dict[str, Record], dict[str, Record]]:
    """Per GPU: the earliest waiting request that holds it back (named in the reason), and the
    latest one before us (watched: only its end can change our turn, so one release wakes
    one waiter rather than the whole line).

    Which GPUs an earlier request could take is judged here, from GPU state and its request,
    never read from its ticket. It holds them back only when leases alone stand in its way
    (the hardware could meet it), while it is not stopped (Ctrl-Z), and while it is not
    failing to take free GPUs for longer than :data:`IDLE_TURN_S`."""
    reserved_by: dict[str, Record] = {}
    next_ahead: dict[str, Record] = {}
    now = time.monotonic()
    seen_turns: set[tuple[int, int, str]] = set()
    for t in earlier:
        wanted = set(t.uuids)
        candidates = [g for g in gpus if g.uuid in wanted]
        acceptable = [g for g in candidates if judge(g, Constraints(
            count=max(1, t.gpus_wanted), min_free_bytes=t.min_free_bytes,
            max_util_pct=t.max_util_pct, allow_shared=t.allow_shared,
            own_pids=owned[g.uuid] | {t.pid})).accepted]
        if len(acceptable) < max(1, t.gpus_wanted):
            continue  # the hardware state cannot meet it: it keeps nothing from anyone
        if _fs.is_stopped(t.pid):
            continue  # it could not take a GPU now; it keeps its place for when it runs again
        free_now = [g for g in acceptable if g.uuid not in reserved_by and locks[g.uuid].idle()]
        if len(free_now) >= max(1, t.gpus_wanted):
            key = t.order()
            seen_turns.add(key)
            since = waiter.turn_since.setdefault(key, now)
            if now - since > IDLE_TURN_S:
                continue  # its turn came and it does not take it: not a live request
        for g in acceptable:
            reserved_by.setdefault(g.uuid, t)
            next_ahead[g.uuid] = t
    for key in list(waiter.turn_since):
        if key not in seen_turns:
            del waiter.turn_since[key]
    return reserved_by, next_ahead


def _other_split(gl: _GpuLocks, slots_per_gpu: int) -> str | None:
    """Why the GPU cannot be split in ``slots_per_gpu`` now: a lease with another K on it."""
    others = [h for h in gl.holders
              if any(c.uuid == gl.gpu.uuid and c.slots_per_gpu != slots_per_gpu
                     for c in h.claims)]
    f = gl.lock_file
    assert f is not None
    low = _locks.slot_offset(slots_per_gpu, 0)
    owner = None
    # Every other split's bytes: below ours, and from the end of ours on (to infinity).
    for start, length in ((0, low), (low + slots_per_gpu, 0)):
        if owner is None and (length or start):
            owner = _locks.test_lock(f.fd, start, length)
            if owner is None and _locks.held_here(f, start, length):
                owner = _locks.LockOwner(os.getpid(), True, start, length)
    if not others and owner is None:
        return None
    if others:
        who = "; ".join(h.who() for h in others)
        k = next(c.slots_per_gpu for h in others for c in h.claims
                 if c.uuid == gl.gpu.uuid and c.slots_per_gpu != slots_per_gpu)
    else:
        assert owner is not None
        who = _fs.describe_owner(owner) + " (no record)"
        k = _locks.slot_of_offset(owner.start)[0]
    return (f"leased in {k} slot(s) per GPU by {who}; this request uses {slots_per_gpu}, so "
            "it waits until the GPU has no lease")


def _take_slots(gl: _GpuLocks, req: LeaseRequest, waiter: _Waiter) -> list[_Held] | None:
    """``slots_each`` free slots of the GPU, or None. A slot named by a live holder record is
    not free even when its byte can be locked: the holder's lock file may have been deleted
    and replaced (an unprepared directory)."""
    f = gl.lock_file
    assert f is not None
    path = _gpu_path(waiter.directory, gl.gpu.uuid)
    claimed = gl.claimed(req.slots_per_gpu)
    taken: list[_Held] = []
    for slot in range(req.slots_per_gpu):
        if slot in claimed:
            continue
        byte = _locks.slot_offset(req.slots_per_gpu, slot)
        if _locks.try_take(f, byte):
            taken.append(_Held(f, byte, path))
            if len(taken) == req.slots_each:
                # A lock on a file someone deleted and replaced would guard nothing.
                if not waiter.recheck or _locks.names_inode(f, path):
                    return taken
                break
    for h in taken:
        _locks.give_back(h.lock_file, h.byte)
    return None


def _leased_reason(gl: _GpuLocks, req: LeaseRequest) -> str:
    now = time.time()
    parts = []
    # Whether a holder is stopped (Ctrl-Z) is asked of /proc only here, for a blocked GPU.
    for h in gl.holders:
        shown = replace(h, stopped=_fs.is_stopped(h.pid, max_age_s=0.5))
        parts.append(f"{shown.who()} for {format_duration(max(0.0, now - h.started_at))}")
    recorded = {h.pid for h in gl.holders}
    f = gl.lock_file
    assert f is not None
    for slot in range(req.slots_per_gpu):
        owner = _locks.test_lock(f.fd, _locks.slot_offset(req.slots_per_gpu, slot), 1)
        if owner is not None and (owner.pid <= 0 or owner.pid not in recorded):
            parts.append(_fs.describe_owner(owner) + ", without a lease record")
            recorded.add(owner.pid)
        elif owner is None and _locks.held_here(f, _locks.slot_offset(req.slots_per_gpu, slot),
                                                1) and os.getpid() not in recorded:
            parts.append(f"pid {os.getpid()} (this process)")
            recorded.add(os.getpid())
        if len(parts) >= 8:
            break
    if not parts:
        return "leased (its holder is just leaving)"
    if req.slots_per_gpu > 1:
        used = sum(len(c.slots) for h in gl.holders for c in h.claims if c.uuid == gl.gpu.uuid)
        return f"{used}/{req.slots_per_gpu} slots leased by " + "; ".join(parts)
    return "leased by " + "; ".join(parts)


def _grant(waiter: _Waiter, chosen: list[tuple[GPUSnapshot, list[_Held]]]) -> Grant:
    req = waiter.request
    # CUDA order for the child: PCI order, as CUDA_DEVICE_ORDER=PCI_BUS_ID numbers them.
    chosen = sorted(chosen, key=lambda item: (item[0].index, item[0].uuid))
    claims = tuple(SlotClaim(uuid=g.uuid, index=g.index, slots_per_gpu=req.slots_per_gpu,
                             slots=tuple(_locks.slot_of_offset(h.byte)[1] for h in taken))
                   for g, taken in chosen)
    held = [h for _g, taken in chosen for h in taken]
    # A fresh random name, created O_EXCL: nobody can have taken it first.
    record = OwnedRecord(waiter.directory, this_process("holder", req.label, claims=claims))
    waited = (time.time_ns() - waiter.started_ns) / 1e9 if waiter.ticket is not None else 0.0
    if waiter.ticket is not None:
        waiter.ticket.remove()
        waiter.ticket = None
    return Grant(tuple(g for g, _t in chosen), claims, held, record, waiter.directory, req,
                 waited)


def _write_ticket(waiter: _Waiter, gpus: Sequence[GPUSnapshot], earlier: list[Record]) -> None:
    """Join the line (under the mutex). The ticket says what this request asks for; its place
    is its birth time, which must come after every ticket already in line: on a filesystem
    with coarse timestamps a ticket born in the same tick as one before it is made again."""
    req = waiter.request
    c = req.constraints
    # The GPUs it may use: those its include/exclude admit (the rest is judged by others).
    uuids = tuple(g.uuid for g in gpus if judge(g, Constraints(
        include=c.include, exclude=c.exclude)).refusal not in (Refusal.NOT_INCLUDED,
                                                              Refusal.EXCLUDED))
    record = this_process("ticket", req.label, gpus_wanted=req.gpus,
                          slots_per_gpu=req.slots_per_gpu, slots_each=req.slots_each,
                          min_free_bytes=c.min_free_bytes, max_util_pct=c.max_util_pct,
                          allow_shared=c.allow_shared, uuids=uuids)
    last = max((t.born_ns for t in earlier), default=0)
    for _ in range(20):
        ticket = OwnedRecord(waiter.directory, record)
        if ticket.record.born_ns > last:
            break
        ticket.remove()
        time.sleep(0.001)
    waiter.ticket = ticket


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
    config = _fs.prepared_config(directory) if prepared else None
    if prepared and (config is None or config.schema < _fs.PREPARED_SCHEMA):
        raise LeaseDirError(
            f"lease directory {str(directory)!r} was prepared by an older gpuwarden (one lock "
            "file per slot)",
            why="this gpuwarden locks one file per GPU, and must not share GPUs with requests "
            "that lock other files",
            fix=f"an admin runs `gpuwarden leases init --dir {directory}` again (and every "
            "user of the host upgrades gpuwarden)")
    return _Waiter(req, directory, config=config, private=_fs.is_private(directory),
                   scanner=Scanner(directory))


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
    except _locks.MutexBusyError as busy:
        # Nothing could be judged: say who holds the directory, GPU by GPU as "unknown".
        blocker = (f"the lease directory's mutex {busy.path} stayed held for "
                   f"{format_duration(busy.waited_s)} (an attempt holds it for about a "
                   f"millisecond) by {_fs.describe_owner(busy.holder)}")
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
