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

from gpuwarden.inventory.snapshot import ComputeMode
from gpuwarden.lease import _fs, _locks, _proc
from gpuwarden.lease.grant import Grant, Held, LeaseRequest
from gpuwarden.lease.memory import DEFAULT_RESERVE_BYTES, GpuBudget, best_fit_key, gpu_budget
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
from gpuwarden.units import format_bytes, format_duration

if TYPE_CHECKING:
    from gpuwarden.inventory.snapshot import GPUSnapshot

# An earlier request that could take free GPUs and has not for this long is not waiting like
# a gpuwarden request (which is woken within milliseconds): it holds nothing back.
IDLE_TURN_S = 3.0
# The most slots per GPU a request may ask for where no prepared directory sets the limit.
MAX_SLOTS_PER_GPU = 1024
# A memory request that must wait for leases to end may be passed by later requests that fit
# where it does not (backfill) for this long after it joined the line; from then on it holds
# back every GPU it could fit, so that a stream of small requests cannot starve it.
OVERTAKE_BOUND_S = 60.0
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
    def reserve_bytes(self) -> int:
        """What each GPU keeps out of memory leases: `leases init --mem-reserve`, or the
        default."""
        if self.config is not None and self.config.memory_reserve_bytes is not None:
            return self.config.memory_reserve_bytes
        return DEFAULT_RESERVE_BYTES

    @property
    def lock_owner(self) -> int | None:
        """Whose lock files alone are used: root's in a prepared directory, ours in our own."""
        if self.prepared:
            return 0
        return os.geteuid() if self.private else None


class _SlotProblem(Exception):
    """A GPU lock file that cannot serve (a FIFO, a link, missing in a prepared dir)."""


