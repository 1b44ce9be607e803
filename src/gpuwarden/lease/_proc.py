"""Who a uid or a pid is, as the kernel says it: a user's name, a process's state, real uid
and command line, read bounded from /proc (never what a lease record claims); escaped, for
display. Used by the lease directory's checks (``_fs.py``), its locks (``_locks.py``: who holds
one) and its records.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pwd
import time
from dataclasses import dataclass

from gpuwarden.safetext import escape_untrusted


@functools.lru_cache(maxsize=256)
def user_name(uid: int) -> str:
    try:
        return escape_untrusted(pwd.getpwuid(uid).pw_name, 64)
    except KeyError:
        return f"uid {uid}"


def _read_proc(path: str, limit: int) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` from /proc (``T``/``t``: stopped), None when unknown."""
    if pid <= 0:
        return None
    data = _read_proc(f"/proc/{pid}/stat", 4096)
    try:
        return None if data is None else data[data.rindex(b")") + 2:][:1].decode()
    except (ValueError, UnicodeDecodeError):
        return None


_states: dict[int, tuple[float, bool]] = {}


def is_stopped(pid: int, max_age_s: float = 0.0) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, Ctrl-Z, a debugger); with ``max_age_s``, an answer
    read that recently may be reused (for display: a waiter retries many times a second)."""
    if max_age_s:
        known = _states.get(pid)
        if known is not None and time.monotonic() - known[0] < max_age_s:
            return known[1]
    stopped = process_state(pid) in ("T", "t")
    if len(_states) > 4096:
        _states.clear()
    _states[pid] = (time.monotonic(), stopped)
    return stopped


def process_uid(pid: int) -> int | None:
    """The real uid of ``pid`` (its /proc status), None when unknown."""
    data = _read_proc(f"/proc/{pid}/status", 8192)
    if data is None:
        return None
    for line in data.splitlines():
        if line.startswith(b"Uid:"):
            with contextlib.suppress(ValueError, IndexError):
                return int(line.split()[1])
    return None


def process_start_ns(pid: int) -> int | None:
    """When ``pid`` started, as Unix time in ns (its /proc stat's start, counted in clock
    ticks since boot: 10 ms resolution), None when there is no such process."""
    if pid <= 0:
        return None
    data = _read_proc(f"/proc/{pid}/stat", 4096)
    if data is None:
        return None
    try:
        # After the command's closing parenthesis: field 3 (state) on; starttime is field 22.
        ticks = int(data[data.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None
    since_boot_ns = ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    return time.time_ns() - time.clock_gettime_ns(time.CLOCK_BOOTTIME) + since_boot_ns


@dataclass(frozen=True)
class ProcessFacts:
    """What the kernel says about a process (never what a record claims); escaped."""

    pid: int
    user: str
    command: str
    stopped: bool

    def describe(self) -> str:
        what = ", ".join(x for x in (self.user, self.command, "stopped" if self.stopped else "")
                         if x)
        return f"pid {self.pid} ({what})" if what else f"pid {self.pid}"


def process_facts(pid: int) -> ProcessFacts:
    uid = process_uid(pid)
    user = user_name(uid) if uid is not None else ""
    command = ""
    data = _read_proc(f"/proc/{pid}/cmdline", 4096)
    if data:
        argv = [a.decode(errors="replace") for a in data.split(b"\0") if a]
        command = escape_untrusted(" ".join(argv), 80)
    return ProcessFacts(pid, user, command, is_stopped(pid))


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` from /proc (0 for the top of a PID namespace), None when
    unknown (gone, or not in this PID namespace)."""
    if pid <= 0:
        return None
    data = _read_proc(f"/proc/{pid}/stat", 4096)
    try:
        return None if data is None else int(data[data.rindex(b")") + 2:].split()[1])
    except (ValueError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (/proc/<pid>/stat field 22): with the pid,
    what names one process for ever (a pid alone is reused)."""
    data = _read_proc(f"/proc/{pid}/stat", 4096)
    try:
        return None if data is None else int(data[data.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


MAX_LINEAGE = 64  # ancestors followed at most (a chain of shells and launchers is short)


def nearest_owner(pid: int, owners: frozenset[int] | set[int],
                  parents: dict[int, int | None] | None = None) -> int | None:
    """The first of ``pid`` itself and its ancestors (the kernel's parent links) that is in
    ``owners``, None when none is. ``parents`` caches parent links for one batch of questions
    (one attempt, one listing): a process's parent changes only when the parent dies."""
    seen = 0
    current: int | None = pid
    while current is not None and current > 0 and seen < MAX_LINEAGE:
        if current in owners:
            return current
        if parents is None:
            current = parent_of(current)
        else:
            if current not in parents:
                parents[current] = parent_of(current)
            current = parents[current]
        seen += 1
    return None
