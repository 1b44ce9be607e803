"""Rank 1 never calls init_process_group; rank 0 records when it starts waiting for it."""
import os
import time

if os.environ["RANK"] == "1":
    time.sleep(600)
import torch.distributed as dist  # noqa: E402

with open(os.environ["BENCH_MARK_FILE"], "w") as f:
    f.write(repr(time.time()))
dist.init_process_group("gloo")
