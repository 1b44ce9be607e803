"""What `gpuwarden leases` shows: holders, waiting requests, and the truth of the slot locks."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwarden.lease import _fs
from gpuwarden.lease.records import Corrupt, Record, scan

_SLOT_RE = re.compile(r"^slot\.(?P<uuid>.+)\.k(?P<k>\d+)\.s(?P<s>\d+)\.lock$")


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "lease_dir": str(self.directory),
            "holders": [r.to_dict() for r in self.holders],
            "waiting": [r.to_dict() for r in self.tickets],
            "corrupt_records": [{"path": str(c.path), "problem": c.problem} for c in self.corrupt],
            "unrecorded_slots": [{"uuid": u, "slots_per_gpu": k, "slot": s}
                                 for u, k, s in self.unrecorded],
        }


def list_leases(directory: Path | None = None) -> LeaseTable:
    """Read a lease directory without changing any lease; a missing directory is empty.

    The slot locks are probed under the directory mutex (so no request is disturbed),
    which finds claims whose record is missing or corrupt.
    """
    directory = directory or _fs.lease_dir_path()
    if not directory.is_dir():
        return LeaseTable(directory, False, (), (), (), ())
    _fs.prepare_dir(directory)
    with _fs.dir_mutex(directory):
        records, corrupt = scan(directory)
        recorded = {(c.uuid.replace("/", "_"), c.slots_per_gpu, s)
                    for r in records if r.kind == "holder" for c in r.claims for s in c.slots}
        unrecorded = []
        for name in sorted(os.listdir(directory)):
            match = _SLOT_RE.match(name)
            if not match:
                continue
            key = (match["uuid"], int(match["k"]), int(match["s"]))
            if key in recorded:
                continue
            fd = _fs.open_lock_file(directory / name)
            try:
                if not _fs.try_lock(fd):
                    unrecorded.append(key)
            finally:
                _fs.unlock_close(fd)
    holders = tuple(sorted((r for r in records if r.kind == "holder"),
                           key=lambda r: (r.started_at, r.record_id)))
    tickets = tuple(sorted((r for r in records if r.kind == "ticket"),
                           key=lambda r: (r.arrival_ns, r.record_id)))
    return LeaseTable(directory, True, holders, tickets, tuple(corrupt), tuple(unrecorded))
