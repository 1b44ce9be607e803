"""A rank that joins the process group, meets the others at a barrier, stamps that it is
ready, then sleeps: any CPU it uses afterwards is its launcher's doing (the sampling thread,
the store watch), not the script's."""
import os
import time

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
if os.environ.get("STAMP_DIR"):
    with open(os.path.join(os.environ["STAMP_DIR"], f"ready{dist.get_rank()}"), "w") as f:
        f.write(str(os.getpid()))
time.sleep(float(os.environ.get("IDLE_S", "600")))
