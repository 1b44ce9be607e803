"""One rank of the healthy DDP soak (benchmarks/soak_ddp.py): train until SOAK_UNTIL (a
wall-clock time), with what a real job does between steps: uneven data loading, an async
all_reduce of a metric and its .wait(), a barrier, rank 0 "checkpointing" while the others wait
at a barrier (less than the stall timeout), a caught collective error now and then."""
import os
import random
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

until = float(os.environ["SOAK_UNTIL"])
pause_s = float(os.environ.get("SOAK_PAUSE_S", "3"))
dist.init_process_group("gloo")
rank = dist.get_rank()
rng = random.Random(rank)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0
while True:
    stop = torch.tensor([float(time.time() >= until)])
    dist.all_reduce(stop)  # every rank leaves at the same step
    if stop.item() > 0:
        break
    time.sleep(rng.uniform(0, 0.02))  # uneven data loading
    x = torch.randn(32, 64)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if step % 50 == 0:
        metric = loss.detach().clone()
        dist.all_reduce(metric, async_op=True).wait()
    if step % 200 == 0:
        if rank == 0:
            time.sleep(pause_s)  # a checkpoint: the others wait at the barrier meanwhile
        dist.barrier()
    if step % 500 == 0:
        try:
            dist.broadcast(torch.ones(1), src=dist.get_world_size() + 1)
        except (ValueError, RuntimeError):
            pass
print(f"rank {rank}: {step} steps", flush=True)
dist.destroy_process_group()
