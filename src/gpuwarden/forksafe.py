"""Would a process forked *now* be able to use CUDA? (:func:`fork_safe`)

PyTorch marks a forked child as unable to use CUDA ("Cannot re-initialize CUDA in
forked subprocess", failure code CUDA_FORK_REINIT) through a C++
``pthread_atfork`` child handler that sets an ``in_bad_fork`` flag. The handler is
registered the first time the parent *touches* CUDA — ``torch.cuda.init()``, any
CUDA tensor, but also a bare ``torch.cuda.is_available()`` or ``device_count()``
when NVML cannot answer (``torch._C._cuda_getDeviceCount`` registers it), unless
``PYTORCH_NVML_BASED_CUDA_CHECK=1``. At that point ``torch.cuda.is_initialized()``
still says False, so it cannot answer the question; only the registered handler
knows, and it only acts in a child.

So the probe forks: the child reads torch's bad-fork flags (CUDA, and the same
flag of the other devices torch guards this way: XPU, MTIA, MPS), writes one line
to a pipe and leaves with ``os._exit`` — no CUDA call, no interpreter shutdown,
a few milliseconds. A process that has not imported torch is fork-safe as far as
torch is concerned and is answered without forking.

Not covered: CUDA driven by another library (CuPy, Numba, JAX) in the same
process; those keep no flag that can be read.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

# torch submodule -> the function of it that reports the child flag, as torch names them.
_FLAG_READERS = (("cuda", "_is_in_bad_fork"), ("xpu", "_is_in_bad_fork"),
                 ("mtia", "_is_in_bad_fork"), ("mps", "_is_in_bad_fork"))


@dataclass(frozen=True)
class ForkSafety:
    """The answer of :func:`fork_safety`.

    ``safe``: a child forked now can initialize every accelerator torch drives here.
    ``poisoned``: the devices a forked child would find marked bad (e.g. ``("cuda",)``).
    ``probed``: whether a child was actually forked to find out.
    """

    safe: bool
    reason: str
    poisoned: tuple[str, ...] = ()
    probed: bool = False
    elapsed_s: float = 0.0


def _bad_fork_flags(torch: Any) -> tuple[str, ...]:
    """Devices whose bad-fork flag is set in *this* process (reading it never initializes)."""
    out = []
    for device, reader in _FLAG_READERS:
        module = getattr(torch, device, None)
        check = getattr(module, reader, None)
        if check is None:
            continue
        try:
            if check():
                out.append(device)
        except Exception:  # a broken build must not make the probe itself crash
            continue
    return tuple(out)


def fork_safety(*, timeout_s: float = 5.0) -> ForkSafety:
    """Find out whether a child forked now could use CUDA, and why not.

    Forks a probe child unless the answer is known without one (torch not
    imported; this process is itself a bad fork; CUDA already initialized here).
    The child is reaped before returning, also on timeout (it is then killed).
    """
    start = time.monotonic()
    torch = sys.modules.get("torch")
    if torch is None:
        return ForkSafety(True, "torch is not imported in this process, so it registered no "
                          "at-fork handler")
    if not hasattr(os, "fork"):
        return ForkSafety(False, "this platform has no fork(); use the spawn start method")
    own = _bad_fork_flags(torch)
    if own:
        return ForkSafety(False, f"this process is itself a bad fork for {', '.join(own)}: it was "
                          "forked from a parent that had touched it, and so are its children",
                          poisoned=own)
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and getattr(cuda, "_initialized", False):
        return ForkSafety(False, "CUDA is initialized in this process", poisoned=("cuda",))

    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns about fork() in a threaded process because a child may inherit a
        # held lock. This child takes none: it reads flags, writes to a pipe and _exits.
        warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks",
                                category=DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: read the flags, report, leave at once
        try:
            os.close(read_fd)
            os.write(write_fd, (",".join(_bad_fork_flags(torch)) + "\n").encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    try:
        answer = _read_line(read_fd, timeout_s)
    finally:
        os.close(read_fd)
        _reap(pid)
    elapsed = time.monotonic() - start
    if answer is None:
        return ForkSafety(False, f"the probe child did not answer within {timeout_s:g} s; "
                          "assuming a forked child would not work either", probed=True,
                          elapsed_s=elapsed)
    poisoned = tuple(d for d in answer.strip().split(",") if d)
    if poisoned:
        touched = ("CUDA (torch.cuda.is_available(), device_count() or any CUDA call)"
                   if "cuda" in poisoned else " and ".join(poisoned))
        return ForkSafety(False, f"torch's at-fork handler marks children bad for "
                          f"{', '.join(poisoned)}: this process touched {touched}",
                          poisoned=poisoned, probed=True, elapsed_s=elapsed)
    return ForkSafety(True, "a forked child found no device marked bad", probed=True,
                      elapsed_s=elapsed)


def fork_safe() -> bool:
    """True when a process forked now could use CUDA (see :func:`fork_safety` for the reason).

    Use it to choose a start method: ``"fork" if fork_safe() else "forkserver"``.
    """
    return fork_safety().safe


def _read_line(fd: int, timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None
        chunk = os.read(fd, 256)
        if not chunk:  # the child died before writing its line
            return None
        data += chunk
    return data.decode(errors="replace")


def _reap(pid: int) -> None:
    """Wait for the probe child; kill it if it has not exited within a second."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.005)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
