"""The record a rank's bootstrap shares with its supervisor: one small mmap'd file per rank.

It holds only what the bootstrap itself knows without touching torch: the script started (the
stack signal's handler is armed), finished, or failed (an uncaught exception, recorded before
the interpreter's slow teardown, so the supervisor stops the other ranks at once). Where a rank
*is* (init, a collective, computing) is not recorded here: the supervisor samples it from
outside (``launch/watch/stall.py``). A generation counter makes a read that raced a write visible
(odd while writing, or changed across the read), and the reader retries. Times are
CLOCK_MONOTONIC, one clock for every process of a Linux host.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import time
from enum import IntEnum

# gen, phase, phase entered at
_FORMAT = "<IId"
SIZE = struct.calcsize(_FORMAT)

def sample_paths(stack_file: str) -> tuple[str, str]:
    """(request FIFO, sample file) beside a rank's faulthandler file: the supervisor writes a
    byte to the FIFO, the rank's sampling thread answers with its stacks in the sample file."""
    return f"{stack_file}.request", f"{stack_file}.sample"


def query_path(stack_file: str) -> str:
    """Where the sampling thread answers a ``q`` byte (someone asked, ``gpuwarden stacks``):
    apart from the sample file, so an answer never takes the place of the supervisor's sample."""
    return f"{stack_file}.query"


# The signal a supervisor sends to ask a rank for an all-thread Python stack dump (faulthandler),
# as a last resort only: when the rank's sampling thread cannot answer (a C extension holding
# the GIL). faulthandler reads the other threads' frames without the GIL, which can crash a
# thread that is changing them at that moment (torch.compile does): never used periodically.
# A real-time signal that nothing in a training stack uses: SIGUSR1/SIGUSR2 belong to the user
# (Slurm's preemption notice, Lightning's requeue; gpuwarden launch forwards them to the ranks),
# SIGPROF/SIGALRM to profilers and timers. glibc reserves SIGRTMIN..SIGRTMIN+1 for its threads
# (Python's signal.SIGRTMIN is already past them); +6 stays clear of the low numbers other
# runtimes pick. faulthandler's handler uses SA_RESTART, so interrupted system calls resume.
STACK_SIGNAL: int = int(signal.SIGRTMIN) + 6


class Phase(IntEnum):
    NOT_STARTED = 0  # the bootstrap has not run yet (interpreter still starting)
    STARTED = 1  # running the script; the stack signal is safe to send
    FINISHED = 2  # the script returned or called sys.exit(0)
    FAILED = 3  # the script raised, or exited with a non-zero code


class RankStatus:
    """One read of a rank's record. (A plain class, not a dataclass: the rank bootstrap
    imports this module before the script runs, and dataclasses would cost it ~6 ms.)"""

    __slots__ = ("phase", "since")

    def __init__(self, phase: Phase, since: float) -> None:
        self.phase = phase
        self.since = since  # monotonic time the phase was entered


class StatusWriter:
    """Rank side. Creates nothing: the supervisor made the file at its full size."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._gen = 0

    def set(self, phase: Phase) -> None:
        self._gen += 1  # odd: a write is under way
        struct.pack_into("<I", self._map, 0, self._gen)
        struct.pack_into(_FORMAT, self._map, 0, self._gen, int(phase), time.monotonic())
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
            gen, phase, since = struct.unpack_from(_FORMAT, self._map, 0)
            (gen_after,) = struct.unpack_from("<I", self._map, 0)
            if gen % 2 == 0 and gen == gen_after:
                break
        if phase == Phase.NOT_STARTED:
            since = self._created
        return RankStatus(Phase(phase), since)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
