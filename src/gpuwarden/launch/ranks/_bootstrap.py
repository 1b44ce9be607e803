"""The bootstrap every rank of ``gpuwarden launch`` runs under:
``python -m gpuwarden.launch.ranks._bootstrap SCRIPT [ARGS...]``.

It changes nothing of torch (no import hook, no wrapped function: the script sees exactly the
``torch`` that torchrun's ranks see) and prints nothing. Before the script runs it only:

- dies with the supervisor: ``PR_SET_PDEATHSIG`` = SIGKILL (then checks that the supervisor did
  not die before that was armed); the supervisor, a child subreaper, keeps the rank's own
  descendants;
- starts a sampling thread (a bare ``_thread``, idle in a read of a per-rank FIFO): for each
  byte the supervisor writes there, it writes every thread's Python stack
  (``sys._current_frames``, under the GIL, so always consistent) to a per-rank file. This is
  how the supervisor sees where each rank is (``launch/watch/sampler.py``, ``launch/watch/stall.py``); a
  ``q`` byte (``gpuwarden stacks`` asked) is answered the same way in a file of its own;
- arms faulthandler: a dump on fatal signals (SIGSEGV, SIGABRT, SIGBUS...) to a file, and an
  all-thread dump on :data:`STACK_SIGNAL`, the last resort when the sampling thread cannot get
  the GIL; only the sampling thread accepts that signal, so no system call of the script or of
  torch is ever interrupted by it;
- marks the rank STARTED in its status record (``launch/watch/status.py``): from then on the stack
  signal is safe to send (before, a real-time signal's default action would kill the rank);
- multi-node only: a daemon thread that looks at the main thread's own frames (public
  ``sys._current_frames``) and, once the script is inside ``init_process_group``, joins the
  job's TCPStore as an observer (``launch/multinode/_store_watch.py``).

It then runs the script as ``python SCRIPT`` does: a fresh ``__main__`` module whose
``__file__`` is absolute, ``sys.argv`` as given, ``sys.path[0]`` the script's (symlink-resolved)
directory. An uncaught exception is recorded to a per-rank JSON file (with the time it happened,
for the root cause), then printed by ``sys.excepthook`` exactly as Python prints it. The rank
leaves through the interpreter's normal finalization: atexit handlers run, non-daemon threads
are joined, files are flushed. Only the standard library is imported here, for a fast start.
"""

from __future__ import annotations

import builtins
import faulthandler
import importlib.machinery
import os
import signal
import sys
import threading
import time
import types

from gpuwarden.launch.watch.status import (
    STACK_SIGNAL,
    Phase,
    StatusWriter,
    query_path,
    sample_paths,
)
from gpuwarden.procs import die_with_parent

TYPE_CHECKING = False  # typing is not imported here at run time: see gpuwarden/__init__.py
if TYPE_CHECKING:
    from typing import Any

# threading is imported above, in the main thread, on purpose: imported first by the sampling
# thread, it would take that thread for the main one, and the interpreter's exit would wait for it.
_status: StatusWriter | None = None
# faulthandler writes to these file descriptors from a signal handler for the life of the
# process; the bootstrap's own module object is kept too (the script replaces __main__).
_keep_alive: list[Any] = []
# Several nodes only: the watch of the workers' store (multinode/_store_watch.py), set by _arm.
# A rank of a one-node job imports none of it.
_store_watch: types.ModuleType | None = None


def _set(phase: Phase) -> None:
    if _status is not None:
        _status.set(phase)


def _arm(env: os._Environ[str] | dict[str, str]) -> None:
    global _status, _store_watch
    # Importing this module ran gpuwarden/__init__, which puts the joblib-backend finder on
    # sys.meta_path; the script did not ask for gpuwarden: its process gets no import hook,
    # and its own `import gpuwarden` runs the package's __init__ as under torchrun.
    from gpuwarden import _joblib_hook

    _joblib_hook.hand_over()
    if "GPUWARDEN_SUPERVISOR_PID" in env:
        die_with_parent(int(env["GPUWARDEN_SUPERVISOR_PID"]), exit_code=128 + int(signal.SIGKILL))
    if env.get("GPUWARDEN_FATAL_FILE"):
        fatal = open(env["GPUWARDEN_FATAL_FILE"], "a", encoding="utf-8")  # noqa: SIM115
        _keep_alive.append(fatal)
        faulthandler.enable(file=fatal, all_threads=True)
    if env.get("GPUWARDEN_STACK_FILE"):
        stacks = open(env["GPUWARDEN_STACK_FILE"], "a", encoding="utf-8")  # noqa: SIM115
        _keep_alive.append(stacks)
        faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
        _start_sampling_thread(*sample_paths(env["GPUWARDEN_STACK_FILE"]),
                               query_path(env["GPUWARDEN_STACK_FILE"]))
    if env.get("GPUWARDEN_STATUS_FILE"):
        _status = StatusWriter(env["GPUWARDEN_STATUS_FILE"])
    if env.get("GPUWARDEN_PEERS_FILE"):
        from gpuwarden.launch.multinode import _store_watch as watch

        _store_watch = watch
        watch.start_when_joining(env)
    _set(Phase.STARTED)  # only now may the supervisor send the stack signal


