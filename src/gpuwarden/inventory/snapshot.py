"""Immutable snapshots of GPU state, as read from NVML or a simulated scenario.

Units live in the names: ``*_bytes`` are bytes, ``*_pct`` percent. A field NVML
could not answer (``NOT_SUPPORTED`` on some boards, a MIG instance's
utilization) is ``None`` rather than a made-up zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from gpuwarden.safetext import escape_untrusted


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
    # From the host's process table (psutil), None when not visible to us: resident host
    # memory, CPU time used so far (user + system), and how long it has been running.
    host_memory_rss_bytes: int | None = None
    cpu_time_s: float | None = None
    elapsed_s: float | None = None

    @property
    def has_compute(self) -> bool:
        """Whether it holds a CUDA (compute) context: what exclusive compute modes count."""
        return "compute" in self.context

    def describe(self) -> str:
        """'pid 5151 (carol, python eval.py)' — the form used in every reason string.

        The user name and command line are another user's writing (NVML, /proc): escaped and
        bounded here, so no reason string can carry terminal controls or megabytes of argv.
        """
        kind = None if self.context == "compute" else f"{self.context} context"
        user = None if self.user is None else escape_untrusted(self.user, 64)
        command = None if self.command is None else escape_untrusted(self.command, 120)
        who = ", ".join(x for x in (user, command, kind, self.note) if x)
        return f"pid {self.pid} ({who})" if who else f"pid {self.pid}"


# NVML's clock event ("throttle") reason bits (nvmlClocksEventReason*, stable since driver
# 352); names as nvidia-smi -q prints them, in lower case.
THROTTLE_REASONS = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clocks"),
)
# The reasons that mean the GPU runs slower than it could for a cause outside the job (an idle
# GPU or clocks an admin set are not news): what `gpuwarden ls` flags.
SLOWDOWN_REASONS = frozenset({"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown",
                              "hw_thermal_slowdown", "hw_power_brake_slowdown"})


# nvmlGpuFabricState_t, in lower case (NOT_SUPPORTED is None): what GPUHealth.fabric_state holds.
FABRIC_COMPLETED = "completed"
FABRIC_STATES = ("not_started", "in_progress", FABRIC_COMPLETED)


def throttle_reason_names(mask: int) -> tuple[str, ...]:
    """NVML's reason bit mask as names; unknown bits as hex (a newer driver's reason)."""
    names = [name for bit, name in THROTTLE_REASONS if mask & bit]
    unknown = mask & ~sum(bit for bit, _ in THROTTLE_REASONS)
    if unknown:
        names.append(f"0x{unknown:x}")
    return tuple(names)


@dataclass(frozen=True)
class GPUHealth:
    """What nvidia-smi shows beside memory: temperature, power, clocks and why they are held
    back, ECC errors and retired memory, NVLink. Every field is None when NVML cannot say."""

    temperature_c: int | None = None
    fan_speed_pct: int | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    performance_state: int | None = None  # P0 (fastest) .. P15
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    memory_clock_mhz: int | None = None
    # Active clock event ("throttle") reasons, see THROTTLE_REASONS; () when none.
    throttle_reasons: tuple[str, ...] | None = None
    # Uncorrectable ECC errors since the driver loaded (volatile counter); None with ECC off.
    ecc_errors_uncorrected: int | None = None
    # Memory pages retired for ECC errors (pre-Ampere), and whether a retirement or a row
    # remapping (Ampere and later) waits for a GPU reset to take effect.
    retired_pages: int | None = None
    memory_repair_pending: bool | None = None
    nvlinks_active: int | None = None
    nvlinks_total: int | None = None
    # The GPU's place in the NVLink fabric of an NVSwitch system (HGX/DGX, Hopper and later:
    # nvmlDeviceGetGpuFabricInfo, nvidia-smi -q's "Fabric" section): one of FABRIC_STATES;
    # None where there is no fabric or NVML cannot say (Ampere answers NOT_SUPPORTED). Until
    # the Fabric Manager has registered the GPU (completed), CUDA refuses to start on the host
    # (cudaErrorSystemNotReady, 802). fabric_error: NVML's error when a completed registration
    # failed (None when it succeeded).
    fabric_state: str | None = None
    fabric_error: str | None = None

    @property
    def fabric_ready(self) -> bool | None:
        """Whether the fabric lets CUDA start: None without a fabric (or when unknown)."""
        if self.fabric_state is None:
            return None
        return self.fabric_state == FABRIC_COMPLETED and self.fabric_error is None

    @property
    def slowdowns(self) -> tuple[str, ...]:
        """The active reasons that slow the GPU down for a cause outside the job."""
        return tuple(r for r in self.throttle_reasons or () if r in SLOWDOWN_REASONS)

    def problems(self) -> tuple[str, ...]:
        """What an operator should look at, in words ('3 uncorrectable ECC errors', ...)."""
        out = []
        if self.ecc_errors_uncorrected:
            out.append(f"{self.ecc_errors_uncorrected} uncorrectable ECC error(s)")
        if self.memory_repair_pending:
            out.append("memory repair pending a GPU reset")
        if self.slowdowns:
            out.append("slowed: " + ", ".join(self.slowdowns))
        if self.nvlinks_total and self.nvlinks_active is not None \
                and self.nvlinks_active < self.nvlinks_total:
            # NCCL then routes through PCIe or host memory: collectives run several times slower
            out.append(f"{self.nvlinks_total - self.nvlinks_active} of {self.nvlinks_total} "
                       "NVLinks down")
        if self.fabric_ready is False:
            out.append(f"NVLink fabric registration failed: {self.fabric_error}"
                       if self.fabric_state == FABRIC_COMPLETED else
                       f"NVLink fabric {self.fabric_state}: CUDA will not start (Fabric Manager)")
        return tuple(out)


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
    # Health and speed, as nvidia-smi and nvitop show them; None wherever NVML cannot say
    # (a board without the sensor, an old driver, a MIG instance).
    health: GPUHealth = field(default_factory=GPUHealth)

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
    # The CUDA driver's answer to cuInit as a scenario states it ("CUDA_SUCCESS",
    # "CUDA_ERROR_SYSTEM_NOT_READY" ...). NVML cannot know it: None from the NVML backend,
    # whose host the doctor asks in a subprocess instead (doctor.probes.query_cuda_driver).
    cuda_init: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "hostname": self.hostname,
            "driver_version": self.driver_version,
            "cuda_driver_version": self.cuda_driver_version,
            "source": self.source,
        }
