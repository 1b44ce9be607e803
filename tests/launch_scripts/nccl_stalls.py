"""NCCL stalls (one GPU per rank, torchrun style); the last rank is the odd one out.

barrier   after two all_reduces, the last rank goes elsewhere (sleeps); the others wait in
          dist.barrier(), which blocks the CPU on NCCL too
mismatch  after two all_reduces, the last rank calls all_gather_object (which waits on the
          CPU for its result), the others barrier
"""
import os
import sys
import time

import torch
import torch.distributed as dist

mode = sys.argv[1]
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
rank, world = dist.get_rank(), dist.get_world_size()
last = rank == world - 1
t = torch.ones(4, device="cuda")
for _ in range(2):
    dist.all_reduce(t)
torch.cuda.synchronize()
if last and mode == "barrier":
    while True:
        time.sleep(0.05)
elif last and mode == "mismatch":
    out: list[object] = [None] * world
    dist.all_gather_object(out, rank)
else:
    dist.barrier()
