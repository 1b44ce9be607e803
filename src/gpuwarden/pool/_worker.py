"""The pool worker: one process, one GPU slot, one task at a time.

Started by the pool's process server (``_server.py``): forked from it (``forkserver``: the
server has imported the preload modules but never touched CUDA; the server put this worker's
variables into its environment before this module runs, and CUDA reads them when it
initializes, later, in a task) or exec'd as ``python -m gpuwarden.pool._worker FD PPID``
(``spawn``: the environment, CUDA_VISIBLE_DEVICES included, is fixed before the interpreter
imports anything).

On the worker's socket (frames of ``_wire.py``): first one byte carrying the pool's claim file
(a descriptor, SCM_RIGHTS), then the pool sends BOOT, then TASK or TASK_BEHIND frames, or
STOP; the worker answers READY (or INIT_ERROR), then for each task STARTED as soon as it has
read it — before anything of the task is unpickled or run, so that the pool knows exactly
which task a death interrupted — then IMPORTED when loading the task imported modules, then
RESULT or ERROR. stdout and stderr are flushed after each task, so a task's output is not lost
with a worker that dies later.

Claims: a TASK_BEHIND was sent while this worker ran another task (tiny tasks are pipelined to
hide the round trip), and the pool takes it back when another worker goes idle first — the
running task may be long. Who runs it is decided by one ``fcntl`` lock on a byte of the claim
file, its offset the send's claim (a number of its own for every such send, at the head of the
payload, so that a copy left in a socket never shares one with a later copy of the task): the worker takes it before STARTED and lets it go after; the pool takes it to
take the task back, and then reads what the worker sent — a STARTED there means the worker was
first. A worker that cannot claim the task answers SKIPPED and never runs it.

Warm start: a worker started later in a pool's life (a resize, a replacement) would pay for
the imports its first task needs while holding that task — scikit-learn's modules take a
second, so a tiny task waited a second on a fresh worker while the warm ones were idle. So
each worker says which modules loading a task imported (the task's function and its
arguments' classes: what every task of that kind needs to start; not what a task imports as
it runs), and the pool hands the list to the workers it starts next, which import them,
after the initializer and before they say READY. Until then they are starting, and the
pool's dispatch sends tasks to the ready workers.
"""

from __future__ import annotations

import fcntl
import importlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
import traceback
import warnings
from typing import Any

from gpuwarden.pool import _pickling
from gpuwarden.pool._wire import CLAIM, FrameSource, Kind, send_frame
from gpuwarden.pool.plan import THREAD_LIMIT_VARS
from gpuwarden.procs import die_with_parent


