"""Rank 1 never arrives where rank 0 waits: in init_process_group ('noinit') or in all_reduce."""
import os
import sys
import time

mode = sys.argv[1]
if os.environ["RANK"] == "1" and mode == "noinit":
    time.sleep(120)  # never calls init_process_group, never imports torch
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(120)  # joined, but never calls the collective
dist.all_reduce(torch.ones(1))
