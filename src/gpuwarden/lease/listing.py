"""What `gpuwarden leases` shows: holders, waiting requests, and the truth of the slot locks."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpuwarden.lease import _fs
from gpuwarden.lease.records import Corrupt, Record, iter_holders, scan

LIST_MUTEX_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class LeaseTable:
    """The state of one lease directory at one moment."""

    directory: Path
    exists: bool
    holders: tuple[Record, ...]
    tickets: tuple[Record, ...]  # in arrival order
    corrupt: tuple[Corrupt, ...]
    # Slot locks held by a process that has no (readable) holder record: (uuid, k, slot).
    unrecorded: tuple[tuple[str, int, int], ...]
    prepared: bool = False  # made by `gpuwarden leases init` (root-owned lock files)
    # Set when the directory mutex stayed held: who holds it (the listing is then a snapshot).
    mutex_holders: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "lease_dir": str(self.directory),
            "prepared": self.prepared,
            "mutex_held_by": self.mutex_holders or None,
            "holders": [{**r.to_dict(), "stopped": r.stopped} for r in self.holders],
            "waiting": [{**r.to_dict(), "stopped": r.stopped} for r in self.tickets],
            "corrupt_records": [{"path": str(c.path), "problem": c.problem} for c in self.corrupt],
            "unrecorded_slots": [{"uuid": u, "slots_per_gpu": k, "slot": s}
                                 for u, k, s in self.unrecorded],
        }


def list_leases(directory: Path | None = None) -> LeaseTable:
    """Read a lease directory without changing anything in it; a missing one is empty.

    Read-only: it needs no write permission (a user may list a directory it cannot lease
    in) and deletes no stale record. The slot locks are probed under the directory mutex
    when it can be had (so no request is disturbed), which finds claims whose record is
    missing or corrupt.
    """
    directory = directory or _fs.lease_dir_path()
    try:
        # The same checks as a lease (links, loops, relative paths), none of the write ones.
        directory, prepared = _fs.check_dir(directory, create=False, write=False)
    except FileNotFoundError:
        return LeaseTable(directory, False, (), (), (), ())
    mutex_holders = ""
    with contextlib.ExitStack() as stack:
        # Without the mutex when this user cannot create it (a directory it may only read),
        # or when someone holds it too long: the listing is then a snapshot that may race a
        # request, which is all it can be.
        try:
            stack.enter_context(_fs.dir_mutex(directory, LIST_MUTEX_TIMEOUT_S,
                                              create=False))
        except _fs.MutexBusyError as busy:
            mutex_holders = busy.holders
        except OSError:
            pass
        records, corrupt, names = scan(directory, cleanup=False)
        recorded = {(_fs.escape_uuid(c.uuid), c.slots_per_gpu, s)
                    for r in iter_holders(records) for c in r.claims for s in c.slots}
        unrecorded = []
        for name in sorted(names):
            key = _fs.parse_slot_name(name)
            if key is None or key in recorded:
                continue
            try:
                fd = _fs.open_lock_file(directory / name, create=False)
            except OSError:
                continue  # unreadable for this user, or not a file: nothing to say about it
            try:
                if not _fs.try_lock(fd):
                    unrecorded.append(key)
            finally:
                _fs.unlock_close(fd)
    records = [replace(r, stopped=_fs.is_stopped(r.pid)) for r in records]
    holders = tuple(sorted(iter_holders(records), key=lambda r: (r.started_at, r.record_id)))
    tickets = tuple(sorted((r for r in records if r.kind == "ticket"),
                           key=lambda r: (r.arrival_ns, r.record_id)))
    return LeaseTable(directory, True, holders, tickets, tuple(corrupt), tuple(unrecorded),
                      prepared, mutex_holders)
