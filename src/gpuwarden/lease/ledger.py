"""Memory in one attempt: each GPU's :class:`~.memory.GpuBudget` (one accounting with slots
and whole GPUs), the processes on it attributed to lease holders, and the reasons, in bytes,
that a request fits, does not, or waits. ``kept``: GPU -> bytes earlier requests in line are
about to take there now (``line.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from gpuwarden.lease import _proc
from gpuwarden.lease.gpu_locks import GpuLocks
from gpuwarden.lease.grant import LeaseRequest
from gpuwarden.lease.memory import GpuBudget, gpu_budget
from gpuwarden.lease.status import GpuState
from gpuwarden.lease.waiter import Waiter
from gpuwarden.units import format_bytes

if TYPE_CHECKING:
    from gpuwarden.inventory.snapshot import GPUSnapshot


def attribute_processes(gpu: GPUSnapshot, owners: AbstractSet[int],
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


class Ledger:
    """Each GPU's :class:`~.memory.GpuBudget` in one attempt, made when first asked for."""

    def __init__(self, waiter: Waiter, locks: Mapping[str, GpuLocks],
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
            owner_of = attribute_processes(
                gpu, self._holder_pids.get(gpu.uuid, frozenset()), self._parents)
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


def holders_named(budget: GpuBudget, limit: int = 3) -> str:
    shares = sorted(budget.shares, key=lambda s: -s.counted_bytes)
    named = [f"{s.holder.who()} {format_bytes(s.counted_bytes)}" for s in shares[:limit]]
    if len(shares) > limit:
        named.append(f"{len(shares) - limit} more")
    return "; ".join(named)


def memory_blocked(ledger: Ledger, kept: Mapping[str, int], gpu: GPUSnapshot,
                   req: LeaseRequest) -> GpuState | None:
    """Why a memory request cannot have ``gpu`` now (a whole-GPU lease, too little room), in
    bytes; None when it fits."""
    budget = ledger.budget(gpu)
    ids = tuple(s.holder.record_id for s in budget.shares)
    whole = budget.whole
    if whole is not None:
        return GpuState(gpu.index, gpu.uuid, gpu.label,
                        f"leased whole by {whole.holder.who()}: memory leases wait until it ends",
                        "leased", ids)
    room = ledger.room(gpu, kept)
    if room >= req.memory_bytes:
        return None
    ahead = kept.get(gpu.uuid, 0)
    why = f"{format_bytes(req.memory_bytes)} does not fit: {budget.describe_room()}"
    if ahead:
        why += f", of which {format_bytes(ahead)} goes to earlier requests in line"
    if budget.shares:
        why += f"; leased by {holders_named(budget)}"
    kind = "leased" if budget.shares or ahead else "refused"
    return GpuState(gpu.index, gpu.uuid, gpu.label, why, kind, ids)


def taken_reason(ledger: Ledger, kept: Mapping[str, int], gpu: GPUSnapshot,
                 req: LeaseRequest) -> str:
    room = ledger.room(gpu, kept)
    return (f"taken: {format_bytes(req.memory_bytes)} of {format_bytes(room)} left "
            f"({ledger.budget(gpu).accounting()}), "
            f"{format_bytes(room - req.memory_bytes)} left after it: the tightest fit")


def not_needed(ledger: Ledger, kept: Mapping[str, int], gpu: GPUSnapshot, req: LeaseRequest,
               taken: Sequence[GPUSnapshot]) -> str:
    if not req.memory_bytes:
        return "free (not needed)"
    room = ledger.room(gpu, kept)
    if room < req.memory_bytes:
        return f"{format_bytes(req.memory_bytes)} does not fit: {format_bytes(room)} left"
    whole = "" if ledger.budget(gpu).shares else ", kept whole"
    tightest = max((ledger.room(g, kept) for g in taken), default=room)
    fit = "a looser fit than the GPU(s) taken" if room > tightest else \
        "as tight a fit as the GPU(s) taken, which come first"
    return f"not taken: {format_bytes(room)} left, {fit}{whole}"


def shared_blocks(ledger: Ledger, kept: Mapping[str, int], gpu: GPUSnapshot,
                  req: LeaseRequest) -> GpuState | None:
    """A slot or whole-GPU request on a GPU that memory leases share: a whole GPU waits until no
    memory lease is left; slots are counted in memory (slots x capacity / K) with them."""
    if not ledger.shared(gpu, kept):
        return None
    budget = ledger.budget(gpu)
    ids = tuple(s.holder.record_id for s in budget.shares)
    memory = budget.memory_shares
    leased = format_bytes(sum(s.counted_bytes for s in memory))
    if req.slots_per_gpu == 1:
        who = f"{len(memory)} memory lease(s) ({leased}: {holders_named(budget)})" if memory \
            else "an earlier memory request in line"
        return GpuState(gpu.index, gpu.uuid, gpu.label,
                        f"shared by {who}: a whole-GPU request waits until none is left",
                        "leased" if memory else "queued", ids)
    need = req.slots_each * budget.capacity_bytes // req.slots_per_gpu
    room = ledger.room(gpu, kept)
    if need <= room:
        return None
    return GpuState(gpu.index, gpu.uuid, gpu.label,
                    f"{req.slots_each} of {req.slots_per_gpu} slots are "
                    f"{format_bytes(need)} of its memory: {budget.describe_room()}; leased by "
                    f"{holders_named(budget)}", "leased", ids)
