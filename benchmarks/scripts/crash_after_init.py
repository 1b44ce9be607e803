"""Rank 1 raises after joining; rank 0 sleeps (not in a collective), so only the launcher can stop it."""
import os
import time

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    with open(os.environ["BENCH_MARK_FILE"], "w") as f:
        f.write(repr(time.time()))
    raise RuntimeError("rank 1 crashed")
time.sleep(600)
