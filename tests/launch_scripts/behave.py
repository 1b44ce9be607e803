"""Rank behaviours for the torchrun-parity tests (no torch import: a rank starts in ~50 ms).

    behave.py usr1 DIR         SIGUSR1 handler writes DIR/usr1.<rank>, then the rank exits 0
    behave.py int DIR          a Ctrl-C passed on arrives as KeyboardInterrupt: DIR/kbint.<rank>
    behave.py ignore-int DIR   ignores SIGINT and sleeps: only SIGKILL ends it
    behave.py hold DIR         writes DIR/pid.<rank>, waits for DIR/go
    behave.py lines N          N short lines on stdout
    behave.py bigline BYTES    one line of BYTES bytes and no newline
"""
import os
import signal
import sys
import time

mode = sys.argv[1]
rank = os.environ["RANK"]


def touch(path: str, text: str = "") -> None:
    with open(path, "w") as f:
        f.write(text)


if mode == "usr1":
    d = sys.argv[2]
    got = []
    signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
    touch(os.path.join(d, f"ready.{rank}"))
    deadline = time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    touch(os.path.join(d, f"usr1.{rank}"), str(len(got)))
elif mode == "int":
    d = sys.argv[2]
    try:  # ready is written inside: a Ctrl-C right after it must land here too
        touch(os.path.join(d, f"ready.{rank}"))
        time.sleep(60)
    except KeyboardInterrupt:
        touch(os.path.join(d, f"kbint.{rank}"))
        sys.exit(130)
elif mode == "ignore-int":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    touch(os.path.join(sys.argv[2], f"ready.{rank}"))
    time.sleep(60)
elif mode == "hold":
    d = sys.argv[2]
    touch(os.path.join(d, f"pid.{rank}"), str(os.getpid()))
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(d, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
elif mode == "lines":
    write = sys.stdout.write
    for i in range(int(sys.argv[2])):
        write(f"line {i} of rank {rank}\n")
elif mode == "bigline":
    sys.stdout.buffer.write(b"x" * int(sys.argv[2]))
else:
    sys.exit(f"unknown mode {mode}")
