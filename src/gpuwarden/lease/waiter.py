"""What a lease request keeps between its attempts (:class:`Waiter`), and what one attempt
answers (:class:`Attempt`). The attempt itself is ``attempt.py``'s; the loop of attempts and
waits is ``manager.py``'s."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuwarden.lease import _fs
from gpuwarden.lease.grant import Grant, LeaseRequest
from gpuwarden.lease.memory import DEFAULT_RESERVE_BYTES
from gpuwarden.lease.records import OwnedRecord
from gpuwarden.lease.scan import Scanner
from gpuwarden.lease.status import GpuState


@dataclass
class Attempt:
    granted: Grant | None = None
    states: tuple[GpuState, ...] = ()
    usable: int = 0  # probe only: GPUs that could be granted now
    watch: frozenset[str] = frozenset()  # names whose end may free what we need
    ahead: int = 0
    mutex_holders: str = ""  # set when the directory mutex could not be had in time


@dataclass
class Waiter:
    """State a request keeps between attempts."""

    request: LeaseRequest
    directory: Path
    # A directory `gpuwarden leases init` prepared: its lock files are root's, and a user
    # never creates one (it could delete its own file under another user's lock).
    config: _fs.PreparedConfig | None = None
    # This user's own directory (nobody else can write in it): a planted name left from
    # before is replaced rather than refused.
    private: bool = False
    scanner: Scanner | None = None
    ticket: OwnedRecord | None = None
    started_ns: int = field(default_factory=time.time_ns)
    # Earlier tickets seen able to take free GPUs, and since when (see IDLE_TURN_S).
    turn_since: dict[tuple[int, int, str], float] = field(default_factory=dict)

    @property
    def prepared(self) -> bool:
        return self.config is not None

    @property
    def recheck(self) -> bool:
        """Whether lock files may be replaced under us (a shared directory not prepared):
        then every use checks the path still names the file locked."""
        return not (self.prepared or self.private)

    @property
    def reserve_bytes(self) -> int:
        """What each GPU keeps out of memory leases: `leases init --mem-reserve`, or the
        default."""
        if self.config is not None and self.config.memory_reserve_bytes is not None:
            return self.config.memory_reserve_bytes
        return DEFAULT_RESERVE_BYTES

    @property
    def lock_owner(self) -> int | None:
        """Whose lock files alone are used: root's in a prepared directory, ours in our own."""
        if self.prepared:
            return 0
        return os.geteuid() if self.private else None

