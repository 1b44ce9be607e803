"""One accounting of a GPU's memory for whole-GPU, slot and memory leases: pure, from a GPU
snapshot (NVML or the simulated host), the live holder records on it, and which holder each of
the GPU's processes descends from (the kernel's parent links, asked by the caller).

::

    capacity  = memory_total - reserve                     (reserve: `leases init --mem-reserve`)
    outside   = memory_used - what the lease holders' processes use   (other users, the driver)
    each lease counts max(what it booked, what its processes use now)
        booked: a memory lease its bytes; a slot lease slots x capacity / K; a whole-GPU lease all
    room      = capacity - outside - sum of the leases' counts

A memory request of M bytes fits a GPU when M <= room (and no whole-GPU lease is on it); among
the GPUs it fits, the one with the least room left after it is taken (best fit), so that GPUs
nobody shares stay whole for requests that need a whole one. A lease whose processes use more
than it booked is :class:`Overuse`: what the guard (``guard.py``), ``gpuwarden ls``, ``leases``
and ``status`` name.

Nothing here reads a file or a process: callers pass the facts, tests pass their own.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuwarden.units import GIB, format_bytes

if TYPE_CHECKING:
    from gpuwarden.inventory.snapshot import GPUSnapshot
    from gpuwarden.lease.records import Record

# What a GPU keeps out of every memory lease unless `leases init --mem-reserve` says otherwise:
# headroom for allocator fragmentation and for a lease's processes creeping past their lease
# before the guard names them. The driver's own use (about 0.5 GiB on an idle H100) is not in
# it: NVML counts that as used memory of no process, which is "outside" below.
DEFAULT_RESERVE_BYTES = 1 * GIB


@dataclass(frozen=True)
class LeaseShare:
    """One lease holder's part of one GPU."""

    holder: Record
    booked_bytes: int  # what its claims book here
    used_bytes: int  # what its processes (the holder and its descendants) use here, per NVML
    kind: str  # "memory", "slots" or "whole"
    pids: tuple[tuple[int, int], ...] = ()  # (pid, bytes) of its processes here, largest first

    @property
    def counted_bytes(self) -> int:
        return max(self.booked_bytes, self.used_bytes)

    @property
    def over_bytes(self) -> int:
        """How far a memory lease's processes are past it (0: within it; other kinds: 0)."""
        return max(0, self.used_bytes - self.booked_bytes) if self.kind == "memory" else 0


@dataclass(frozen=True)
class GpuBudget:
    """A GPU's memory as the leases see it, at one moment."""

    uuid: str
    index: int
    label: str
    total_bytes: int
    reserve_bytes: int
    outside_bytes: int  # used by no lease holder's process: other users, the driver
    shares: tuple[LeaseShare, ...]

    @property
    def capacity_bytes(self) -> int:
        return max(0, self.total_bytes - self.reserve_bytes)

    @functools.cached_property
    def leased_bytes(self) -> int:
        return sum(s.counted_bytes for s in self.shares)

    @functools.cached_property
    def room_bytes(self) -> int:
        """What a new memory lease may take now."""
        if self.whole is not None:
            return 0
        return max(0, self.capacity_bytes - self.outside_bytes - self.leased_bytes)

    @property
    def whole(self) -> LeaseShare | None:
        return next((s for s in self.shares if s.kind == "whole"), None)

    @property
    def memory_shares(self) -> tuple[LeaseShare, ...]:
        return tuple(s for s in self.shares if s.kind == "memory")

    def could_ever_fit(self, memory_bytes: int) -> bool:
        """Whether ``memory_bytes`` would fit were every lease on it gone (the hardware could
        serve it: waiting may)."""
        return memory_bytes <= self.capacity_bytes - self.outside_bytes

    def accounting(self) -> str:
        """'78.6 GiB - 1.0 GiB reserve - 0.5 GiB outside leases - 60.0 GiB leased (3 leases)'."""
        parts = [format_bytes(self.total_bytes), f"{format_bytes(self.reserve_bytes)} reserve"]
        if self.outside_bytes:
            parts.append(f"{format_bytes(self.outside_bytes)} used outside leases")
        if self.shares:
            parts.append(f"{format_bytes(self.leased_bytes)} leased ({len(self.shares)} "
                         f"lease{'s' if len(self.shares) != 1 else ''})")
        return " - ".join(parts)

    def describe_room(self) -> str:
        """'19.1 GiB left (78.6 GiB - 1.0 GiB reserve - 60.0 GiB leased (3 leases))'."""
        return f"{format_bytes(self.room_bytes)} left ({self.accounting()})"


