"""Process plumbing shared by every process gpuwarden starts: launch ranks, pool workers, the
pool's fork server. Standard library only (the rank bootstrap imports it before the script runs)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Iterable, Sequence

TYPE_CHECKING = False  # neither typing nor dataclasses at run time: see gpuwarden/__init__.py
if TYPE_CHECKING:
    from typing import Any

_PR_SET_PDEATHSIG = 1


def _resolve_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved once, at import, in the parent: die_with_parent then makes only system calls, so it
# is safe as a subprocess preexec_fn (between fork and exec, where a dlopen could deadlock on
# a lock another thread of the parent held at the fork).
_PRCTL = _resolve_prctl()


def die_with_parent(expected_ppid: int, *, exit_code: int = 1) -> None:
    """Make the kernel SIGKILL this process when its parent dies (Linux prctl).

    The parent may already be gone by the time this runs (we were re-parented to init or a
    subreaper): then exit at once instead of living on as an orphan. Elsewhere the pipe EOF
    a worker sees on its task connection is the only watchdog. Safe as a ``preexec_fn``.
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != expected_ppid:
        os._exit(exit_code)


def announce_group(reaper_fd: int) -> None:
    """In a child between fork and exec (a ``preexec_fn``, after its setsid/setpgid): tell the
    watcher the group this process leads, before it runs a single instruction of its own, so
    that an owner SIGKILLed at once still has it killed. One write of one line: atomic on a pipe,
    never mixed with the owner's own lines."""
    if reaper_fd >= 0:
        try:
            os.write(reaper_fd, b"+%d\n" % os.getpid())
        except OSError:
            pass


def shell_exit_code(returncode: int) -> int:
    """A subprocess returncode as a shell reports it: the exit code, or 128+N for signal N."""
    return returncode if returncode >= 0 else 128 - returncode


def signal_name(signum: int) -> str:
    """'SIGKILL' for 9; 'signal 77' for a number with no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int | None) -> str:
    """'SIGKILL(-9)', 'exit code 3', or 'unknown exit status' — the loky form for signals."""
    if returncode is None:
        return "unknown exit status"
    if returncode < 0:
        return f"{signal_name(-returncode)}({returncode})"
    return f"exit code {returncode}"


def status_to_returncode(status: int) -> int:
    """A waitpid status as subprocess reports it: -signal, or the exit code."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def short_command(argv: Sequence[str], width: int = 80) -> str:
    """A command line cut to ``width`` characters in the middle: the program and the end (where
    the script and its arguments are) say more than a long path prefix."""
    text = " ".join(argv)
    if len(text) <= width:
        return text
    head = width // 3
    return f"{text[:head]}…{text[-(width - head - 1):]}"


class ProcStat:
    """A process as /proc/PID/stat tells it: what identifies it across pid reuse (its start
    time, in clock ticks since boot) and the group and session it is in now. (A plain class,
    not a dataclass: the rank bootstrap imports this module, dataclasses costs it ~6 ms.)"""

    __slots__ = ("pid", "ppid", "pgrp", "session", "start_ticks")

    def __init__(self, pid: int, ppid: int, pgrp: int, session: int, start_ticks: int) -> None:
        self.pid = pid
        self.ppid = ppid
        self.pgrp = pgrp
        self.session = session
        self.start_ticks = start_ticks


