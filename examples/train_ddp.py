"""A tiny DDP training run that works on CPU (gloo) and on GPUs (NCCL) unchanged.

    gpuwarden launch -n 2 examples/train_ddp.py
"""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gpuwarden.distributed as gdist


def main() -> None:
    info = gdist.init()  # device first, then the process group, with a timeout in minutes
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(info.device)
    ddp = DistributedDataParallel(model, device_ids=[info.device] if info.device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1234 + info.rank)  # each rank its own shard of data
    w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
    for step in range(60):
        x = torch.randn(64, 16, generator=gen)
        y = x @ w_true
        loss = nn.functional.mse_loss(ddp(x.to(info.device)), y.to(info.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0 or step == 59:
            print(f"rank {info.rank}/{info.world_size} on {info.device}: step {step} loss {loss.item():.4f}")
    # DDP keeps replicas identical: the sum of every rank's checksum is world_size times ours.
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    total = checksum.clone()
    torch.distributed.all_reduce(total)
    assert torch.allclose(total, checksum * info.world_size), "replicas diverged"
    # DDP holds the process group: dropped first, the group's gloo/NCCL threads end inside
    # destroy(), not while the interpreter shuts down (where they can abort the process).
    del ddp, opt
    gdist.destroy()


if __name__ == "__main__":
    main()
