"""The plan: a PURE function from the config, the GPUs taken and the port to one RankSpec per rank.

Nothing here starts a process or reads the host, so tests check every rank's environment
directly (STYLE.md, after accelerate's ``prepare_*_env``). The environment is what torchrun
gives a worker, so torchrun scripts run unchanged (docs/launch.md lists every difference), plus:

- ``CUDA_VISIBLE_DEVICES`` naming the job's GPUs (the ones gpuwarden chose and leased) in rank
  order, so ``cuda:LOCAL_RANK`` is the rank's own GPU as under torchrun (``--bind all``, the
  default); ``--bind rank`` (torchrun's ``--virtual-local-rank``) names only the rank's own GPU,
  which is then ``cuda:0``, with ``LOCAL_RANK=0``; ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so an index
  means NVML's GPU;
- ``GPUWARDEN_*`` variables that tell the bootstrap (:mod:`gpuwarden.launch.ranks._bootstrap`) where to write its
  progress, error record and stack dumps.

The command is torchrun's (``python -u SCRIPT``, ``PYTHON_EXEC`` honoured) with the bootstrap
in between: ``python -u -m gpuwarden.launch.ranks._bootstrap SCRIPT ARGS``; ``--no-python`` runs the target itself.

With ``--nnodes N --node-rank R`` (docs/multinode.md) ranks are numbered node by node as in
torchrun's static rendezvous: this node's K ranks are ``R*K .. R*K+K-1``, ``WORLD_SIZE`` is
``N*K``, ``GROUP_RANK`` is R, and each rank gets ``GPUWARDEN_PEERS_FILE``, where its bootstrap's
store watch (:mod:`gpuwarden.launch.multinode._store_watch`) reports what it learns from the job's TCPStore.

``TORCHELASTIC_USE_AGENT_STORE`` is ``False`` on one node: there is no agent-hosted TCPStore
(hosting one would need torch in the supervisor); rank 0 hosts the store, as with plain
``env://``. On several nodes the node agent of rank 0's node hosts it (``agent_store``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuwarden.launch.config import LaunchConfig
from gpuwarden.visibility import CHILD_ORDER_ENV

if TYPE_CHECKING:
    from gpuwarden.inventory.snapshot import GPUSnapshot


@dataclass(frozen=True)
class RankFiles:
    status: str  # mmap'd progress record (launch/watch/status.py)
    error: str  # JSON record of an uncaught exception
    stacks: str  # faulthandler dumps on request (status.STACK_SIGNAL), sampled by the supervisor
    fatal: str  # faulthandler dump on a fatal signal (SIGSEGV, SIGABRT, SIGBUS...)
    peers: str = ""  # multi-node: what the rank's store watch saw (arrivals, abort, store lost)

    @classmethod
    def under(cls, run_dir: str, rank: int) -> RankFiles:
        def p(kind: str) -> str:
            return os.path.join(run_dir, f"rank{rank}.{kind}")

        return cls(p("status"), p("error.json"), p("stacks"), p("fatal"), p("peers.json"))


@dataclass(frozen=True)
class RankSpec:
    rank: int
    local_rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]  # set on top of the supervisor's own environment
    gpu: GPUSnapshot | None  # None: the rank runs on CPU
    files: RankFiles
    shares_gpu_with: tuple[int, ...] = ()

    @property
    def device_label(self) -> str:
        return self.gpu.label if self.gpu is not None else "CPU"


@dataclass(frozen=True)
class LaunchPlan:
    config: LaunchConfig
    ranks: tuple[RankSpec, ...]
    master_addr: str
    master_port: int
    run_id: str
    run_dir: str
    notes: tuple[str, ...] = ()
    nnodes: int = 1
    node_rank: int = 0
    log_run_dir: str | None = None  # torchrun's <log-dir>/<run id>_<suffix> (--log-dir, -t, -r)
    attempt: int = 0  # TORCHELASTIC_RESTART_COUNT: 0, then one more per --max-restarts restart

    @property
    def attempt_dir(self) -> str | None:
        """Where this attempt's log files go (torchrun's layout), None when none are written."""
        return os.path.join(self.log_run_dir, f"attempt_{self.attempt}") if self.log_run_dir \
            else None

    @property
    def world_size(self) -> int:
        """Ranks of the whole job (every node runs as many as this one)."""
        return len(self.ranks) * self.nnodes

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The global ranks that run on this node."""
        return tuple(r.rank for r in self.ranks)

    def spec(self, rank: int) -> RankSpec | None:
        """This node's spec of global ``rank`` (None: it runs on another node)."""
        return next((r for r in self.ranks if r.rank == rank), None)

    def node_of(self, rank: int) -> int:
        return rank // max(1, len(self.ranks))


