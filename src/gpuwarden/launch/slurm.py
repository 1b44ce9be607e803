"""`srun gpuwarden launch SCRIPT` with no flags: the multi-node settings from Slurm's variables.

Pure (a function of the environment), so tests set the variables exactly as srun sets them.

- nodes: ``SLURM_STEP_NUM_NODES`` (the step's), else ``SLURM_NNODES`` / ``SLURM_JOB_NUM_NODES``;
- this node's rank: ``SLURM_NODEID``;
- MASTER_ADDR: the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``), expanded
  by :mod:`gpuwarden.nodelist` (``node[01-03,07]`` → node01);
- MASTER_PORT: ``10000 + SLURM_JOB_ID % 20000``, the same on every node without any exchange and
  the same as :func:`gpuwarden.distributed.detect_world` derives;
- ranks per node: ``SLURM_GPUS_ON_NODE`` when the allocation has GPUs (the GPUs themselves come
  from the allocation: :mod:`gpuwarden.visibility` narrows to ``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS``).

srun must start one launcher per node (``--ntasks-per-node=1``): the launcher starts the ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpuwarden.errors import UsageError
from gpuwarden.nodelist import first_host


@dataclass(frozen=True)
class SlurmSettings:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    nproc: int | None
    job_id: str


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = env.get(name, "").split("(")[0].strip()  # '2(x3)' in SLURM_TASKS_PER_NODE style
        if raw:
            try:
                return int(raw)
            except ValueError:
                raise UsageError(f"{name}={env[name]!r} is not a number", fix=f"check {name}") from None
    return None


def slurm_settings(env: Mapping[str, str]) -> SlurmSettings | None:
    """The launch settings of the Slurm step this process runs in; None outside Slurm.

    Raises UsageError when srun started more than one launcher per node, or when the job has
    several nodes but this is the batch script itself (no srun step: only node 0 would run).
    """
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nnodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if not job_id or nnodes is None:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") \
        or env.get("SLURM_NODELIST")
    if not nodelist:
        raise UsageError("SLURM_JOB_NODELIST is not set: the first node (MASTER_ADDR) is unknown",
                         fix="run inside an allocation via srun, or give --master-addr")
    if nnodes > 1 and "SLURM_STEP_ID" not in env:
        raise UsageError(f"this Slurm job has {nnodes} nodes but gpuwarden launch runs in the batch "
                         "script itself, i.e. on one node only",
                         fix="srun --ntasks-per-node=1 gpuwarden launch SCRIPT")
    tasks = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if tasks is not None and tasks > nnodes:
        raise UsageError(f"srun started {tasks} tasks on {nnodes} node(s); gpuwarden launch starts "
                         "the ranks itself and must run once per node",
                         fix="srun --ntasks-per-node=1 gpuwarden launch -n RANKS_PER_NODE SCRIPT")
    gpus = _int(env, "SLURM_GPUS_ON_NODE")
    return SlurmSettings(
        nnodes=nnodes,
        node_rank=_int(env, "SLURM_NODEID") or 0,
        master_addr=first_host(nodelist),
        master_port=10000 + int(job_id.split("_")[0]) % 20000,
        nproc=gpus if gpus else None,
        job_id=job_id,
    )
