"""The bootstrap every rank of ``gpuwarden launch`` runs under: ``python -m gpuwarden._rank SCRIPT``.

Before the user's script runs, it:

- dies with the supervisor: ``PR_SET_PDEATHSIG`` = SIGKILL (then checks that the supervisor did
  not die before that was armed); the supervisor's reaper process covers the rank's own children;
- arms faulthandler: an all-thread stack dump on SIGUSR2 (the supervisor asks for it when ranks
  stall) and a dump on fatal signals (SIGSEGV, SIGABRT, SIGBUS...);
- hooks ``torch.distributed`` and ``torch.cuda`` *if and when the script imports them* (torch is
  never imported here): init_process_group and the collectives report the rank's progress through
  an mmap'd record (launch/status.py); ``torch.cuda.set_device(LOCAL_RANK)`` is mapped to
  ``cuda:0`` when the rank sees only its own GPU (``--bind rank``), so torchrun scripts keep working.

It then runs the script as ``python SCRIPT`` would (``__main__``, ``sys.argv``, ``sys.path[0]``),
records an uncaught exception with its traceback to a per-rank JSON file, and exits with the
script's exit code. Only the standard library is imported here, for a fast start.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from gpuwarden.launch.status import STACK_SIGNAL_NAME, Phase, StatusWriter
from gpuwarden.procs import die_with_parent

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list", "barrier",
    "monitored_barrier",
)

_status: StatusWriter | None = None
_keep_open: list[Any] = []  # faulthandler needs its files open for the life of the process


def _set(phase: Phase, op: str | None = None) -> None:
    if _status is not None:
        _status.set(phase, op)


class _TorchHooks(importlib.abc.MetaPathFinder):
    """Patches torch.distributed / torch.cuda right after they execute, only if the script
    imports them (the bootstrap itself never imports torch)."""

    def __init__(self, patchers: dict[str, Callable[[Any], None]]) -> None:
        self.patchers = patchers

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        patch = self.patchers.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                loader: Any = spec.loader
                loader.exec_module = _patched_exec(loader.exec_module, patch, fullname)
                return spec
            if spec is not None:
                return spec
        return None


def _patched_exec(original: Callable[[ModuleType], None], patch: Callable[[ModuleType], None],
                  fullname: str) -> Callable[[ModuleType], None]:
    def exec_module(module: ModuleType) -> None:
        original(module)
        try:
            patch(module)
        except Exception as exc:  # a hook must never break the user's import
            print(f"[gpuwarden] could not hook {fullname}: {exc!r}", file=sys.stderr)

    return exec_module


def _patch_distributed(dist: Any) -> None:
    init = getattr(dist, "init_process_group", None)
    if init is None:  # torch built without distributed support
        return

    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        _set(Phase.IN_INIT, "init_process_group")
        if os.environ.get("GPUWARDEN_PEERS_FILE"):
            # Multi-node: say on the job's own TCPStore who arrived, and watch for another
            # node's abort (gpuwarden/_store_watch.py). torch is loaded: the script imported it.
            from gpuwarden import _store_watch

            _store_watch.start(os.environ)
        result = init(*args, **kwargs)
        _set(Phase.JOINED)
        return result

    dist.init_process_group = init_process_group
    destroy = getattr(dist, "destroy_process_group", None)
    if destroy is not None:
        @functools.wraps(destroy)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            _stop_store_watch()
            return destroy(*args, **kwargs)

        dist.destroy_process_group = destroy_process_group
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None:
            setattr(dist, name, _tracked(name, fn))


def _tracked(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> Any:
        _set(Phase.IN_COLLECTIVE, name)
        result = fn(*args, **kwargs)
        _set(Phase.RUNNING)
        return result

    return collective


def _ordinal(device: Any) -> int | None:
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        head, _, tail = device.partition(":")
        return int(tail) if head == "cuda" and tail.isdigit() else None
    if getattr(device, "type", None) == "cuda" and isinstance(getattr(device, "index", None), int):
        return int(device.index)
    return None


def _patch_cuda(cuda: Any) -> None:
    """Each rank sees one GPU, so ``set_device(LOCAL_RANK)`` would be 'invalid device ordinal'
    for every rank but 0: map exactly that call to device 0, the rank's own GPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    set_device = cuda.set_device

    @functools.wraps(set_device)
    def set_device_bound(device: Any) -> None:
        if local_rank != 0 and _ordinal(device) == local_rank:
            device = 0
        set_device(device)

    cuda.set_device = set_device_bound


def _user_traceback(exc: BaseException) -> str:
    """The traceback as `python SCRIPT` would print it: without the bootstrap's, runpy's and
    the progress hooks' frames."""
    te = traceback.TracebackException.from_exception(exc)
    te.stack = traceback.StackSummary.from_list(
        [f for f in te.stack if f.filename != __file__ and "runpy" not in f.filename])
    return "".join(te.format())


def _write_error(path: str, exc: BaseException) -> None:
    record = {
        "rank": int(os.environ.get("RANK", "-1")),
        "pid": os.getpid(),
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "traceback": _user_traceback(exc),
        "monotonic": time.monotonic(),
        "time": time.time(),
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp, path)


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


