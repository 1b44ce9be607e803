"""The progress record a rank shares with its supervisor: one small mmap'd file per rank.

The rank writes plain memory (no syscall per collective, so wrapping every collective costs
nanoseconds); the supervisor reads the file whenever it polls. A generation counter makes a
read that raced a write visible (odd while writing, or changed across the read), and the
reader simply retries. Times are CLOCK_MONOTONIC, which is one clock for every process of a
Linux host, so the supervisor can compare them with its own ``time.monotonic()``.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from enum import IntEnum

# gen, phase, collective count, phase entered at, first collective at, operation name
_FORMAT = "<IIQdd48s"
SIZE = struct.calcsize(_FORMAT)


class Phase(IntEnum):
    NOT_STARTED = 0  # the bootstrap has not run yet (interpreter still starting)
    STARTED = 1  # running the script, before init_process_group
    IN_INIT = 2  # inside init_process_group: waiting for the other ranks
    JOINED = 3  # init_process_group returned
    IN_COLLECTIVE = 4  # inside a collective (op names which)
    RUNNING = 5  # after a collective returned
    FINISHED = 6  # the script returned or called sys.exit
    FAILED = 7  # the script raised


@dataclass(frozen=True)
class RankStatus:
    phase: Phase
    collectives: int  # collectives entered so far
    since: float  # monotonic time the phase was entered
    first_collective_at: float  # 0.0 when none yet
    op: str

    @property
    def point(self) -> tuple[int, int]:
        """Where the rank waits: ranks at the same point are waiting for the same thing."""
        return (int(self.phase), self.collectives if self.phase is Phase.IN_COLLECTIVE else 0)

    def describe(self, now: float) -> str:
        age = now - self.since
        if self.phase is Phase.NOT_STARTED:
            return "has not started Python yet"
        if self.phase is Phase.STARTED:
            return f"has not called init_process_group ({age:.1f} s after it started)"
        if self.phase is Phase.IN_INIT:
            return f"waiting in init_process_group for {age:.1f} s"
        if self.phase is Phase.JOINED:
            return f"joined, no collective yet ({age:.1f} s ago)"
        if self.phase is Phase.IN_COLLECTIVE:
            return f"waiting in {self.op} (collective #{self.collectives}) for {age:.1f} s"
        if self.phase is Phase.RUNNING:
            return f"running, between collectives (last: {self.op} #{self.collectives})"
        if self.phase is Phase.FINISHED:
            return "finished its script"
        return "failed (exception or non-zero exit)"


class StatusWriter:
    """Rank side. Creates nothing: the supervisor made the file at its full size."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._gen = 0
        self._collectives = 0
        self._first = 0.0
        self._op = b""

    def set(self, phase: Phase, op: str | None = None) -> None:
        if op is not None:
            self._op = op.encode()[:48]
        if phase is Phase.IN_COLLECTIVE:
            self._collectives += 1
            if not self._first:
                self._first = time.monotonic()
        self._gen += 1  # odd: a write is under way
        struct.pack_into("<I", self._map, 0, self._gen)
        struct.pack_into(_FORMAT, self._map, 0, self._gen, int(phase), self._collectives,
                         time.monotonic(), self._first, self._op)
        self._gen += 1
        struct.pack_into("<I", self._map, 0, self._gen)


class StatusReader:
    """Supervisor side: creates the file (so a rank never races its creation) and reads it."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "wb") as f:
            f.write(b"\0" * SIZE)
        self._created = time.monotonic()
        self._map: mmap.mmap | None = None

    def read(self) -> RankStatus:
        if self._map is None:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                self._map = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        for _ in range(100):
            gen, phase, count, since, first, op = struct.unpack_from(_FORMAT, self._map, 0)
            (gen_after,) = struct.unpack_from("<I", self._map, 0)
            if gen % 2 == 0 and gen == gen_after:
                break
        if phase == Phase.NOT_STARTED:
            since = self._created
        return RankStatus(Phase(phase), count, since, first, op.rstrip(b"\0").decode(errors="replace"))

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

# The signal a supervisor sends to ask a rank for an all-thread Python stack dump. Not SIGUSR1:
# Lightning and other trainers use that one for Slurm requeueing.
STACK_SIGNAL_NAME = "SIGUSR2"
