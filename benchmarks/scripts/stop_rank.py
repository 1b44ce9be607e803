"""A rank for bench_stop.py: torch imported, gloo init, then one rank fails and the others are
busy until the launcher stops them.

BENCH_MODE raise: rank 1 raises ValueError; exit: rank 1 calls sys.exit(3). The other ranks
(BENCH_VICTIM busy): a loop of 2 ms sleeps writing a heartbeat (monotonic time) each turn; or
(collective) a loop of all_reduce, each followed by a heartbeat, so rank 1's exit reaches them
as gloo's own error ("Connection closed by peer": their "second error") unless the launcher
stops them first. STAMP_DIR gets ``failed`` (rank 1, just before it fails), ``beat_<rank>``
(the last heartbeat) and ``echo_<rank>`` (a victim whose collective raised, with the time).
"""
import os
import sys
import time

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
stamps = os.environ["STAMP_DIR"]
mode = os.environ["BENCH_MODE"]
victim = os.environ.get("BENCH_VICTIM", "busy")
dist.init_process_group("gloo")
x = torch.ones(1)
dist.all_reduce(x)  # every rank is up and connected
if rank == 1:
    time.sleep(1.0)
    with open(os.path.join(stamps, "failed"), "w") as f:
        f.write(repr(time.monotonic()))
    if mode == "exit":
        sys.exit(3)
    raise ValueError("the failure the launcher must act on")
fd = os.open(os.path.join(stamps, f"beat_{rank}"), os.O_WRONLY | os.O_CREAT, 0o644)
while True:
    if victim == "collective":
        try:
            dist.all_reduce(x)
        except Exception:
            with open(os.path.join(stamps, f"echo_{rank}"), "w") as f:
                f.write(repr(time.monotonic()))
            raise
    else:
        time.sleep(0.002)
    os.pwrite(fd, repr(time.monotonic()).encode().ljust(32), 0)
