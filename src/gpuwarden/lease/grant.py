"""What a lease request asks for (:class:`LeaseRequest`, validated by :func:`make_request`) and
what it is granted (:class:`Grant`: the GPUs, the slots held, the holder record), released by
its holder or by its holder's death.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from gpuwarden.errors import UsageError
from gpuwarden.lease import _fs, _locks
from gpuwarden.lease.records import OwnedRecord, SlotClaim
from gpuwarden.lease.status import GpuState, describe_request
from gpuwarden.select import Constraints
from gpuwarden.units import parse_duration, parse_size
from gpuwarden.visibility import CHILD_ORDER_ENV

if TYPE_CHECKING:
    from gpuwarden.inventory.snapshot import GPUSnapshot


@dataclass(frozen=True)
class LeaseRequest:
    """A validated request. Build it with :func:`make_request` (or :func:`acquire`)."""

    constraints: Constraints
    slots_per_gpu: int = 1
    slots_each: int = 1
    wait_s: float | None = None
    label: str = ""
    # n="all": every GPU acceptable and free at the attempt (at least 1), decided under the
    # directory mutex; ``constraints.count`` is then 1, the least that serves the request.
    every_usable: bool = False
    up_to: int | None = None  # n="all" only: take at most this many
    # A memory lease: these bytes of each GPU, shared with other leases (0: slots/whole GPUs).
    memory_bytes: int = 0

    @property
    def gpus(self) -> int:
        return self.constraints.count

    def describe(self) -> str:
        return describe_request(self.gpus, self.constraints.min_free_bytes, self.slots_per_gpu,
                                self.slots_each, every_usable=self.every_usable,
                                memory_bytes=self.memory_bytes)


def make_request(n: int | Literal["all"] | None = None, *, min_free: str | int | None = None,
                 slots_per_gpu: int = 1, slots_each: int = 1,
                 wait: str | float | None = None, constraints: Constraints | None = None,
                 label: str | None = None, up_to: int | None = None,
                 mem: str | int | None = None) -> LeaseRequest:
    """Validate the arguments of :func:`acquire`; UsageError (exit 2) names the bad one."""
    base = constraints or Constraints()
    every_usable = n == "all"
    count = 1 if every_usable else base.count if n is None else n
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise UsageError(f"n={count!r}: a lease needs at least 1 GPU",
                         fix="ask for n >= 1, or n='all' for every usable GPU")
    if not isinstance(slots_per_gpu, int) or slots_per_gpu < 1:
        raise UsageError(f"slots_per_gpu={slots_per_gpu!r} must be 1 or more",
                         fix="1 for a whole GPU, K to let K requests share each GPU")
    if not isinstance(slots_each, int) or not 1 <= slots_each <= slots_per_gpu:
        raise UsageError(f"slots_each={slots_each!r} must be between 1 and slots_per_gpu "
                         f"({slots_per_gpu})", fix="slots_each=slots_per_gpu takes whole GPUs")
    min_free_bytes = base.min_free_bytes
    if min_free is not None:
        given = min_free if isinstance(min_free, int) else parse_size(min_free, what="min_free")
        min_free_bytes = max(min_free_bytes, given)
    if up_to is not None and (not every_usable or not isinstance(up_to, int) or up_to < 1):
        raise UsageError(f"up_to={up_to!r}: only with n='all', and at least 1",
                         fix="lease(n='all', up_to=2) takes every usable GPU, at most 2")
    wait_s = None if wait is None else parse_duration(wait, what="wait")
    memory_bytes = 0
    if mem is not None:
        memory_bytes = mem if isinstance(mem, int) and not isinstance(mem, bool) else \
            parse_size(str(mem), what="mem")
        if memory_bytes < 1:
            raise UsageError(f"mem={mem!r}: a memory lease needs more than 0 bytes",
                             fix="e.g. mem='20GiB'")
        if slots_per_gpu != 1 or slots_each != 1:
            raise UsageError(f"mem={mem!r} with slots_per_gpu={slots_per_gpu}: a lease is "
                             "memory or slots, not both",
                             fix="mem='6GiB' shares a GPU by memory; slots_per_gpu=K in K "
                             "equal slots")
    return LeaseRequest(
        constraints=replace(base, count=count, min_free_bytes=min_free_bytes),
        slots_per_gpu=slots_per_gpu, slots_each=slots_each, wait_s=wait_s, label=label or "",
        every_usable=every_usable, up_to=up_to, memory_bytes=memory_bytes,
    )


@dataclass(frozen=True)
class Held:
    """One slot this process holds: a byte of a GPU's lock file (``shared``: the read lock
    every memory lease of the GPU holds on byte 0)."""

    lock_file: _locks._Inode
    byte: int
    path: Path
    shared: bool = False


class Grant:
    """GPUs leased to this process. Release with :meth:`release` or by leaving ``with``.

    ``gpus`` are in the order the child will number them (``cuda:0`` first);
    ``visible_devices`` and ``env`` are what a child needs to see exactly them. The
    claim belongs to the process that called :func:`acquire`: children (fork or exec)
    never hold it, and it ends when that process ends, however it ends.
    """

    def __init__(self, gpus: tuple[GPUSnapshot, ...], claims: tuple[SlotClaim, ...],
                 held: list[Held], record: OwnedRecord, lease_dir: Path, request: LeaseRequest,
                 waited_s: float, states: tuple[GpuState, ...] = ()) -> None:
        self.gpus = gpus
        self.claims = claims
        self.lease_dir = lease_dir
        self.request = request
        self.waited_s = waited_s
        # Every visible GPU as the granting attempt judged it: why taken, or why not (bytes).
        self.states = states
        self.visible_devices = ",".join(g.cuda_id for g in gpus)
        self.env: dict[str, str] = {"CUDA_VISIBLE_DEVICES": self.visible_devices,
                                    **CHILD_ORDER_ENV}
        if request.memory_bytes:
            from gpuwarden.mps import pinned_memory_env

            # Where MPS runs, the driver itself holds the child to its lease.
            self.env.update(pinned_memory_env(request.memory_bytes, len(gpus)))
        self._held = held
        self._record = record
        # A shared flock on the directory: systemd-tmpfiles does not age a locked directory.
        self._dir_fd = _fs.hold_dir(lease_dir)  # the process's descriptor: never closed here
        self._owner_pid = os.getpid()
        self._lock = threading.Lock()
        _fs.track(self)

    @property
    def holder_id(self) -> str:
        return self._record.record.record_id

    @property
    def memory_bytes(self) -> int:
        """The bytes leased on each GPU (0: slots or whole GPUs)."""
        return self.request.memory_bytes

    @property
    def held(self) -> bool:
        return bool(self._held) and os.getpid() == self._owner_pid

    def release(self) -> None:
        """Give the slots back. Idempotent; a no-op (beyond forgetting) in a forked child."""
        with self._lock:
            if os.getpid() != self._owner_pid:
                self._close_in_child()
                return
            held, self._held = self._held, []
            # Slots first, then the record: a waiter woken by the record's deletion finds
            # the slots already free.
            for h in held:
                if h.shared:
                    _locks.give_back_shared(h.lock_file, h.byte)
                else:
                    _locks.give_back(h.lock_file, h.byte)
            if held:
                self._record.remove()
            self._dir_fd = -1  # the process's own (hold_dir): not closed here
        _fs.untrack(self)

    def verify(self) -> list[str]:
        """What has happened to this lease's files since it was granted (empty: nothing).

        In a directory `gpuwarden leases init` did not prepare, another user can delete a
        lock file this lease holds and create a new one at its path; the lease directory can
        be deleted (a tmp cleaner). The lease still stands (its live record keeps other
        gpuwarden requests off its slots) but its holder should know, and say so."""
        problems: list[str] = []
        if not self.held:
            return problems
        if not _fs.same_dir(self._dir_fd, self.lease_dir):
            problems.append(f"the lease directory {self.lease_dir} was deleted or replaced")
        for path in dict.fromkeys(h.path for h in self._held if not _locks.names_inode(
                h.lock_file, h.path)):
            problems.append(f"the lock file {path.name} was deleted or replaced")
        record_fd = self._record.fd
        if record_fd is not None and not _fs.same_file(record_fd, self._record.path):
            problems.append(f"the record {self._record.path.name} was deleted or replaced")
        return problems

    def _close_in_child(self) -> None:
        # The child holds none of the parent's POSIX locks: forget them, never unlock.
        self._held = []
        self._dir_fd = -1
        self._record._close_in_child()

    def __enter__(self) -> Grant:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()

    def __repr__(self) -> str:
        state = "held" if self.held else "released"
        return f"<Grant {self.visible_devices!r} {state} id={self.holder_id}>"