# A dump stays small whatever the script does: a deep recursion keeps its innermost frames and
# the outermost ones (where the script called in from), thousands of threads the first ones.
MAX_DUMP_THREADS = 256
MAX_DUMP_FRAMES = 256
_OUTERMOST_KEPT = 32


def format_stacks(frames: dict[int, types.FrameType], skip: int) -> str:
    """Every thread's stack in faulthandler's format (innermost first), the main thread first."""
    main = threading.main_thread().ident
    out = []
    for ident in sorted(frames, key=lambda i: i != main)[:MAX_DUMP_THREADS + 1]:
        if ident == skip:
            continue
        out.append(f"Thread 0x{ident:016x} (most recent call first):")
        lines = []
        frame: types.FrameType | None = frames[ident]
        while frame is not None:
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno or 0} in {code.co_name}')
            frame = frame.f_back
        if len(lines) > MAX_DUMP_FRAMES:
            cut = len(lines) - MAX_DUMP_FRAMES
            lines = [*lines[:MAX_DUMP_FRAMES - _OUTERMOST_KEPT], f"  ... {cut} frames left out",
                     *lines[-_OUTERMOST_KEPT:]]
        out += lines
        out.append("")
    return "\n".join(out)


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _sampling_loop(request_fifo: str, sample_file: str, query_file: str) -> None:
    import _thread

    me = _thread.get_ident()
    try:
        # O_RDWR: opening never waits for a writer, and reads never see end-of-file.
        fd = os.open(request_fifo, os.O_RDWR)
    except OSError:
        return  # no FIFO (run by hand): no sampling
    while True:
        try:
            asked = os.read(fd, 64)
            if not asked:
                return
            # One look answers every byte read at once: the supervisor's samples ("s") and
            # someone's question ("q", `gpuwarden stacks`), each in its own file.
            text = format_stacks(sys._current_frames(), me)
            if asked.strip(b"q"):
                _write(sample_file, text)
            if b"q" in asked:
                _write(query_file, text)
        except OSError:
            return


def _start_sampling_thread(request_fifo: str, sample_file: str, query_file: str) -> None:
    """The sampling thread also is the only thread that accepts the stack signal: it is started
    first (a thread inherits its creator's signal mask), then the signal is blocked in the main
    thread, so every thread the script starts has it blocked too (a signal landing on the
    script's thread would interrupt its system call, and C++ code does not always retry:
    TCPStore's connect loop logs 'Interrupted system call' and waits a second). A bare
    ``_thread`` thread: not in ``threading.enumerate()``, never joined at exit."""
    import _thread

    _thread.start_new_thread(_sampling_loop, (request_fifo, sample_file, query_file))
    signal.pthread_sigmask(signal.SIG_BLOCK, {STACK_SIGNAL})


