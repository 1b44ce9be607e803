"""Multi-node test job: STEPS steps (default 30; STEPS_AFTER_RESTART once restarted) of a gloo
all_reduce and a short sleep (STEP_S, default 0.1 s), printing the world size and restart count
at the first and last step, so tests can follow membership changes (elastic re-rendezvous) and
restarts. KILL_AT_STEP: the last rank SIGKILLs itself at that step of attempt 0, after writing
the time (CLOCK_MONOTONIC) to KILL_STAMP. Each first-step line carries the time too (at=...)."""

import os
import signal
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
steps = int(os.environ.get("STEPS", "30") if restart == "0"
            else os.environ.get("STEPS_AFTER_RESTART", os.environ.get("STEPS", "30")))
pause = float(os.environ.get("STEP_S", "0.1"))
for step in range(steps):
    x = torch.ones(1)
    dist.all_reduce(x)
    if step in (0, steps - 1):
        print(f"rank {rank}/{world} step {step} sum {x.item():g} restart {restart} "
              f"node {os.environ['GROUP_RANK']} at={time.monotonic():.3f}", flush=True)
    if restart == "0" and rank == world - 1 and str(step) == os.environ.get("KILL_AT_STEP"):
        with open(os.environ["KILL_STAMP"], "w") as stamp:
            stamp.write(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(pause)
dist.barrier()
dist.destroy_process_group()
