"""Process plumbing shared by every process gpuwarden starts: launch ranks, pool workers, the
pool's fork server. Standard library only (the rank bootstrap imports it before the script runs)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence
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


# The reaper reads "+PGID" / "-PGID" lines; "done" means its owner finished cleanly. End of input
# without "done" means the owner died (SIGKILL, OOM killer): SIGKILL every group still listed.
_REAPER_SOURCE = """
import os, signal, sys
groups = set()
for line in sys.stdin:
    line = line.strip()
    if line == "done":
        sys.exit(0)
    if line[:1] == "+":
        groups.add(int(line[1:]))
    elif line[:1] == "-":
        groups.discard(int(line[1:]))
for g in groups:
    try:
        os.killpg(g, signal.SIGKILL)
    except OSError:
        pass
"""


class GroupReaper:
    """A tiny watcher process that SIGKILLs the registered process groups if its owner dies.

    PR_SET_PDEATHSIG reaches only a direct child; a rank's or a command's own children live on
    in its process group, and no cleanup code runs when the owner is SIGKILLed. The watcher is
    a fresh interpreter (``python -S``, no fork of a process that may have threads or lease
    locks), in its own session so a signal to the owner's group spares it, and it learns of
    the owner's death from end of input on its stdin.
    """

    def __init__(self) -> None:
        import subprocess

        self._proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _REAPER_SOURCE], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _tell(self, line: str) -> None:
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.write(f"{line}\n".encode())
                self._proc.stdin.flush()
            except OSError:
                pass

    def fileno(self) -> int:
        """The write end of the watcher's input (-1 once closed). A child may write its own
        ``+PGID`` line there before it execs (one write, atomic in a pipe): then its group is
        known to the watcher before any of its code runs, however soon the owner dies."""
        stdin = self._proc.stdin
        return -1 if stdin is None or stdin.closed else stdin.fileno()

    def add(self, pgid: int) -> None:
        self._tell(f"+{pgid}")

    def remove(self, pgid: int) -> None:
        self._tell(f"-{pgid}")

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
