"""Story 1, the gpuwarden way: ``gpuwarden.distributed.spawn`` + ``init()`` (CPU or GPU).

    python fixed.py

The parent may ask torch.cuda anything: ``spawn`` starts fresh processes (never forks this
one), leases one GPU per rank before the rank runs any code (CUDA_VISIBLE_DEVICES names the
job's GPUs in rank order, as under torchrun, so the rank's GPU is ``cuda:LOCAL_RANK``), and
``init()`` does set_device, then ``init_process_group`` with the right
backend (NCCL on a GPU of its own, gloo on CPU) and ``device_id`` — so a bad device fails at
init, not at the first collective. A failing rank comes back as one SpawnError naming the rank.

With fewer GPUs than ranks, spawn refuses before starting anything (it would be "Duplicate GPU
detected"): shown on a host with one GPU. Without a GPU the ranks run on the CPU with gloo.

Exit code: 0 when the job ran (and, with one GPU, the over-subscription was refused).
"""

import sys

import gpuwarden.distributed as gdist
from gpuwarden.errors import ConstraintError


def worker(rank: int) -> str:
    import torch
    import torch.distributed as dist

    info = gdist.init()
    t = torch.ones(1, device=info.device) * (rank + 1)
    dist.all_reduce(t)
    where = f"{info.device} ({torch.cuda.get_device_name(info.device)})" if info.device.type == "cuda" \
        else "cpu"
    gdist.destroy()
    return f"rank {rank}/{info.world_size} on {where}, backend {info.backend}: all_reduce = {t.item():g}"


def usable_gpus() -> int:
    from gpuwarden.errors import NoGPUError, VisibilityError
    from gpuwarden.inventory import read_visible

    try:
        return len(read_visible()[1])
    except (NoGPUError, VisibilityError):  # no driver, or CUDA_VISIBLE_DEVICES hides every GPU
        return 0


def main() -> int:
    import torch

    print(f"parent: torch.cuda.is_available() = {torch.cuda.is_available()} "
          "(harmless: spawn never forks this process)", flush=True)
    gpus = usable_gpus()
    nprocs = gpus if gpus >= 2 else 2
    results = gdist.spawn(worker, nprocs=nprocs if gpus != 1 else 1, cpu=gpus == 0,
                          stall_timeout="60s")
    for line in results:
        print(line)
    ok = True
    if gpus == 1:
        try:
            gdist.spawn(worker, nprocs=2)
            print("FAILED: 2 ranks on 1 GPU were not refused")
            ok = False
        except ConstraintError as exc:
            print(f"2 ranks on 1 GPU, refused before any rank started:\n{exc.render()}")
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
