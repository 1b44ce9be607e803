"""Failures for --max-restarts, decided by argv[1] and TORCHELASTIC_RESTART_COUNT (torchrun's).

kill_once:       the last rank SIGKILLs itself after init_process_group on attempt 0; then all finish.
raise_rank0:     rank 0 (the store's host) raises after an all_reduce on attempt 0; then all finish.
raise_last:      the last rank (on the last node) does the same.
kill_always:     the last rank SIGKILLs itself after init_process_group on every attempt.
keyerror:        the last rank raises the same KeyError at the same line on every attempt, after init.
ecc_once:        no torch (a simulated GPU host): rank 1 prints a Xid and a CUDA ECC error and
                 dies on attempt 0; every rank then prints the GPU it was given.
Every rank that finishes prints "rank R done, restart count K of M, sum S" (S = WORLD_SIZE**2).
"""
import os
import signal
import sys

mode = sys.argv[1]
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
limit = os.environ["TORCHELASTIC_MAX_RESTARTS"]
rank = int(os.environ["RANK"])

if mode == "ecc_once":
    if attempt == 0 and rank == 1:
        print(f"NVRM: Xid (PCI:0000:3b:00): 48, pid={os.getpid()}, An uncorrectable double bit "
              "error (DBE) has been detected on GPU in the framebuffer", file=sys.stderr)
        print("RuntimeError: CUDA error: uncorrectable ECC error encountered", file=sys.stderr)
        sys.exit(1)
    print(f"rank {rank} done, restart count {attempt} of {limit}, gpu {os.environ['GPUWARDEN_GPU']}")
    sys.exit(0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if os.environ.get("GPUWARDEN_DEVICE") == "cuda":  # on real GPUs: NCCL, as torchrun scripts do
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    total = torch.ones(1, device="cuda")
else:
    dist.init_process_group("gloo")
    total = torch.ones(1)
dist.all_reduce(total)
if attempt == 0 and mode == "kill_once" and rank == dist.get_world_size() - 1:
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "kill_always" and rank == dist.get_world_size() - 1:
    os.kill(os.getpid(), signal.SIGKILL)
if attempt == 0 and mode == "raise_rank0" and rank == 0:
    raise RuntimeError("lost the batch")
if attempt == 0 and mode == "raise_last" and rank == dist.get_world_size() - 1:
    raise RuntimeError("lost the batch")
if mode == "keyerror" and rank == dist.get_world_size() - 1:
    config: dict[str, int] = {}
    print(config["learning_rate"])
dist.all_reduce(total)  # the others wait here for the rank that failed
print(f"rank {rank} done, restart count {attempt} of {limit}, sum {int(total.item())}", flush=True)
dist.barrier()  # no rank tears gloo down while a peer (on another node) still uses it
dist.destroy_process_group()
