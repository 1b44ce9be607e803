"""A rank that counts preemption notices, without torch (it starts in ~50 ms).

    slurm_notice.py DIR   writes DIR/ready.<rank>; each run of its SIGUSR1 handler appends a
                          line to DIR/notice.<rank>; ends when DIR/go appears (up to 60 s)
"""
import os
import signal
import sys
import time

d = sys.argv[1]
rank = os.environ["RANK"]


def on_notice(signum, frame):
    with open(os.path.join(d, f"notice.{rank}"), "a") as f:
        f.write(f"{time.monotonic()}\n")


signal.signal(signal.SIGUSR1, on_notice)
with open(os.path.join(d, f"ready.{rank}"), "w") as f:
    f.write(str(os.getpid()))
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(d, "go")) and time.monotonic() < deadline:
    time.sleep(0.02)
