"""Worker side: ``init()`` in the right order under any launcher, ``destroy()``, ``spawn()``.

``init()`` finds the rank, world size, local rank and rendezvous address from whichever
launcher started the process — gpuwarden launch / torchrun (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), Slurm's srun (``SLURM_PROCID``,
``SLURM_LOCALID``, ``SLURM_NTASKS``, first host of ``SLURM_JOB_NODELIST``) or Open MPI
(``OMPI_COMM_WORLD_*``) — or runs a world of one. Under Slurm or MPI it exports ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (``MASTER_ADDR``/``MASTER_PORT`` when
unset) as torchrun would have set them, for the code that reads them. Then, in this order:

1. the device: ``cuda:0`` when this process sees one GPU (gpuwarden launch, srun with one GPU per
   task), ``cuda:LOCAL_RANK`` when it sees the node's GPUs (torchrun), CPU when there is none;
   ``torch.cuda.set_device`` before any other CUDA work;
2. the backend: NCCL on a GPU of its own, gloo on CPU or on a GPU shared with another rank
   (NCCL refuses two ranks of one communicator on one GPU);
3. ``init_process_group`` with ``device_id`` (eager NCCL init: a bad device fails here, not at the
   first collective) and a timeout of minutes (default 5), not PyTorch's 10–30.

This module imports torch only inside the functions that need it.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from gpuwarden.errors import GpuwardenError, UsageError

DEFAULT_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class WorldEnv:
    """Where this process sits in the job, as its launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "gpuwarden", "torchrun", "slurm", "mpi" or "single"


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device
    backend: str
    launcher: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_info: DistInfo | None = None


def detect_world(env: Mapping[str, str] | None = None) -> WorldEnv:
    """Read the launcher's variables (pure given ``env``). Raises UsageError (exit 2) naming a
    missing, malformed or out-of-range variable, e.g. Open MPI without MASTER_ADDR,
    ``MASTER_PORT=70000`` (before torch would raise its own ValueError), ``RANK`` not below
    ``WORLD_SIZE``."""
    world = _detect_world(os.environ if env is None else env)
    _check_ranges(world)
    return world


