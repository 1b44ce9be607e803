"""One GPU's lock file in one attempt: who holds which slots (the records and the kernel's
record locks), taking slots or a memory share of it, letting go, and why it is taken.

A slot is a byte of the GPU's lock file (``_locks.slot_offset``); byte 0 is the whole GPU: a
write lock there is a whole-GPU lease, read locks are memory leases sharing it."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from gpuwarden.lease import _fs, _locks, _proc
from gpuwarden.lease.grant import Held, LeaseRequest
from gpuwarden.lease.records import Record
from gpuwarden.lease.waiter import Waiter
from gpuwarden.units import format_duration

if TYPE_CHECKING:
    from gpuwarden.inventory.snapshot import GPUSnapshot


class SlotProblem(Exception):
    """A GPU lock file that cannot serve (a FIFO, a link, missing in a prepared dir)."""



def mutex_path(directory: Path) -> Path:
    return directory / _fs.MUTEX_NAME


def open_gpu_lock(waiter: Waiter, uuid: str) -> _locks._Inode:
    """This process's handle of ``uuid``'s lock file. Raises SlotProblem when it cannot be
    one (a FIFO, a link, another user's file in a prepared dir, missing there)."""
    path = _fs.gpu_path(waiter.directory, uuid)
    config = waiter.config
    if config is not None and uuid not in config.gpus:
        raise SlotProblem(
            f"{waiter.directory} has no lock file for it (prepared before this GPU appeared): "
            f"an admin runs `gpuwarden leases init --dir {waiter.directory}` again")
    try:
        return _locks.open_lock_file(path, create=not waiter.prepared, owner=waiter.lock_owner,
                                     replace_planted=waiter.private, recheck=waiter.recheck)
    except _fs.UnsafeFileError as exc:
        raise SlotProblem(f"its lock file {path.name} {exc.problem}: remove it (as root)"
                           ) from None
    except FileNotFoundError:
        raise SlotProblem(f"{waiter.directory} has no lock file {path.name}: an admin runs "
                           f"`gpuwarden leases init --dir {waiter.directory}` again") from None
    except PermissionError:
        raise SlotProblem(
            f"its lock file {path.name} is not writable for {_proc.user_name(os.geteuid())} "
            f"(a lock needs a writable descriptor): an admin runs `gpuwarden leases init --dir "
            f"{waiter.directory}` again") from None


@dataclass
class GpuLocks:
    """One GPU's locks as the kernel and the records tell them, in one attempt."""

    gpu: GPUSnapshot
    lock_file: _locks._Inode | None = None
    problem: str = ""
    holders: list[Record] = field(default_factory=list)  # live holder records naming it
    _idle: bool | None = None

    def claimed(self, slots_per_gpu: int) -> set[int]:
        return {s for h in self.holders for c in h.claims
                if c.uuid == self.gpu.uuid and c.slots_per_gpu == slots_per_gpu for s in c.slots}

    def idle(self) -> bool:
        """No slot of any split held by anyone (records or kernel): any request could use it."""
        if self._idle is None:
            f = self.lock_file
            self._idle = not self.holders and f is not None and \
                _locks.test_lock(f.fd, 0, 0) is None and not _locks.held_here(f, 0, 0)
        return self._idle


def take_memory(gl: GpuLocks, waiter: Waiter) -> list[Held] | None:
    """A read lock on byte 0 of the GPU's lock file (shared by every memory lease on it; a
    whole-GPU lease's write lock there excludes them), or None when a write lock is on it."""
    f = gl.lock_file
    assert f is not None
    if not _locks.try_share(f, 0):
        return None
    held = Held(f, 0, _fs.gpu_path(waiter.directory, gl.gpu.uuid), shared=True)
    # A lock on a file someone deleted and replaced would guard nothing.
    if waiter.recheck and not _locks.names_inode(f, held.path):
        let_go(held)
        return None
    return [held]


def let_go(held: Held) -> None:
    if held.shared:
        _locks.give_back_shared(held.lock_file, held.byte)
    else:
        _locks.give_back(held.lock_file, held.byte)


def other_split(gl: GpuLocks, slots_per_gpu: int) -> str | None:
    """Why the GPU cannot be split in ``slots_per_gpu`` now: a lease with another K on it.
    Memory leases are no split: they share byte 0 with read locks and are counted in memory
    (:func:`shared_blocks`); only a write lock on byte 0 is a whole GPU's."""
    others = [h for h in gl.holders
              if any(c.uuid == gl.gpu.uuid and not c.is_memory
                     and c.slots_per_gpu != slots_per_gpu for c in h.claims)]
    f = gl.lock_file
    assert f is not None
    low = _locks.slot_offset(slots_per_gpu, 0)
    owner = None
    # Every other split's bytes: below ours, and from the end of ours on (to infinity).
    # Byte 0 (a whole GPU) is asked for write locks only: read locks there are memory leases.
    probes = [(0, 1, False)] if slots_per_gpu > 1 else []
    if low > 1:
        probes.append((1, low - 1, True))
    probes.append((low + slots_per_gpu, 0, True))
    for start, length, any_kind in probes:
        if owner is not None:
            break
        owner = _locks.test_lock(f.fd, start, length, write=any_kind)
        if owner is None and (_locks.held_here(f, start, length) if any_kind
                              else _locks.written_here(f, start)):
            owner = _locks.LockOwner(os.getpid(), True, start, length)
    if not others and owner is None:
        return None
    if others:
        who = "; ".join(h.who() for h in others)
        k = next(c.slots_per_gpu for h in others for c in h.claims
                 if c.uuid == gl.gpu.uuid and not c.is_memory
                 and c.slots_per_gpu != slots_per_gpu)
    else:
        assert owner is not None
        who = _locks.describe_owner(owner) + " (no record)"
        k = _locks.slot_of_offset(owner.start)[0]
    return (f"leased in {k} slot(s) per GPU by {who}; this request uses {slots_per_gpu}, so "
            "it waits until the GPU has no lease")


def take_slots(gl: GpuLocks, req: LeaseRequest, waiter: Waiter) -> list[Held] | None:
    """``slots_each`` free slots of the GPU, or None. A slot named by a live holder record is
    not free even when its byte can be locked: the holder's lock file may have been deleted
    and replaced (an unprepared directory)."""
    f = gl.lock_file
    assert f is not None
    path = _fs.gpu_path(waiter.directory, gl.gpu.uuid)
    claimed = gl.claimed(req.slots_per_gpu)
    taken: list[Held] = []
    for slot in range(req.slots_per_gpu):
        if slot in claimed:
            continue
        byte = _locks.slot_offset(req.slots_per_gpu, slot)
        if _locks.try_take(f, byte):
            taken.append(Held(f, byte, path))
            if len(taken) == req.slots_each:
                # A lock on a file someone deleted and replaced would guard nothing.
                if not waiter.recheck or _locks.names_inode(f, path):
                    return taken
                break
    for h in taken:
        _locks.give_back(h.lock_file, h.byte)
    return None


def leased_reason(gl: GpuLocks, req: LeaseRequest) -> str:
    now = time.time()
    parts = []
    # Whether a holder is stopped (Ctrl-Z) is asked of /proc only here, for a blocked GPU.
    for h in gl.holders:
        shown = replace(h, stopped=_proc.is_stopped(h.pid, max_age_s=0.5))
        parts.append(f"{shown.who()} for {format_duration(max(0.0, now - h.started_at))}")
    recorded = {h.pid for h in gl.holders}
    f = gl.lock_file
    assert f is not None
    for slot in range(req.slots_per_gpu):
        owner = _locks.test_lock(f.fd, _locks.slot_offset(req.slots_per_gpu, slot), 1)
        if owner is not None and (owner.pid <= 0 or owner.pid not in recorded):
            parts.append(_locks.describe_owner(owner) + ", without a lease record")
            recorded.add(owner.pid)
        elif owner is None and _locks.held_here(f, _locks.slot_offset(req.slots_per_gpu, slot),
                                                1) and os.getpid() not in recorded:
            parts.append(f"pid {os.getpid()} (this process)")
            recorded.add(os.getpid())
        if len(parts) >= 8:
            break
    if not parts:
        return "leased (its holder is just leaving)"
    if req.slots_per_gpu > 1:
        used = sum(len(c.slots) for h in gl.holders for c in h.claims if c.uuid == gl.gpu.uuid)
        return f"{used}/{req.slots_per_gpu} slots leased by " + "; ".join(parts)
    return "leased by " + "; ".join(parts)
