"""A job with a straggler: every rank all_reduces a stop flag in a loop; SLOW_RANK first sleeps
SLOW_DELAY_S per step, in a loop of short sleeps, so the others wait for it in all_reduce.
The job ends when STOP_FILE exists (the flag is the sum over ranks, so all agree). Prints one
line at the start and one at the end, nothing else; rank 0 stamps its first step's time."""
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
slow = int(os.environ.get("SLOW_RANK", "-1"))
delay_s = float(os.environ.get("SLOW_DELAY_S", "0"))
stop_file = os.environ.get("STOP_FILE", "")
print(f"rank {rank} ready", flush=True)
steps = 0
while True:
    if rank == slow:
        until = time.monotonic() + delay_s
        while time.monotonic() < until:
            time.sleep(0.02)
    flag = torch.tensor([1.0 if stop_file and os.path.exists(stop_file) else 0.0])
    dist.all_reduce(flag)
    steps += 1
    if steps == 1 and rank == 0 and os.environ.get("STAMP_DIR"):
        with open(os.path.join(os.environ["STAMP_DIR"], "first_step"), "w") as f:
            f.write(repr(time.monotonic()))
    if flag.item() > 0:
        break
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