@dataclass(frozen=True)
class Overuse:
    """A memory lease whose processes use more of a GPU than it leased."""

    holder: Record
    gpu_index: int
    uuid: str
    leased_bytes: int
    used_bytes: int
    pids: tuple[tuple[int, int], ...]  # (pid, bytes), largest first
    command: str = ""  # the largest process's command line, as the kernel gives it (escaped)

    def describe(self) -> str:
        """'pid 4711 (python eval.py) uses 25.0 GiB of GPU 0: 5.0 GiB more than the 20.0 GiB
        of its memory lease (held by pid 4702, alice: eval)'"""
        top = self.pids[0][0] if self.pids else self.holder.pid
        who = f"pid {top}" + (f" ({self.command})" if self.command else "")
        verb = "uses"
        if len(self.pids) > 1:
            who += f" and {len(self.pids) - 1} other process(es) of its lease"
            verb = "use"
        holder = ", ".join(x for x in (self.holder.user, self.holder.label) if x)
        return (f"{who} {verb} {format_bytes(self.used_bytes)} of GPU {self.gpu_index}: "
                f"{format_bytes(self.used_bytes - self.leased_bytes)} more than the "
                f"{format_bytes(self.leased_bytes)} of its memory lease (held by pid "
                f"{self.holder.pid}{': ' + holder if holder else ''})")

    def short(self) -> str:
        """'pid 4711 uses 25.0 GiB, leased 20.0 GiB (python eval.py)': numbers first, for a
        line that a narrow terminal cuts."""
        top = self.pids[0][0] if self.pids else self.holder.pid
        more = f" with {len(self.pids) - 1} other(s)" if len(self.pids) > 1 else ""
        return (f"pid {top}{more} uses {format_bytes(self.used_bytes)}, leased "
                f"{format_bytes(self.leased_bytes)}" + (f" ({self.command})" if self.command
                                                         else ""))

    def to_dict(self) -> dict[str, object]:
        return {"code": OVERUSE_CODE, "holder_pid": self.holder.pid, "holder_id":
                self.holder.record_id, "gpu": self.gpu_index, "uuid": self.uuid,
                "leased_bytes": self.leased_bytes, "used_bytes": self.used_bytes,
                "processes": [{"pid": p, "used_bytes": b} for p, b in self.pids]}


OVERUSE_CODE = "LEASE_MEMORY_EXCEEDED"


def claim_kind(holder: Record, uuid: str) -> tuple[str, int, int]:
    """(kind, memory bytes, slots over K as (slots, K) folded in bytes later) of what
    ``holder`` claims on ``uuid``: ('memory', M, 0), ('slots', S, K) or ('whole', 0, 1)."""
    memory = sum(c.memory_bytes for c in holder.claims if c.uuid == uuid and c.is_memory)
    if memory:
        return "memory", memory, 0
    slots = [c for c in holder.claims if c.uuid == uuid and not c.is_memory]
    if not slots:
        return "", 0, 0
    k = slots[0].slots_per_gpu
    taken = sum(len(c.slots) for c in slots)
    if k <= 1 or taken >= k:
        return "whole", 0, 1
    return "slots", taken, k


def gpu_budget(gpu: GPUSnapshot, holders: Sequence[Record], owner_of: Mapping[int, int],
               reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> GpuBudget:
    """The budget of ``gpu`` with the live ``holders`` that claim it; ``owner_of`` maps each of
    the GPU's process pids that descends from (or is) a holder to that holder's pid."""
    capacity = max(0, gpu.memory_total_bytes - reserve_bytes)
    used_by: dict[int, list[tuple[int, int]]] = {}
    attributed = 0
    for proc in gpu.processes:
        owner = owner_of.get(proc.pid)
        if owner is None:
            continue
        used = proc.used_memory_bytes or 0  # NVML could not say: the GPU's total counts it
        used_by.setdefault(owner, []).append((proc.pid, used))
        attributed += used
    shares = []
    for holder in holders:
        kind, amount, k = claim_kind(holder, gpu.uuid)
        if not kind:
            continue
        booked = amount if kind == "memory" else capacity if kind == "whole" \
            else amount * capacity // k
        pids = tuple(sorted(used_by.get(holder.pid, []), key=lambda p: (-p[1], p[0]))) \
            if holder.pid > 0 else ()
        shares.append(LeaseShare(holder, booked, sum(b for _p, b in pids), kind, pids))
    outside = max(0, gpu.memory_used_bytes - attributed)
    return GpuBudget(gpu.uuid, gpu.index, gpu.label, gpu.memory_total_bytes, reserve_bytes,
                     outside, tuple(shares))


def overuses(budget: GpuBudget) -> list[Overuse]:
    """The memory leases on the GPU whose processes use more than they leased."""
    return [Overuse(s.holder, budget.index, budget.uuid, s.booked_bytes, s.used_bytes, s.pids)
            for s in budget.memory_shares if s.over_bytes > 0]


def best_fit_key(room_bytes: int, memory_bytes: int) -> int:
    """Sort key of a GPU a request of ``memory_bytes`` fits: the room left after it, least
    first (the tightest fit), so shared GPUs fill before a whole one is broken into."""
    return room_bytes - memory_bytes