def _attribute(gpu: GPUSnapshot, owners: AbstractSet[int],
               parents: dict[int, int | None]) -> dict[int, int]:
    """pid -> the nearest of ``owners`` it is or descends from, for the processes on ``gpu``
    (at most 256 looked at). A process in another PID namespace has no parent here: it is
    nobody's, and judged as foreign, the safe side."""
    if not gpu.processes or not owners:
        return {}
    frozen = frozenset(owners)
    out = {}
    for proc in gpu.processes[:256]:
        owner = _proc.nearest_owner(proc.pid, frozen, parents)
        if owner is not None:
            out[proc.pid] = owner
    return out


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
    memory = req.memory_bytes > 0
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
        parents: dict[int, int | None] = {}
        # Kernel pids only: an older gpuwarden's record names a pid nobody vouches for.
        holder_pids = {g.uuid: frozenset(h.pid for h in locks[g.uuid].holders
                                         if not h.legacy and h.pid > 0) for g in gpus}
        owned = {g.uuid: frozenset(_attribute(g, me | holder_pids[g.uuid]
                                              | {t.pid for t in earlier}, parents)) | me
                 for g in gpus}
        ledger = _Ledger(waiter, locks, holder_pids, parents)
        mine_only = replace(req.constraints, own_pids=me)  # a GPU without a holder's process
        if memory:  # a memory lease shares the GPU: other processes count by their memory
            mine_only = replace(mine_only, allow_shared=True)
        states: dict[str, GpuState] = {}
        eligible: list[GPUSnapshot] = []
        for gpu in gpus:
            constraints = mine_only if owned[gpu.uuid] == me else \
                replace(mine_only, own_pids=owned[gpu.uuid])
            verdict = judge(gpu, constraints)
            if verdict.accepted and locks[gpu.uuid].problem:
                states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label,
                                            locks[gpu.uuid].problem, "refused")
            elif verdict.accepted and memory and gpu.compute_mode is not ComputeMode.DEFAULT:
                states[gpu.uuid] = GpuState(
                    gpu.index, gpu.uuid, gpu.label,
                    f"{gpu.compute_mode.value} mode: one process at a time, while memory leases "
                    "share a GPU between processes (a whole-GPU lease can use it)", "refused")
            elif verdict.accepted and memory and not ledger.budget(gpu).could_ever_fit(
                    req.memory_bytes):
                budget = ledger.budget(gpu)
                states[gpu.uuid] = GpuState(
                    gpu.index, gpu.uuid, gpu.label,
                    f"{format_bytes(req.memory_bytes)} asked, more than it can ever lend: "
                    f"{format_bytes(budget.total_bytes)} - {format_bytes(budget.reserve_bytes)} "
                    f"reserve - {format_bytes(budget.outside_bytes)} used outside leases",
                    "refused")
            elif verdict.accepted:
                eligible.append(gpu)
            else:
                states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label,
                                            verdict.reason, "refused")
        limit = _slot_limit(waiter)
        if req.slots_per_gpu > limit:
            for gpu in eligible:
                states[gpu.uuid] = GpuState(
                    gpu.index, gpu.uuid, gpu.label,
                    f"{waiter.directory} allows at most {limit} slots per GPU: an admin runs "
                    f"`gpuwarden leases init --dir {waiter.directory} --slots-per-gpu "
                    f"{req.slots_per_gpu}`", "refused")
            eligible = []

        line = _line(waiter, gpus, earlier, locks, owned, ledger)
        if memory:
            # Best fit: the GPUs it fits, the least room left after it first; then the rest.
            def fit_key(g: GPUSnapshot) -> tuple[int, int, tuple[int, int, int, str]]:
                room = ledger.room(g, line.kept)
                fits = room >= req.memory_bytes and g.uuid not in line.reserved_by
                return (0 if fits else 1, best_fit_key(room, req.memory_bytes) if fits else -room,
                        preference_key(g))
            eligible.sort(key=fit_key)
        else:
            eligible.sort(key=preference_key)
        chosen: list[tuple[GPUSnapshot, list[Held]]] = []
        watch: set[str] = set()
        try:
            for gpu in eligible:
                if len(chosen) == (req.up_to if req.every_usable else req.gpus):
                    fits = not memory or ledger.room(gpu, line.kept) >= req.memory_bytes
                    states[gpu.uuid] = GpuState(
                        gpu.index, gpu.uuid, gpu.label,
                        _not_needed(ledger, line, gpu, req, [g for g, _t in chosen]),
                        "free" if fits else "leased")
                    continue
                gl = locks[gpu.uuid]
                assert gl.lock_file is not None
                watch.add(_fs.gpu_file_name(gpu.uuid))
                ticket = line.reserved_by.get(gpu.uuid)
                if ticket is not None:
                    just_ahead = line.next_ahead[gpu.uuid]
                    if just_ahead.path is not None:
                        watch.add(just_ahead.path.name)
                    waited = format_duration(max(0.0, time.time() - ticket.started_at))
                    states[gpu.uuid] = GpuState(
                        gpu.index, gpu.uuid, gpu.label,
                        f"held back for an earlier request: {ticket.who()} waiting for "
                        f"{_wants(ticket)} for {waited}", "queued", (ticket.record_id,))
                    continue
                watch.update(h.path.name for h in gl.holders if h.path is not None)
                if memory:
                    blocked = _memory_blocked(ledger, line, gpu, req)
                    taken = None if blocked is not None else _take_memory(gl, waiter)
                    if blocked is None and taken is None:
                        owner = _locks.test_lock(gl.lock_file.fd, 0, 1, write=False)
                        blocked = GpuState(gpu.index, gpu.uuid, gpu.label,
                                           f"leased whole by {_locks.describe_owner(owner)} "
                                           "(no record)", "leased")
                    if blocked is not None:
                        before = line.next_ahead.get(gpu.uuid)
                        if before is not None and before.path is not None:
                            watch.add(before.path.name)
                        states[gpu.uuid] = blocked
                        continue
                    assert taken is not None
                    chosen.append((gpu, taken))
                    states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label,
                                                _taken_reason(ledger, line, gpu, req), "free")
                    continue
                split = _other_split(gl, req.slots_per_gpu)
                if split is not None:
                    states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label, split, "leased",
                                                tuple(h.record_id for h in gl.holders))
                    continue
                shared = _shared_blocks(ledger, line, gpu, req)
                if shared is not None:
                    states[gpu.uuid] = shared
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
                grant = _grant(waiter, chosen, ordered_states)
                chosen = []  # the grant holds them now
                return Attempt(granted=grant, states=ordered_states)
        finally:
            for _gpu, taken in chosen:
                for held in taken:
                    _let_go(held)
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


# -- memory: one accounting with slots and whole GPUs (memory.py) ---------------------------------

