"""Rank 1 raises while rank 0 waits in all_reduce: rank 0's 'Connection closed by peer' is an echo."""
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(0.3)
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
dist.all_reduce(torch.ones(1))