def rank_argv(config: LaunchConfig, python: str) -> tuple[str, ...]:
    """torchrun's command (``python -u [-m] TARGET ARGS``) with the bootstrap in between; the
    target itself with ``--no-python`` (no bootstrap: no progress record, so no stall report).
    ``--run-path`` is the plain case: the bootstrap runs the script as ``python SCRIPT`` does."""
    if config.no_python and not config.run_path:
        return (config.target, *config.args)
    tail = ("-m", config.target) if config.module else (config.target,)
    return (python, "-u", "-m", "gpuwarden.launch.ranks._bootstrap", *tail, *config.args)


def error_file(log_run_dir: str, local_rank: int, attempt: int = 0) -> str:
    """TORCHELASTIC_ERROR_FILE in torchrun's layout: ``attempt_<k>/<local rank>/error.json``."""
    return os.path.join(log_run_dir, f"attempt_{attempt}", str(local_rank), "error.json")


def rank_count(config: LaunchConfig, usable_gpus: int | None) -> int:
    """How many ranks: -n, else --gpus N, else every usable GPU for --gpus all, else 1;
    ``--nproc-per-node auto``: every usable GPU, else one per CPU core (as torchrun)."""
    if config.nproc is not None:
        return config.nproc
    if isinstance(config.gpus, int):
        return config.gpus
    if config.gpus == "all":
        return max(1, usable_gpus or 0)
    if config.nproc_auto:
        return usable_gpus or cpu_count()
    return 1