def _run(argv: list[str]) -> None:
    if argv[0] == "--call":
        _call(argv[1])
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        import runpy

        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        path = argv[0]
        sys.argv = [path, *argv[1:]]
        # As `python SCRIPT`: the script's directory first on sys.path, not the cwd.
        sys.path[0] = os.path.dirname(os.path.abspath(path))
        import runpy

        runpy.run_path(path, run_name="__main__")


def main(argv: list[str]) -> int:
    global _status
    env = os.environ
    if "GPUWARDEN_SUPERVISOR_PID" in env:
        die_with_parent(int(env["GPUWARDEN_SUPERVISOR_PID"]), exit_code=128 + int(signal.SIGKILL))
    if env.get("GPUWARDEN_FATAL_FILE"):
        fatal = open(env["GPUWARDEN_FATAL_FILE"], "a", encoding="utf-8")  # noqa: SIM115
        _keep_open.append(fatal)
        faulthandler.enable(file=fatal, all_threads=True)
    if env.get("GPUWARDEN_STACK_FILE"):
        stacks = open(env["GPUWARDEN_STACK_FILE"], "a", encoding="utf-8")  # noqa: SIM115
        _keep_open.append(stacks)
        faulthandler.register(getattr(signal, STACK_SIGNAL_NAME), file=stacks, all_threads=True)
    if env.get("GPUWARDEN_STATUS_FILE"):
        _status = StatusWriter(env["GPUWARDEN_STATUS_FILE"])
    patchers: dict[str, Callable[[Any], None]] = {"torch.distributed": _patch_distributed}
    if env.get("GPUWARDEN_BIND", "rank") == "rank" and env.get("GPUWARDEN_DEVICE") == "cuda":
        patchers["torch.cuda"] = _patch_cuda
    sys.meta_path.insert(0, _TorchHooks(patchers))
    _set(Phase.STARTED)  # only now may the supervisor send the stack signal

    code = 0
    failed_marked = False
    try:
        _run(argv)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    except BaseException as exc:
        # FAILED first: the supervisor stops the other ranks while this one writes its record.
        _set(Phase.FAILED)
        if env.get("GPUWARDEN_ERROR_FILE"):
            _write_error(env["GPUWARDEN_ERROR_FILE"], exc)
        sys.stderr.write(_user_traceback(exc))
        code = 1
        failed_marked = True
    if code != 0:
        if not failed_marked:
            _set(Phase.FAILED)
        _tell_other_nodes(code)
    else:
        _set(Phase.FINISHED)
        _stop_store_watch()
    return code


def _stop_store_watch() -> None:
    if "gpuwarden._store_watch" in sys.modules:
        sys.modules["gpuwarden._store_watch"].stop()


def _tell_other_nodes(code: int) -> None:
    """Multi-node: set the job's abort key at once, so every node stops within a poll (0.5 s)
    rather than at NCCL's watchdog. Only when this rank already holds a store client."""
    if "gpuwarden._store_watch" not in sys.modules:
        return
    from gpuwarden import _store_watch

    env = os.environ
    record: dict[str, Any] = {"rank": int(env.get("RANK", "-1")), "node":
                              int(env.get("GPUWARDEN_NODE_RANK", "0")), "pid": os.getpid(),
                              "exit_code": code, "time": time.time()}
    try:
        import socket

        record["host"] = socket.gethostname()
        with open(env.get("GPUWARDEN_ERROR_FILE", ""), encoding="utf-8") as f:
            err = json.load(f)
        record["what"] = f"{err.get('type')}: {err.get('message')}"
    except (OSError, ValueError):
        record.setdefault("what", f"exit code {code}")
    _store_watch.abort_from_rank(record)


def _exit_now(code: int) -> None:
    """Leave without the interpreter's final teardown, after everything a program may rely on:
    atexit handlers (logging, wandb, checkpoint writers), a GC pass, flushed stdio.

    Why: with torch loaded, finalization costs ~0.5 s per rank, and with gloo it sometimes ends
    in SIGABRT ('terminate called without an active exception': gloo threads still holding work
    objects while the interpreter is torn down) after a *successful* run — under torchrun too.
    GPUWARDEN_FULL_EXIT=1 restores the normal exit."""
    import atexit
    import gc
    import io

    atexit._run_exitfuncs()
    gc.collect()
    # The normal teardown would flush files the script opened and never closed (a log kept in a
    # module global, say); os._exit does not, so flush every live writable file ourselves, text
    # layers before the binary buffers under them. No work may be lost for a faster exit.
    files = [o for o in gc.get_objects() if isinstance(o, io.IOBase)]
    files.sort(key=lambda f: not isinstance(f, io.TextIOBase))
    for stream in (*files, sys.stdout, sys.stderr):
        try:
            if not stream.closed and stream.writable():
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -m gpuwarden._rank SCRIPT [ARGS...] | -m MODULE [ARGS...] "
              "| --call PAYLOAD",
              file=sys.stderr)
        sys.exit(2)
    exit_code = main(sys.argv[1:])
    if "torch" in sys.modules and os.environ.get("GPUWARDEN_FULL_EXIT") != "1":
        _exit_now(exit_code)
    sys.exit(exit_code)