def proc_stat(pid: int) -> ProcStat | None:
    """``pid``'s stat line, None when there is no such process (or /proc is missing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
        fields = data[data.rindex(b")") + 2:].split()
        return ProcStat(pid, int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))
    except (OSError, ValueError, IndexError):
        return None


def live_group_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that are not zombies (a scan of /proc): while its
    leader is an unreaped zombie, ``killpg(pgid, 0)`` succeeds even with nobody else left."""
    members: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return members
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read(512)
            fields = data[data.rindex(b")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != b"Z":
                members.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return members


# The watcher reads commands, one a line:
#   "+G START SID" a process group led by pid G (started at START ticks, in session SID);
#   "-G" forget it; "p+P START" one process; "p-P" forget it; "c PATH" a job's cgroup;
#   "done" its owner finished cleanly. End of input without "done" means the owner died
#   (SIGKILL, OOM killer): kill all of it, each after checking it is still what was registered.
_REAPER_SOURCE = r"""
import os, signal, sys, time

# The signals named on the command line stay pending here instead of acting: the owner reads
# them in /proc (see GroupReaper.got) and has them taken away with the line "n".
held = {int(x) for x in sys.argv[1:]}
signal.pthread_sigmask(signal.SIG_BLOCK, held)
groups, pids, cgroups = {}, {}, []

def stat(pid):
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read(4096)
        x = data[data.rindex(b")") + 2:].split()
        return int(x[2]), int(x[3]), int(x[19])  # pgrp, session, start time
    except (OSError, ValueError, IndexError):
        return None

def kill_pid(pid, start):
    # A pidfd names one process for good: checked after it is opened, the start time proves
    # the pid was not reused meanwhile, and the signal cannot reach another process.
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return
    try:
        st = stat(pid)
        if st is not None and st[2] == start:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)

def kill_group(pgid, start, sid):
    st = stat(pgid)
    if st is not None:
        if st[2] == start:  # its leader, alive or a zombie: the group is still the one we knew
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
        return  # the pid is another process's now: so is any group of that number
    # The leader is gone: the members still in its group and session, started after it.
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if name.isdigit():
            st = stat(int(name))
            if st is not None and st[0] == pgid and st[1] == sid and st[2] >= start:
                kill_pid(int(name), st[2])

def kill_cgroup(path):
    try:
        with open(path + "/cgroup.kill", "w") as f:
            f.write("1")
        return
    except OSError:
        pass
    try:  # before Linux 5.14: freeze, kill what is in it, thaw
        with open(path + "/cgroup.freeze", "w") as f:
            f.write("1")
        with open(path + "/cgroup.procs") as f:
            members = [int(x) for x in f.read().split()]
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        with open(path + "/cgroup.freeze", "w") as f:
            f.write("0")
    except (OSError, ValueError):
        pass

for line in sys.stdin:
    word = line.split()
    if not word:
        continue
    if word[0] == "done":
        sys.exit(0)
    try:
        if word[0] == "n":
            while held and signal.sigtimedwait(held, 0) is not None:
                pass
        elif word[0] == "c":
            cgroups.append(line[2:].rstrip("\n"))
        elif word[0].startswith("p+"):
            pids[int(word[0][2:])] = int(word[1])
        elif word[0].startswith("p-"):
            pids.pop(int(word[0][2:]), None)
        elif word[0].startswith("+"):
            # "+G" alone: a group registered the moment its leader was started, before its
            # start time could be read (killed as is if the owner dies in that moment).
            groups[int(word[0][1:])] = (int(word[1]), int(word[2])) if len(word) > 2 else None
        elif word[0].startswith("-"):
            groups.pop(int(word[0][1:]), None)
    except (ValueError, IndexError):
        pass
for _ in range(3):  # again, for what was starting while the first round ran
    for path in cgroups:
        kill_cgroup(path)
    for pgid, known in list(groups.items()):
        if known is None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
        else:
            kill_group(pgid, *known)
    for pid, start in list(pids.items()):
        kill_pid(pid, start)
    time.sleep(0.05)
for path in cgroups:
    for _ in range(100):
        try:
            os.rmdir(path)
            break
        except OSError:
            time.sleep(0.05)
"""


class GroupReaper:
    """A tiny watcher process that kills what its owner registered if the owner dies.

    PR_SET_PDEATHSIG reaches only a direct child; a rank's or a command's own children live on
    in its process group, and no cleanup code runs when the owner is SIGKILLed. The watcher is
    a fresh interpreter (``python -S``, no fork of a process that may have threads or lease
    locks), in its own session so a signal to the owner's group spares it, and it learns of
    the owner's death from end of input on its stdin.

    It never signals what is no longer its owner's: a group is registered with its leader's
    start time and killed only while that leader (alive or a zombie) is still there, or, once
    the leader is gone, member by member through pidfds after checking each one's session and
    start time; a single process is killed through a pidfd after the same check; a job's
    cgroup is killed whole (``cgroup.kill``). The owner removes a group before it reaps the
    group's leader.

    The signals in ``hold`` are blocked in the watcher: they neither end it nor act on it,
    they stay pending, where :meth:`got` sees them. The watcher is placed as a launcher's
    ranks are (the owner's child, a session of its own), so a signal it got too was sent to
    more than the owner: to the owner's whole process tree (Slurm's proctrack/linuxproc), its
    cgroup (proctrack/cgroup), every process of a name (``pkill``). That is how a launcher
    knows whether its ranks already got a signal it would pass on to them.
    """

    def __init__(self, hold: Iterable[int] = ()) -> None:
        import subprocess

        self.hold = frozenset(int(s) for s in hold)
        self._proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _REAPER_SOURCE, *map(str, sorted(self.hold))],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        self.groups: set[int] = set()
        self.pids: set[int] = set()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def announce_fd(self) -> int:
        """The watcher's input, for :func:`announce_group` in a child being started (-1: gone)."""
        stdin = self._proc.stdin
        return stdin.fileno() if stdin is not None and not stdin.closed else -1

    def _tell(self, line: str) -> None:
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.write(f"{line}\n".encode())
                self._proc.stdin.flush()
            except (OSError, ValueError):
                pass

    def add(self, pgid: int) -> bool:
        """Register the process group ``pgid``, led by the live (or unreaped) process of that
        pid; False when it is already gone (nothing registered)."""
        self._tell(f"+{pgid}")  # at once: the owner may die before /proc is read
        st = proc_stat(pgid)
        if st is None:
            self._tell(f"-{pgid}")
            return False
        self.groups.add(pgid)
        self._tell(f"+{pgid} {st.start_ticks} {st.session}")
        return True

    def remove(self, pgid: int) -> None:
        """Forget ``pgid`` (before its leader is reaped: its number may then be reused)."""
        if pgid in self.groups:
            self.groups.discard(pgid)
            self._tell(f"-{pgid}")

    def add_process(self, pid: int, start_ticks: int) -> None:
        self.pids.add(pid)
        self._tell(f"p+{pid} {start_ticks}")

    def remove_process(self, pid: int) -> None:
        if pid in self.pids:
            self.pids.discard(pid)
            self._tell(f"p-{pid}")

    def add_cgroup(self, path: str) -> None:
        self._tell(f"c {path}")

    def got(self, sig: int) -> bool | None:
        """Whether signal ``sig`` (one of ``hold``) is pending in the watcher: it was sent to the
        watcher too. None when that cannot be known (not held, the watcher gone, or its
        blocked mask not in place yet: it blocks them first thing after it starts)."""
        if sig not in self.hold or self._proc.poll() is not None:
            return None
        masks = {}
        try:
            with open(f"/proc/{self._proc.pid}/status", encoding="ascii") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in ("ShdPnd", "SigPnd", "SigBlk"):
                        masks[key] = int(value.strip(), 16)
        except (OSError, ValueError):
            return None
        bit = 1 << (sig - 1)
        if len(masks) < 3 or not masks["SigBlk"] & bit:
            return None
        return bool((masks["ShdPnd"] | masks["SigPnd"]) & bit)

    def forget_signals(self) -> None:
        """Have the watcher take its pending held signals, so that :meth:`got` sees the next."""
        self._tell("n")

    def close(self) -> None:
        """The owner is finishing cleanly: the watcher exits without killing anything."""
        import subprocess

        self._tell("done")
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
