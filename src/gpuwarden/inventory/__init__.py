"""GPU inventory: the one interface through which all GPU state is read.

``read_host()`` returns a :class:`HostSnapshot` of every GPU on the host;
``read_visible()`` narrows it to what this process may use
(CUDA_VISIBLE_DEVICES, Slurm). The backend is NVML, or a simulated host when
``GPUWARDEN_SIMULATE`` names a scenario file. Neither creates a CUDA context.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Protocol

from gpuwarden.inventory.snapshot import ComputeMode, GPUProcess, GPUSnapshot, HostSnapshot

__all__ = [
    "ComputeMode",
    "GPUBackend",
    "GPUProcess",
    "GPUSnapshot",
    "HostSnapshot",
    "get_backend",
    "read_host",
    "read_visible",
    "real_gpu_present",
    "SIMULATE_ENV",
]

SIMULATE_ENV = "GPUWARDEN_SIMULATE"


class GPUBackend(Protocol):
    """Anything that can take a snapshot of a host's GPUs."""

    name: str

    def read_host(self) -> HostSnapshot: ...


def get_backend(env: Mapping[str, str] | None = None) -> GPUBackend:
    """The simulated host when GPUWARDEN_SIMULATE is set (and not empty), else NVML."""
    env = os.environ if env is None else env
    path = env.get(SIMULATE_ENV, "")
    if path:
        from gpuwarden.inventory.simulated import SimulatedBackend

        return SimulatedBackend(path)
    from gpuwarden.inventory.nvml import NvmlBackend

    return NvmlBackend()


def read_host(env: Mapping[str, str] | None = None) -> HostSnapshot:
    """Every GPU of this host. Raises NoGPUError (exit 3) when NVML is unavailable."""
    return get_backend(env).read_host()


def read_visible(env: Mapping[str, str] | None = None) -> tuple[HostSnapshot, tuple[GPUSnapshot, ...]]:
    """The host and the GPUs this process may use, in CUDA's order for it."""
    from gpuwarden.visibility import resolve_visible

    env = os.environ if env is None else env
    host = read_host(env)
    return host, resolve_visible(host.gpus, env)


def real_gpu_present() -> bool:
    """Whether NVML (never the simulated host) reports at least one GPU on this machine.

    For code that must decide whether GPU-only work can run at all (gpu-marked tests, the
    stories' GPU parts); it never raises and never creates a CUDA context.
    """
    from gpuwarden.errors import GpuwardenError
    from gpuwarden.inventory.nvml import device_count

    try:
        return device_count() > 0  # a count, not a snapshot: no per-process lookups
    except GpuwardenError:
        return False
