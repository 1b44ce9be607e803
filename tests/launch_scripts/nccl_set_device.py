"""torchrun style on GPUs: set_device(LOCAL_RANK), then NCCL all_reduce on the rank's GPU."""
import os
import sys

import torch
import torch.distributed as dist

local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)  # cuda:LOCAL_RANK is the rank's own GPU, as under torchrun
if sys.argv[1:] == ["--no-collective"]:  # ranks sharing one GPU: NCCL would refuse them
    print(f"rank {os.environ['RANK']} local {local_rank} current_device="
          f"{torch.cuda.current_device()} count={torch.cuda.device_count()}")
    sys.exit(0)
dist.init_process_group("nccl")
t = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} current_device={torch.cuda.current_device()} "
      f"count={torch.cuda.device_count()} sum={t.item():g}")
dist.destroy_process_group()
