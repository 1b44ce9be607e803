"""Story 2, the naive way (GPU only): DataLoader workers that use CUDA, after the parent asked.

    python naive.py

The parent only asks ``torch.cuda.is_available()`` to choose its device; the dataset augments
each sample on that device; ``DataLoader(num_workers=2)`` forks its workers (Linux's default
start method up to Python 3.13). The first worker to touch CUDA fails, every time:

    RuntimeError: Caught RuntimeError in DataLoader worker process 0.
    RuntimeError: Cannot re-initialize CUDA in forked subprocess. ...

Exit code: 1 when the workers failed, 0 if the epoch ran, 77 without a GPU (on a CPU build of
torch ``is_available()`` returns False without arming torch's fork check, so there is nothing to
reproduce).
"""

import sys

import torch
from torch.utils.data import DataLoader, Dataset

SKIP_EXIT = 77


class Augmented(Dataset):
    """64 images of 3x32x32, "augmented" on the GPU, handed back on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.full((3, 32, 32), float(i), device=self.device)
        return (x * 2 + 1).cpu()


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # arms the fork check
    if device.type != "cuda":
        print("story 2 naive: skipped, CUDA_FORK_REINIT needs a CUDA build of torch and a GPU "
              "(torch.cuda.is_available() is False here)", file=sys.stderr)
        return SKIP_EXIT
    loader = DataLoader(Augmented(device), batch_size=16, num_workers=2)
    total = sum(float(batch.sum()) for batch in loader)
    print(f"epoch done, checksum {total:g}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError:
        import traceback

        traceback.print_exc()
        sys.exit(1)
