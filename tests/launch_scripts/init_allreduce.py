"""The gpuwarden.distributed.init() way; an atexit handler must run, as under `python SCRIPT`."""
import atexit
import os

import torch
import torch.distributed as dist

import gpuwarden.distributed as gdist

atexit.register(lambda: print("atexit handler ran", flush=True))
# Written and never closed: the interpreter's normal exit flushes it to disk.
unclosed_log = open(os.path.join(os.environ["UNCLOSED_LOG_DIR"], f"rank{os.environ['RANK']}.txt"), "w")  # noqa: SIM115
unclosed_log.write("written without close\n")
info = gdist.init()
assert gdist.init() is info  # idempotent
t = torch.tensor([float(info.rank + 1)], device=info.device)  # NCCL moves GPU tensors only
dist.all_reduce(t)
print(f"rank {info.rank}/{info.world_size} local {info.local_rank} {info.device} {info.backend} "
      f"launcher={info.launcher} sum={t.item():g}")
gdist.destroy()
