"""One scenario per argv[1]; the last rank is the odd one out (WORLD_SIZE - 1).

async     the others wait on all_reduce(async_op=True).wait(); the last rank sleeps elsewhere
ddp       DDP training; the last rank stops taking part after 3 steps (sleeps in its loop)
mismatch  the last rank calls broadcast, every other rank all_reduce
exit0     the last rank leaves with os._exit(0) after init; the others all_reduce
healthy   no stall (exit 0, no report), in three steps: every rank calls a collective that
          raises and catches it; rank 0 prepares data (sleeps) a little under the timeout while
          the others wait at a barrier; every rank computes past the timeout (rank 0 longest),
          then all meet in all_reduce
compile   a collective inside torch.compile(fullgraph=True, backend="eager")
"""
import os
import sys
import time

import torch
import torch.distributed as dist

mode = sys.argv[1]
stall_s = float(os.environ.get("STALL_S", "4"))
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
last = rank == world - 1


def stamp() -> None:
    """When this rank starts to wait for good (tests measure the time to the report from it)."""
    if os.environ.get("STAMP_DIR"):
        with open(os.path.join(os.environ["STAMP_DIR"], f"rank{rank}"), "w") as f:
            f.write(repr(time.monotonic()))


def elsewhere() -> None:
    while True:
        time.sleep(0.05)  # not a collective, not computing: the odd one out


def busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = torch.randn(64, 64)
    while time.monotonic() < end:
        x = torch.tanh(x @ x)


if mode == "async":
    if last:
        elsewhere()
    handle = dist.all_reduce(torch.ones(1), async_op=True)
    stamp()
    handle.wait()
elif mode == "ddp":
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1000):
        if last and step == 3:
            elsewhere()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        stamp()
        loss.backward()
        opt.step()
elif mode == "mismatch":
    stamp()
    if last:
        dist.broadcast(torch.ones(1), src=rank)
    else:
        dist.all_reduce(torch.ones(1))
elif mode == "exit0":
    if last:
        time.sleep(0.5)
        os._exit(0)
    stamp()
    dist.all_reduce(torch.ones(1))
elif mode == "healthy":
    try:
        dist.broadcast(torch.ones(1), src=world + 5)  # no such rank: raises at once
    except (ValueError, RuntimeError) as exc:
        print(f"caught {type(exc).__name__}", flush=True)
    if rank == 0:
        time.sleep(max(0.5, stall_s - 1.5))
    dist.barrier()
    print("past the barrier", flush=True)
    busy(stall_s + 2 if rank == 0 else stall_s + 1)
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"sum {t.item():g}", flush=True)
elif mode == "compile":
    @torch.compile(fullgraph=True, backend="eager")
    def summed(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    out = summed(torch.full((2,), float(rank + 1)))
    print(f"rank {rank}: compiled all_reduce -> {out.tolist()}", flush=True)
dist.destroy_process_group()
