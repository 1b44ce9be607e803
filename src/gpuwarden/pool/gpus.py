"""Which GPUs a pool takes: the one seam between the pool and selection/leases.

``gpus`` is ``"auto"`` (every usable visible GPU), a count, or a list of indices/UUIDs.
GPU state comes from the inventory (NVML or GPUWARDEN_SIMULATE), never from CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from gpuwarden.errors import ConstraintError, NoGPUError, UsageError
from gpuwarden.inventory.snapshot import GPUSnapshot
from gpuwarden.select import Constraints

if TYPE_CHECKING:
    from gpuwarden.inventory import Inventory
    from gpuwarden.lease import Grant


@dataclass(frozen=True)
class TakenGPUs:
    gpus: tuple[GPUSnapshot, ...]
    release: Callable[[], None]
    why_cpu: str = ""  # set when ``gpus`` is empty: why the pool runs on the CPU
    grant: Grant | None = None  # the lease (or job step) the GPUs are held by


def _nothing() -> None:
    pass


def gpus_for_workers(max_workers: int, workers_per_gpu: int) -> int:
    """GPUs that ``max_workers`` workers fill, ``workers_per_gpu`` on each."""
    return -(-max_workers // workers_per_gpu)


def usable_gpu_count(spec: str | int | Sequence[int | str], *, min_free_bytes: int = 0,
                     allow_shared: bool = False, workers_per_gpu: int = 1,
                     inventory: Inventory | None = None, mem_per_worker_bytes: int = 0) -> int:
    """How many GPUs :func:`take_gpus` would take for ``spec`` now (0: a CPU pool).

    For ``"auto"`` this asks the lease manager the same question ``take_gpus`` has it decide
    (every GPU acceptable under these constraints and not leased to someone else), so a
    count made here and the GPUs taken later agree unless another process leases meanwhile.
    In a job step (a process started by a lease holder) it is the holder's GPUs seen here.
    """
    if isinstance(spec, int):
        return spec
    if not isinstance(spec, str):
        return len(spec)
    from gpuwarden.inventory import Inventory
    from gpuwarden.lease import jobstep
    from gpuwarden.lease.manager import usable_count

    inventory = inventory or Inventory.from_env()
    try:
        _, visible = inventory.read_visible()
    except NoGPUError:
        return 0
    if not visible:
        return 0
    step = jobstep.usable(visible=visible)
    if step is not None:
        return step
    if mem_per_worker_bytes:
        return usable_count(mem=workers_per_gpu * mem_per_worker_bytes,
                            constraints=_constraints(1, min_free_bytes, allow_shared),
                            visible=visible, inventory=inventory)
    return usable_count(slots_per_gpu=workers_per_gpu, slots_each=workers_per_gpu,
                        constraints=_constraints(1, min_free_bytes, allow_shared),
                        visible=visible, inventory=inventory)


def _constraints(count: int, min_free_bytes: int, allow_shared: bool,
                 include: tuple[str, ...] = ()) -> Constraints:
    return Constraints(count=count, min_free_bytes=min_free_bytes, allow_shared=allow_shared,
                       include=include)


def take_gpus(spec: str | int | Sequence[int | str], workers_per_gpu: int, *,
              max_workers: int | None = None, min_free_bytes: int = 0,
              allow_shared: bool = False, wait: float | str | None = None,
              label: str = "gpuwarden pool", inventory: Inventory | None = None,
              mem_per_worker_bytes: int = 0) -> TakenGPUs:
    """Lease the GPUs for a pool, with every GPU's verdict in the error when that fails.

    ``mem_per_worker_bytes``: a memory lease of ``workers_per_gpu`` times that on each GPU
    (shared with other leases by memory) instead of every slot of it.

    ``max_workers`` caps the GPUs taken at the ones that many workers fill. ``"auto"`` takes
    every GPU acceptable and free when the lease is decided (at least one).

    Raises UsageError for a malformed ``spec``; LeaseUnavailableError / LeaseTimeoutError
    (exit 4) when fewer GPUs than asked are usable now / within ``wait`` (busy, leased,
    too little free memory, prohibited compute mode; the error lists every GPU's verdict);
    NoGPUError when GPUs are asked for by count or id on a host without NVML or with
    none visible.
    """
    from gpuwarden.inventory import Inventory
    from gpuwarden.lease import acquire

    inventory = inventory or Inventory.from_env()
    explicit = spec != "auto"
    if isinstance(spec, str) and spec != "auto":
        raise UsageError(f"gpus={spec!r}: expected 'auto', a count, or a list of ids",
                         fix="gpus='auto', gpus=2 or gpus=[0, 3]")
    try:
        _, visible = inventory.read_visible()
    except NoGPUError as exc:
        if explicit:
            raise
        return TakenGPUs((), _nothing, why_cpu=exc.what)
    if not visible:
        if explicit:
            raise NoGPUError("GPUs were requested for the pool but none is visible",
                             fix="check CUDA_VISIBLE_DEVICES, use gpus='auto', or gpus=0 for "
                             "a CPU pool")
        return TakenGPUs((), _nothing, why_cpu="no GPU is visible to this process")
    cap = None if max_workers is None else gpus_for_workers(max_workers, workers_per_gpu)
    # Every slot of each GPU, one per worker, through gpuwarden.lease: two pools or jobs on
    # this host never pick the same GPU at the same moment.
    n: int | Literal["all"] = "all"
    up_to = cap
    include: tuple[str, ...] = ()
    if not isinstance(spec, str):
        include = () if isinstance(spec, int) else tuple(str(i) for i in spec)
        n = spec if isinstance(spec, int) else len(include)
        n, up_to = (n if cap is None else min(n, cap)), None
    try:
        if mem_per_worker_bytes:
            grant = acquire(n, up_to=up_to, mem=workers_per_gpu * mem_per_worker_bytes,
                            wait=wait, label=label, visible=visible, inventory=inventory,
                            constraints=_constraints(1, min_free_bytes, allow_shared, include))
        else:
            grant = acquire(n, up_to=up_to, slots_per_gpu=workers_per_gpu,
                            slots_each=workers_per_gpu, wait=wait, label=label,
                            visible=visible, inventory=inventory,
                            constraints=_constraints(1, min_free_bytes, allow_shared, include))
    except ConstraintError as exc:
        from gpuwarden.lease import jobstep

        jobstep.blame_ancestor(exc)
        raise
    return TakenGPUs(tuple(grant.gpus), grant.release, grant=grant)


@dataclass(frozen=True)
class LeaseTerms:
    """What a pool's GPUs were leased under, to lease the same ones again (a parked pool)."""

    min_free: int | str | None
    allow_shared: bool
    label: str
    inventory: Inventory | None
    mem_per_worker_bytes: int


def take_again(gpus: Sequence[GPUSnapshot], workers_per_gpu: int,
               terms: LeaseTerms) -> TakenGPUs | None:
    """Lease exactly ``gpus`` again under ``terms`` (every slot of each, or their memory
    lease), without waiting; None when one of them is not free now (another job took it)."""
    from gpuwarden.errors import GpuwardenError
    from gpuwarden.lease.grant import make_request

    uuids = [g.uuid for g in gpus]
    min_free_bytes = make_request(1, min_free=terms.min_free).constraints.min_free_bytes
    try:
        taken = take_gpus(uuids, workers_per_gpu, min_free_bytes=min_free_bytes,
                          allow_shared=terms.allow_shared, wait=None, label=terms.label,
                          inventory=terms.inventory,
                          mem_per_worker_bytes=terms.mem_per_worker_bytes)
    except GpuwardenError:
        return None
    if sorted(g.uuid for g in taken.gpus) != sorted(uuids):
        taken.release()
        return None
    return taken


def tree_on_gpus(gpus: Sequence[GPUSnapshot], root_pid: int,
                 inventory: Inventory | None = None) -> bool:
    """Whether ``root_pid`` or a process under it is on one of ``gpus``, as NVML (or the
    simulated host) lists their processes; True when that cannot be told (no reading, a
    process tree that cannot be read, or NVML's pids of another PID namespace)."""
    from gpuwarden.errors import GpuwardenError
    from gpuwarden.inventory import Inventory

    try:
        host = (inventory or Inventory.from_env()).read_host()
    except GpuwardenError:
        return True
    mine = {g.uuid for g in gpus}
    on_them = [p for g in host.gpus if g.uuid in mine for p in g.processes]
    if not on_them:
        return False
    if any(p.note and "namespace" in p.note for p in on_them):
        return True
    import psutil

    try:
        root = psutil.Process(root_pid)
        tree = {root_pid, *(c.pid for c in root.children(recursive=True))}
    except psutil.Error:
        return True
    return any(p.pid in tree for p in on_them)


# What a worker's CUDA context takes beside its allocator's memory (NVML counts both).
CONTEXT_ALLOWANCE_BYTES = 512 * 1024**2


def memory_per_worker(mem_per_worker: int | str | None, workers_per_gpu: int | None) -> int:
    """``mem_per_worker`` in bytes (0: none); UsageError for a bad one, or without a fixed
    ``workers_per_gpu`` (the lease of a GPU is that many workers' memory)."""
    if mem_per_worker is None:
        return 0
    from gpuwarden.lease.grant import make_request

    mem_bytes = make_request(1, mem=mem_per_worker).memory_bytes
    if workers_per_gpu is None:
        raise UsageError("mem_per_worker needs workers_per_gpu: a GPU's memory lease is that "
                         "many workers' memory", fix="e.g. GPUPool(workers_per_gpu=2, "
                         "mem_per_worker='6GiB')")
    return mem_bytes


def fraction_for(mem_bytes: int, gpus: Sequence[GPUSnapshot]) -> float:
    """The allocator cap (torch's per-process memory fraction) that keeps a worker inside
    ``mem_bytes`` on the largest of ``gpus`` (smaller ones give it less)."""
    total = max(g.memory_total_bytes for g in gpus) or 1
    allowed = max(mem_bytes - CONTEXT_ALLOWANCE_BYTES, mem_bytes // 2)
    return max(0.001, min(1.0, allowed / total))
