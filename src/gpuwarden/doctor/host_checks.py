"""Checks of the host around the GPUs: /dev/shm, the open-files limit, fork safety advice."""

from __future__ import annotations

import sys
from collections.abc import Mapping

from gpuwarden.doctor.model import Check, Status, check
from gpuwarden.doctor.probes import ShmInfo, TorchInfo
from gpuwarden.units import GIB, MIB, format_bytes

OK, WARN, FAIL, SKIP = Status.OK, Status.WARN, Status.FAIL, Status.SKIP

# /dev/shm thresholds. DataLoader workers hand every batch to the main process through
# /dev/shm; num_workers * prefetch_factor batches are in flight (8 with 4 workers and the
# default prefetch_factor 2). Eight batches of 64 images of 3x224x224 float32 (38.5 MiB each)
# take 308 MiB, of 256 images 1.2 GiB. Docker's default 64 MiB fails the first of these: we
# warn below 1 GiB, and fail when less than 32 MiB is free (not even one such batch fits; a
# job with num_workers=0 needs none, which is why a small /dev/shm is only a warning).
SHM_WARN_BYTES = 1 * GIB
SHM_FAIL_FREE_BYTES = 32 * MIB

# DataLoader's default sharing strategy on Linux (file_descriptor) keeps one descriptor per
# tensor storage in flight between a worker and the main process: a batch of 100 tensors with
# 4 workers and prefetch 2 holds 800, next to the process's own files and sockets. The common
# default soft limit of 1024 then fails ('received 0 items of ancdata', 'Too many open files').
NOFILE_WARN = 4096


def check_shm_dataloader(shm: ShmInfo | None) -> Check:
    """/dev/shm against DataLoader worker batches (DATALOADER_SHM)."""
    cid, code = "shm_dataloader", "DATALOADER_SHM"
    fix = ("give the container more shared memory (docker run --shm-size=8g, or --ipc=host; "
           "Kubernetes: an emptyDir with medium: Memory on /dev/shm), or use fewer workers and "
           "a smaller prefetch_factor")
    if shm is None:
        return check(cid, code, FAIL, "/dev/shm does not exist: DataLoader workers cannot "
                     "hand batches over", fix=fix)
    size = (f"/dev/shm: {format_bytes(shm.total_bytes)}, {format_bytes(shm.free_bytes)} free "
            f"(warn below {format_bytes(SHM_WARN_BYTES)}, fail below "
            f"{format_bytes(SHM_FAIL_FREE_BYTES)} free)")
    why = ("each DataLoader worker passes its batches through /dev/shm; num_workers x "
           "prefetch_factor batches are in flight (8 x 38.5 MiB = 308 MiB for 64 images of "
           "3x224x224 float32 with 4 workers); when it is full a worker dies with 'Bus error'")
    if shm.free_bytes < SHM_FAIL_FREE_BYTES:
        return check(cid, code, FAIL, f"only {format_bytes(shm.free_bytes)} of /dev/shm is free",
                     why=why, fix=fix, evidence=[size])
    if shm.total_bytes < SHM_WARN_BYTES:
        return check(cid, code, WARN, f"/dev/shm is only {format_bytes(shm.total_bytes)}",
                     why=why, fix=fix, evidence=[size])
    return check(cid, code, OK, f"/dev/shm has {format_bytes(shm.free_bytes)} free",
                 evidence=[size])


def check_shm_nccl(shm: ShmInfo | None, local_gpus: int) -> Check:
    """/dev/shm for NCCL between ranks of one node (NCCL_SHM)."""
    cid, code = "shm_nccl", "NCCL_SHM"
    if local_gpus < 2:
        return check(cid, code, SKIP, "fewer than 2 GPUs here: NCCL needs no shared memory "
                     "between local ranks")
    fix = "docker run --shm-size=8g or --ipc=host (NCCL_SHM_DISABLE=1 avoids it at a speed cost)"
    why = ("NCCL keeps per-peer buffers (NCCL_BUFFSIZE, 4 MiB, per channel) of its shared-memory "
           "transport and proxy under /dev/shm; a full /dev/shm fails communicator setup with "
           "'unhandled system error' / 'Error while creating shared memory segment'")
    if shm is None or shm.free_bytes < SHM_FAIL_FREE_BYTES:
        free = "no /dev/shm" if shm is None else f"{format_bytes(shm.free_bytes)} free in /dev/shm"
        return check(cid, code, FAIL, f"{free} for NCCL among {local_gpus} local GPUs",
                     why=why, fix=fix)
    if shm.total_bytes < SHM_WARN_BYTES:
        return check(cid, code, WARN, f"/dev/shm is only {format_bytes(shm.total_bytes)} for "
                     f"NCCL among {local_gpus} local GPUs", why=why, fix=fix)
    return check(cid, code, OK, f"/dev/shm ({format_bytes(shm.total_bytes)}) is enough for NCCL "
                 f"among {local_gpus} local GPUs")