class _Ledger:
    """Each GPU's :class:`~.memory.GpuBudget` in one attempt, made when first asked for."""

    def __init__(self, waiter: Waiter, locks: Mapping[str, _GpuLocks],
                 holder_pids: Mapping[str, frozenset[int]],
                 parents: dict[int, int | None]) -> None:
        self.reserve_bytes = waiter.reserve_bytes
        self._locks = locks
        self._holder_pids = holder_pids
        self._parents = parents
        self._budgets: dict[str, GpuBudget] = {}

    def budget(self, gpu: GPUSnapshot) -> GpuBudget:
        budget = self._budgets.get(gpu.uuid)
        if budget is None:
            owner_of = _attribute(gpu, self._holder_pids.get(gpu.uuid, frozenset()),
                                  self._parents)
            budget = gpu_budget(gpu, self._locks[gpu.uuid].holders, owner_of,
                                self.reserve_bytes)
            self._budgets[gpu.uuid] = budget
        return budget

    def room(self, gpu: GPUSnapshot, kept: Mapping[str, int]) -> int:
        """What a memory request may take on ``gpu`` now: its room, less what earlier
        requests in line are about to take there."""
        return self.budget(gpu).room_bytes - (kept.get(gpu.uuid, 0) if kept else 0)

    def shared(self, gpu: GPUSnapshot, kept: Mapping[str, int]) -> bool:
        """Memory leases are on ``gpu``, or an earlier memory request is about to take some."""
        return bool(kept.get(gpu.uuid)) or any(
            c.is_memory for h in self._locks[gpu.uuid].holders for c in h.claims
            if c.uuid == gpu.uuid)


def _holders_named(budget: GpuBudget, limit: int = 3) -> str:
    shares = sorted(budget.shares, key=lambda s: -s.counted_bytes)
    named = [f"{s.holder.who()} {format_bytes(s.counted_bytes)}" for s in shares[:limit]]
    if len(shares) > limit:
        named.append(f"{len(shares) - limit} more")
    return "; ".join(named)


def _memory_blocked(ledger: _Ledger, line: _Line, gpu: GPUSnapshot, req: LeaseRequest
                    ) -> GpuState | None:
    """Why a memory request cannot have ``gpu`` now (a whole-GPU lease, too little room), in
    bytes; None when it fits."""
    budget = ledger.budget(gpu)
    ids = tuple(s.holder.record_id for s in budget.shares)
    whole = budget.whole
    if whole is not None:
        return GpuState(gpu.index, gpu.uuid, gpu.label,
                        f"leased whole by {whole.holder.who()}: memory leases wait until it ends",
                        "leased", ids)
    room = ledger.room(gpu, line.kept)
    if room >= req.memory_bytes:
        return None
    kept = line.kept.get(gpu.uuid, 0)
    why = f"{format_bytes(req.memory_bytes)} does not fit: {budget.describe_room()}"
    if kept:
        why += f", of which {format_bytes(kept)} goes to earlier requests in line"
    if budget.shares:
        why += f"; leased by {_holders_named(budget)}"
    kind = "leased" if budget.shares or kept else "refused"
    return GpuState(gpu.index, gpu.uuid, gpu.label, why, kind, ids)


def _taken_reason(ledger: _Ledger, line: _Line, gpu: GPUSnapshot, req: LeaseRequest) -> str:
    room = ledger.room(gpu, line.kept)
    return (f"taken: {format_bytes(req.memory_bytes)} of {format_bytes(room)} left "
            f"({ledger.budget(gpu).accounting()}), "
            f"{format_bytes(room - req.memory_bytes)} left after it: the tightest fit")


def _not_needed(ledger: _Ledger, line: _Line, gpu: GPUSnapshot, req: LeaseRequest,
                taken: Sequence[GPUSnapshot]) -> str:
    if not req.memory_bytes:
        return "free (not needed)"
    room = ledger.room(gpu, line.kept)
    if room < req.memory_bytes:
        return f"{format_bytes(req.memory_bytes)} does not fit: {format_bytes(room)} left"
    whole = "" if ledger.budget(gpu).shares else ", kept whole"
    tightest = max((ledger.room(g, line.kept) for g in taken), default=room)
    fit = "a looser fit than the GPU(s) taken" if room > tightest else \
        "as tight a fit as the GPU(s) taken, which come first"
    return f"not taken: {format_bytes(room)} left, {fit}{whole}"


def _shared_blocks(ledger: _Ledger, line: _Line, gpu: GPUSnapshot, req: LeaseRequest
                   ) -> GpuState | None:
    """A slot or whole-GPU request on a GPU that memory leases share: a whole GPU waits until no
    memory lease is left; slots are counted in memory (slots x capacity / K) with them."""
    if not ledger.shared(gpu, line.kept):
        return None
    budget = ledger.budget(gpu)
    ids = tuple(s.holder.record_id for s in budget.shares)
    memory = budget.memory_shares
    leased = format_bytes(sum(s.counted_bytes for s in memory))
    if req.slots_per_gpu == 1:
        who = f"{len(memory)} memory lease(s) ({leased}: {_holders_named(budget)})" if memory \
            else "an earlier memory request in line"
        return GpuState(gpu.index, gpu.uuid, gpu.label,
                        f"shared by {who}: a whole-GPU request waits until none is left",
                        "leased" if memory else "queued", ids)
    need = req.slots_each * budget.capacity_bytes // req.slots_per_gpu
    room = ledger.room(gpu, line.kept)
    if need <= room:
        return None
    return GpuState(gpu.index, gpu.uuid, gpu.label,
                    f"{req.slots_each} of {req.slots_per_gpu} slots are "
                    f"{format_bytes(need)} of its memory: {budget.describe_room()}; leased by "
                    f"{_holders_named(budget)}", "leased", ids)


