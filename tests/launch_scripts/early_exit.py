"""Rank 1 leaves at once (exit 0); rank 0 stays until the file $GO exists (at most 60 s)."""
import os
import time

rank = int(os.environ["RANK"])
with open(os.path.join(os.environ["PIDDIR"], f"rank{rank}.pids"), "w") as f:
    f.write(f"{os.getpid()}\n")
if rank == 0:
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["GO"]) and time.monotonic() < deadline:
        time.sleep(0.05)
