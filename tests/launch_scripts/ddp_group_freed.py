"""DDP through gpuwarden.distributed, then destroy(): print the gloo threads alive before and after.

The group's threads must end inside destroy(): left running, one releasing a collective's tensors
while the interpreter exits aborts the rank.
"""

import os

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gpuwarden.distributed as gdist


def gloo_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        if "gloo" in name:
            names.append(name)
    return sorted(names)


gdist.init()
ddp = DistributedDataParallel(nn.Linear(4, 1))  # its first use imports torch._dynamo
ddp(torch.randn(2, 4)).sum().backward()
total = torch.ones(1)
torch.distributed.all_reduce(total)
print("BEFORE", gloo_threads())
del ddp
gdist.destroy()
print("AFTER", gloo_threads())