def _take_memory(gl: _GpuLocks, waiter: Waiter) -> list[Held] | None:
    """A read lock on byte 0 of the GPU's lock file (shared by every memory lease on it; a
    whole-GPU lease's write lock there excludes them), or None when a write lock is on it."""
    f = gl.lock_file
    assert f is not None
    if not _locks.try_share(f, 0):
        return None
    held = Held(f, 0, _fs.gpu_path(waiter.directory, gl.gpu.uuid), shared=True)
    # A lock on a file someone deleted and replaced would guard nothing.
    if waiter.recheck and not _locks.names_inode(f, held.path):
        _let_go(held)
        return None
    return [held]


def _let_go(held: Held) -> None:
    if held.shared:
        _locks.give_back_shared(held.lock_file, held.byte)
    else:
        _locks.give_back(held.lock_file, held.byte)


def _wants(ticket: Record) -> str:
    if ticket.memory_bytes:
        n = max(1, ticket.gpus_wanted)
        return f"{format_bytes(ticket.memory_bytes)} on {n} GPU{'s' if n != 1 else ''}"
    return f"{ticket.gpus_wanted} GPU(s)"


# -- the line ------------------------------------------------------------------------------------

@dataclass
class _Line:
    """What earlier waiting requests keep from this one."""

    reserved_by: dict[str, Record] = field(default_factory=dict)  # GPU -> earliest holding it
    next_ahead: dict[str, Record] = field(default_factory=dict)  # GPU -> latest before us
    kept: dict[str, int] = field(default_factory=dict)  # GPU -> bytes earlier requests take now


def _overtake_bound_s() -> float:
    return OVERTAKE_BOUND_S


def _line(waiter: Waiter, gpus: Sequence[GPUSnapshot], earlier: list[Record],
          locks: Mapping[str, _GpuLocks], owned: Mapping[str, frozenset[int]],
          ledger: _Ledger) -> _Line:
    """Per GPU: the earliest waiting request that holds it back (named in the reason), the
    latest one before us (watched: only its end can change our turn, so one release wakes
    one waiter rather than the whole line), and the memory earlier requests take there now.

    Which GPUs an earlier request could take is judged here, from GPU state and its request,
    never read from its ticket. It holds them back only when leases alone stand in its way
    (the hardware could meet it), while it is not stopped (Ctrl-Z), and while it is not
    failing to take free GPUs for longer than :data:`IDLE_TURN_S`.

    An earlier *memory* request that fits now keeps only its bytes, on the GPUs it would take
    (best fit, as it judges): later requests use the rest. One that must wait for leases to end
    may be overtaken by later requests that fit where it does not, for
    :data:`OVERTAKE_BOUND_S` after it joined the line; from then on it holds back every GPU it
    could ever fit, so it starts as soon as enough of the leases there now have ended."""
    line = _Line()
    now = time.monotonic()
    seen_turns: set[tuple[int, int, str]] = set()
    for t in earlier:
        wanted = set(t.uuids)
        candidates = [g for g in gpus if g.uuid in wanted]
        need = max(1, t.gpus_wanted)
        if t.memory_bytes:
            acceptable = [g for g in candidates if g.compute_mode is ComputeMode.DEFAULT
                          and judge(g, Constraints(
                              count=need, max_util_pct=t.max_util_pct, allow_shared=True,
                              own_pids=owned[g.uuid] | {t.pid})).accepted
                          and ledger.budget(g).could_ever_fit(t.memory_bytes)]
        else:
            acceptable = [g for g in candidates if judge(g, Constraints(
                count=need, min_free_bytes=t.min_free_bytes,
                max_util_pct=t.max_util_pct, allow_shared=t.allow_shared,
                own_pids=owned[g.uuid] | {t.pid})).accepted]
        if len(acceptable) < need:
            continue  # the hardware state cannot meet it: it keeps nothing from anyone
        if _proc.is_stopped(t.pid):
            continue  # it could not take a GPU now; it keeps its place for when it runs again
        if t.memory_bytes:
            fit_now = sorted(
                (g for g in acceptable if g.uuid not in line.reserved_by
                 and ledger.budget(g).whole is None
                 and ledger.room(g, line.kept) >= t.memory_bytes),
                key=lambda g: (best_fit_key(ledger.room(g, line.kept), t.memory_bytes),
                               preference_key(g)))
            if len(fit_now) >= need:
                if _idle_turn(waiter, t, now, seen_turns):
                    continue
                for g in fit_now[:need]:
                    line.kept[g.uuid] = line.kept.get(g.uuid, 0) + t.memory_bytes
                    line.next_ahead[g.uuid] = t
                continue
            if time.time() - t.started_at < _overtake_bound_s():
                continue  # later requests that fit elsewhere may pass it, for a bounded time
        else:
            free_now = [g for g in acceptable if g.uuid not in line.reserved_by
                        and locks[g.uuid].idle() and not line.kept.get(g.uuid)]
            if len(free_now) >= need and _idle_turn(waiter, t, now, seen_turns):
                continue
        for g in acceptable:
            line.reserved_by.setdefault(g.uuid, t)
            line.next_ahead[g.uuid] = t
    for key in list(waiter.turn_since):
        if key not in seen_turns:
            del waiter.turn_since[key]
    return line


