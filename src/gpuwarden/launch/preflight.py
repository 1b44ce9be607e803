"""Checks that touch the host before any rank starts: which GPUs, and a usable MASTER_PORT.

Everything a launch can know to be wrong is refused here, at once, with the reason for each
GPU — rather than N ranks failing later with NCCL's ``Duplicate GPU detected`` or a rendezvous
that waits for its timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuwarden.errors import (
    ConstraintError,
    NoGPUError,
    PortInUseError,
    RendezvousError,
    UsageError,
)
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
    grant: Any = field(default=None, repr=False)  # the lease (a memory lease's guard reads it)

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
        return _on_cpu(config, "--cpu: ranks run on CPU (gloo)")
    from gpuwarden.inventory import Inventory
    from gpuwarden.select import Constraints, select

    inventory = inventory or Inventory.from_env()
    try:
        _host, visible = inventory.read_visible()
    except NoGPUError as exc:
        if config.gpus is not None:
            raise
        return _on_cpu(config, f"no GPU ({exc.what}): ranks run on CPU (gloo)")
    if not visible and config.gpus is None:
        return _on_cpu(config, "no GPU visible: ranks run on CPU (gloo)")

    from gpuwarden.lease.jobstep import same_slurm_job

    # A memory lease shares its GPU: other processes there count by their memory (the lease
    # manager's accounting), not as a reason to refuse it.
    shared = bool(config.mem_per_rank_bytes)
    # Inside a Slurm job, its other steps' processes on these GPUs are the job's own use of
    # them, not a stranger's (`srun --overlap`: the steps of a job share its GPUs).
    ours = same_slurm_job(p.pid for g in visible for p in g.processes)
    probe = select(visible, Constraints(count=0, min_free_bytes=config.min_free_bytes,
                                        allow_shared=shared, own_pids=ours))
    usable = len(probe.acceptable)
    world = rank_count(config, usable)
    want = config.explicit_gpu_count or world
    if config.share:
        want = min(want, max(usable, 1))
    constraints = Constraints(count=want, min_free_bytes=config.min_free_bytes,
                              allow_shared=shared, own_pids=ours)
    now = select(visible, constraints)
    if not now.satisfied and (not config.wait_s or want > len(visible)):
        # Refuse at once, with select's verdict on every GPU, what cannot be served now
        # (no --wait) or ever (more GPUs than visible).
        raise _more_ranks_than_gpus(now.error(), world, want)
    taken = _take_gpus(want, constraints, config, world, visible, inventory)
    if config.numa_binding:
        taken.notes = (*taken.notes, f"--numa-binding {config.numa_binding} is not applied: "
                       "ranks run on every CPU this launch may use")
    return taken


def _on_cpu(config: LaunchConfig, note: str) -> TakenGPUs:
    """The ranks run on CPU: refused, at once, when they are far more than the cores (unless
    --oversubscribe); no GPU leased."""
    from gpuwarden.launch.config import CPU_RANKS_PER_CORE, MIN_CPU_RANK_LIMIT
    from gpuwarden.launch.plan import cpu_count

    if config.numa_binding:
        raise UsageError(
            f"--numa-binding {config.numa_binding}: the ranks run on CPU, and torchrun binds "
            "each rank to the NUMA node of its GPU",
            why="torchrun asks CUDA for the rank's GPU and fails (exit 1; 'Torch not compiled "
            "with CUDA enabled' with a CPU-only torch)",
            fix="leave --numa-binding out, or run on GPUs (numactl --cpunodebind=N in front of "
            "the launch binds the whole job)")
    world = rank_count(config, 0)
    cores = cpu_count()
    limit = max(MIN_CPU_RANK_LIMIT, CPU_RANKS_PER_CORE * cores)
    if world > limit and not config.oversubscribe:
        raise UsageError(
            f"-n {world}: {world} CPU ranks on {cores} core(s), more than {limit} are refused "
            f"({CPU_RANKS_PER_CORE} per core, at least {MIN_CPU_RANK_LIMIT})",
            why="each rank is an interpreter that most often imports torch: starting and "
            "stopping them would take the host minutes",
            fix=f"fewer ranks (-n {cores}, or --nproc-per-node cpu: one per core), or "
            "--oversubscribe to run them anyway")
    return TakenGPUs((), (note,))


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
                            on_wait=printer if config.wait_s else None,
                            mem=config.mem_per_rank_bytes or None)
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
    if config.mem_per_rank_bytes:
        from gpuwarden.units import format_bytes

        notes += (f"leased {format_bytes(config.mem_per_rank_bytes)} of GPU(s) "
                  f"{grant.visible_devices}, one rank each (--mem-per-rank; --mem-enforce "
                  f"{config.mem_enforce})",)
    return TakenGPUs(tuple(grant.gpus), notes, grant.release, grant)


def _more_ranks_than_gpus(exc: ConstraintError, world: int, count: int) -> ConstraintError:
    return ConstraintError(
        f"{world} rank(s) need {count} GPU(s), one each: {exc.what}",
        why="gpuwarden gives every rank its own GPU; two ranks of one NCCL communicator on one GPU "
        "fail with 'Duplicate GPU detected' (NCCL_DUPLICATE_GPU)",
        fix="fewer ranks (-n), a lower --min-free, --wait 10m for GPUs to free, --cpu, or --share "
        "to put several ranks on one GPU (they then use gloo)",
        evidence=exc.evidence,
    )


FQDN_TIMEOUT_S = 2.0  # this host's name, looked up as torch's rendezvous does (getfqdn)
RESOLVE_TIMEOUT_S = 3.0  # an explicit MASTER_ADDR on one node


def choose_master_addr(config: LaunchConfig) -> tuple[str, tuple[str, ...]]:
    """MASTER_ADDR of a launch on one node, and notes: the address given (static rendezvous),
    which must resolve here, at once (RendezvousError RDZV_DNS: PyTorch retries an unknown
    name silently for its whole timeout, 30 minutes for gloo); else this host's own name, as
    torchrun's c10d rendezvous gives it (--local-addr, else ``socket.getfqdn()``)."""
    from gpuwarden import net

    if config.master_addr:
        _check_resolves(config.master_addr)
        return config.master_addr, ()
    if config.local_addr:
        return config.local_addr, ()
    name = net.host_fqdn(timeout_s=FQDN_TIMEOUT_S)
    if name is None:
        return "localhost", (f"this host's name did not resolve within {FQDN_TIMEOUT_S:g} s: "
                             "MASTER_ADDR=localhost (torchrun would wait for the resolver and "
                             "give its answer)",)
    found = net.resolve(name, timeout_s=RESOLVE_TIMEOUT_S)
    if not any(net.is_local_address(a) for a in found.addresses):
        # torchrun would hand the ranks this name, and they would wait to connect to a host
        # that is not this one (or to nothing) until their timeout
        where = ", ".join(found.addresses) or found.error or "no address"
        return "localhost", (f"this host's name {name} resolves to {where}, not to an address "
                             "of this host: MASTER_ADDR=localhost (torchrun would give the name "
                             "and its ranks would wait to connect)",)
    return name, ()


def _check_resolves(addr: str) -> None:
    from gpuwarden import net
    from gpuwarden.doctor.model import Status
    from gpuwarden.doctor.net_checks import check_master_addr
    from gpuwarden.doctor.probes import RendezvousFacts

    resolution = net.resolve(addr, timeout_s=RESOLVE_TIMEOUT_S)
    if resolution.ok:
        return
    # The doctor's words for the same fact (`gpuwarden doctor` and `explain` name it so too).
    c = check_master_addr(RendezvousFacts(addr, None, None, resolution, False, None, None, None),
                          1)
    assert c.status is Status.FAIL
    raise RendezvousError(c.what, why=c.why, fix="give --master-addr a name or address this host "
                          "resolves (one node: this host's own), or leave --master-addr out: "
                          "gpuwarden then gives the ranks this host's name, as torchrun",
                          evidence=list(c.evidence), code=c.code,
                          fields={"master_addr": addr, "error": resolution.error})


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
