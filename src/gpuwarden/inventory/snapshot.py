"""Immutable snapshots of GPU state, as read from NVML or a simulated scenario.

Units live in the names: ``*_bytes`` are bytes, ``*_pct`` percent. A field NVML
could not answer (``NOT_SUPPORTED`` on some boards, a MIG instance's
utilization) is ``None`` rather than a made-up zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class ComputeMode(str, Enum):
    """NVML compute modes. Only PROHIBITED and a held EXCLUSIVE_PROCESS refuse a new context."""

    DEFAULT = "default"
    EXCLUSIVE_THREAD = "exclusive_thread"  # deprecated by NVIDIA, behaves like exclusive_process
    PROHIBITED = "prohibited"
    EXCLUSIVE_PROCESS = "exclusive_process"

    @property
    def is_exclusive(self) -> bool:
        return self in (ComputeMode.EXCLUSIVE_PROCESS, ComputeMode.EXCLUSIVE_THREAD)


@dataclass(frozen=True)
class GPUProcess:
    """A process holding a context on a GPU. ``user``/``command`` are None when not visible
    to us (another PID namespace, or a process that has just exited); ``note`` says which."""

    pid: int
    user: str | None
    command: str | None
    used_memory_bytes: int | None
    # "compute", "graphics" (a display server, a renderer) or "compute+graphics".
    context: str = "compute"
    # Why user/command are missing: e.g. "pid not in this PID namespace (container)".
    note: str | None = None

    @property
    def has_compute(self) -> bool:
        """Whether it holds a CUDA (compute) context: what exclusive compute modes count."""
        return "compute" in self.context

    def describe(self) -> str:
        """'pid 5151 (carol, python eval.py)' — the form used in every reason string."""
        kind = None if self.context == "compute" else f"{self.context} context"
        who = ", ".join(x for x in (self.user, self.command, kind, self.note) if x)
        return f"pid {self.pid} ({who})" if who else f"pid {self.pid}"


@dataclass(frozen=True)
class GPUSnapshot:
    """One GPU (or one MIG instance, when ``mig_parent_uuid`` is set) at one moment."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization_gpu_pct: int | None
    compute_mode: ComputeMode
    mig_enabled: bool
    processes: tuple[GPUProcess, ...] = ()
    # MIG instances of this GPU (empty unless mig_enabled).
    mig_devices: tuple[GPUSnapshot, ...] = ()
    # Set on a MIG instance: the uuid of the GPU it is carved from.
    mig_parent_uuid: str | None = None
    # Set when the GPU could not be read: NVML's error ("NVML: GPU is lost"). Its other
    # fields are then what was read before the error (memory 0); selection refuses it.
    error: str | None = None

    @property
    def memory_free_bytes(self) -> int:
        return max(0, self.memory_total_bytes - self.memory_used_bytes)

    @property
    def is_mig_instance(self) -> bool:
        return self.mig_parent_uuid is not None

    @property
    def cuda_id(self) -> str:
        """What a child's CUDA_VISIBLE_DEVICES should name to see this device.

        Indices assume the child gets CUDA_DEVICE_ORDER=PCI_BUS_ID (everything gpuwarden
        starts does), so that CUDA's order is NVML's. A MIG instance can only be named
        by its ``MIG-`` uuid.
        """
        return self.uuid if self.is_mig_instance else str(self.index)

    @property
    def label(self) -> str:
        """'GPU 2' or 'GPU 0 MIG-…' for reason strings."""
        return f"GPU {self.index} {self.uuid}" if self.is_mig_instance else f"GPU {self.index}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["compute_mode"] = self.compute_mode.value
        data["memory_free_bytes"] = self.memory_free_bytes
        data["mig_devices"] = [m.to_dict() for m in self.mig_devices]
        return data


@dataclass(frozen=True)
class HostSnapshot:
    """Every GPU of one host as the backend sees it (before CUDA_VISIBLE_DEVICES)."""

    hostname: str
    driver_version: str | None
    cuda_driver_version: str | None
    gpus: tuple[GPUSnapshot, ...]
    source: str  # "nvml" or "simulated:<path>"

    def to_dict(self) -> dict[str, Any]:
        return {
            "hostname": self.hostname,
            "driver_version": self.driver_version,
            "cuda_driver_version": self.cuda_driver_version,
            "source": self.source,
        }