def _check_ranges(world: WorldEnv) -> None:
    names = {"gpuwarden": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
             "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
             "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
             "mpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                     "OMPI_COMM_WORLD_LOCAL_RANK")}.get(world.launcher)
    # 0 only for a world of one, where it means "pick a free port".
    lowest_port = 0 if world.launcher == "single" else 1
    if not lowest_port <= world.master_port <= 65535:
        raise UsageError(f"MASTER_PORT={world.master_port} is not a TCP port",
                         why="ports are 1-65535; torch would fail with a ValueError",
                         fix="set MASTER_PORT to a free port in 1024-65535, e.g. 29500")
    if names is None:
        return
    rank_name, world_name, local_name = names
    if world.world_size < 1:
        raise UsageError(f"{world_name}={world.world_size}: a job has at least one rank",
                         fix=f"fix {world_name}")
    if not 0 <= world.rank < world.world_size:
        raise UsageError(f"{rank_name}={world.rank} is outside 0..{world.world_size - 1} "
                         f"({world_name}={world.world_size})", fix=f"fix {rank_name}")
    if world.local_rank < 0:
        raise UsageError(f"{local_name}={world.local_rank} is negative", fix=f"fix {local_name}")


def _detect_world(env: Mapping[str, str]) -> WorldEnv:

    def num(name: str, default: int | None = None) -> int:
        raw = env.get(name)
        if raw is None or raw == "":
            if default is None:
                raise UsageError(f"{name} is not set", fix=f"export {name}, or start the job "
                                 "with gpuwarden launch / torchrun / srun")
            return default
        text = raw.split("(")[0].strip()  # SLURM_TASKS_PER_NODE style '2(x3)'
        # At most 9 digits: no rank, size or port is larger, and int() of a 5000-digit value
        # would raise its own ValueError about digit limits.
        if not (text.lstrip("+-").isdigit() and len(text) <= 10):
            raise UsageError(f"{name}={raw[:40]!r} is not a number", fix=f"fix {name}")
        return int(text)

    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "gpuwarden" if "GPUWARDEN_RUN_ID" in env else "torchrun"
        world = num("WORLD_SIZE")
        return WorldEnv(num("RANK"), world, num("LOCAL_RANK", 0), num("LOCAL_WORLD_SIZE", world),
                        _master_addr(env, None), num("MASTER_PORT", 29500), launcher)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        from gpuwarden.launch.multinode.slurm import slurm_master

        # The same address and port on every task of a job without any exchange, and the same
        # as `srun gpuwarden launch` derives; distinct ports for distinct jobs.
        default_addr, job_port = slurm_master(env)
        port = num("MASTER_PORT", 10000 if job_port is None else job_port)
        world = num("SLURM_NTASKS")
        local_world = _slurm_tasks_here(env, num("SLURM_NODEID", 0)) \
            or num("SLURM_NTASKS_PER_NODE", 0) or world
        return WorldEnv(num("SLURM_PROCID"), world, num("SLURM_LOCALID", 0), local_world,
                        _master_addr(env, default_addr), port, "slurm")
    if "OMPI_COMM_WORLD_RANK" in env:
        world = num("OMPI_COMM_WORLD_SIZE")
        return WorldEnv(num("OMPI_COMM_WORLD_RANK"), world, num("OMPI_COMM_WORLD_LOCAL_RANK", 0),
                        num("OMPI_COMM_WORLD_LOCAL_SIZE", world), _master_addr(env, None),
                        num("MASTER_PORT", 29500), "mpi")
    return WorldEnv(0, 1, 0, 1, env.get("MASTER_ADDR", "127.0.0.1"), num("MASTER_PORT", 0), "single")


def _slurm_tasks_here(env: Mapping[str, str], node: int) -> int | None:
    """How many tasks of this step run on this node: entry ``node`` (SLURM_NODEID) of the
    step's per-node counts, else the job's (``SLURM_STEP_TASKS_PER_NODE``,
    ``SLURM_TASKS_PER_NODE``: ``3,1`` or ``2(x3),1``, as Slurm compresses them); None when
    neither is set. Slurm spreads tasks unevenly whenever ``--ntasks`` is given without
    ``--ntasks-per-node`` (``srun --nodes=2 --ntasks=4`` may place 3 and 1). UsageError naming
    the variable when it is not such a list or has no entry for this node."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        raw = env.get(name, "")
        if not raw:
            continue
        left = node
        for item in raw[:4096].split(","):
            found = re.fullmatch(r"\s*(\d{1,9})(?:\(x(\d{1,9})\))?\s*", item)
            if found is None:
                break
            if left < int(found.group(2) or 1):
                return int(found.group(1))
            left -= int(found.group(2) or 1)
        raise UsageError(f"{name}={raw[:60]!r} names no task count for node {node} "
                         "(SLURM_NODEID)", why="Slurm writes one count per node: 3,1 or 2(x3),1",
                         fix=f"run inside the srun step that set {name}, or unset it")
    return None


def _export(world: WorldEnv) -> None:
    """Under Slurm or MPI, torchrun's variables for the code that reads them after init()
    (what the srun/mpirun scripts it replaces export by hand): this process's place as found."""
    if world.launcher not in ("slurm", "mpi"):
        return
    os.environ.update({"RANK": str(world.rank), "WORLD_SIZE": str(world.world_size),
                       "LOCAL_RANK": str(world.local_rank),
                       "LOCAL_WORLD_SIZE": str(world.local_world_size)})


def _master_addr(env: Mapping[str, str], default: str | None) -> str:
    addr = env.get("MASTER_ADDR") or default
    if not addr:
        raise UsageError("MASTER_ADDR is not set: the ranks cannot find rank 0",
                         fix="export MASTER_ADDR=<host of rank 0> (with mpirun: -x MASTER_ADDR)")
    return addr


def _as_timedelta(timeout: float | str | timedelta | None) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        return timeout
    from gpuwarden.units import parse_duration

    return timedelta(seconds=parse_duration(timeout, what="timeout"))


def choose_device(world: WorldEnv, cuda_count: int, env: Mapping[str, str]) -> int | None:
    """The CUDA index this rank should use, or None for CPU (pure)."""
    if cuda_count == 0 or env.get("GPUWARDEN_DEVICE") == "cpu":
        return None
    if cuda_count == 1:
        return 0  # one GPU visible: it is this rank's (gpuwarden launch, srun --gpus-per-task)
    if world.local_rank < cuda_count:
        return world.local_rank  # the node's GPUs visible (torchrun): one per local rank
    raise GpuwardenError(
        f"local rank {world.local_rank} has no GPU of its own: {cuda_count} visible",
        why="more ranks on this node than visible GPUs; cuda:LOCAL_RANK does not exist",
        fix="start as many ranks per node as GPUs, or use gpuwarden launch, which checks this",
        code="CUDA_INVALID_ORDINAL")


def init(backend: str | None = None, timeout: float | str | timedelta | None = None) -> DistInfo:
    """Join the job's process group (idempotent) and return rank, world size, local rank, device.

    Raises UsageError for missing launcher variables, GpuwardenError(CUDA_INVALID_ORDINAL) when
    this rank has no GPU of its own; init_process_group's own errors otherwise (under gpuwarden
    launch they are named in the launch report).
    """
    global _info
    import torch
    import torch.distributed as dist

    if _info is not None and dist.is_initialized():
        return _info
    world = detect_world()
    shared = os.environ.get("GPUWARDEN_SHARED_GPU") == "1"
    index = None
    if backend in (None, "nccl") and torch.cuda.is_available():
        index = choose_device(world, torch.cuda.device_count(), os.environ)
    if index is not None:
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    chosen = backend or ("nccl" if index is not None and not shared else "gloo")
    if dist.is_initialized():  # someone else initialized it: describe it, do not re-init
        _info = DistInfo(dist.get_rank(), dist.get_world_size(), world.local_rank, device,
                         str(dist.get_backend()), world.launcher)
        return _info
    if world.launcher == "single" and world.master_port == 0:
        from gpuwarden.net import pick_free_port

        world = WorldEnv(0, 1, 0, 1, world.master_addr, pick_free_port(), "single")
    os.environ.setdefault("MASTER_ADDR", world.master_addr)
    os.environ.setdefault("MASTER_PORT", str(world.master_port))
    _export(world)
    kwargs: dict[str, Any] = {"backend": chosen, "rank": world.rank, "world_size": world.world_size,
                              "timeout": _as_timedelta(timeout), "init_method": "env://"}
    if chosen == "nccl":
        kwargs["device_id"] = device  # eager init: a bad device fails now, not at a collective
    # torch.distributed.nn.functional binds `group.WORLD` into default arguments when it is
    # imported; imported after init (DDP's first use imports it, through torch._dynamo), it holds
    # the default group for ever: destroy_process_group() cannot free it, its gloo threads
    # outlive the script, and one releasing a collective's tensors as the interpreter exits
    # aborts the rank ("terminate called without an active exception"). Imported first (~5 ms),
    # it binds None.
    import torch.distributed.nn  # noqa: F401
    dist.init_process_group(**kwargs)
    _info = DistInfo(world.rank, world.world_size, world.local_rank, device, chosen, world.launcher)
    return _info


def destroy() -> None:
    """Leave the process group (safe to call when not initialized)."""
    global _info
    _info = None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class SpawnError(GpuwardenError):
    """A rank of :func:`spawn` failed or stalled; the message is the launch report."""


def spawn(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *,
          stall_timeout: float | str = "5m", grace: float | str = "5s", cpu: bool = False) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` fresh processes (spawn semantics, works from a
    notebook) with gpuwarden launch's binding, supervision, report and teardown; return each
    rank's return value in rank order.

    ``fn`` may be defined in a notebook: it travels by value (cloudpickle). Raises SpawnError carrying the launch report when a rank fails or stalls,
    ConstraintError when there are fewer usable GPUs than ``nprocs``.
    """
    import sys
    import tempfile

    from gpuwarden.launch.config import LaunchConfig
    from gpuwarden.launch.runner import launch
    from gpuwarden.units import parse_duration

    work = tempfile.mkdtemp(prefix="gpuwarden-spawn-")
    try:
        payload = os.path.join(work, "payload.pkl")
        with open(payload, "wb") as f:
            _pickler().dump((fn, tuple(args)), f)
        # localhost, as mp.spawn users set it: no torchrun command line to follow here
        config = LaunchConfig(target="gpuwarden.launch.ranks._bootstrap", module=True,
                              nproc=nprocs, cpu=cpu, master_addr="localhost",
                              stall_timeout_s=parse_duration(stall_timeout, what="stall_timeout"),
                              grace_s=parse_duration(grace, what="grace"))
        argv = (sys.executable, "-m", "gpuwarden.launch.ranks._bootstrap", "--call", payload)
        report, _ = launch(config, argv=argv, run_dir=work)
        if not report.ok:
            raise SpawnError(report.what, why=report.why, fix=report.fix,
                             evidence=[*report.evidence, *(f"{h}: {' | '.join(b[:6])}" for h, b in report.sections)],
                             code=report.code, fields=report.fields)
        results = []
        for rank in range(nprocs):
            with open(os.path.join(work, f"rank{rank}.result.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def _pickler() -> Any:
    # By value, as the pool sends tasks: a notebook's functions live in __main__, which a
    # spawned rank cannot import.
    import cloudpickle

    return cloudpickle
