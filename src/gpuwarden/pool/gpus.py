"""Which GPUs a pool takes: the one seam between the pool and selection/leases.

``gpus`` is ``"auto"`` (every usable visible GPU), a count, or a list of indices/UUIDs.
GPU state comes from the inventory (NVML or GPUWARDEN_SIMULATE), never from CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuwarden.errors import NoGPUError, UsageError
from gpuwarden.inventory.snapshot import GPUSnapshot
from gpuwarden.select import Constraints, select


@dataclass(frozen=True)
class TakenGPUs:
    gpus: tuple[GPUSnapshot, ...]
    release: Callable[[], None]
    why_cpu: str = ""  # set when ``gpus`` is empty: why the pool runs on the CPU


def _nothing() -> None:
    pass


def take_gpus(spec: str | int | Sequence[int | str], workers_per_gpu: int, *,
              min_free_bytes: int = 0, allow_shared: bool = False,
              wait: float | str | None = None, label: str = "gpuwarden pool") -> TakenGPUs:
    """Select the GPUs for a pool, with every GPU's verdict in the error when that fails.

    Raises UsageError for a malformed ``spec``, ConstraintError (exit 4) when fewer GPUs
    than asked are usable, NoGPUError when GPUs are asked for by count or id on a host
    without NVML.
    """
    from gpuwarden.inventory import read_visible

    explicit = spec != "auto"
    if isinstance(spec, str) and spec != "auto":
        raise UsageError(f"gpus={spec!r}: expected 'auto', a count, or a list of ids")
    try:
        _, visible = read_visible()
    except NoGPUError as exc:
        if explicit:
            raise
        return TakenGPUs((), _nothing, why_cpu=exc.what)
    if not visible:
        if explicit and spec != 0:
            raise NoGPUError("GPUs were requested for the pool but none is visible",
                             fix="check CUDA_VISIBLE_DEVICES, or use gpus='auto'")
        return TakenGPUs((), _nothing, why_cpu="no GPU is visible to this process")
    if isinstance(spec, int):
        include: tuple[str, ...] = ()
        count = spec
    elif isinstance(spec, str):
        include = ()
        count = len(select(visible, Constraints(
            count=0, min_free_bytes=min_free_bytes, allow_shared=allow_shared)).acceptable)
        count = count or 1  # none usable: ask for one, so that the error lists every verdict
    else:
        include = tuple(str(i) for i in spec)
        count = len(include)
    constraints = Constraints(count=count, min_free_bytes=min_free_bytes,
                              allow_shared=allow_shared, include=include)
    return _acquire(visible, constraints, workers_per_gpu, wait=wait, label=label)


def _acquire(visible: tuple[GPUSnapshot, ...], constraints: Constraints, workers_per_gpu: int,
             *, wait: float | str | None, label: str) -> TakenGPUs:
    """Lease the GPUs (one slot per worker, every slot of each GPU) through gpuwarden.lease,
    so that two pools or jobs on this host never pick the same GPU at the same moment."""
    from gpuwarden.lease import acquire

    grant = acquire(constraints.count, slots_per_gpu=workers_per_gpu, slots_each=workers_per_gpu,
                    wait=wait, constraints=constraints, label=label, visible=visible)
    return TakenGPUs(tuple(grant.gpus), grant.release)
