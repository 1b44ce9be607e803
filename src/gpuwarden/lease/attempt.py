"""One attempt of a lease request, under the lease directory's mutex: all or nothing.

Read the records again (what changed only), judge every GPU by NVML state with the processes of
its lease holders (and their descendants) not counted as foreign, keep off GPUs an earlier
waiting request could take (the line: :func:`_line`), and take the slots: write locks on bytes
of the GPU's lock file, non-blocking. Either all the GPUs asked for get their slots (a
:class:`~.grant.Grant`), or every lock taken in this attempt is let go again and, for a
request that waits, a ticket joins the line. What stands in the way of each GPU comes back as
its :class:`~.status.GpuState`, and the names whose end may free it as the names to watch.

:class:`Waiter` is what a request keeps between attempts; the loop of attempts and waits is
``manager.py``'s.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from gpuwarden.lease import _fs, _locks, _proc
from gpuwarden.lease.grant import Grant, Held, LeaseRequest
from gpuwarden.lease.records import (
    OwnedRecord,
    Record,
    Scanner,
    SlotClaim,
    entries_seen,
    this_process,
)
from gpuwarden.lease.status import GpuState
from gpuwarden.select import Constraints, Refusal, judge, preference_key
from gpuwarden.units import format_duration

if TYPE_CHECKING:
    from gpuwarden.inventory.snapshot import GPUSnapshot

# An earlier request that could take free GPUs and has not for this long is not waiting like
# a gpuwarden request (which is woken within milliseconds): it holds nothing back.
IDLE_TURN_S = 3.0
# The most slots per GPU a request may ask for where no prepared directory sets the limit.
MAX_SLOTS_PER_GPU = 1024
# A directory this small (as its last scan saw it) is read once per attempt, under the mutex;
# a larger one is read outside it first, so that the read under it finds everything parsed.
WARM_SCAN_NAMES = 64


@dataclass
class Attempt:
    granted: Grant | None = None
    states: tuple[GpuState, ...] = ()
    usable: int = 0  # probe only: GPUs that could be granted now
    watch: frozenset[str] = frozenset()  # names whose end may free what we need
    ahead: int = 0
    mutex_holders: str = ""  # set when the directory mutex could not be had in time


@dataclass
class Waiter:
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


def _lock_file(waiter: Waiter, uuid: str) -> _locks._Inode:
    """This process's handle of ``uuid``'s lock file. Raises _SlotProblem when it cannot be
    one (a FIFO, a link, another user's file in a prepared dir, missing there)."""
    path = _fs.gpu_path(waiter.directory, uuid)
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
            f"its lock file {path.name} is not writable for {_proc.user_name(os.geteuid())} "
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


def attempt(waiter: Waiter, gpus: Sequence[GPUSnapshot], *, will_wait: bool,
             probe: bool = False, mutex_timeout_s: float = _fs.MUTEX_TIMEOUT_S) -> Attempt:
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
        chosen: list[tuple[GPUSnapshot, list[Held]]] = []
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
                return Attempt(states=ordered_states, usable=len(chosen))
            if chosen and (req.every_usable or len(chosen) == req.gpus):
                grant = _grant(waiter, chosen)
                chosen = []  # the grant holds them now
                return Attempt(granted=grant, states=ordered_states)
        finally:
            for _gpu, taken in chosen:
                for slot in taken:
                    _locks.give_back(slot.lock_file, slot.byte)
        wanted = {g.uuid for g in eligible}
        ahead = sum(1 for t in earlier if wanted.intersection(t.uuids))
        if will_wait and waiter.ticket is None:
            _write_ticket(waiter, gpus, earlier)
        return Attempt(states=ordered_states, watch=frozenset(watch), ahead=ahead)


def _slot_limit(waiter: Waiter) -> int:
    """K from the prepared directory's own configuration, never from file names."""
    if waiter.config is not None:
        return waiter.config.max_slots_per_gpu
    return MAX_SLOTS_PER_GPU


def _line(waiter: Waiter, gpus: Sequence[GPUSnapshot], earlier: list[Record],
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
        if _proc.is_stopped(t.pid):
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
        who = _locks.describe_owner(owner) + " (no record)"
        k = _locks.slot_of_offset(owner.start)[0]
    return (f"leased in {k} slot(s) per GPU by {who}; this request uses {slots_per_gpu}, so "
            "it waits until the GPU has no lease")


def _take_slots(gl: _GpuLocks, req: LeaseRequest, waiter: Waiter) -> list[Held] | None:
    """``slots_each`` free slots of the GPU, or None. A slot named by a live holder record is
    not free even when its byte can be locked: the holder's lock file may have been deleted
    and replaced (an unprepared directory)."""
    f = gl.lock_file
    assert f is not None
    path = _fs.gpu_path(waiter.directory, gl.gpu.uuid)
    claimed = gl.claimed(req.slots_per_gpu)
    taken: list[Held] = []
    for slot in range(req.slots_per_gpu):
        if slot in claimed:
            continue
        byte = _locks.slot_offset(req.slots_per_gpu, slot)
        if _locks.try_take(f, byte):
            taken.append(Held(f, byte, path))
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
        shown = replace(h, stopped=_proc.is_stopped(h.pid, max_age_s=0.5))
        parts.append(f"{shown.who()} for {format_duration(max(0.0, now - h.started_at))}")
    recorded = {h.pid for h in gl.holders}
    f = gl.lock_file
    assert f is not None
    for slot in range(req.slots_per_gpu):
        owner = _locks.test_lock(f.fd, _locks.slot_offset(req.slots_per_gpu, slot), 1)
        if owner is not None and (owner.pid <= 0 or owner.pid not in recorded):
            parts.append(_locks.describe_owner(owner) + ", without a lease record")
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


def _grant(waiter: Waiter, chosen: list[tuple[GPUSnapshot, list[Held]]]) -> Grant:
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


def _write_ticket(waiter: Waiter, gpus: Sequence[GPUSnapshot], earlier: list[Record]) -> None:
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
