"""The training script of the Slurm tests (docs/slurm.md's recipes run it as ``train.py``):
torch's env:// contract only, a gloo all_reduce of (rank + 1), one line per rank saying what
the rank was given. Switches, exported by the job as a user exports them:

    TRAIN_LIGHT=1         no torch: the line from the environment alone (sum=-), for the tests
                          about what a launcher is given and how a job ends, not the collective
    TRAIN_CRASH_RANK=R    rank R raises after init_process_group; the others wait (in the hold,
                          or in the all_reduce) until their launcher stops them
    TRAIN_HOLD_DIR=D      after init each rank writes D/ready.<rank> (its pid and node) and
                          waits for D/go (up to 300 s) before the all_reduce; with
                          TRAIN_HOLD_FIRST_RUN_ONLY=1 only a job's first run holds (a requeued
                          run has SLURM_RESTART_COUNT >= 1)
    TRAIN_NOTICE_DIR=D    a preemption notice (SIGUSR1) appends one line to D/notice.<rank>
                          each time the rank's handler runs: the checkpoint a real job saves
"""

import os
import signal
import sys
import time

env = os.environ.get
light = bool(env("TRAIN_LIGHT"))
notices = env("TRAIN_NOTICE_DIR")
if notices:
    def on_notice(signum, frame):
        with open(os.path.join(notices, f"notice.{os.environ['RANK']}"), "a") as f:
            f.write(f"{time.monotonic()}\n")

    signal.signal(signal.SIGUSR1, on_notice)

if light:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
else:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
restart = int(env("SLURM_RESTART_COUNT") or 0)
if env("TRAIN_CRASH_RANK") == str(rank):
    time.sleep(0.5)  # the others are waiting by then (in the hold, or in the all_reduce)
    raise RuntimeError(f"rank {rank} crashed on purpose")
hold = env("TRAIN_HOLD_DIR")
if hold and not (env("TRAIN_HOLD_FIRST_RUN_ONLY") and restart > 0):
    with open(os.path.join(hold, f"ready.{rank}.tmp"), "w") as f:
        f.write(f"{os.getpid()} {env('SLURMD_NODENAME')}\n")
    os.rename(os.path.join(hold, f"ready.{rank}.tmp"), os.path.join(hold, f"ready.{rank}"))
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(hold, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
total = "-"
if not light:
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    total = f"{x.item():g}"
# One write: the ranks of torchrun share one pipe, and print's two writes could interleave.
sys.stdout.write(f"train: rank={rank} world={world} local={env('LOCAL_RANK')}/"
                 f"{env('LOCAL_WORLD_SIZE')} node={env('GROUP_RANK')} "
                 f"host={env('SLURMD_NODENAME')} gpus={env('CUDA_VISIBLE_DEVICES')} "
                 f"restart={restart} sum={total}\n")
sys.stdout.flush()
if not light:
    dist.destroy_process_group()