def cpu_count() -> int:
    """The cores this process may run on (torch._utils.cpu_count's answer for torchrun's
    ``--nproc-per-node cpu``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def make_plan(
    config: LaunchConfig,
    gpus: Sequence[GPUSnapshot],
    *,
    master_port: int,
    run_id: str,
    run_dir: str,
    supervisor_pid: int,
    python: str,
    base_env: Mapping[str, str],
    log_run_dir: str | None = None,
    attempt: int = 0,
    restart_count: int | None = None,
    agent_store: bool = False,
) -> LaunchPlan:
    """One RankSpec per rank. ``gpus`` empty: CPU ranks. Otherwise one GPU per rank, or, with
    ``config.share``, ranks spread round-robin over ``gpus``. ``log_run_dir``: torchrun's
    ``<log-dir>/<run id>_<suffix>`` when ``--log-dir`` is given (error files go under it);
    ``attempt``: the restart count (--max-restarts), in TORCHELASTIC_RESTART_COUNT and the
    ``attempt_<k>`` directory of the log layout; ``restart_count``, when given, is the job's
    count for TORCHELASTIC_RESTART_COUNT instead (several nodes: a re-rendezvous for a node
    that joined is an attempt of this node, not a restart of the job). ``agent_store``: the
    node agent of rank 0's node hosts the workers' store at MASTER_ADDR:MASTER_PORT (several
    nodes), so every rank connects as a client (``TORCHELASTIC_USE_AGENT_STORE=True``)."""
    local = rank_count(config, len(gpus))
    if gpus and len(gpus) < local and not config.share:
        raise ValueError(f"{local} ranks need {local} GPUs, {len(gpus)} given")  # preflight's job
    node_rank = config.node_rank or 0  # a dynamic job plans with its round's node rank
    world = local * config.nnodes
    first = node_rank * local  # torchrun: ranks numbered node by node
    argv = rank_argv(config, base_env.get("PYTHON_EXEC") or python)
    notes: list[str] = []
    common = {
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(config.nnodes),
        "ROLE_NAME": config.role,
        "ROLE_WORLD_SIZE": str(world),
        # The runner looks this host's name up (preflight.choose_master_addr) before planning.
        "MASTER_ADDR": config.master_addr or "localhost",
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(attempt if restart_count is None else restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(config.signals_to_handle),
        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "GPUWARDEN_SUPERVISOR_PID": str(supervisor_pid),
        "GPUWARDEN_RUN_ID": run_id,
        "GPUWARDEN_BIND": config.bind,
        **CHILD_ORDER_ENV,
    }
    # Without a cap every rank starts one OpenMP thread per core: N ranks oversubscribe the
    # host N times over. torchrun sets the same default.
    if config.multinode:
        common.update({"GPUWARDEN_NNODES": str(config.nnodes),
                       "GPUWARDEN_NODE_RANK": str(node_rank),
                       "GPUWARDEN_RDZV_TIMEOUT": f"{config.rdzv_timeout_s:g}"})
    if local > 1 and "OMP_NUM_THREADS" not in base_env:
        common["OMP_NUM_THREADS"] = "1"
    if config.cpu:
        common["CUDA_VISIBLE_DEVICES"] = ""  # --cpu: a rank must not start CUDA by accident
    common.update(dict(config.extra_env))

    assigned = [gpus[i % len(gpus)] if gpus else None for i in range(local)]
    owners: dict[str, list[int]] = {}
    for i, gpu in enumerate(assigned):
        if gpu is not None:
            owners.setdefault(gpu.uuid, []).append(first + i)
    ranks = []
    for i, gpu in enumerate(assigned):
        rank = first + i
        files = RankFiles.under(run_dir, rank)
        env = dict(common)
        env.update({
            "RANK": str(rank),
            # --bind rank is torchrun's --virtual-local-rank: the rank's one GPU is cuda:0
            "LOCAL_RANK": "0" if config.bind == "rank" else str(i),
            "ROLE_RANK": str(rank),
            "TORCHELASTIC_ERROR_FILE": error_file(log_run_dir or run_dir, i, attempt),
            "GPUWARDEN_STATUS_FILE": files.status,
            "GPUWARDEN_ERROR_FILE": files.error,
            "GPUWARDEN_STACK_FILE": files.stacks,
            "GPUWARDEN_FATAL_FILE": files.fatal,
            "GPUWARDEN_DEVICE": "cuda" if gpu is not None else "cpu",
        })
        if config.multinode:
            env["GPUWARDEN_PEERS_FILE"] = files.peers
        mates: tuple[int, ...] = ()
        if gpu is not None:
            from gpuwarden.launch.watch.flight_recorder import recorder_env

            env.update(recorder_env(run_dir, base_env))  # NCCL's flight recorder, for stalls
            env["GPUWARDEN_GPU"] = gpu.label
            if config.bind == "rank":
                env["CUDA_VISIBLE_DEVICES"] = gpu.cuda_id
            else:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(g.cuda_id for g in gpus[:local])
            mates = tuple(r for r in owners[gpu.uuid] if r != rank)
            if mates:
                env["GPUWARDEN_SHARED_GPU"] = "1"
        ranks.append(RankSpec(rank, i, argv, env, gpu, files, mates))
    for rs in owners.values():
        if len(rs) > 1:
            notes.append(
                f"ranks {', '.join(map(str, rs))} share {ranks[rs[0] - first].device_label} (--share): "
                "NCCL refuses two ranks of one communicator on one GPU (NCCL_DUPLICATE_GPU), so "
                "gpuwarden.distributed.init() uses gloo for them")
    return LaunchPlan(config, tuple(ranks), common["MASTER_ADDR"], master_port, run_id, run_dir,
                      tuple(notes), config.nnodes, node_rank, log_run_dir, attempt)