def serve(sock: socket.socket) -> int:
    """Run the worker loop until told to stop or the pool goes away; the exit code."""
    # Ctrl-C is for the caller (the worker is in a process group of its own anyway).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    except OSError:
        return 0
    claims = fds[0] if fds else -1
    if fds:
        os.set_inheritable(claims, False)  # not for what a task starts
    claims_id = _file_id(claims)
    frames = FrameSource(sock)
    first = frames.next()
    if first is None or first[0] is not Kind.BOOT:
        return 0
    boot = _pickling.loads(first[2])
    os.environ.update(boot["env"])
    # The caller's authkey: its Manager() proxies and listeners accept this worker.
    multiprocessing.current_process().authkey = boot["authkey"]
    for entry in reversed(boot["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    # The pid is the worker's own (a spawned worker's is not known to the pool before).
    name = f"worker {boot['index']} (pid {os.getpid()}, {boot['device']})"
    try:
        notes = _start(boot)
    except BaseException as exc:  # noqa: BLE001 - every start-up failure is reported
        # As concurrent.futures' workers do: the traceback goes to this logger too.
        logging.getLogger("concurrent.futures").critical("Exception in initializer:",
                                                         exc_info=True)
        send_frame(sock, Kind.INIT_ERROR, -1, _pickling.dumps_result(_exception(exc, name)))
        return 3
    send_frame(sock, Kind.READY, -1, _pickling.dumps_result(notes))
    while True:
        try:
            message = frames.next()
        except OSError:
            return 0
        if message is None or message[0] is Kind.STOP:
            return 0  # stopped, or the pool's process is gone: nobody wants results
        kind, task_id, payload = message
        if kind is Kind.TASK_BEHIND:
            claim_bytes = bytes(payload[:CLAIM.size])
            (claim,) = CLAIM.unpack(claim_bytes)
            if not _claim(claims, claims_id, claim):
                send_frame(sock, Kind.SKIPPED, task_id, claim_bytes)
                continue
            send_frame(sock, Kind.STARTED, task_id)
            _unclaim(claims, claim)  # STARTED is in the socket: the pool's own claim sees it
            del payload[:CLAIM.size]
        else:
            send_frame(sock, Kind.STARTED, task_id)
        reply_kind, reply, imported = _run(payload, name)
        del payload, message
        if imported:
            send_frame(sock, Kind.IMPORTED, task_id, _pickling.dumps_result(imported))
        send_frame(sock, reply_kind, task_id, reply)
        del reply
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass


def _file_id(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _claim(claims: int, claims_id: tuple[int, int] | None, claim: int) -> bool:
    """Take the claim's byte of the claim file; False when the pool has it (it took the task
    back), or when the file is not usable (a task closed its descriptor, maybe reused for
    another file): the pool then runs the task elsewhere."""
    if claims_id is None or _file_id(claims) != claims_id:
        return False
    try:
        fcntl.lockf(claims, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, claim)
        return True
    except (OSError, ValueError):
        return False


def _unclaim(claims: int, claim: int) -> None:
    try:
        fcntl.lockf(claims, fcntl.LOCK_UN, 1, claim)
    except (OSError, ValueError):
        pass  # the file was closed by a task: the lock went with it


def _start(boot: dict[str, Any]) -> list[str]:
    notes = apply_thread_caps(boot["threads"])
    for module in boot["preload"]:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            notes.append(f"preload {module!r} not importable: {exc}")
    if boot["preload"]:
        notes.extend(apply_thread_caps(boot["threads"]))
    fraction = boot["memory_fraction"]
    if fraction is not None:
        notes.extend(_cap_memory(fraction))
    if boot["initializer"] is not None:
        initializer, initargs = _pickling.loads(boot["initializer"])
        initializer(*initargs)
    if boot.get("warm"):
        warm_up(boot["warm"])
        notes.extend(apply_thread_caps(boot["threads"]))
    return notes


def warm_up(modules: list[str]) -> None:
    """Import what loading the pool's earlier tasks imported (see the top of this module).
    Quietly: a module that fails here fails again, with its own error, in the task that
    needs it; its import-time warnings were shown by the worker that imported it first."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in modules:
            if module in sys.modules:
                continue
            try:
                importlib.import_module(module)
            except Exception:  # noqa: BLE001,S112 - see the docstring
                continue


def imported_since(known: int) -> list[str]:
    """The modules imported since ``sys.modules`` had ``known`` entries (it only grows in
    practice), as names importable on their own: not ``__main__`` (a task's function from the
    caller's script travels by value), not aliases (``os.path`` is posixpath), not modules
    made without a spec."""
    names = list(sys.modules.copy())[known:]
    return [n for n in names if n not in ("__main__", "__mp_main__")
            and getattr(getattr(sys.modules.get(n), "__spec__", None), "name", None) == n]


# The thread variables in the environment when this process began loading libraries: a spawned
# worker's own, from its start; a forked one's, inherited from the server, which records them
# before it preloads anything.
_loaded_under: tuple[str | None, ...] | None = None


def record_thread_env() -> None:
    global _loaded_under
    _loaded_under = tuple(os.environ.get(var) for var in THREAD_LIMIT_VARS)


def _loaded_under_caps(threads: int) -> bool:
    """Whether every library loaded so far read this worker's caps from the environment."""
    now = tuple(os.environ.get(var) for var in THREAD_LIMIT_VARS)
    return _loaded_under == now and now[0] == str(threads)


def apply_thread_caps(threads: int | None) -> list[str]:
    """Cap the thread pools of numerical libraries already loaded in this process.

    The variables (OMP_NUM_THREADS, ...) are in the environment before any library is
    loaded in a spawned worker; a forked one inherits libraries the server loaded, whose
    thread counts were read at their load. So the caps are also applied through the
    libraries' own calls: torch's ``set_num_threads`` and, when it is installed,
    threadpoolctl's (OpenMP, OpenBLAS, MKL, BLIS) — unless every library was loaded under the
    same variables (a forked worker whose caps are the server's: the common case), where
    threadpoolctl would cost ~9 ms of each worker's start for nothing."""
    if threads is None:
        return []
    notes: list[str] = []
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "set_num_threads"):
        try:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        except RuntimeError as exc:
            notes.append(f"torch.set_num_threads({threads}) failed: {exc}")
    if any(name in sys.modules for name in ("numpy", "torch", "scipy")) \
            and not _loaded_under_caps(threads):
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            return notes
        threadpool_limits(limits=threads)
    return notes


def _cap_memory(fraction: float) -> list[str]:
    try:
        import torch
    except ImportError:
        return ["memory_fraction ignored: torch is not installed in the worker"]
    if not torch.cuda.is_available():
        return ["memory_fraction ignored: no CUDA device in the worker"]
    # A cap on PyTorch's caching allocator of this process, not an isolation between
    # processes: other CUDA users, and the context itself, are not counted.
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return []


def _run(data: bytearray, name: str) -> tuple[Kind, bytes, list[Any]]:
    """Load and run one task: the reply's kind and payload, and — when loading it imported
    modules — how long loading took and the modules' names."""
    known, began = len(sys.modules), time.monotonic()
    try:
        fn, args, kwargs = _pickling.loads(data)
    except BaseException as exc:  # noqa: BLE001 - the caller gets it back, named
        error = _pickling.TaskLoadError(f"the task could not be unpickled in the worker: "
                                        f"{type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return Kind.ERROR, _pickling.dumps_result(_exception(error, name)), []
    imported = ([time.monotonic() - began, imported_since(known)]
                if len(sys.modules) > known else [])
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the caller gets it back
        return Kind.ERROR, _pickling.dumps_result(_exception(exc, name)), imported
    finally:
        del fn, args, kwargs
    try:
        return Kind.RESULT, _pickling.dumps_result(result), imported
    except BaseException as exc:  # noqa: BLE001 - an unpicklable result is the task's error
        return Kind.ERROR, _pickling.dumps_result(_exception(exc, name)), imported


def _exception(exc: BaseException, name: str) -> Any:
    carrier = _pickling.ExceptionWithTraceback(exc, name)
    try:
        _pickling.dumps_result(carrier)
        return carrier
    except BaseException as pickling_error:  # noqa: BLE001 - even that must come back
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        carrier.exc = RuntimeError(
            f"{text} (this exception could not be pickled back from the worker: "
            f"{pickling_error})")
        return carrier


def main(argv: list[str]) -> int:
    fd, ppid = int(argv[0]), int(argv[1])
    record_thread_env()  # spawned with its slot's variables: nothing is loaded yet
    die_with_parent(ppid)
    return serve(socket.socket(fileno=fd))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
