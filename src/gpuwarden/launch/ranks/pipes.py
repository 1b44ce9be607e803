"""Reading the ranks' pipes and pseudo-terminals into their relays (the supervisor's selector).

A stream that the terminal's view shows (launch/ranks/terminal.py) is read once per wake-up,
the others' in turn: ranks that print the same lines as fast as they can then reach the view
milliseconds apart, not one pipe's worth of lines apart (read until empty, the first rank read
keeps the relay busy while the other ranks' lines wait in their buffers); and it is not read at
all while its lines wait for the other ranks' (``RankRelay.accepts``): it leaves the selector,
*paused*, and comes back as soon as they left, as a terminal's flow control would. Every other
stream, and every stream at the end (``ending``, ``drain``), is read until it is empty.

Between two rounds of such reads, when none found more than :data:`SMALL_READ_BYTES` (the relay
is ahead of the ranks), :func:`gather` naps :data:`GATHER_S` so that their output gathers: the
view's cost is per read (a look at its queues, a write), and on a quiet box the relay would
otherwise read each rank every few hundred bytes (2 ranks printing 1M lines each: 95-115k
reads, with the nap 25k, and 30% less of the launcher's CPU). A pseudo-terminal gives at most 4 KiB
a read and holds about 20 KiB before its writer waits, so a rank writing less than 40 MB/s is
never held up by the nap, and one with more than a small read waiting is never napped for.
"""

from __future__ import annotations

import os
import selectors
import time
from typing import Protocol

from gpuwarden.launch.ranks.relay import RankRelay
from gpuwarden.launch.ranks.stdio import RankStdio

SMALL_READ_BYTES = 2048  # half of what a pseudo-terminal gives in one read
GATHER_S = 0.0005


def gather(fullest: int) -> None:
    """Nap after a round of reads when even its fullest found little (``fullest`` bytes; 0:
    no stream was read once): see the module's docstring."""
    if 0 < fullest < SMALL_READ_BYTES:
        time.sleep(GATHER_S)


class _Reading(Protocol):
    relay: RankRelay
    stdio: RankStdio


class RankPipes:
    """The ranks' streams in ``sel``, registered with ``(rank, is_err)`` as their data."""

    def __init__(self, sel: selectors.BaseSelector) -> None:
        self.sel = sel
        # fd -> (rank, is_err): streams not read for now, their lines waiting in the view
        self.paused: dict[int, tuple[_Reading, bool]] = {}
        self.ending = False  # the last reads after every rank exited: whole pipes

    def read(self, rank: _Reading, fd: int, is_err: bool, drain: bool = False) -> int:
        """Read the stream (once, or until it is empty); what a read once got (0 otherwise)."""
        once = rank.relay.viewed(is_err) and not drain and not self.ending
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return 0
            except OSError:  # EIO: the rank's end of its pseudo-terminal is closed
                data = b""
            if not data:
                self.sel.unregister(fd)
                rank.relay.finish(is_err)
                return 0
            rank.relay.feed(is_err, data)
            if once:
                if not rank.relay.accepts(is_err):
                    self.sel.unregister(fd)
                    self.paused[fd] = (rank, is_err)
                return len(data)

    def resume_ready(self) -> None:
        """Paused streams whose lines have left: read again."""
        for fd, (rank, is_err) in list(self.paused.items()):
            if rank.relay.accepts(is_err):
                self._resume(fd)

    def end(self) -> None:
        """Every rank exited: what is left is read whole, nothing paused."""
        self.ending = True
        for fd in list(self.paused):
            self._resume(fd)

    def is_open(self) -> bool:
        return bool(self.paused) or any(
            isinstance(key.data, tuple) for key in self.sel.get_map().values())

    def drain(self, rank: _Reading) -> None:
        """Everything still in a rank's pipes (it exited): a paused stream too."""
        for fd in [fd for fd, _ in rank.stdio.reads if fd in self.paused]:
            self._resume(fd)
        registered = {k.fd for k in self.sel.get_map().values()}
        for fd, is_err in rank.stdio.reads:
            if fd in registered:
                self.read(rank, fd, is_err, drain=True)

    def clear(self) -> None:
        self.paused.clear()

    def _resume(self, fd: int) -> None:
        rank, is_err = self.paused.pop(fd)
        self.sel.register(fd, selectors.EVENT_READ, (rank, is_err))
