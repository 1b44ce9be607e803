"""`srun gpuwarden launch SCRIPT` with no flags: the multi-node settings from Slurm's variables.

Pure (a function of the environment), so tests set the variables exactly as srun sets them.

- nodes: ``SLURM_STEP_NUM_NODES`` (the step's), else ``SLURM_NNODES`` / ``SLURM_JOB_NUM_NODES``;
- this node's rank: ``SLURM_NODEID``;
- MASTER_ADDR: the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``), expanded
  by :mod:`gpuwarden.nodelist` (``node[01-03,07]`` → node01);
- MASTER_PORT: ``10000 + SLURM_JOB_ID % 20000``, the same on every node without any exchange and
  the same as :func:`gpuwarden.distributed.detect_world` derives (both call :func:`slurm_master`);
  used only when the job has several nodes: one node picks a free port, as without Slurm;
- the job's hosts: the whole expanded node list, so that a wait for nodes names the missing ones;
- ranks per node: ``SLURM_GPUS_ON_NODE`` when the allocation has GPUs (the GPUs themselves come
  from the allocation: :mod:`gpuwarden.visibility` narrows to ``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS``).

srun must start one launcher per node (``--ntasks-per-node=1``): the launcher starts the ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpuwarden.errors import UsageError
from gpuwarden.nodelist import expand_nodelist, first_host


@dataclass(frozen=True)
class SlurmSettings:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    nproc: int | None
    hosts: tuple[str, ...] = ()  # the step's (else the job's) nodes, in Slurm's order


def slurm_int(env: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` that is set, as an int (``'2(x3)'`` in SLURM_TASKS_PER_NODE style
    counts as 2); None when none is set. UsageError naming the variable when it is no number."""
    for name in names:
        raw = env.get(name, "").split("(")[0].strip()
        if raw:
            try:
                return int(raw)
            except ValueError:
                raise UsageError(f"{name}={env[name]!r} is not a number", fix=f"check {name}") from None
    return None


def slurm_master(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    """(MASTER_ADDR, MASTER_PORT) every node and task of a Slurm job derives alike, without any
    exchange: the first host of the step's (else the job's) node list, and
    ``10000 + job id % 20000``. The job id is ``SLURM_JOB_ID`` or its old spelling
    ``SLURM_JOBID``; an array task's ``123_4`` counts as 123. Either part is None when Slurm
    did not set its variable. UsageError when the job id is no number."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") \
        or env.get("SLURM_NODELIST")
    name = "SLURM_JOB_ID" if env.get("SLURM_JOB_ID") else "SLURM_JOBID"
    job = slurm_int({name: env.get(name, "").split("_")[0]}, name) if env.get(name) else None
    return (first_host(nodelist) if nodelist else None,
            None if job is None else 10000 + job % 20000)


def slurm_settings(env: Mapping[str, str]) -> SlurmSettings | None:
    """The launch settings of the Slurm step this process runs in; None outside Slurm.

    Raises UsageError when srun started more than one launcher per node, or when the job has
    several nodes but this is the batch script itself (no srun step: only node 0 would run).
    A one-node batch script or salloc command (no step) is a launch like any other, whatever
    its ``--ntasks``.
    """
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nnodes = slurm_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if not job_id or nnodes is None:
        return None
    master_addr, master_port = slurm_master(env)
    if master_addr is None:
        raise UsageError("SLURM_JOB_NODELIST is not set: the first node (MASTER_ADDR) is unknown",
                         fix="run inside an allocation via srun, or give --master-addr")
    assert master_port is not None  # a job id is set
    # Only a step's tasks are processes srun started. Outside any step (the batch script
    # itself, salloc's command) SLURM_NTASKS is the allocation's --ntasks, which the user may
    # well mean as the ranks gpuwarden starts (torchrun runs there too).
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    if nnodes > 1 and not in_step:
        raise UsageError(f"this Slurm job has {nnodes} nodes but gpuwarden launch runs in the batch "
                         "script itself, i.e. on one node only",
                         fix="srun --ntasks-per-node=1 gpuwarden launch SCRIPT")
    tasks = slurm_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if in_step else None
    if tasks is not None and tasks > nnodes:
        raise UsageError(f"srun started {tasks} tasks on {nnodes} node(s); gpuwarden launch starts "
                         "the ranks itself and must run once per node",
                         fix="srun --ntasks-per-node=1 gpuwarden launch -n RANKS_PER_NODE SCRIPT")
    gpus = slurm_int(env, "SLURM_GPUS_ON_NODE")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") \
        or env.get("SLURM_NODELIST") or ""
    return SlurmSettings(
        nnodes=nnodes,
        node_rank=slurm_int(env, "SLURM_NODEID") or 0,
        master_addr=master_addr,
        master_port=master_port,
        nproc=gpus if gpus else None,
        hosts=tuple(expand_nodelist(nodelist)) if nodelist else (),
    )
