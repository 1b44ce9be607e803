"""Tasks the pool tests send to workers. Standard library only: a worker imports this module
by name to run them, and the fault matrix starts many workers."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def tiny(x: int) -> int:
    return x + 1


def note_run(path: str, x: int, sleep_s: float = 0.0) -> int:
    """Append "x pid" to ``path`` (one write, O_APPEND: lines from several workers do not mix),
    sleep, return ``x``: which worker ran which task, and how many times."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{x} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    time.sleep(sleep_s)
    return x


def pid_and_loaded(module: str, delay_s: float = 0.0) -> tuple[int, bool]:
    """Whether ``module`` was loaded in this worker before this task (which imports nothing)."""
    time.sleep(delay_s)
    return os.getpid(), module in sys.modules


def meet_then_report(folder: str, count: int, module: str) -> tuple[int, bool]:
    """Wait (60 s at most) until ``count`` tasks are running at once, each in its own worker,
    then say whether ``module`` was loaded in this worker (this task imports nothing)."""
    Path(folder, str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(folder)) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpid(), module in sys.modules


def wait_for_file(path: str, cap_s: float = 120.0) -> bool:
    """A task as slow as the test wants: it ends once ``path`` exists (or after ``cap_s``)."""
    deadline = time.monotonic() + cap_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.path.exists(path)


def pid_and_env(delay_s: float = 0.0) -> tuple[int, str | None, str | None]:
    time.sleep(delay_s)
    return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("OMP_NUM_THREADS")


def die(how: str) -> None:
    """End this process the way a worker dies: 'SIGKILL', 'SIGSEGV' or 'exit3'."""
    if how == "exit3":
        os._exit(3)
    # No core file: a segfault here is a test's, and a core dump costs seconds.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.kill(os.getpid(), getattr(signal, how))
    time.sleep(10)  # the signal arrives before this ends


def fault(how: str, delay_s: float = 0.0) -> None:
    time.sleep(delay_s)
    die(how)


class DiesWhenPickled:
    """A result whose pickling (in the worker, after the task returned) kills the worker."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __reduce__(self) -> Any:
        die(self.how)
        raise AssertionError("unreachable")


def fault_while_sending(how: str) -> DiesWhenPickled:
    return DiesWhenPickled(how)


def write_pid_and_sleep(path: str, seconds: float = 60.0) -> None:
    Path(path).write_text(str(os.getpid()))
    time.sleep(seconds)


def fork_helper_then_die(path: str) -> None:
    """Fork a helper that keeps every descriptor (the worker's socket too), then die."""
    helper = os.fork()
    if helper == 0:
        time.sleep(60)
        os._exit(0)
    Path(path).write_text(str(helper))
    die("SIGKILL")


def start_sleeper(path: str, new_session: bool) -> int:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=new_session)
    Path(path).write_text(str(proc.pid))
    return proc.pid


def hang_in_slot(slot: str) -> None:
    """An initializer that never returns in worker ``slot``."""
    if os.environ.get("GPUWARDEN_POOL_WORKER") == slot:
        time.sleep(3600)


def die_once(marker: str) -> None:
    """An initializer that kills the first worker to run it (as the OOM killer during
    ``import torch``) and lets the next ones start."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    die("SIGKILL")


def thread_counts() -> dict[str, Any]:
    import torch
    from threadpoolctl import threadpool_info

    return {"torch": torch.get_num_threads(),
            "pools": {(p["internal_api"], p["num_threads"]) for p in threadpool_info()},
            "env": os.environ.get("OMP_NUM_THREADS")}


def meet_then(folder: str, count: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, once ``count`` tasks run at once, each in its own worker (60 s at most):
    every worker of the pool answers, however fast tiny tasks finish elsewhere on a loaded box."""
    meet_then_report(folder, count, "")
    return fn(*args)


def thread_caps() -> dict[str, Any]:
    """This worker's OMP_NUM_THREADS and the thread counts of the libraries loaded in it, read
    through threadpoolctl."""
    from threadpoolctl import threadpool_info

    return {"pid": os.getpid(), "env": os.environ.get("OMP_NUM_THREADS"),
            "pools": {(p["internal_api"], p["num_threads"]) for p in threadpool_info()}}


def dies_in_the_middle_of_its_result(size: int) -> bytes:
    """Return ``size`` bytes, and SIGKILL this worker while it is sending them: once the
    frame's header is out and its payload is being sent (``send_frame``'s current piece is the
    payload), so the parent has a partial frame whatever the machine's load. (A fixed delay
    after ``send_frame`` began let a fast socket deliver the whole result first.)"""
    import threading

    main = threading.get_ident()

    def watch() -> None:
        while True:
            frame = sys._current_frames().get(main)
            while frame is not None:
                if frame.f_code.co_name == "send_frame":
                    piece = frame.f_locals.get("piece")
                    if piece is not None and len(piece) >= size:
                        time.sleep(0.001)  # some of the payload is on its way by then
                        die("SIGKILL")
                frame = frame.f_back
            time.sleep(0.0005)

    threading.Thread(target=watch, daemon=True).start()
    return b"x" * size


def sleep_then_raise(seconds: float) -> None:
    """An initializer that fails after ``seconds`` (the pool breaks then, not at once)."""
    time.sleep(seconds)
    raise RuntimeError("initializer failed on purpose")


def sleep_in_slot(slot: str, seconds: float) -> None:
    """An initializer that takes ``seconds`` in worker ``slot`` (loading a model) only."""
    if os.environ.get("GPUWARDEN_POOL_WORKER") == slot:
        time.sleep(seconds)
