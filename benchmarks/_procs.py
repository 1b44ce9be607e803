"""What several benchmarks need of the processes they time (imported as a sibling module: the
benchmarks run as scripts from this folder)."""

from __future__ import annotations

import compileall
import contextlib
import os
import signal
import subprocess
from pathlib import Path

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


def as_installed(*package_dirs: Path) -> None:
    """gpuwarden's modules as an install has them: compiled once to bytecode files, and
    loaded from those by every process the benchmark starts. pip compiles a wheel's modules
    when it installs it (as it did for joblib, loky and torch here); an editable install does
    not, and where PYTHONDONTWRITEBYTECODE is set (this machine's environment sets it) every
    new interpreter compiles them again: ~20 ms more for a pool's process server, ~0.2 s of CPU
    for a launcher. Without this the benchmark would time that, on gpuwarden's side alone."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    for folder in package_dirs:
        compileall.compile_dir(str(folder), quiet=1)
