"""Story 2, the gpuwarden way: the same DataLoader, two fixes that work (CPU or GPU).

    python fixed.py

A. Workers that must use CUDA: ``gpuwarden.data.loader_kwargs(2, device=..., uses_cuda_in_workers=True)``
   sees that a forked worker could not use CUDA (the parent queried it) and returns a
   ``forkserver`` context, persistent workers and pinned memory.
B. Usually better: workers stay on the CPU (cheap ``fork`` start, no CUDA context per worker) and
   ``gpuwarden.data.DevicePrefetcher`` moves each batch to the GPU in the main process, the next
   copy overlapping the current compute.

Both epochs must give the same checksum as the arithmetic says. Exit code: 0 when they do.
"""

import sys

import torch
from torch.utils.data import DataLoader, Dataset

from gpuwarden.data import DevicePrefetcher, loader_kwargs

EXPECTED = sum((2 * i + 1) * 3 * 32 * 32 for i in range(64))


class Augmented(Dataset):
    """The naive dataset: 64 images of 3x32x32, augmented on ``device``, returned on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.full((3, 32, 32), float(i), device=self.device)
        return (x * 2 + 1).cpu()


class CpuAugmented(Augmented):
    """Pattern B: the same augmentation on the CPU; the GPU work moves to the main process."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"

    kwargs = loader_kwargs(2, device=device, uses_cuda_in_workers=on_gpu)
    shown = {k: getattr(v, "__name__", None) or type(v).__name__ if callable(v) else v
             for k, v in kwargs.items()}
    print(f"A. loader_kwargs(2, device={str(device)!r}, uses_cuda_in_workers={on_gpu}) -> {shown}")
    total_a = sum(float(batch.sum()) for batch in DataLoader(Augmented(device), batch_size=16, **kwargs))
    print(f"   epoch, the dataset working on {device} in the workers: checksum {total_a:g}")

    kwargs_b = loader_kwargs(2, device=device)
    print(f"B. loader_kwargs(2, device={str(device)!r}) -> "
          f"start method {kwargs_b.get('multiprocessing_context', 'fork (default)')}, "
          f"pin_memory={kwargs_b.get('pin_memory')}")
    total_b = 0.0
    for batch in DevicePrefetcher(DataLoader(CpuAugmented(), batch_size=16, **kwargs_b), device):
        assert batch.device.type == device.type
        total_b += float((batch * 1).sum())  # the "compute", on the device
    print(f"   epoch with CPU workers + DevicePrefetcher to {device}: checksum {total_b:g}")
    ok = total_a == total_b == EXPECTED
    print("ok: both epochs ran, checksums match" if ok else f"FAILED: expected {EXPECTED:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
