"""One NCCL all_reduce on this rank's GPU, torchrun's way (bench_launch.py --gpu)."""

import os

import torch
import torch.distributed as dist

local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local_rank)
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
value = torch.ones(1, device=device)
dist.all_reduce(value)
assert value.item() == dist.get_world_size()
dist.destroy_process_group()
