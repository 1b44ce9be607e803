"""NVIDIA MPS (Multi-Process Service), seen from outside: is its control daemon up, and the
variables that make the driver hold an MPS client to a memory lease.

Where the MPS control daemon runs, every CUDA process of the host becomes an MPS client, and a
client started with ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=20480M"`` cannot allocate more than
that on its device 0: the driver enforces a memory lease, not only gpuwarden's guard. Without
MPS the variable is ignored; gpuwarden sets it only where the daemon is up, so a child's
environment says what applies to it.

The daemon writes its pid to ``nvidia-cuda-mps-control.pid`` in its pipe directory
(``CUDA_MPS_PIPE_DIRECTORY``, default ``/tmp/nvidia-mps``); "up" is that pid naming a live process
called ``nvidia-cuda-mps-control`` (the kernel's name of it, ``/proc/<pid>/comm``). Reading
this costs one failed ``open`` where MPS does not run. Nothing here initializes CUDA.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.units import MIB

PIPE_DIR_ENV = "CUDA_MPS_PIPE_DIRECTORY"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
PID_FILE = "nvidia-cuda-mps-control.pid"
PINNED_MEM_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
THREAD_PCT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
# /proc/<pid>/comm keeps 15 characters of the program's name.
_COMM = "nvidia-cuda-mps-control"[:15]


@dataclass(frozen=True)
class MpsState:
    """Whether the MPS control daemon runs, and where its pipes are."""

    running: bool
    pipe_dir: Path
    pid: int | None = None
    detail: str = ""  # why not (no pid file, a dead pid, another program)

    def describe(self) -> str:
        if self.running:
            return f"MPS control daemon up (pid {self.pid}, pipes in {self.pipe_dir})"
        return f"MPS not running ({self.detail})"


def pipe_dir(env: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if env is None else env
    return Path(environ.get(PIPE_DIR_ENV) or DEFAULT_PIPE_DIR)


# A grant asks whether MPS runs; a daemon starts or stops rarely: an answer this recent is
# reused (per pipe directory), so that a memory lease costs no extra open() in a hot loop.
CACHE_S = 1.0
_cache: dict[str, tuple[float, MpsState]] = {}


def mps_state(env: Mapping[str, str] | None = None, *, max_age_s: float = 0.0) -> MpsState:
    """Whether the MPS control daemon of ``env``'s pipe directory runs on this host; an answer
    read at most ``max_age_s`` ago may be reused."""
    environ = os.environ if env is None else env
    key = environ.get(PIPE_DIR_ENV) or DEFAULT_PIPE_DIR
    if max_age_s:
        known = _cache.get(key)
        if known is not None and time.monotonic() - known[0] < max_age_s:
            return known[1]
    state = _read_state(Path(key))
    _cache[key] = (time.monotonic(), state)
    return state


def _read_state(where: Path) -> MpsState:
    try:
        fd = os.open(os.path.join(where, PID_FILE),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return MpsState(False, where, detail=f"no {PID_FILE} in {where}")
    try:
        raw = os.read(fd, 32)
    except OSError:
        raw = b""
    finally:
        os.close(fd)
    try:
        pid = int(raw.strip() or b"0")
    except ValueError:
        pid = 0
    if pid <= 0:
        return MpsState(False, where, detail=f"{where / PID_FILE} holds no pid")
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            comm = f.read(64).decode(errors="replace").strip()
    except OSError:
        return MpsState(False, where, pid, f"pid {pid} of {where / PID_FILE} is gone (a "
                        "daemon that did not shut down cleanly)")
    if comm != _COMM:
        return MpsState(False, where, pid, f"pid {pid} of {where / PID_FILE} is {comm!r}, not "
                        "the MPS control daemon")
    return MpsState(True, where, pid)


def pinned_memory_env(memory_bytes: int, devices: int, *, thread_pct: int | None = None,
                      env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that hold an MPS client to ``memory_bytes`` on each of its ``devices``
    (its CUDA ordinals 0..devices-1), and to ``thread_pct`` percent of the SMs when given;
    empty where MPS does not run."""
    if devices < 1 or not mps_state(env, max_age_s=CACHE_S).running:
        return {}
    limit = max(1, memory_bytes // MIB)
    out = {PINNED_MEM_ENV: ",".join(f"{i}={limit}M" for i in range(devices))}
    if thread_pct is not None:
        out[THREAD_PCT_ENV] = str(thread_pct)
    return out
