"""The training script of this story: what every rank runs (torchrun-style, env:// rendezvous).

Nothing here is wrong. It reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT like any script
written for torchrun, joins the process group and sums one tensor across the ranks.

``--timeout-s`` stands in for PyTorch's default (30 minutes for gloo, 10 for NCCL) so that the
story finishes in seconds; ``--stuck-rank N`` makes rank N block before init_process_group, the
way a rank does that waits on a dataset download or a lock that never comes.
"""

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout-s", type=float, default=None)
    parser.add_argument("--stuck-rank", type=int, default=None)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if rank == args.stuck_rank:
        time.sleep(3600)  # "downloading the dataset": never reaches init_process_group
    timeout = datetime.timedelta(seconds=args.timeout_s) if args.timeout_s else None
    print(f"rank {rank}: init_process_group(gloo) via {os.environ['MASTER_ADDR']}:"
          f"{os.environ['MASTER_PORT']}", flush=True)
    dist.init_process_group("gloo", timeout=timeout)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"rank {rank}/{dist.get_world_size()}: all_reduce sum = {total.item():g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
