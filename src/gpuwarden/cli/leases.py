"""``gpuwarden leases``: who holds which GPU slots, and who waits in line for what.

``gpuwarden leases init`` (root, once): prepare the shared lease directory that no user can
break (root-owned lock files in a sticky directory, see docs/leases.md).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from gpuwarden.cli._args import MAX_SLOTS_PER_GPU, bounded_int, memory_size
from gpuwarden.cli._output import emit_json, emit_table, note
from gpuwarden.units import format_bytes, format_duration


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "leases",
        help="list the GPU leases of this host and the requests waiting for GPUs; "
        "`leases init` prepares the shared lease directory (root, once)",
        description="List the holders of GPU leases (pid, user, host, command, since when) and "
        "the requests waiting in line, read from the lease directory (GPUWARDEN_LEASE_DIR; "
        "else /run/gpuwarden when `gpuwarden leases init` prepared it; else "
        "/tmp/gpuwarden-leases-<uid>, this user's own). Needs no GPU and changes no lease.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
    p.add_argument("--dir", type=Path, default=None, metavar="D",
                   help="the lease directory to read (default: as above)")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    init = actions.add_parser(
        "init",
        help="prepare a shared lease directory no user can break (run once, as root)",
        description="Create (or repair) the shared lease directory: owned by root, sticky, "
        "with the mutex and one lock file per GPU of this host owned by root, so no user can "
        "delete or replace a lock another user holds; users only lock bytes of them, and "
        "create their own record files. It changes only files it made: a root-owned name with "
        "another link count or mode is left and reported (exit 1). Idempotent: run it again "
        "after adding GPUs or to allow more slots per GPU. /run is emptied at boot: run it "
        "from a boot unit (docs/leases.md).",
    )
    init.add_argument("--dir", type=Path, default=None, metavar="D", dest="init_dir",
                      help="the directory to prepare (default /run/gpuwarden, which every "
                      "gpuwarden uses when it is prepared)")
    init.add_argument("--group", default=None, metavar="G",
                      help="only members of group G may use it (mode 1770, lock files 0660); "
                      "default: every user (1777, 0666)")
    init.add_argument("--slots-per-gpu", type=bounded_int("--slots-per-gpu", 1, MAX_SLOTS_PER_GPU),
                      default=None, metavar="K",
                      help=f"the most slots per GPU a request may use (default 8, at most "
                      f"{MAX_SLOTS_PER_GPU}); a request with more is refused in a prepared "
                      "directory")
    init.add_argument("--mem-reserve", type=memory_size("--mem-reserve", zero=True), default=None,
                      metavar="SIZE", help="what each GPU keeps out of memory leases (`run "
                      "--mem`): headroom for fragmentation and for a process creeping past its "
                      "lease before the guard names it (default 1GiB)")
    init.add_argument("--json", action="store_true", dest="init_json",
                      help="machine-readable output (schema_version 1)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "init":
        return _init(args)
    from gpuwarden.lease import list_leases
    from gpuwarden.lease._fs import lease_dir_choice
    from gpuwarden.lease.status import describe_request
    from gpuwarden.safetext import escape_untrusted

    if args.dir is not None:
        directory, warning = args.dir, None
    else:
        directory, warning = lease_dir_choice()
    table = list_leases(directory)
    memory = _memory_use(table)
    if args.json:
        emit_json({**table.to_dict(), **_memory_json(table, memory)})
        return 0
    if warning:
        note(f"gpuwarden: note: {warning}")
    now = time.time()
    if table.mutex_holders:
        note(f"gpuwarden: the lease directory's mutex is held by {table.mutex_holders}: "
             "this listing may race a request")
    for bad in table.corrupt:
        note(f"gpuwarden: ignored a lease record {escape_untrusted(str(bad.path))} "
             f"({escape_untrusted(bad.problem)})")
    for held in table.unrecorded:
        note(f"gpuwarden: {escape_untrusted(held.uuid)} slot {held.slot} of "
             f"{held.slots_per_gpu} is held by {held.holder}, which left no lease record")
    for user, count in table.left_out:
        note(f"gpuwarden: {count} more record(s) of {user} not read (each user's oldest are "
             "read, up to a bound per listing)")
    if not table.complete:
        note("gpuwarden: the lease directory holds more than one listing reads: this listing "
             "is partial")
    if not table.exists:
        note(f"no leases: the lease directory {table.directory} does not exist yet")
        return 0
    rows = []
    with_memory = memory is not None and bool(memory.budgets)
    for h in table.holders:
        for c in h.claims:
            slots = format_bytes(c.memory_bytes) if c.is_memory else "all" \
                if c.slots_per_gpu == 1 else f"{len(c.slots)} of {c.slots_per_gpu}"
            row = [str(c.index), slots, _pid(h), h.user, h.host, h.label or h.command,
                   format_duration(max(0.0, now - h.started_at)), h.command]
            if with_memory:
                assert memory is not None
                row.insert(2, _use_cell(memory, h, c))
            rows.append(row)
    kind = "prepared" if table.prepared else "not prepared by `gpuwarden leases init`"
    head = ["GPU", "slots", "pid", "user", "host", "label", "for", "command"]
    if with_memory:
        head.insert(2, "uses")
    emit_table(head, rows,
               title=f"{len(table.holders)} lease holder(s) [{table.directory}, {kind}]")
    if memory is not None:
        _say_memory(memory)
    if table.tickets:
        wait_rows = []
        for pos, t in enumerate(table.tickets, 1):
            want = describe_request(t.gpus_wanted, 0, t.slots_per_gpu, t.slots_each,
                                    memory_bytes=t.memory_bytes)
            may_use = "-" if t.stopped or not t.uuids else ",".join(t.uuids)
            wait_rows.append([str(pos), _pid(t), t.user, t.label or t.command, want,
                              format_duration(max(0.0, now - t.started_at)), may_use])
        emit_table(["#", "pid", "user", "label", "wants", "waiting", "may use"], wait_rows,
                   title=f"{len(table.tickets)} request(s) waiting, in arrival order")
    return 0


def _memory_use(table: Any) -> Any:
    """What the memory leases' processes use now (None: no memory lease is held)."""
    from gpuwarden.lease.guard import lease_memory

    if not any(c.is_memory for h in table.holders for c in h.claims):
        return None
    return lease_memory(table)


