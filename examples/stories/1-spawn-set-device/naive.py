"""Story 1, the naive way (GPU only): starting DDP ranks by hand with torch.multiprocessing.

    python naive.py fork-after-cuda   # the parent asked torch.cuda, then forked the ranks
    python naive.py no-set-device     # mp.spawn, NCCL, and no torch.cuda.set_device(rank)

fork-after-cuda: ``torch.cuda.is_available()`` in the parent (is there a GPU at all?), then
``start_processes(..., start_method="fork")`` — what ``multiprocessing.Process`` does by default
on Linux. Each rank's first CUDA call fails: CUDA_FORK_REINIT. (``device_count()`` alone would
not do it: torch counts through NVML when it can, which leaves forked children able to use
CUDA; the first run on a real GPU showed exactly that, the ranks getting as far as NCCL.
``is_available()`` asks the CUDA runtime unless PYTORCH_NVML_BASED_CUDA_CHECK=1.)
no-set-device: ``mp.spawn`` starts clean processes, but no rank calls ``set_device``, so every
rank's ``cuda`` is GPU 0 and NCCL refuses the communicator: "Duplicate GPU detected"
(NCCL_DUPLICATE_GPU), at the first collective, since NCCL starts lazily. Two ranks, so one GPU
is enough to show it.

Exit code: 1 when the ranks failed, 0 if the job ran, 77 without a GPU.
"""

import datetime
import os
import socket
import sys
import traceback

from gpuwarden.inventory import real_gpu_present as has_gpu

SKIP_EXIT = 77


def worker(rank: int, world_size: int, set_device: bool) -> None:
    import torch
    import torch.distributed as dist

    if set_device:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.ones(1, device="cuda")  # cuda: the current device, GPU 0 unless set_device
    dist.all_reduce(t)
    print(f"rank {rank}: all_reduce = {t.item():g}", flush=True)
    dist.destroy_process_group()


def main() -> int:
    case = sys.argv[1] if len(sys.argv) > 1 else "no-set-device"
    if case not in ("fork-after-cuda", "no-set-device"):
        print("usage: python naive.py fork-after-cuda|no-set-device", file=sys.stderr)
        return 2
    if not has_gpu():
        code = "CUDA_FORK_REINIT" if case == "fork-after-cuda" else "NCCL_DUPLICATE_GPU"
        print(f"story 1 naive ({case}): skipped, {code} needs a real GPU (NVML reports none here)",
              file=sys.stderr)
        return SKIP_EXIT
    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    try:
        if case == "fork-after-cuda":
            if not torch.cuda.is_available():  # the parent "only asked"
                return SKIP_EXIT
            nprocs = max(2, torch.cuda.device_count())
            mp.start_processes(worker, args=(nprocs, True), nprocs=nprocs, start_method="fork")
        else:
            mp.spawn(worker, args=(2, False), nprocs=2)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