def _idle_turn(waiter: Waiter, t: Record, now: float, seen_turns: set[tuple[int, int, str]]
               ) -> bool:
    """Whether ``t``, whose turn has come, has not taken it for longer than IDLE_TURN_S: then it
    is not a live request, and holds nothing back."""
    key = t.order()
    seen_turns.add(key)
    since = waiter.turn_since.setdefault(key, now)
    return now - since > IDLE_TURN_S


def _other_split(gl: _GpuLocks, slots_per_gpu: int) -> str | None:
    """Why the GPU cannot be split in ``slots_per_gpu`` now: a lease with another K on it.
    Memory leases are no split: they share byte 0 with read locks and are counted in memory
    (:func:`_shared_blocks`); only a write lock on byte 0 is a whole GPU's."""
    others = [h for h in gl.holders
              if any(c.uuid == gl.gpu.uuid and not c.is_memory
                     and c.slots_per_gpu != slots_per_gpu for c in h.claims)]
    f = gl.lock_file
    assert f is not None
    low = _locks.slot_offset(slots_per_gpu, 0)
    owner = None
    # Every other split's bytes: below ours, and from the end of ours on (to infinity).
    # Byte 0 (a whole GPU) is asked for write locks only: read locks there are memory leases.
    probes = [(0, 1, False)] if slots_per_gpu > 1 else []
    if low > 1:
        probes.append((1, low - 1, True))
    probes.append((low + slots_per_gpu, 0, True))
    for start, length, any_kind in probes:
        if owner is not None:
            break
        owner = _locks.test_lock(f.fd, start, length, write=any_kind)
        if owner is None and (_locks.held_here(f, start, length) if any_kind
                              else _locks.written_here(f, start)):
            owner = _locks.LockOwner(os.getpid(), True, start, length)
    if not others and owner is None:
        return None
    if others:
        who = "; ".join(h.who() for h in others)
        k = next(c.slots_per_gpu for h in others for c in h.claims
                 if c.uuid == gl.gpu.uuid and not c.is_memory
                 and c.slots_per_gpu != slots_per_gpu)
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


def _grant(waiter: Waiter, chosen: list[tuple[GPUSnapshot, list[Held]]],
           states: tuple[GpuState, ...] = ()) -> Grant:
    req = waiter.request
    # CUDA order for the child: PCI order, as CUDA_DEVICE_ORDER=PCI_BUS_ID numbers them.
    chosen = sorted(chosen, key=lambda item: (item[0].index, item[0].uuid))
    if req.memory_bytes:
        claims = tuple(SlotClaim(uuid=g.uuid, index=g.index, slots_per_gpu=1, slots=(),
                                 memory_bytes=req.memory_bytes) for g, _taken in chosen)
    else:
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
                 waited, states)


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
                          allow_shared=c.allow_shared, uuids=uuids,
                          memory_bytes=req.memory_bytes)
    last = max((t.born_ns for t in earlier), default=0)
    for _ in range(20):
        ticket = OwnedRecord(waiter.directory, record)
        if ticket.record.born_ns > last:
            break
        ticket.remove()
        time.sleep(0.001)
    waiter.ticket = ticket
