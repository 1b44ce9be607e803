"""The pool worker: one process, one GPU slot, one task at a time.

Started either as a fresh interpreter (``python -m gpuwarden.pool._worker FD PPID``,
the ``spawn`` start method: its environment, CUDA_VISIBLE_DEVICES included, is fixed
by exec before the interpreter imports anything) or forked by gpuwarden's fork server
(``forkserver``: the server has imported the preload modules but never touched CUDA;
:func:`serve` puts this worker's variables into the environment before anything else
runs, and CUDA reads them when it initializes, which is later, in a task).

Protocol on the worker's connection (one framed message each):
parent -> worker: a boot dict, then task bytes ``(task_id, fn, args, kwargs)``, or ``b"stop"``;
worker -> parent: a :data:`HEADER` (task id, kind) then a pickle: first READY (notes) or
INIT_ERROR (the exception), then per task RESULT or ERROR. The header stays outside the
pickle so that the parent knows which task a result belongs to even when the result
cannot be unpickled there.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import struct
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

from gpuwarden.pool import _pickling
from gpuwarden.procs import die_with_parent

HEADER = struct.Struct("<qB")
RESULT, ERROR, READY, INIT_ERROR = range(4)


def _message(task_id: int, kind: int, payload: bytes) -> bytes:
    return HEADER.pack(task_id, kind) + payload


def serve(conn: Connection, boot: dict[str, Any]) -> int:
    """Run the worker loop until told to stop or the parent goes away; the exit code."""
    # Ctrl-C goes to the whole process group: the parent decides, the worker finishes its task.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(boot["env"])
    # The caller's authkey: its Manager() proxies and listeners accept this worker.
    multiprocessing.current_process().authkey = boot["authkey"]
    for entry in reversed(boot["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    name = boot["name"]
    try:
        notes = _start(boot)
    except BaseException as exc:  # noqa: BLE001 - every start-up failure is reported
        conn.send_bytes(_message(-1, INIT_ERROR, _pickling.dumps_result(_exception(exc, name))))
        return 3
    conn.send_bytes(_message(-1, READY, _pickling.dumps_result(notes)))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return 0  # the pool's process is gone: nobody wants the results
        if data == b"stop":
            return 0
        conn.send_bytes(_run(data, name))


def _start(boot: dict[str, Any]) -> list[str]:
    notes: list[str] = []
    for module in boot["preload"]:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            notes.append(f"preload {module!r} not importable: {exc}")
    fraction = boot["memory_fraction"]
    if fraction is not None:
        notes.extend(_cap_memory(fraction))
    if boot["initializer"] is not None:
        initializer, initargs = _pickling.loads(boot["initializer"])
        initializer(*initargs)
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


def _run(data: bytes, name: str) -> bytes:
    task_id = HEADER.unpack_from(data)[0]
    try:
        fn, args, kwargs = _pickling.loads(memoryview(data)[HEADER.size:])
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the caller gets it back
        return _message(task_id, ERROR, _pickling.dumps_result(_exception(exc, name)))
    try:
        return _message(task_id, RESULT, _pickling.dumps_result(result))
    except BaseException as exc:  # noqa: BLE001 - an unpicklable result is the task's error
        return _message(task_id, ERROR, _pickling.dumps_result(_exception(exc, name)))


def _exception(exc: BaseException, name: str) -> Any:
    carrier = _pickling.ExceptionWithTraceback(exc, name)
    try:
        _pickling.dumps_result(carrier)
        return carrier
    except Exception as pickling_error:
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        carrier.exc = RuntimeError(
            f"{text} (this exception could not be pickled back from the worker: "
            f"{pickling_error})")
        return carrier


def main(argv: list[str]) -> int:
    fd, ppid = int(argv[0]), int(argv[1])
    die_with_parent(ppid)
    conn = Connection(fd)
    boot = _pickling.loads(conn.recv_bytes())
    return serve(conn, boot)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
