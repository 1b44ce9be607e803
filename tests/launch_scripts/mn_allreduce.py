"""Multi-node test job: gloo all_reduce of (rank + 1) on every rank; prints the sum it got.
With CRASH_RANK set, that rank raises after init while the others sleep (not in a collective),
so only gpuwarden's abort propagation can stop them early."""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
crash = os.environ.get("CRASH_RANK")
if crash is not None:
    if rank == int(crash):
        time.sleep(0.5)
        if os.environ.get("CRASH_STAMP"):  # CLOCK_MONOTONIC is one clock for the whole machine
            with open(os.environ["CRASH_STAMP"], "w") as stamp:
                stamp.write(repr(time.monotonic()))
        raise RuntimeError(f"rank {rank} crashed on purpose")
    time.sleep(120)
x = torch.tensor([float(rank + 1)])
dist.all_reduce(x)
print(f"rank {rank}/{dist.get_world_size()} on {os.environ['GROUP_RANK']}: all_reduce={x.item():g}",
      flush=True)
dist.barrier()
dist.destroy_process_group()
