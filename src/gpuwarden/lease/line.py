"""The line: who waits before whom, and what earlier waiting requests keep from a later one.

Its order is the kernel's (each ticket's birth time); what an earlier request could take is
judged from GPU state and its request (:func:`line_ahead`), never read from its ticket."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpuwarden.inventory.snapshot import ComputeMode
from gpuwarden.lease import _proc
from gpuwarden.lease.gpu_locks import GpuLocks
from gpuwarden.lease.ledger import Ledger
from gpuwarden.lease.memory import best_fit_key
from gpuwarden.lease.records import OwnedRecord, Record, this_process
from gpuwarden.lease.waiter import Waiter
from gpuwarden.select import Constraints, Refusal, judge, preference_key
from gpuwarden.units import format_bytes

if TYPE_CHECKING:
    from gpuwarden.inventory.snapshot import GPUSnapshot

# An earlier request that could take free GPUs and has not for this long is not waiting like
# a gpuwarden request (which is woken within milliseconds): it holds nothing back.
IDLE_TURN_S = 3.0
# A memory request that must wait for leases to end may be passed by later requests that fit
# where it does not (backfill) for this long after it joined the line; from then on it holds
# back every GPU it could fit, so that a stream of small requests cannot starve it.
OVERTAKE_BOUND_S = 60.0


@dataclass
class Line:
    """What earlier waiting requests keep from this one."""

    reserved_by: dict[str, Record] = field(default_factory=dict)  # GPU -> earliest holding it
    next_ahead: dict[str, Record] = field(default_factory=dict)  # GPU -> latest before us
    kept: dict[str, int] = field(default_factory=dict)  # GPU -> bytes earlier requests take now


def overtake_bound_s() -> float:
    return OVERTAKE_BOUND_S


def line_ahead(waiter: Waiter, gpus: Sequence[GPUSnapshot], earlier: list[Record],
          locks: Mapping[str, GpuLocks], owned: Mapping[str, frozenset[int]],
          ledger: Ledger) -> Line:
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
    line = Line()
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
                if idle_turn(waiter, t, now, seen_turns):
                    continue
                for g in fit_now[:need]:
                    line.kept[g.uuid] = line.kept.get(g.uuid, 0) + t.memory_bytes
                    line.next_ahead[g.uuid] = t
                continue
            if time.time() - t.started_at < overtake_bound_s():
                continue  # later requests that fit elsewhere may pass it, for a bounded time
        else:
            free_now = [g for g in acceptable if g.uuid not in line.reserved_by
                        and locks[g.uuid].idle() and not line.kept.get(g.uuid)]
            if len(free_now) >= need and idle_turn(waiter, t, now, seen_turns):
                continue
        for g in acceptable:
            line.reserved_by.setdefault(g.uuid, t)
            line.next_ahead[g.uuid] = t
    for key in list(waiter.turn_since):
        if key not in seen_turns:
            del waiter.turn_since[key]
    return line


def idle_turn(waiter: Waiter, t: Record, now: float, seen_turns: set[tuple[int, int, str]]
               ) -> bool:
    """Whether ``t``, whose turn has come, has not taken it for longer than IDLE_TURN_S: then it
    is not a live request, and holds nothing back."""
    key = t.order()
    seen_turns.add(key)
    since = waiter.turn_since.setdefault(key, now)
    return now - since > IDLE_TURN_S



def wants(ticket: Record) -> str:
    if ticket.memory_bytes:
        n = max(1, ticket.gpus_wanted)
        return f"{format_bytes(ticket.memory_bytes)} on {n} GPU{'s' if n != 1 else ''}"
    return f"{ticket.gpus_wanted} GPU(s)"


def write_ticket(waiter: Waiter, gpus: Sequence[GPUSnapshot], earlier: list[Record]) -> None:
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
