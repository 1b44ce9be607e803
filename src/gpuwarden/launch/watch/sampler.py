"""Where each rank is, seen from outside: its Python stack and its CPU time, now and then.

Each tick the sampler reads the sample the rank's sampling thread wrote since the last tick
(asked for then; it is written in well under a millisecond), then asks for the next one by
writing a byte to the rank's request FIFO. Nothing waits: a sample is one tick old when read,
stamped with the time it was asked for. The rank's thread takes the stacks under the GIL
(``sys._current_frames``), which every collective, ``.wait()`` and sleep releases, so it
answers while the script is blocked in C++. CPU time comes from ``/proc/PID/stat`` (all
threads). The supervisor keeps the samples; :func:`gpuwarden.launch.watch.stall.decide_stall` judges
them.

For the report, a rank that does not answer within a second (a C extension holding the GIL)
is asked once through faulthandler's signal handler instead (``status.STACK_SIGNAL``), which
reads the frames without the GIL.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time

from gpuwarden.launch.watch.stall import Sample, main_thread, parse_dump
from gpuwarden.launch.watch.status import STACK_SIGNAL, sample_paths

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MAX_DUMP_BYTES = 1 << 20  # a dump of thousands of threads is cut here, never read whole


def sample_interval(stall_timeout_s: float) -> float:
    """Often enough to name a stall within a second or two of the timeout, rarely enough to
    cost nothing."""
    return min(2.0, max(0.25, stall_timeout_s / 8))


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (all its threads), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (IndexError, ValueError):
        return None


def make_request_fifo(stack_file: str) -> None:
    """Created by the supervisor before the rank starts (the job's private directory)."""
    fifo, _ = sample_paths(stack_file)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(fifo)
    os.mkfifo(fifo, 0o600)


def read_dump(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_DUMP_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return ""


class RankSampler:
    """The samples of one rank (bounded: enough to cover the stall timeout)."""

    def __init__(self, pid: int, stack_file: str, keep: int) -> None:
        self.pid = pid
        self.stack_file = stack_file
        self.request_fifo, self.sample_file = sample_paths(stack_file)
        self.samples: collections.deque[Sample] = collections.deque(maxlen=keep)
        self.last_dump = ""  # the latest dump with the script's thread in it, for the report
        self._asked_at: float | None = None
        self._cpu_at_ask: float | None = None
        self._seen: tuple[int, int] | None = None  # (inode, mtime) of the last sample read
        self._fd: int | None = None

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.sample_file)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns)

    def _new_dump(self) -> str:
        """The sample written since the last one read, or ''."""
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return ""
        self._seen = stamp
        dump = read_dump(self.sample_file)
        if main_thread(parse_dump(dump)):
            self.last_dump = dump
        return dump

    def _ask(self) -> bool:
        try:
            if self._fd is None:
                self._fd = os.open(self.request_fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.write(self._fd, b"s")
        except OSError:  # no reader yet or any more, or the FIFO is full (rank not answering)
            return False
        return True

    def tick(self, now: float) -> None:
        """Collect the sample asked for last tick, then ask for the next one."""
        if self._asked_at is not None:
            dump = self._new_dump()
            frames = tuple(main_thread(parse_dump(dump))) if dump else ()
            self.samples.append(Sample(self._asked_at, frames, self._cpu_at_ask))
        self._cpu_at_ask = cpu_seconds(self.pid)
        self._asked_at = now if self._ask() else None

    def fresh_dump(self, wait_s: float = 1.0) -> str:
        """A dump taken now (for the report): from the sampling thread, else from faulthandler's
        signal handler, else the latest one."""
        self._new_dump()  # whatever is pending is not fresh
        if self._ask():
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                time.sleep(0.01)
                dump = self._new_dump()
                if dump:
                    self._asked_at = None  # answered: the next tick starts a fresh request
                    return dump
        return self._signal_dump(wait_s) or self.last_dump

    def _signal_dump(self, wait_s: float) -> str:
        with contextlib.suppress(OSError):
            os.truncate(self.stack_file, 0)
        try:
            os.kill(self.pid, STACK_SIGNAL)
        except (ProcessLookupError, PermissionError):
            return ""
        deadline = time.monotonic() + wait_s
        size = -1
        while time.monotonic() < deadline:
            time.sleep(0.02)
            try:
                now_size = os.path.getsize(self.stack_file)
            except OSError:
                break
            if now_size > 0 and now_size == size:
                break  # written, and nothing more since the last look
            size = now_size
        dump = read_dump(self.stack_file)
        return dump if main_thread(parse_dump(dump)) else ""

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
