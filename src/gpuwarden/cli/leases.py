"""``gpuwarden leases``: who holds which GPU slots, and who waits in line for what."""

from __future__ import annotations

import argparse
import time
from typing import Any

from gpuwarden.cli._output import emit_json, emit_table, note
from gpuwarden.units import format_duration


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "leases",
        help="list the GPU leases of this host and the requests waiting for GPUs",
        description="List the holders of GPU leases (pid, user, host, command, since when) and "
        "the requests waiting in line, read from the lease directory (GPUWARDEN_LEASE_DIR, "
        "default /tmp/gpuwarden-leases). Needs no GPU and changes no lease.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gpuwarden.lease import list_leases
    from gpuwarden.lease.status import describe_request

    table = list_leases()
    if args.json:
        emit_json(table.to_dict())
        return 0
    now = time.time()
    for bad in table.corrupt:
        note(f"gpuwarden: ignored an unreadable lease record {bad.path} ({bad.problem})")
    for uuid, k, slot in table.unrecorded:
        note(f"gpuwarden: {uuid} slot {slot} of {k} is held by a process that left no record")
    if not table.exists:
        note(f"no leases: the lease directory {table.directory} does not exist yet")
        return 0
    rows = []
    for h in table.holders:
        for c in h.claims:
            slots = "all" if c.slots_per_gpu == 1 else f"{len(c.slots)} of {c.slots_per_gpu}"
            rows.append([str(c.index), slots, str(h.pid), h.user, h.host,
                         h.label or h.command, format_duration(max(0.0, now - h.started_at)),
                         h.command])
    emit_table(["GPU", "slots", "pid", "user", "host", "label", "for", "command"], rows,
               title=f"{len(table.holders)} lease holder(s) [{table.directory}]")
    if table.tickets:
        wait_rows = []
        for pos, t in enumerate(table.tickets, 1):
            want = describe_request(t.gpus_wanted, 0, t.slots_per_gpu, t.slots_each)
            held_back = ",".join(t.eligible) if t.eligible else "-"
            wait_rows.append([str(pos), str(t.pid), t.user, t.label or t.command, want,
                              format_duration(max(0.0, now - t.started_at)), held_back])
        emit_table(["#", "pid", "user", "label", "wants", "waiting", "holds back"], wait_rows,
                   title=f"{len(table.tickets)} request(s) waiting, in arrival order")
    return 0
