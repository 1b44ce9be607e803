"""Choose a DataLoader start method from gpuwarden.fork_safe().

`torch.cuda.is_available()` alone makes every child forked afterwards unable to use CUDA
("Cannot re-initialize CUDA in forked subprocess"), although `torch.cuda.is_initialized()`
still says False. fork_safe() asks a forked probe child, so fork is used while it is safe
(fast start, shared memory pages) and forkserver once it is not.

    python examples/fork_safe_dataloader.py
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import gpuwarden


def loader(dataset: TensorDataset) -> DataLoader:
    safety = gpuwarden.fork_safety()
    context = "fork" if safety.safe else "forkserver"
    print(f"fork safe: {safety.safe} ({safety.reason}) -> multiprocessing_context={context!r}")
    return DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context=context)


if __name__ == "__main__":
    data = TensorDataset(torch.arange(16, dtype=torch.float32))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # may poison fork on a GPU host
    total = sum(batch[0].to(device).sum().item() for batch in loader(data))
    print(f"sum over {device}: {total}")
