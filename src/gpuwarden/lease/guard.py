"""The memory guard: a memory lease's processes, seen from outside through NVML, against what
the lease booked.

::

    holder (gpuwarden run, launch, a pool)            anyone (ls, leases, status)
      MemoryGuard.poll() every POLL_S                   lease_memory(table, inventory)
        inventory.read_memory(its GPUs)                   inventory.read_memory(leased GPUs)
        its own process tree (cached per pid+start)       every holder's tree (/proc parents)
        -> GuardReport: newly over, back within           -> budgets and Overuse per lease
        the holder prints the finding; with
        --mem-enforce stop it ends what it started

Both sides use the same accounting (``memory.py``): a lease's use is what NVML shows for the
holder and every process that descends from it, on each GPU it leased. Neither initializes
CUDA nor reaches into a process: the guard reads NVML and ``/proc``, and the holder decides what
to do about it (it may signal only the processes it started and still owns).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from gpuwarden.findings import Finding, Severity
from gpuwarden.lease import _proc
from gpuwarden.lease.memory import (
    DEFAULT_RESERVE_BYTES,
    OVERUSE_CODE,
    GpuBudget,
    Overuse,
    gpu_budget,
    overuses,
)
from gpuwarden.units import format_bytes

if TYPE_CHECKING:
    from gpuwarden.inventory import Inventory
    from gpuwarden.inventory.snapshot import GPUSnapshot
    from gpuwarden.lease.grant import Grant
    from gpuwarden.lease.listing import LeaseTable
    from gpuwarden.lease.records import Record

# How often a holder reads its GPUs' memory. An over-use is named within one poll plus one
# NVML read: well inside the 2 s gpuwarden promises, at a cost measured in
# benchmarks/bench_lease.py (--guard).
POLL_S = 0.5


@dataclass
class GuardReport:
    """What one poll found: over-uses that began, those that ended, and every current one."""

    new: list[Overuse] = field(default_factory=list)
    ended: list[Overuse] = field(default_factory=list)
    current: list[Overuse] = field(default_factory=list)
    error: str = ""  # the GPUs could not be read this time


class _Tree:
    """Whether a pid is ``root`` or descends from it, remembered per (pid, start time): a
    process's ancestry does not change while it lives, and a pid reused by another process
    has another start time. A pid seen in the previous poll is not looked up again."""

    def __init__(self, root: int) -> None:
        self.root = frozenset({root})
        self._known: dict[int, tuple[int | None, bool]] = {}
        self._last: set[int] = set()

    def mine(self, pids: Sequence[int]) -> set[int]:
        now = set(pids)
        out = set()
        for pid in now:
            known = self._known.get(pid)
            if known is None or pid not in self._last:
                ticks = _proc.start_ticks(pid)
                if known is None or known[0] != ticks:
                    known = (ticks, ticks is not None
                             and _proc.nearest_owner(pid, self.root) is not None)
                    self._known[pid] = known
            if known[1]:
                out.add(pid)
        self._last = now
        if len(self._known) > 4 * len(now) + 256:
            self._known = {p: v for p, v in self._known.items() if p in now}
        return out


class MemoryGuard:
    """Polls the GPUs of a memory lease held by this process, for its processes' memory.

    ``poll()`` returns what changed; the holder reports it (and, asked to, stops what it
    started). ``inventory``: where GPU memory is read (NVML, or the simulated host)."""

    def __init__(self, grant: Grant, inventory: Inventory) -> None:
        self.grant = grant
        self.inventory = inventory
        self.leased = {c.uuid: c.memory_bytes for c in grant.claims if c.is_memory}
        self._tree = _Tree(os.getpid())
        self._over: dict[str, Overuse] = {}
        self.first_over_at: dict[str, float] = {}  # uuid -> when this guard first saw it over
        self._holder = grant._record.record if hasattr(grant, "_record") else None

    @property
    def active(self) -> bool:
        return bool(self.leased) and self._holder is not None

    def poll(self) -> GuardReport:
        report = GuardReport()
        if not self.active:
            return report
        from gpuwarden.errors import GpuwardenError

        try:
            devices = self.inventory.read_memory(tuple(self.leased))
        except GpuwardenError as exc:
            report.error = exc.what
            return report
        assert self._holder is not None
        mine = self._tree.mine([p.pid for d in devices for p in d.processes])
        now: dict[str, Overuse] = {}
        for device in devices:
            leased = self.leased.get(device.uuid)
            if leased is None:
                continue
            pids = sorted(((p.pid, p.used_memory_bytes or 0) for p in device.processes
                           if p.pid in mine), key=lambda p: (-p[1], p[0]))
            used = sum(b for _p, b in pids)
            if used > leased:
                now[device.uuid] = Overuse(self._holder, device.index, device.uuid, leased,
                                           used, tuple(pids))
        stamp = time.time()
        for uuid, over in now.items():
            if uuid not in self._over:
                over = named(over)
                now[uuid] = over
                report.new.append(over)
                self.first_over_at[uuid] = stamp
        report.ended = [o for u, o in self._over.items() if u not in now]
        for over in report.ended:
            self.first_over_at.pop(over.uuid, None)
        self._over = now
        report.current = list(now.values())
        return report


def named(over: Overuse) -> Overuse:
    """``over`` with its largest process's command line, as the kernel gives it."""
    if not over.pids:
        return over
    return replace(over, command=_proc.process_facts(over.pids[0][0]).command)


