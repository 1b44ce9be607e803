"""GPU inventory: the one interface through which all GPU state is read.

An :class:`Inventory` is a backend (NVML, a simulated scenario, a fixed snapshot, a test's)
plus the variables that narrow its host to what this process may use (CUDA_VISIBLE_DEVICES,
Slurm). ``read_host()`` gives a :class:`HostSnapshot` of every GPU on the host;
``read_visible()`` the GPUs this process may use. The default inventory
(:meth:`Inventory.from_env`) is NVML, or a simulated host when ``GPUWARDEN_SIMULATE`` names a
scenario file; callers that take ``inventory=`` use it when given none. None of them creates
a CUDA context.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Protocol

from gpuwarden.inventory.snapshot import ComputeMode, GPUProcess, GPUSnapshot, HostSnapshot

if TYPE_CHECKING:  # visibility.py imports snapshot types from here: import it lazily
    from gpuwarden.visibility import Visibility

__all__ = [
    "ComputeMode",
    "GPUBackend",
    "GPUProcess",
    "GPUSnapshot",
    "HostSnapshot",
    "Inventory",
    "StaticBackend",
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


class StaticBackend:
    """A host given as a snapshot (a test's, or one read earlier): every read returns it."""

    name = "static"

    def __init__(self, host: HostSnapshot) -> None:
        self.host = host

    def read_host(self) -> HostSnapshot:
        return self.host


class Inventory:
    """The GPUs one process may use: a backend, and the variables that narrow its host.

    ``backend``: NVML, a simulated scenario, a :class:`StaticBackend` or anything with
    ``read_host()``. ``env``: where CUDA_VISIBLE_DEVICES and Slurm's variables are read
    (None: ``os.environ`` at each read). Everything that reads GPUs (``acquire``,
    ``GPUPool``, the launcher, the CLI's ``main``) takes one; :meth:`from_env` is the
    default they use, where GPUWARDEN_SIMULATE chooses a simulated host over NVML.
    """

    def __init__(self, backend: GPUBackend, env: Mapping[str, str] | None = None) -> None:
        self.backend = backend
        self.env = env

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Inventory:
        """NVML, or the scenario GPUWARDEN_SIMULATE names (in ``env``, default os.environ)."""
        return cls(get_backend(env), env)

    @classmethod
    def of(cls, host: HostSnapshot, env: Mapping[str, str] | None = None) -> Inventory:
        """A fixed host; ``env`` None reads CUDA_VISIBLE_DEVICES from os.environ, {} ignores it."""
        return cls(StaticBackend(host), env)

    def read_host(self) -> HostSnapshot:
        """Every GPU of the host. Raises NoGPUError (exit 3) when NVML is unavailable."""
        return self.backend.read_host()

    def read_memory(self, uuids: Collection[str] | None = None) -> tuple[GPUSnapshot, ...]:
        """The devices ``uuids`` (GPUs or MIG instances, every one when None) with their memory
        and the memory of each process on them: what the memory guard polls. A backend with a
        cheaper read than ``read_host`` (NVML: three calls per device, no process lookups)
        gives it; the others' ``read_host`` is used."""
        read = getattr(self.backend, "read_memory", None)
        if read is not None:
            return tuple(read(uuids))
        host = self.backend.read_host()
        devices = [d for g in host.gpus for d in (g, *g.mig_devices)]
        return tuple(d for d in devices if uuids is None or d.uuid in uuids)

    def visibility(self) -> tuple[HostSnapshot, Visibility]:
        """The host, and what CUDA_VISIBLE_DEVICES / Slurm leave of it (with notes)."""
        from gpuwarden.visibility import parse_visibility

        host = self.read_host()
        return host, parse_visibility(host.gpus, os.environ if self.env is None else self.env)

    def read_visible(self) -> tuple[HostSnapshot, tuple[GPUSnapshot, ...]]:
        """The host and the GPUs this process may use, in CUDA's order for it."""
        host, vis = self.visibility()
        return host, vis.gpus

    def __repr__(self) -> str:
        return f"Inventory({self.backend.name})"


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
    """Every GPU of this host (``Inventory.from_env(env).read_host()``)."""
    return Inventory.from_env(env).read_host()


def read_visible(env: Mapping[str, str] | None = None) -> tuple[HostSnapshot, tuple[GPUSnapshot, ...]]:
    """The host and the GPUs this process may use (``Inventory.from_env(env).read_visible()``)."""
    return Inventory.from_env(env).read_visible()


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
