"""What several benchmarks need of the processes they time (imported as a sibling module: the
benchmarks run as scripts from this folder)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import psutil


def wait_or_kill_tree(proc: subprocess.Popen[bytes], cap_s: float) -> int | None:
    """``proc``'s exit code, or None when it outlived ``cap_s`` and its whole tree was killed.
    The tree is listed before the group is killed: a launcher's ranks may each run in a
    session of their own (torchrun's do), out of reach of the launcher's group."""
    try:
        return proc.wait(cap_s)
    except subprocess.TimeoutExpired:
        tree = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for child in tree:
            with contextlib.suppress(psutil.Error):
                child.kill()
        proc.wait()
        return None