def overuse_finding(over: Overuse, *, enforce: str = "warn", stopping: str = "",
                    detected_at: float | None = None) -> Finding:
    """The finding every place shows for an over-use (``LEASE_MEMORY_EXCEEDED``).

    ``enforce``: what the holder does about it (``warn``: it is named; ``stop``: the holder
    ends it); ``stopping``: what was stopped, in words."""
    evidence = [f"pid {pid}: {format_bytes(used)} of GPU {over.gpu_index}"
                for pid, used in over.pids[:8]]
    if len(over.pids) > 8:
        evidence.append(f"and {len(over.pids) - 8} more process(es)")
    evidence.append(f"lease {over.holder.record_id}: {format_bytes(over.leased_bytes)} of GPU "
                    f"{over.gpu_index} ({over.uuid})")
    fields: dict[str, Any] = dict(over.to_dict())
    if detected_at is not None:
        fields["detected_at"] = detected_at
    if stopping:
        evidence.append(f"stopped: {stopping}")
    return Finding(
        code=OVERUSE_CODE,
        what=over.describe(),
        why="a memory lease shares its GPU: the rest of the GPU's memory is leased to others, "
        "and past its lease a process can make them run out of memory (CUDA_OOM)",
        fix=("lease what it needs (--mem with its peak, CUDA context included) or cap it in "
             "the program (torch.cuda.set_per_process_memory_fraction)"
             + ("" if enforce == "stop" else "; `--mem-enforce stop` ends such a process "
                "instead of naming it")),
        evidence=evidence,
        fields=fields,
        severity=Severity.ERROR if stopping else Severity.WARNING,
    )


# -- seen from anywhere: every memory lease of a directory --------------------------------------

@dataclass(frozen=True)
class LeaseMemory:
    """Every GPU that memory leases are on, as budgets, and every lease past its memory."""

    budgets: tuple[GpuBudget, ...] = ()
    overuses: tuple[Overuse, ...] = ()
    error: str = ""  # GPU state could not be read: nothing is known of use

    def budget_of(self, uuid: str) -> GpuBudget | None:
        return next((b for b in self.budgets if b.uuid == uuid), None)

    def use_of(self, holder: Record, uuid: str) -> int | None:
        """What ``holder``'s processes use of GPU ``uuid`` now (None: not known)."""
        budget = self.budget_of(uuid)
        if budget is None:
            return None
        return next((s.used_bytes for s in budget.shares if s.holder.record_id
                     == holder.record_id), None)


def lease_memory(table: LeaseTable, inventory: Inventory | None = None,
                 reserve_bytes: int | None = None) -> LeaseMemory:
    """The memory of every GPU a memory lease of ``table`` is on, each lease's use, and the
    leases past their memory: what ``ls``, ``leases`` and ``status`` show. Reads only those
    GPUs (nothing when no memory lease is held), and /proc for each GPU process's parents."""
    uuids = {c.uuid for h in table.holders for c in h.claims if c.is_memory}
    if not uuids:
        return LeaseMemory()
    from gpuwarden.errors import GpuwardenError
    from gpuwarden.inventory import Inventory

    try:
        devices = (inventory or Inventory.from_env()).read_memory(uuids)
    except GpuwardenError as exc:
        return LeaseMemory(error=exc.what)
    return lease_memory_of(devices, table.holders,
                           table.reserve_bytes if reserve_bytes is None else reserve_bytes)


def lease_memory_of(devices: Sequence[GPUSnapshot], holders: Sequence[Record],
                    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
                    parents: dict[int, int | None] | None = None) -> LeaseMemory:
    """:func:`lease_memory` over GPU snapshots already read."""
    parents = {} if parents is None else parents
    budgets = []
    found: list[Overuse] = []
    for device in devices:
        on_it = [h for h in holders if any(c.uuid == device.uuid for c in h.claims)]
        if not on_it:
            continue
        owners = frozenset(h.pid for h in on_it if h.pid > 0 and not h.legacy)
        owner_of: Mapping[int, int] = {
            p.pid: owner for p in device.processes
            if (owner := _proc.nearest_owner(p.pid, owners, parents)) is not None}
        budget = gpu_budget(device, on_it, owner_of, reserve_bytes)
        budgets.append(budget)
        found.extend(named(o) for o in overuses(budget))
    return LeaseMemory(tuple(budgets), tuple(found))
