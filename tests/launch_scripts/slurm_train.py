"""The training script of the Slurm tests (docs/slurm.md's recipes run it as ``train.py``):
torch's env:// contract only, a gloo all_reduce of (rank + 1), one line per rank saying what
the rank was given. Switches, exported by the job as a user exports them:

    TRAIN_CRASH_RANK=R    rank R raises after init_process_group; the others wait in the
                          all_reduce until their launcher stops them
    TRAIN_HOLD_DIR=D      after init each rank writes D/ready.<rank> (its pid and node) and
                          waits for D/go (up to 300 s) before the all_reduce; with
                          TRAIN_HOLD_FIRST_RUN_ONLY=1 only a job's first run holds (a requeued
                          run has SLURM_RESTART_COUNT >= 1)
    TRAIN_NOTICE_DIR=D    a preemption notice (SIGUSR1) appends one line to D/notice.<rank>
                          each time the rank's handler runs: the checkpoint a real job saves
"""

import os
import signal
import time

import torch
import torch.distributed as dist

notices = os.environ.get("TRAIN_NOTICE_DIR")
if notices:
    def on_notice(signum, frame):
        rank = os.environ["RANK"]
        with open(os.path.join(notices, f"notice.{rank}"), "a") as f:
            f.write(f"{time.monotonic()}\n")

    signal.signal(signal.SIGUSR1, on_notice)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
hold = os.environ.get("TRAIN_HOLD_DIR")
if hold and not (os.environ.get("TRAIN_HOLD_FIRST_RUN_ONLY") and restart > 0):
    with open(os.path.join(hold, f"ready.{rank}.tmp"), "w") as f:
        f.write(f"{os.getpid()} {os.environ.get('SLURMD_NODENAME')}\n")
    os.rename(os.path.join(hold, f"ready.{rank}.tmp"), os.path.join(hold, f"ready.{rank}"))
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(hold, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
if os.environ.get("TRAIN_CRASH_RANK") == str(rank):
    raise RuntimeError(f"rank {rank} crashed on purpose")
x = torch.tensor([float(rank + 1)])
dist.all_reduce(x)
env = os.environ.get
print(f"train: rank={rank} world={world} local={env('LOCAL_RANK')}/{env('LOCAL_WORLD_SIZE')} "
      f"node={env('GROUP_RANK')} host={env('SLURMD_NODENAME')} "
      f"gpus={env('CUDA_VISIBLE_DEVICES')} restart={restart} sum={x.item():g}", flush=True)
dist.destroy_process_group()
