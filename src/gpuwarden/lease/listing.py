"""What `gpuwarden leases` shows: holders, waiting requests, and the truth of the locks."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpuwarden.lease import _fs, _locks, _proc
from gpuwarden.lease.memory import DEFAULT_RESERVE_BYTES
from gpuwarden.lease.records import Record, iter_holders
from gpuwarden.lease.scan import Corrupt, scan


@dataclass(frozen=True)
class Unrecorded:
    """A slot lock held by a process that has no (readable) holder record."""

    uuid: str
    slots_per_gpu: int
    slot: int
    holder: str  # what the kernel says of the lock's holder (pid, user, command)


@dataclass(frozen=True)
class LeaseTable:
    """The state of one lease directory at one moment."""

    directory: Path
    exists: bool
    holders: tuple[Record, ...]
    tickets: tuple[Record, ...]  # in arrival order
    corrupt: tuple[Corrupt, ...]
    unrecorded: tuple[Unrecorded, ...]
    prepared: bool = False  # made by `gpuwarden leases init` (root-owned lock files)
    # Set when the directory mutex is held right now: who holds it, as the kernel says.
    mutex_holders: str = ""
    complete: bool = True  # False: the scan's bounds left part of the directory unread
    left_out: tuple[tuple[str, int], ...] = ()  # (user, records not read) per user over a cap
    reserve_bytes: int = DEFAULT_RESERVE_BYTES  # what each GPU keeps out of memory leases

    def to_dict(self) -> dict[str, Any]:
        return {
            "lease_dir": str(self.directory),
            "prepared": self.prepared,
            "mutex_held_by": self.mutex_holders or None,
            "complete": self.complete,
            "holders": [{**r.to_dict(), "stopped": r.stopped} for r in self.holders],
            "waiting": [{**r.to_dict(), "stopped": r.stopped} for r in self.tickets],
            "corrupt_records": [{"path": str(c.path), "problem": c.problem} for c in self.corrupt],
            "unrecorded_slots": [{"uuid": u.uuid, "slots_per_gpu": u.slots_per_gpu,
                                  "slot": u.slot, "held_by": u.holder} for u in self.unrecorded],
            "records_left_out": [{"user": user, "count": n} for user, n in self.left_out],
            "memory_reserve_bytes": self.reserve_bytes,
        }


def list_leases(directory: Path | None = None) -> LeaseTable:
    """Read a lease directory without changing anything in it; a missing one is empty.

    Read-only: it needs no write permission (a user may list a directory it cannot lease
    in), takes no lock and deletes no stale record. The kernel names the holder of every
    lock it finds (the mutex, slots held without a record)."""
    directory = directory or _fs.lease_dir_path()
    try:
        # The same checks as a lease (links, loops, relative paths), none of the write ones.
        directory, prepared = _fs.check_dir(directory, create=False, write=False)
    except FileNotFoundError:
        return LeaseTable(directory, False, (), (), (), ())
    config = _fs.prepared_config(directory) if prepared else None
    view = scan(directory)
    mutex_holders = ""
    with _locks.peek(directory / _fs.MUTEX_NAME) as fd:
        owner = _locks.test_lock(fd, _locks.MUTEX_BYTE, 1) if fd is not None else None
        if owner is not None:
            mutex_holders = _locks.describe_owner(owner)
    holders = list(iter_holders(view.records))
    names = [_fs.gpu_file_name(u) for u in config.gpus] if config is not None else \
        sorted(view.gpu_files)
    unrecorded = []
    for name in names:
        uuid = name[len("gpu."):-len(".lock")]
        recorded = {(c.slots_per_gpu, s): h.pid for h in holders for c in h.claims
                    if _fs.escape_uuid(c.uuid) == uuid for s in c.slots}
        # Memory leases share a read lock on byte 0: the kernel names one of their holders.
        sharing = {h.pid for h in holders for c in h.claims
                   if c.is_memory and _fs.escape_uuid(c.uuid) == uuid}
        with _locks.peek(directory / name) as fd:
            if fd is None:
                continue
            for owner in _locks.held_ranges(fd):
                for byte in range(owner.start, owner.start + (owner.length or 1)):
                    k, slot = _locks.slot_of_offset(byte)
                    if byte == 0 and not owner.write and owner.pid in sharing:
                        continue
                    if recorded.get((k, slot)) != owner.pid or owner.pid < 0:
                        unrecorded.append(Unrecorded(uuid, k, slot, _locks.describe_owner(owner)))
                    if len(unrecorded) >= 256:
                        break
    records = [replace(r, stopped=_proc.is_stopped(r.pid)) for r in view.records]
    holders_sorted = tuple(sorted(iter_holders(records), key=lambda r: (r.born_ns, r.record_id)))
    tickets = tuple(sorted((r for r in records if r.kind == "ticket"), key=Record.order))
    left_out = tuple((_proc.user_name(uid), n) for uid, n in sorted(view.left_out.items()))
    reserve = config.memory_reserve_bytes if config is not None \
        and config.memory_reserve_bytes is not None else DEFAULT_RESERVE_BYTES
    return LeaseTable(directory, True, holders_sorted, tickets, tuple(view.corrupt),
                      tuple(unrecorded), prepared, mutex_holders, view.complete, left_out,
                      reserve)
