"""A torchrun-style script: every rank adds its rank+1; all ranks must see the same sum.

    gpuwarden launch -n 2 examples/allreduce.py        (or: torchrun --standalone --nproc-per-node 2 ...)
"""

import os

import torch
import torch.distributed as dist


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    assert value.item() == expected, (value.item(), expected)
    print(f"rank {rank}/{world}: all_reduce sum = {value.item():g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
