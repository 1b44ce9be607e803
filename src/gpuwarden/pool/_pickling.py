"""What crosses the pool's process boundary, and how.

Tasks and results are pickled with cloudpickle, as loky does, so lambdas and
functions defined in ``__main__`` or a notebook travel by value and a worker
never has to re-import the caller's main module.

Tensors get one rule each way:

- a CUDA tensor in a task's arguments is refused (:class:`CudaTensorArgumentError`):
  the worker would unpickle it onto *its* ``cuda:0``, which is another GPU
  than the one the caller's tensor lives on, and the caller would never know.
- a CUDA tensor in a result is copied to the CPU inside the worker before it
  is pickled: the caller then owns an ordinary tensor and needs no CUDA
  context (the pool's parent never initializes CUDA).

Exceptions come back as their own type with the worker's formatted traceback
as ``__cause__``: a ``concurrent.futures.process._RemoteTraceback``, exactly what a
``ProcessPoolExecutor`` gives (so code and tests written for it read it the same way).
"""

from __future__ import annotations

import io
import pickle
import sys
import traceback
import types
from collections.abc import Callable, Mapping
from typing import Any

import cloudpickle

from gpuwarden.errors import CudaTensorArgumentError

PROTOCOL = pickle.HIGHEST_PROTOCOL


def _is_cuda_tensor(obj: Any) -> bool:
    # Only when torch is already imported: an object cannot be a tensor otherwise, and the
    # check must not import torch into a process that does not use it.
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    return isinstance(obj, torch.Tensor) and obj.device.type == "cuda"


def _code_in(ctor: Callable[..., types.CodeType], args: tuple[Any, ...],
             filename: str) -> types.CodeType:
    return ctor(*args).replace(co_filename=filename)


class _TaskPickler(cloudpickle.Pickler):
    reducers: Mapping[type, Callable[[Any], Any]] = {}

    def reducer_override(self, obj: Any) -> Any:
        reducer = self.reducers.get(type(obj))
        if reducer is not None:
            return reducer(obj)
        if type(obj) is types.CodeType:  # checked first: this runs for every object pickled
            # cloudpickle >= 3.1.3 names every code object it sends by value "<dynamic-code>"
            # (a deterministic payload), so a task defined in the user's script would fail with
            # a traceback that has neither its file nor its source lines: sent with its file.
            code_reduce = self.dispatch_table.get(types.CodeType)
            if code_reduce is not None:
                ctor, args = code_reduce(obj)
                return _code_in, (ctor, args, obj.co_filename)
        if _is_cuda_tensor(obj):
            raise CudaTensorArgumentError(
                f"a task argument is a CUDA tensor on {obj.device} "
                f"(shape {tuple(obj.shape)}, dtype {obj.dtype})",
                why="each pool worker sees only its own GPU as cuda:0; unpickled there, the "
                "tensor would silently be re-created on another GPU than the one it is on here",
                fix="pass CPU tensors (tensor.cpu()) and move them in the task with "
                "tensor.to('cuda'), or load the data inside the task",
            )
        return super().reducer_override(obj)


def _cpu_copy(tensor: Any) -> Any:
    torch = sys.modules["torch"]
    cpu = tensor.detach().to("cpu")
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(cpu, requires_grad=tensor.requires_grad)
    if tensor.is_leaf and tensor.requires_grad:
        cpu.requires_grad_(True)
    return cpu


def _identity(obj: Any) -> Any:
    return obj


class _ResultPickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if _is_cuda_tensor(obj):
            # Pickled as "the CPU copy": the copy itself goes through the normal path.
            return _identity, (_cpu_copy(obj),)
        return super().reducer_override(obj)


def _dumps(pickler_cls: type, obj: Any,
           reducers: Mapping[type, Callable[[Any], Any]] | None = None) -> bytes:
    buf = io.BytesIO()
    pickler = pickler_cls(buf, protocol=PROTOCOL)
    if reducers:
        pickler.reducers = reducers
    pickler.dump(obj)
    return buf.getvalue()


def dumps_task(obj: Any, reducers: Mapping[type, Callable[[Any], Any]] | None = None) -> bytes:
    """Pickle a task; raises CudaTensorArgumentError for a CUDA tensor anywhere in it.

    ``reducers`` maps exact types to reduce functions (``obj -> (callable, args)``), used
    before anything else: joblib's reducers that send large arrays as memory maps."""
    return _dumps(_TaskPickler, obj, reducers)


def dumps_result(obj: Any) -> bytes:
    """Pickle a worker's result, CUDA tensors copied to the CPU first."""
    return _dumps(_ResultPickler, obj)


loads = pickle.loads


def __getattr__(name: str) -> Any:
    # RemoteTraceback is only needed where exceptions are unpickled (the pool's process):
    # a worker does not pay for importing concurrent.futures.process.
    if name == "RemoteTraceback":
        from concurrent.futures.process import _RemoteTraceback

        return _RemoteTraceback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class TaskLoadError(Exception):
    """The task's function or arguments could not be unpickled in the worker. (Defined here,
    not in the worker's module: a spawned worker runs that module as ``__main__``.)"""


def _rebuild_exception(exc: BaseException, tb: str) -> BaseException:
    from concurrent.futures.process import _RemoteTraceback

    exc.__cause__ = _RemoteTraceback(tb)  # type: ignore[arg-type]  # it takes the text
    return exc


class ExceptionWithTraceback:
    """Carries an exception and its formatted traceback through pickle."""

    def __init__(self, exc: BaseException, worker: str) -> None:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.tb = f'\n"""\n{worker}, {text}"""'
        # The frames would keep the task's objects alive (and cannot be pickled anyway).
        exc.__traceback__ = None
        self.exc = exc

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_exception, (self.exc, self.tb)
