"""One attempt of a lease request, under the lease directory's mutex: all or nothing.

Read the records again (what changed only), judge every GPU by NVML state with the processes of
its lease holders (and their descendants) not counted as foreign, keep off GPUs an earlier
waiting request could take (the line: ``line.py``), and take the slots: write locks on bytes
of the GPU's lock file, non-blocking. Either all the GPUs asked for get their slots (a
:class:`~.grant.Grant`), or every lock taken in this attempt is let go again and, for a
request that waits, a ticket joins the line. What stands in the way of each GPU comes back as
its :class:`~.status.GpuState`, and the names whose end may free it as the names to watch.

:class:`Waiter` is what a request keeps between attempts; the loop of attempts and waits is
``manager.py``'s.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from gpuwarden.inventory.snapshot import ComputeMode
from gpuwarden.lease import _fs, _locks
from gpuwarden.lease.gpu_locks import (
    GpuLocks,
    SlotProblem,
    leased_reason,
    let_go,
    mutex_path,
    open_gpu_lock,
    other_split,
    take_memory,
    take_slots,
)
from gpuwarden.lease.grant import Grant, Held
from gpuwarden.lease.ledger import (
    Ledger,
    attribute_processes,
    memory_blocked,
    not_needed,
    shared_blocks,
    taken_reason,
)
from gpuwarden.lease.line import line_ahead, wants, write_ticket
from gpuwarden.lease.memory import best_fit_key
from gpuwarden.lease.records import OwnedRecord, SlotClaim, this_process
from gpuwarden.lease.scan import entries_seen
from gpuwarden.lease.status import GpuState
from gpuwarden.lease.waiter import Attempt, Waiter
from gpuwarden.select import judge, preference_key
from gpuwarden.units import format_bytes, format_duration

if TYPE_CHECKING:
    from gpuwarden.inventory.snapshot import GPUSnapshot

# The most slots per GPU a request may ask for where no prepared directory sets the limit.
MAX_SLOTS_PER_GPU = 1024
# A directory this small (as its last scan saw it) is read once per attempt, under the mutex;
# a larger one is read outside it first, so that the read under it finds everything parsed.
WARM_SCAN_NAMES = 64


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
    with _locks.dir_mutex(mutex_path(waiter.directory), mutex_timeout_s,
                          owner=waiter.lock_owner, create=not waiter.prepared,
                          replace_planted=waiter.private, recheck=waiter.recheck):
        view = scanner.scan(cleanup=True)
        mine = waiter.ticket.record if waiter.ticket is not None else None
        earlier = [t for t in view.tickets() if mine is None or t.order() < mine.order()]
        locks: dict[str, GpuLocks] = {g.uuid: GpuLocks(g) for g in gpus}
        for holder in view.holders():
            for c in holder.claims:
                if c.uuid in locks and holder not in locks[c.uuid].holders:
                    locks[c.uuid].holders.append(holder)
        for gl in locks.values():
            try:
                gl.lock_file = open_gpu_lock(waiter, gl.gpu.uuid)
            except SlotProblem as problem:
                gl.problem = str(problem)

        me = frozenset({os.getpid(), *req.constraints.own_pids})
        parents: dict[int, int | None] = {}
        # Kernel pids only: an older gpuwarden's record names a pid nobody vouches for.
        holder_pids = {g.uuid: frozenset(h.pid for h in locks[g.uuid].holders
                                         if not h.legacy and h.pid > 0) for g in gpus}
        owned = {g.uuid: frozenset(attribute_processes(
                     g, me | holder_pids[g.uuid] | {t.pid for t in earlier}, parents)) | me
                 for g in gpus}
        ledger = Ledger(waiter, locks, holder_pids, parents)
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

        line = line_ahead(waiter, gpus, earlier, locks, owned, ledger)
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
                        not_needed(ledger, line.kept, gpu, req, [g for g, _t in chosen]),
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
                        f"{wants(ticket)} for {waited}", "queued", (ticket.record_id,))
                    continue
                watch.update(h.path.name for h in gl.holders if h.path is not None)
                if memory:
                    blocked = memory_blocked(ledger, line.kept, gpu, req)
                    taken = None if blocked is not None else take_memory(gl, waiter)
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
                                                taken_reason(ledger, line.kept, gpu, req), "free")
                    continue
                split = other_split(gl, req.slots_per_gpu)
                if split is not None:
                    states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label, split, "leased",
                                                tuple(h.record_id for h in gl.holders))
                    continue
                shared = shared_blocks(ledger, line.kept, gpu, req)
                if shared is not None:
                    states[gpu.uuid] = shared
                    continue
                taken = take_slots(gl, req, waiter)
                if taken is None:
                    states[gpu.uuid] = GpuState(gpu.index, gpu.uuid, gpu.label,
                                                leased_reason(gl, req), "leased",
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
                    let_go(held)
        wanted = {g.uuid for g in eligible}
        ahead = sum(1 for t in earlier if wanted.intersection(t.uuids))
        if will_wait and waiter.ticket is None:
            write_ticket(waiter, gpus, earlier)
        return Attempt(states=ordered_states, watch=frozenset(watch), ahead=ahead)



def _slot_limit(waiter: Waiter) -> int:
    """K from the prepared directory's own configuration, never from file names."""
    if waiter.config is not None:
        return waiter.config.max_slots_per_gpu
    return MAX_SLOTS_PER_GPU



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