def check_nofile(nofile: tuple[int, int]) -> Check:
    """RLIMIT_NOFILE against DataLoader's file_descriptor sharing strategy."""
    cid, code = "open_files", "NOFILE_LIMIT"
    soft, hard = nofile
    shown = f"ulimit -n: soft {'unlimited' if soft < 0 else soft}, hard {'unlimited' if hard < 0 else hard}"
    if soft < 0 or soft >= NOFILE_WARN:
        return check(cid, code, OK, f"open-files limit {'unlimited' if soft < 0 else soft}",
                     evidence=[shown])
    can_raise = hard < 0 or hard >= NOFILE_WARN
    fix = (f"raise it before starting the job: `ulimit -n {hard if hard > 0 else 65536}`"
           if can_raise else "ask an admin to raise the hard limit (limits.conf / systemd LimitNOFILE)")
    fix += "; or torch.multiprocessing.set_sharing_strategy('file_system') in the main process"
    return check(cid, code, WARN, f"open-files limit is {soft} (below {NOFILE_WARN})",
                 why="DataLoader workers share each tensor through a file descriptor until the main "
                 "process has received it; with many tensors per batch the limit runs out: "
                 "'received 0 items of ancdata' or 'Too many open files'",
                 fix=fix, evidence=[shown])


def check_nvml_based_cuda_check(env: Mapping[str, str], torch: TorchInfo) -> Check:
    """PYTORCH_NVML_BASED_CUDA_CHECK: whether torch.cuda.is_available() poisons fork."""
    cid, code = "nvml_cuda_check", "CUDA_FORK_REINIT"
    value = env.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    if not torch.cuda_compiled:
        return check(cid, code, SKIP, "torch is not a CUDA build: nothing to poison fork")
    if value == "1":
        return check(cid, code, OK, "PYTORCH_NVML_BASED_CUDA_CHECK=1: torch.cuda.is_available() "
                     "asks NVML and leaves forked children able to use CUDA")
    why = ("without it, torch.cuda.is_available() calls cudaGetDeviceCount, which registers "
           "torch's at-fork handler: every child forked afterwards (DataLoader workers, "
           "multiprocessing/joblib fork pools) fails with 'Cannot re-initialize CUDA in forked "
           "subprocess', although torch.cuda.is_initialized() still says False")
    if value is not None:
        return check(cid, code, WARN, f"PYTORCH_NVML_BASED_CUDA_CHECK={value!r} has no effect: "
                     "torch only honors the exact value 1", why=why,
                     fix="export PYTORCH_NVML_BASED_CUDA_CHECK=1")
    return check(cid, code, WARN, "PYTORCH_NVML_BASED_CUDA_CHECK is unset: "
                 "torch.cuda.is_available() in a parent breaks forked children", why=why,
                 fix="export PYTORCH_NVML_BASED_CUDA_CHECK=1, or use the forkserver/spawn start "
                 "method; gpuwarden.fork_safe() tells whether forking is safe at a given point")


def check_start_method(torch: TorchInfo, version: tuple[int, int] = sys.version_info[:2],
                       platform: str = sys.platform) -> Check:
    """Which start method multiprocessing uses here by default, and what to use with CUDA."""
    cid, code = "start_method", "CUDA_FORK_REINIT"
    if platform.startswith("linux"):
        default = "forkserver" if version >= (3, 14) else "fork"
    else:
        default = "spawn"
    what = (f"multiprocessing's default start method here is {default} "
            f"(Python {version[0]}.{version[1]} on {platform})")
    if default != "fork" or not torch.cuda_compiled:
        return check(cid, code, OK, what, evidence=[] if torch.cuda_compiled else
                     ["torch has no CUDA here: fork is safe for it"])
    return check(cid, code, OK, what,
                 why="fork is fast and fine as long as the parent has not touched CUDA; after "
                 "that, only spawn/forkserver children can use CUDA",
                 fix="with CUDA in the parent: mp.set_start_method('forkserver'), "
                 "DataLoader(multiprocessing_context='forkserver'), joblib's loky backend; or "
                 "keep workers CPU-only and move batches to the GPU in the main process")


def host_checks(shm: ShmInfo | None, nofile: tuple[int, int], env: Mapping[str, str],
                torch: TorchInfo, local_gpus: int) -> list[Check]:
    return [
        check_shm_dataloader(shm),
        check_shm_nccl(shm, local_gpus),
        check_nofile(nofile),
        check_nvml_based_cuda_check(env, torch),
        check_start_method(torch),
    ]
