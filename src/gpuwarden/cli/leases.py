"""``gpuwarden leases``: who holds which GPU slots, and who waits in line for what.

``gpuwarden leases init`` (root, once): prepare the shared lease directory that no user can
break (root-owned lock files in a sticky directory, see docs/leases.md).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from gpuwarden.cli._args import MAX_SLOTS_PER_GPU, bounded_int
from gpuwarden.cli._output import emit_json, emit_table, note
from gpuwarden.units import format_duration


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
    if args.json:
        emit_json(table.to_dict())
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
    for h in table.holders:
        for c in h.claims:
            slots = "all" if c.slots_per_gpu == 1 else f"{len(c.slots)} of {c.slots_per_gpu}"
            rows.append([str(c.index), slots, _pid(h), h.user, h.host,
                         h.label or h.command, format_duration(max(0.0, now - h.started_at)),
                         h.command])
    kind = "prepared" if table.prepared else "not prepared by `gpuwarden leases init`"
    emit_table(["GPU", "slots", "pid", "user", "host", "label", "for", "command"], rows,
               title=f"{len(table.holders)} lease holder(s) [{table.directory}, {kind}]")
    if table.tickets:
        wait_rows = []
        for pos, t in enumerate(table.tickets, 1):
            want = describe_request(t.gpus_wanted, 0, t.slots_per_gpu, t.slots_each)
            may_use = "-" if t.stopped or not t.uuids else ",".join(t.uuids)
            wait_rows.append([str(pos), _pid(t), t.user, t.label or t.command, want,
                              format_duration(max(0.0, now - t.started_at)), may_use])
        emit_table(["#", "pid", "user", "label", "wants", "waiting", "may use"], wait_rows,
                   title=f"{len(table.tickets)} request(s) waiting, in arrival order")
    return 0


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
                             max_slots=args.slots_per_gpu or DEFAULT_MAX_SLOTS)
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
