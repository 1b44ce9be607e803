"""Heavy output, no torch: measures the relay.

    chatty.py lines N            N short lines on stdout (print, as training logs do)
    chatty.py chunks N SIZE      N writes of SIZE bytes without a newline (progress bars, dumps)
"""
import sys

mode, n = sys.argv[1], int(sys.argv[2])
if mode == "lines":
    for i in range(n):
        print(f"step {i} loss 0.1234 lr 3e-4")
else:
    block = b"x" * int(sys.argv[3])
    out = sys.stdout.buffer
    for _ in range(n):
        out.write(block)
    out.flush()
