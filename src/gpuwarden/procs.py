"""Process plumbing shared by every process gpuwarden starts: launch ranks, pool workers, the
pool's fork server. Standard library only (the rank bootstrap imports it before the script runs)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_ppid: int, *, exit_code: int = 1) -> None:
    """Make the kernel SIGKILL this process when its parent dies (Linux prctl).

    The parent may already be gone by the time this runs (we were re-parented to init or a
    subreaper): then exit at once instead of living on as an orphan. Elsewhere the pipe EOF
    a worker sees on its task connection is the only watchdog.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != expected_ppid:
        os._exit(exit_code)


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


def short_command(argv: list[str], width: int = 80) -> str:
    """A command line cut to ``width`` characters in the middle: the program and the end (where
    the script and its arguments are) say more than a long path prefix."""
    text = " ".join(argv)
    if len(text) <= width:
        return text
    head = width // 3
    return f"{text[:head]}…{text[-(width - head - 1):]}"