def _script_traceback(exc: BaseException) -> types.TracebackType | None:
    """The traceback from the script's first frame on, as the interpreter shows it for ``python
    SCRIPT`` (or ``python -m MODULE``, whose traceback starts in runpy's frames): the bootstrap's
    own frames left out. None when only bootstrap frames remain (a SyntaxError in the script:
    python then prints the error without a "Traceback" header)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _write_error(path: str, exc: BaseException, tb: types.TracebackType | None) -> None:
    import json  # here, as traceback: a rank that does not fail imports neither
    import traceback

    record = {
        "rank": int(os.environ.get("RANK", "-1")),
        "pid": os.getpid(),
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, tb)),
        "monotonic": time.monotonic(),
        "time": time.time(),
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def _run_path(path: str, args: list[str]) -> None:
    """What ``python SCRIPT ARGS`` does, without runpy (which would make sys.argv[0] absolute
    and take its temporary ``__main__`` away again before finalization)."""
    absolute = os.path.abspath(path)
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(absolute))
    main = types.ModuleType("__main__")
    main.__file__ = absolute
    main.__cached__ = None  # type: ignore[attr-defined]
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", absolute)
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    _keep_alive.append(sys.modules["__main__"])
    sys.modules["__main__"] = main
    with open(absolute, "rb") as f:
        source = f.read()
    exec(compile(source, absolute, "exec", dont_inherit=True), main.__dict__)


def _call(payload: str) -> None:
    """gpuwarden.distributed.spawn: call fn(rank, *args), keep its return value for the parent."""
    import pickle

    with open(payload, "rb") as f:
        fn, args = pickle.load(f)
    rank = int(os.environ.get("RANK", "0"))
    result = fn(rank, *args)
    out = os.path.join(os.path.dirname(payload), f"rank{rank}.result.pkl")
    with open(f"{out}.tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(f"{out}.tmp", out)


def _run_module(name: str, args: list[str]) -> None:
    """What ``python -m MODULE ARGS`` does: runpy's own entry for ``-m`` (the traceback of an
    error in the module starts in its frames, and an unknown module is the interpreter's one
    line ``PYTHON: No module named MODULE``, exit 1), in a fresh ``__main__`` module."""
    import runpy

    main = types.ModuleType("__main__")
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    _keep_alive.append(sys.modules["__main__"])
    sys.modules["__main__"] = main
    sys.argv = ["-m", *args]  # runpy puts the module's path in argv[0], as python does
    runpy._run_module_as_main(name, alter_argv=True)  # type: ignore[attr-defined]


def _run(argv: list[str]) -> None:
    if argv[0] == "--call":
        _call(argv[1])
    elif argv[0] == "-m":
        _run_module(argv[1], argv[2:])
    else:
        _run_path(argv[0], argv[1:])


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def _print_as_python(tb: types.TracebackType | None) -> None:
    """Make the interpreter print the exception about to leave the bootstrap as it prints one
    leaving ``python SCRIPT``: with ``tb``, the script's traceback, not the one it collected on
    its way out through the bootstrap. A one-shot hook around whatever ``sys.excepthook`` is
    then (the script's, or torch's ``[rankN]:`` prefixing one), restored as it is called."""
    hook = sys.excepthook

    def once(exc_type: type[BaseException], value: BaseException,
             _tb: types.TracebackType | None) -> None:
        sys.excepthook = hook
        value.__traceback__ = tb
        hook(exc_type, value, tb)

    sys.excepthook = once


def main(argv: list[str]) -> int:
    """Run the script; return 0, or let its exception out to the interpreter, which then ends
    the process as ``python SCRIPT`` ends: a SystemExit's code (a string printed, exit 1), an
    exception printed and exit 1, an uncaught KeyboardInterrupt printed and death by SIGINT
    after the interpreter's finalization (what a shell sees as 130)."""
    env = os.environ
    _arm(env)
    try:
        _run(argv)
    except SystemExit as exc:
        code = _exit_code(exc)
        _finished(code)
        raise
    except BaseException as exc:
        # The record (milliseconds), then FAILED: the supervisor starts stopping the other ranks
        # while this one goes through its (slow, with torch loaded) interpreter teardown, and
        # reads, with FAILED, whether the error is an echo of a peer that left (its own is
        # stopped for at once, an echo waits for a leaving peer to be seen: supervisor.py).
        tb = _script_traceback(exc)
        try:
            if env.get("GPUWARDEN_ERROR_FILE"):
                _write_error(env["GPUWARDEN_ERROR_FILE"], exc, tb)
        finally:
            _set(Phase.FAILED)
        _finished(130 if isinstance(exc, KeyboardInterrupt) else 1)
        _print_as_python(tb)
        raise
    _finished(0)
    return 0


def _finished(code: int) -> None:
    if code == 0:
        _set(Phase.FINISHED)
        if _store_watch is not None:
            _store_watch.stop()
    else:
        _set(Phase.FAILED)
        if _store_watch is not None:
            _tell_other_nodes(code)
            # As after a good run: no store traffic (and no watch starting) while the
            # interpreter finalizes, where torch's C++ objects abort on a thread still using them.
            _store_watch.stop()


def _tell_other_nodes(code: int) -> None:
    """Multi-node: set the job's abort key at once, so every node stops within a poll (0.5 s)
    rather than at NCCL's watchdog. Only when this rank already holds a store client."""
    from gpuwarden.launch.multinode import _store_watch

    if not _store_watch.connected(wait_s=2.0):
        return
    env = os.environ
    record: dict[str, Any] = {"rank": int(env.get("RANK", "-1")), "node":
                              int(env.get("GPUWARDEN_NODE_RANK", "0")), "pid": os.getpid(),
                              "exit_code": code, "time": time.time()}
    try:
        import json
        import socket

        record["host"] = socket.gethostname()
        with open(env.get("GPUWARDEN_ERROR_FILE", ""), encoding="utf-8") as f:
            err = json.load(f)
        record["what"] = f"{err.get('type')}: {err.get('message')}"
    except (OSError, ValueError):
        record.setdefault("what", f"exit code {code}")
    _store_watch.abort_from_rank(record)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -m gpuwarden.launch.ranks._bootstrap SCRIPT [ARGS...] | -m MODULE "
              "[ARGS...] | --call PAYLOAD", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1:]))
