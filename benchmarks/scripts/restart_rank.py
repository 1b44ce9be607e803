"""A rank for bench_restart.py: gloo init and one all_reduce (the "first step"), stamped.

kill_once: on attempt 0, rank 1 stamps the moment and SIGKILLs itself after its first step.
keyerror:  rank 1 raises the same KeyError after init on every attempt.
STAMP_DIR gets ``start_<attempt>_<rank>``, ``step_<attempt>_<rank>`` (monotonic time of the
first step), ``failed`` and ``failed_<attempt>``.
"""
import os
import signal
import time

import torch
import torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
stamps = os.environ["STAMP_DIR"]
mode = os.environ["BENCH_MODE"]
with open(os.path.join(stamps, f"start_{attempt}_{rank}"), "w") as f:
    f.write(repr(time.monotonic()))
dist.init_process_group("gloo")
if mode == "keyerror" and rank == 1:
    with open(os.path.join(stamps, f"failed_{attempt}"), "w") as f:
        f.write(repr(time.monotonic()))
    raise KeyError("learning_rate")
x = torch.ones(1)
dist.all_reduce(x)
with open(os.path.join(stamps, f"step_{attempt}_{rank}"), "w") as f:
    f.write(repr(time.monotonic()))
if mode == "kill_once" and attempt == 0 and rank == 1:
    with open(os.path.join(stamps, "failed"), "w") as f:
        f.write(repr(time.monotonic()))
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(x)
dist.barrier()
dist.destroy_process_group()