def _memory_json(table: Any, memory: Any) -> dict[str, Any]:
    if memory is None:
        return {"gpu_memory": [], "memory_findings": []}
    from gpuwarden.lease.guard import overuse_finding

    return {"gpu_memory": [{"index": b.index, "uuid": b.uuid, "total_bytes": b.total_bytes,
                            "reserve_bytes": b.reserve_bytes, "outside_bytes": b.outside_bytes,
                            "leased_bytes": b.leased_bytes, "room_bytes": b.room_bytes,
                            "leases": [{"holder_id": s.holder.record_id, "pid": s.holder.pid,
                                        "kind": s.kind, "booked_bytes": s.booked_bytes,
                                        "used_bytes": s.used_bytes} for s in b.shares]}
                           for b in memory.budgets],
            "memory_findings": [overuse_finding(o).to_dict() for o in memory.overuses],
            "gpu_memory_error": memory.error or None}


def _use_cell(memory: Any, holder: Any, claim: Any) -> str:
    used = memory.use_of(holder, claim.uuid)
    if used is None:
        return "?"
    over = claim.is_memory and used > claim.memory_bytes
    return format_bytes(used) + (" !" if over else "")


def _say_memory(memory: Any) -> None:
    from gpuwarden.findings import render_plain
    from gpuwarden.lease.guard import overuse_finding

    if memory.error:
        note(f"gpuwarden: note: what memory leases use is not known: {memory.error}")
    for b in memory.budgets:
        note(f"gpuwarden: GPU {b.index}: {b.describe_room()}")
    for over in memory.overuses:
        finding = overuse_finding(over)
        note(render_plain(finding, head=f"gpuwarden: {finding.label}: {finding.what}"))


def _pid(record: Any) -> str:
    return f"{record.pid} (stopped)" if record.stopped else str(record.pid)


def _init(args: argparse.Namespace) -> int:
    from gpuwarden.errors import UsageError
    from gpuwarden.inventory import read_host
    from gpuwarden.lease._fs import SHARED_LEASE_DIR
    from gpuwarden.lease.admin import DEFAULT_MAX_SLOTS, init_shared_dir

    host = read_host()
    if host.source != "nvml" and args.init_dir is None:
        # The host's shared directory holds the lock files of its real GPUs: made for a
        # simulated host's, they would stand there for GPUs that do not exist.
        raise UsageError(
            f"leases init would prepare {SHARED_LEASE_DIR} for the GPUs of a simulated host "
            f"({host.source})",
            fix="unset GPUWARDEN_SIMULATE to prepare this host's real GPUs, or "
            "give --dir D to prepare a directory of your own for the simulated ones")
    uuids = [u for g in host.gpus for u in (g.uuid, *(m.uuid for m in g.mig_devices))]
    report = init_shared_dir(args.init_dir or Path(SHARED_LEASE_DIR), uuids, group=args.group,
                             max_slots=args.slots_per_gpu or DEFAULT_MAX_SLOTS,
                             memory_reserve_bytes=args.mem_reserve)
    if args.init_json:
        emit_json(report.to_dict())
    else:
        print(f"prepared {report.directory} (mode {report.mode:04o}, group {report.group}) for "
              f"{len(host.gpus)} GPU(s): {len(report.created)} lock file(s) created, "
              f"{len(report.kept)} kept, {len(report.replaced)} replaced")
    for name in report.replaced:
        note(f"gpuwarden: replaced {name}: it was not a root-owned lock file")
    for name in report.held:
        note(f"gpuwarden: left {name}: a user's lock file held right now; run init again when "
             "it is free")
    for name in report.refused:
        note(f"gpuwarden: left {name} untouched: root's, but not a file init makes (a hard "
             "link to another file, or another mode); remove it yourself and run init again")
    return 1 if report.held or report.refused else 0
