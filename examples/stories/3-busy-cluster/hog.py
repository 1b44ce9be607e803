"""The "other user" of story 3 (GPU only): fills the first visible GPU and holds it.

    python hog.py [--leave-gib 6]      # prints "holding N bytes" once it holds the memory

Allocates all but --leave-gib of the GPU's free memory and sleeps until killed. Whoever starts
it starts it in its own process group and kills that group (naive.py, fixed.py, verify-gpu).
"""

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leave-gib", type=float, default=6.0)
    args = parser.parse_args()
    free, _total = torch.cuda.mem_get_info(0)
    hold = max(0, free - int(args.leave_gib * 2**30))
    block = torch.empty(hold, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    print(f"holding {block.numel()} bytes on cuda:0", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
