"""The job of story 3: it needs --need-gib of GPU memory on the GPU it is given.

Written the usual way: it uses ``cuda`` (the first visible GPU) — whichever GPU
CUDA_VISIBLE_DEVICES names, or GPU 0 when nothing narrows it. Without CUDA (a CPU machine running
the story on the simulated host) it says which GPU it was given and stops there.
"""

import argparse
import os
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--need-gib", type=float, default=16.0)
    parser.add_argument("--hold-s", type=float, default=0.0, help="keep the GPU this long")
    args = parser.parse_args()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    if not torch.cuda.is_available():
        print(f"job: CUDA_VISIBLE_DEVICES={visible}; no CUDA on this machine, so no allocation "
              f"of {args.need_gib:g} GiB (on a GPU host it would go to that GPU)", flush=True)
        time.sleep(args.hold_s)
        return
    need_bytes = int(args.need_gib * 2**30)
    weights = torch.empty(need_bytes, dtype=torch.uint8, device="cuda")
    weights.fill_(1)
    torch.cuda.synchronize()
    print(f"job: CUDA_VISIBLE_DEVICES={visible}; allocated {args.need_gib:g} GiB on "
          f"{torch.cuda.get_device_name(0)}", flush=True)
    time.sleep(args.hold_s)


if __name__ == "__main__":
    main()
