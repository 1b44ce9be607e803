"""DataLoader settings that are safe for the current process, and a device prefetcher.

- :func:`loader_kwargs` returns keyword arguments for ``torch.utils.data.DataLoader``:
  a ``forkserver`` context when forked workers could not use CUDA (the parent already
  initialized or queried CUDA: CUDA_FORK_REINIT) or when the workers use CUDA themselves,
  ``pin_memory`` when a GPU is the target, ``persistent_workers`` when restarting workers
  every epoch would be slow, and a warning (DATALOADER_SHM) when ``/dev/shm`` cannot hold
  the batches in flight.
- :class:`DevicePrefetcher` copies the next batch to the GPU on a side stream while the
  current one is being used.

Nothing here initializes CUDA in the caller; see docs/data.md.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from gpuwarden.units import format_bytes

SHM_PATH = "/dev/shm"
# DataLoader tensors also live in /dev/shm next to everything else there: keep headroom.
SHM_USABLE_SHARE = 0.8


class SharedMemoryWarning(UserWarning):
    """/dev/shm looks too small for the DataLoader's batches in flight (DATALOADER_SHM)."""


def _fork_safe() -> bool:
    """Whether a process forked now could use CUDA. The one seam to gpuwarden.fork_safe."""
    from gpuwarden.forksafe import fork_safe

    return fork_safe()


def _shm_free_bytes() -> int | None:
    try:
        return shutil.disk_usage(SHM_PATH).free
    except OSError:
        return None


class CudaWorkerInit:
    """worker_init_fn for DataLoader workers that use CUDA: selects the target device first.

    A worker inherits CUDA_VISIBLE_DEVICES from the parent, so the parent's device index
    names the same GPU in the worker; without this, every worker's CUDA work lands on
    ``cuda:0``.
    """

    def __init__(self, device_index: int, then: Callable[[int], None] | None = None) -> None:
        self.device_index = device_index
        self.then = then

    def __call__(self, worker_id: int) -> None:
        import torch

        torch.cuda.set_device(self.device_index)
        if self.then is not None:
            self.then(worker_id)


def _cuda_index(device: Any) -> int | None:
    """The CUDA index of a device spec ('cuda', 'cuda:1', torch.device, int), None if not CUDA."""
    if device is None:
        return None
    if isinstance(device, int):
        return device
    text = str(device)
    if not text.startswith("cuda"):
        return None
    return int(text.split(":", 1)[1]) if ":" in text else 0


def loader_kwargs(
    num_workers: int,
    *,
    device: Any = None,
    uses_cuda_in_workers: bool = False,
    batch_bytes: int | None = None,
    prefetch_factor: int = 2,
    persistent_workers: bool | None = None,
    worker_init_fn: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """DataLoader keyword arguments that are safe for this process now.

    ``device`` is where the batches go (``"cuda:0"`` turns on ``pin_memory``);
    ``uses_cuda_in_workers`` says that the dataset itself calls CUDA in the workers;
    ``batch_bytes`` (the size of one batch) enables the /dev/shm check.

    Warns (SharedMemoryWarning, DATALOADER_SHM) when ``num_workers * prefetch_factor *
    batch_bytes`` exceeds what /dev/shm has free: the workers would die with a bus error.
    Raises ValueError for negative ``num_workers``.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers}: must be >= 0")
    cuda_index = _cuda_index(device)
    kwargs: dict[str, Any] = {"num_workers": num_workers, "pin_memory": cuda_index is not None}
    if num_workers == 0:
        return kwargs
    kwargs["prefetch_factor"] = prefetch_factor
    needs_fresh = uses_cuda_in_workers or not _fork_safe()
    if needs_fresh:
        import multiprocessing

        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() \
            else "spawn"
        kwargs["multiprocessing_context"] = method
    # Fresh workers re-import the dataset's modules (torch) every epoch: keep them.
    kwargs["persistent_workers"] = needs_fresh if persistent_workers is None \
        else persistent_workers
    if uses_cuda_in_workers:
        kwargs["worker_init_fn"] = CudaWorkerInit(cuda_index or 0, worker_init_fn)
    elif worker_init_fn is not None:
        kwargs["worker_init_fn"] = worker_init_fn
    if batch_bytes:
        _check_shm(num_workers, prefetch_factor, batch_bytes)
    return kwargs


def _check_shm(num_workers: int, prefetch_factor: int, batch_bytes: int) -> None:
    free = _shm_free_bytes()
    need = num_workers * prefetch_factor * batch_bytes
    if free is None or need <= free * SHM_USABLE_SHARE:
        return
    warnings.warn(
        f"[DATALOADER_SHM] {num_workers} workers x prefetch_factor {prefetch_factor} x "
        f"{format_bytes(batch_bytes)} per batch = {format_bytes(need)} in flight, but "
        f"{SHM_PATH} has {format_bytes(free)} free: workers will die with 'Bus error' / "
        f"'out of shared memory'. Fix: a larger /dev/shm (docker --shm-size or --ipc=host), "
        f"fewer workers, or a smaller prefetch_factor.",
        SharedMemoryWarning,
        stacklevel=3,
    )


def _move(batch: Any, device: Any) -> Any:
    torch = sys.modules["torch"]
    if isinstance(batch, torch.Tensor):
        source = batch if batch.is_pinned() else batch.pin_memory()
        return source.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: _move(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_move(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_move(v, device) for v in batch)
    return batch


def _record(batch: Any, stream: Any) -> None:
    torch = sys.modules["torch"]
    if isinstance(batch, torch.Tensor):
        if batch.is_cuda:
            batch.record_stream(stream)
    elif isinstance(batch, Mapping):
        for v in batch.values():
            _record(v, stream)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            _record(v, stream)


class DevicePrefetcher:
    """Iterate ``loader`` with each batch already on ``device``, the next one in flight.

    On a CUDA device, batch *n+1* is copied host-to-device on a side stream (from pinned
    memory, ``non_blocking``) while batch *n* is in use; before a batch is handed out the
    compute stream waits for its copy (``wait_stream``) and every tensor is marked with
    ``record_stream`` so the caching allocator does not reuse its memory while the compute
    stream may still read it. Tensors inside tuples, lists, namedtuples and dicts are moved.
    On the CPU the loader's batches are passed through unchanged.
    """

    def __init__(self, loader: Any, device: Any) -> None:
        import torch

        self.loader = loader
        self.device = torch.device(device)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        import torch

        if self.device.type != "cuda":
            yield from self.loader
            return
        side = torch.cuda.Stream(device=self.device)
        batches = iter(self.loader)

        def preload() -> Any:
            try:
                batch = next(batches)
            except StopIteration:
                return _END
            with torch.cuda.stream(side):
                return _move(batch, self.device)

        upcoming = preload()
        while upcoming is not _END:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(side)
            _record(upcoming, compute)
            current, upcoming = upcoming, preload()
            yield current


_END = object()
