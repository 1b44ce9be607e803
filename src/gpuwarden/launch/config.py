"""LaunchConfig: what the user asked for, validated once, before anything touches the host."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gpuwarden.errors import UsageError

DEFAULT_STALL_TIMEOUT_S = 300.0
DEFAULT_GRACE_S = 5.0
DEFAULT_MASTER_ADDR = "127.0.0.1"
# How long a node > 0 waits for MASTER_ADDR:MASTER_PORT to accept connections before any rank
# starts: nodes are started by hand, ssh or Slurm within minutes of each other, not hours.
DEFAULT_RDZV_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LaunchConfig:
    """One launch on this node (of ``nnodes``; ``node_rank`` is this node's index).

    ``nproc`` ranks run ``target`` (a script path, or a module name when ``module``).
    ``gpus``: None lets the host decide (GPUs when NVML shows usable ones, else CPU),
    an int asks for that many GPUs (one per rank), "all" for every usable GPU.
    ``bind``: "rank" gives each rank only its own GPU (it is ``cuda:0`` there); "all" gives
    every rank all the job's GPUs in rank order (torchrun's behaviour: the script must call
    ``set_device(local_rank)``).
    """

    target: str
    args: tuple[str, ...] = ()
    module: bool = False
    nproc: int | None = None
    gpus: int | str | None = None
    cpu: bool = False
    share: bool = False
    bind: str = "rank"
    min_free_bytes: int = 0
    wait_s: float | None = None
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    keep_waiting: bool = False
    grace_s: float = DEFAULT_GRACE_S
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int | None = None
    log_dir: str | None = None
    quiet: bool = False
    run_id: str | None = None
    extra_env: tuple[tuple[str, str], ...] = field(default=())
    nnodes: int = 1
    node_rank: int = 0
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S
    # Where the multi-node settings came from ("flags", "slurm"): said in notes and reports.
    source: str = "flags"

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def multinode(self) -> bool:
        return self.nnodes > 1

    @property
    def explicit_gpu_count(self) -> int | None:
        return self.gpus if isinstance(self.gpus, int) else None


def _validate(c: LaunchConfig) -> None:
    if c.nproc is not None and c.nproc < 1:
        raise UsageError(f"-n {c.nproc}: a job needs at least one rank", fix="give -n 1 or more")
    if isinstance(c.gpus, str) and c.gpus != "all":
        raise UsageError(f"--gpus {c.gpus!r} is neither a number nor 'all'", fix="--gpus 2 or --gpus all")
    if isinstance(c.gpus, int) and c.gpus < 1:
        raise UsageError(f"--gpus {c.gpus}: at least one GPU", fix="give --gpus 1 or more, or --cpu")
    if c.cpu and c.gpus is not None:
        raise UsageError("--cpu and --gpus contradict each other", fix="give one of them")
    if c.cpu and c.share:
        raise UsageError("--share is about GPUs and means nothing with --cpu", fix="drop --share")
    if c.gpus is not None and c.nproc is not None and c.gpus != "all" and c.gpus != c.nproc \
            and not c.share:
        raise UsageError(
            f"-n {c.nproc} and --gpus {c.gpus} disagree: gpuwarden runs one rank per GPU",
            fix=f"give only one of them, or --share to put {c.nproc} ranks on {c.gpus} GPU(s)",
        )
    if c.bind not in ("rank", "all"):
        raise UsageError(f"--bind {c.bind!r} is not 'rank' or 'all'", fix="--bind rank (default) or all")
    if c.bind == "all" and c.share:
        raise UsageError("--bind all with --share would name one GPU twice in CUDA_VISIBLE_DEVICES "
                         "(CUDA then sees none)", fix="use --bind rank (the default) with --share")
    if c.master_port is not None and not 1 <= c.master_port <= 65535:
        raise UsageError(f"--master-port {c.master_port} is not a TCP port", fix="give 1..65535")
    if c.stall_timeout_s <= 0:
        raise UsageError("--stall-timeout must be more than 0", fix="e.g. --stall-timeout 30s")
    if c.nnodes < 1:
        raise UsageError(f"--nnodes {c.nnodes}: a job has at least one node", fix="--nnodes 2")
    if not 0 <= c.node_rank < c.nnodes:
        raise UsageError(f"--node-rank {c.node_rank} is not in 0..{c.nnodes - 1} (--nnodes "
                         f"{c.nnodes})", fix="number the nodes 0 to N-1; node 0 hosts rank 0")
    if c.rdzv_timeout_s <= 0:
        raise UsageError("--rdzv-timeout must be more than 0", fix="e.g. --rdzv-timeout 5m")
    if c.multinode:
        if c.master_port is None:
            # Every node must use the same port: a free port picked here is unknown elsewhere.
            raise UsageError(f"--nnodes {c.nnodes} needs --master-port (the same on every node)",
                             fix="e.g. --master-port 29500; under Slurm it is derived from the job id")
        if c.master_addr == DEFAULT_MASTER_ADDR:
            raise UsageError(f"--nnodes {c.nnodes} needs --master-addr: node 0's address, the "
                             "same on every node (127.0.0.1 is each node's own loopback)",
                             fix="--master-addr 10.0.0.4 (node 0's address on the network the "
                             "nodes share)")
    if not c.target:
        raise UsageError("no script to run", fix="gpuwarden launch -n 2 train.py [ARGS...]")
    if not c.module and not os.path.isfile(c.target):
        # Fail here once rather than N ranks printing the same "can't open file".
        raise UsageError(f"script {c.target!r} does not exist",
                         fix="give the path of a Python script, or -m MODULE")
    if c.log_dir is not None and os.path.exists(c.log_dir) and not os.path.isdir(c.log_dir):
        raise UsageError(f"--log-dir {c.log_dir!r} is a file", fix="name a directory")
