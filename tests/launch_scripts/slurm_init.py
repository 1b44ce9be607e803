"""A task started by ``srun -n N python slurm_init.py``, no launcher: gpuwarden.distributed.init()
finds its place from Slurm's variables; a gloo all_reduce of (rank + 1); one line per task with
what the scripts it replaces read from the environment afterwards."""

import os
import sys

import torch
import torch.distributed as dist

from gpuwarden.distributed import init

info = init()
x = torch.tensor([float(info.rank + 1)])
dist.all_reduce(x)
env = os.environ.get
sys.stdout.write(f"init: rank={info.rank} world={info.world_size} local={info.local_rank} "
                 f"launcher={info.launcher} host={env('SLURMD_NODENAME')} RANK={env('RANK')} "
                 f"WORLD_SIZE={env('WORLD_SIZE')} LOCAL_RANK={env('LOCAL_RANK')} "
                 f"LOCAL_WORLD_SIZE={env('LOCAL_WORLD_SIZE')} sum={x.item():g}\n")
sys.stdout.flush()  # one write: the tasks of srun share one output
dist.destroy_process_group()
