"""Heavy output, no torch: measures the relay.

    chatty.py lines N            N short lines on stdout (print, as training logs do); the same
                                 lines in every rank
    chatty.py distinct N         the same, each line with the rank's number (RANK): no two ranks
                                 print the same line
    chatty.py chunks N SIZE      N writes of SIZE bytes without a newline (progress bars, dumps)
    chatty.py stamped N GAP      (rank 0 only) N lines 'stamp <CLOCK_MONOTONIC>', one every GAP
                                 seconds: the reader measures how long each took to show
"""
import os
import sys
import time

mode, n = sys.argv[1], int(sys.argv[2])
if mode == "lines":
    for i in range(n):
        print(f"step {i} loss 0.1234 lr 3e-4")
elif mode == "distinct":
    rank = os.environ.get("RANK", "0")
    for i in range(n):
        print(f"rank {rank} step {i} loss 0.1234 lr 3e-4")
elif mode == "stamped":
    gap = float(sys.argv[3])
    if os.environ.get("RANK", "0") == "0":
        for _ in range(n):
            print(f"stamp {time.monotonic():.6f}", flush=True)
            time.sleep(gap)
    else:
        time.sleep(n * gap)
else:
    block = b"x" * int(sys.argv[3])
    out = sys.stdout.buffer
    for _ in range(n):
        out.write(block)
    out.flush()
