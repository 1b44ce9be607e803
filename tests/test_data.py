"""loader_kwargs and DevicePrefetcher on the CPU, with real DataLoaders."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from gpuwarden import data
from gpuwarden.data import CudaWorkerInit, DevicePrefetcher, SharedMemoryWarning, loader_kwargs

pytestmark = pytest.mark.timeout(120)


class Squares(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i * i])


@pytest.mark.slow
def test_poisoned_parent_gets_forkserver_and_the_loader_iterates(monkeypatch) -> None:
    # No leftover-process check here: multiprocessing's forkserver and resource tracker
    # live as long as the interpreter, by design of the standard library.
    # The seam stands for gpuwarden.fork_safe() (doctor issue), which detects a parent that
    # touched CUDA; this CPU box cannot poison itself for real (see the gpu test below).
    monkeypatch.setattr(data, "_fork_safe", lambda: False)
    kwargs = loader_kwargs(2)
    assert kwargs["multiprocessing_context"] == "forkserver"
    assert kwargs["persistent_workers"] is True
    loader = DataLoader(Squares(), batch_size=2, **kwargs)
    batches = [b.flatten().tolist() for b in loader]
    assert sorted(sum(batches, [])) == [i * i for i in range(8)]
    del loader


def test_healthy_parent_keeps_the_default_fork() -> None:
    kwargs = loader_kwargs(2)
    assert "multiprocessing_context" not in kwargs
    assert kwargs["pin_memory"] is False and kwargs["persistent_workers"] is False


def test_cuda_target_and_cuda_workers() -> None:
    kwargs = loader_kwargs(4, device="cuda:1", uses_cuda_in_workers=True)
    assert kwargs["pin_memory"] is True
    assert kwargs["multiprocessing_context"] == "forkserver"
    init = kwargs["worker_init_fn"]
    assert isinstance(init, CudaWorkerInit) and init.device_index == 1


def test_no_workers_no_context() -> None:
    assert loader_kwargs(0, device="cpu") == {"num_workers": 0, "pin_memory": False}


def test_warns_when_dev_shm_cannot_hold_the_batches() -> None:
    with pytest.warns(SharedMemoryWarning, match=r"DATALOADER_SHM.*8 workers x prefetch_factor 4"):
        loader_kwargs(8, prefetch_factor=4, batch_bytes=1 << 50)


Pair = collections.namedtuple("Pair", "x y")


def test_prefetcher_on_cpu_passes_batches_through() -> None:
    batches = [(torch.ones(2), {"y": torch.zeros(1)}), [torch.ones(1)], Pair(torch.ones(1), 3)]
    out = list(DevicePrefetcher(batches, "cpu"))
    assert len(out) == 3
    for got, want in zip(out, batches, strict=True):
        assert got is want
