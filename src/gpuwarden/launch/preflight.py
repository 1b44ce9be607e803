"""Checks that touch the host before any rank starts: which GPUs, and a usable MASTER_PORT.

Everything a launch can know to be wrong is refused here, at once, with the reason for each
GPU — rather than N ranks failing later with NCCL's ``Duplicate GPU detected`` or a rendezvous
that waits for its timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpuwarden.errors import ConstraintError, NoGPUError, PortInUseError
from gpuwarden.launch.config import LaunchConfig
from gpuwarden.launch.plan import rank_count

if TYPE_CHECKING:
    from gpuwarden.inventory import Inventory
    from gpuwarden.inventory.snapshot import GPUSnapshot
    from gpuwarden.select import Constraints


@dataclass
class TakenGPUs:
    """The GPUs a launch runs on (empty: CPU), held until :meth:`release`."""

    gpus: tuple[GPUSnapshot, ...]
    notes: tuple[str, ...] = ()
    _release: Callable[[], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release()


def take_gpus(config: LaunchConfig, inventory: Inventory | None = None) -> TakenGPUs:
    """The GPUs for ``config``, leased when the lease manager is installed.

    CPU when ``--cpu``, or when the host has no GPU (no NVML, or none visible) and ``--gpus``
    was not given. The GPUs are leased (gpuwarden.lease) until :meth:`TakenGPUs.release`. Raises NoGPUError (exit 3) when ``--gpus`` asks for GPUs a host without NVML
    cannot give; ConstraintError (exit 4) with every GPU's verdict when fewer are usable than
    ranks (unless ``--share``), or when ``--wait`` ran out.
    """
    if config.cpu:
        return TakenGPUs((), ("--cpu: ranks run on CPU (gloo)",))
    from gpuwarden.inventory import Inventory
    from gpuwarden.select import Constraints, select

    inventory = inventory or Inventory.from_env()
    try:
        _host, visible = inventory.read_visible()
    except NoGPUError as exc:
        if config.gpus is not None:
            raise
        return TakenGPUs((), (f"no GPU ({exc.what}): ranks run on CPU (gloo)",))
    if not visible and config.gpus is None:
        return TakenGPUs((), ("no GPU visible: ranks run on CPU (gloo)",))

    from gpuwarden.lease.jobstep import same_slurm_job

    # Inside a Slurm job, its other steps' processes on these GPUs are the job's own use of
    # them, not a stranger's (`srun --overlap`: the steps of a job share its GPUs).
    ours = same_slurm_job(p.pid for g in visible for p in g.processes)
    probe = select(visible, Constraints(count=0, min_free_bytes=config.min_free_bytes,
                                        own_pids=ours))
    usable = len(probe.acceptable)
    world = rank_count(config, usable)
    want = config.explicit_gpu_count or world
    if config.share:
        want = min(want, max(usable, 1))
    constraints = Constraints(count=want, min_free_bytes=config.min_free_bytes, own_pids=ours)
    now = select(visible, constraints)
    if not now.satisfied and (not config.wait_s or want > len(visible)):
        # Refuse at once, with select's verdict on every GPU, what cannot be served now
        # (no --wait) or ever (more GPUs than visible).
        raise _more_ranks_than_gpus(now.error(), world, want)
    return _take_gpus(want, constraints, config, world, visible, inventory)


def _take_gpus(count: int, constraints: Constraints, config: LaunchConfig, world: int,
               visible: tuple[GPUSnapshot, ...], inventory: Inventory) -> TakenGPUs:
    """Lease the GPUs (gpuwarden.lease): the pick and the claim are one atomic step between
    jobs on this host, and ``--wait`` waits in line. The grant is held by this (supervising)
    process; ranks never inherit its lock files (they are started with ``close_fds``)."""
    import sys

    from gpuwarden.lease import StatusPrinter, acquire

    # --wait says what it waits for, as `gpuwarden run` does (a live line on a terminal).
    printer = StatusPrinter(sys.stderr)
    try:
        with printer:
            grant = acquire(count, min_free=config.min_free_bytes, wait=config.wait_s,
                            constraints=constraints, label=f"gpuwarden launch {config.target}",
                            visible=visible, inventory=inventory,
                            on_wait=printer if config.wait_s else None)
    except ConstraintError as exc:
        from gpuwarden.lease.jobstep import blame_slurm_job

        refused = _more_ranks_than_gpus(exc, world, count)
        blame_slurm_job(refused)  # GPUs another step of this Slurm job holds: its fix
        raise refused from exc
    from gpuwarden.lease.jobstep import StepGrant

    notes: tuple[str, ...] = ()
    if isinstance(grant, StepGrant) and grant.slurm_job is not None:
        holders = ", ".join(f"pid {a.holder_pid}" for a in grant.allocations)
        notes = (f"GPU(s) {grant.visible_devices} shared with another step of Slurm job "
                 f"{grant.slurm_job} ({holders}), which holds them",)
    return TakenGPUs(tuple(grant.gpus), notes, grant.release)


def _more_ranks_than_gpus(exc: ConstraintError, world: int, count: int) -> ConstraintError:
    return ConstraintError(
        f"{world} rank(s) need {count} GPU(s), one each: {exc.what}",
        why="gpuwarden gives every rank its own GPU; two ranks of one NCCL communicator on one GPU "
        "fail with 'Duplicate GPU detected' (NCCL_DUPLICATE_GPU)",
        fix="fewer ranks (-n), a lower --min-free, --wait 10m for GPUs to free, --cpu, or --share "
        "to put several ranks on one GPU (they then use gloo)",
        evidence=exc.evidence,
    )


def choose_port(config: LaunchConfig) -> int:
    """MASTER_PORT: the one given if it is free (else RDZV_PORT_IN_USE at once), or a free one."""
    from gpuwarden.net import pick_free_port, port_is_free

    if config.master_port is None:
        return pick_free_port()
    if port_is_free(config.master_port):
        return config.master_port
    raise PortInUseError(
        f"MASTER_PORT {config.master_port} is already in use on this host",
        why="rank 0 would fail to bind it ('Address already in use') and the other ranks would wait "
        "for it until their timeout",
        fix="leave --master-port out (gpuwarden picks a free port), or stop the process holding it",
        evidence=_port_holders(config.master_port) or None,
    )


def _port_holders(port: int) -> list[str]:
    import psutil

    from gpuwarden.procs import short_command

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return []
    out = []
    for conn in conns:
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            try:
                proc = psutil.Process(conn.pid) if conn.pid else None
                who = f"pid {proc.pid} ({short_command(proc.cmdline())})" if proc else "a process"
            except psutil.Error:
                who = f"pid {conn.pid}"
            out.append(f"{who} listens on {conn.laddr.ip}:{port}")
    return out
