"""The real backend: GPU state through NVML (nvidia-ml-py), never through CUDA.

NVML does not create a CUDA context, so reading it in a launcher or a pool's
parent leaves the process fork-safe. Every call goes through :func:`_call`,
which initializes NVML lazily under a lock and maps NVML's errors to
gpuwarden's. NVML is shut down at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from gpuwarden.errors import NoGPUError, NVMLError
from gpuwarden.inventory.snapshot import ComputeMode, GPUProcess, GPUSnapshot, HostSnapshot

T = TypeVar("T")

_lock = threading.Lock()
_initialized = False

_NO_NVML_FIX = (
    "on a GPU host install the NVIDIA driver (it ships libnvidia-ml.so.1); in a container start it "
    "with GPUs (--gpus all); to try gpuwarden without a GPU set GPUWARDEN_SIMULATE=<scenario.json>"
)

_MODES = {0: ComputeMode.DEFAULT, 1: ComputeMode.EXCLUSIVE_THREAD, 2: ComputeMode.PROHIBITED,
          3: ComputeMode.EXCLUSIVE_PROCESS}


def _pynvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:  # the dependency is declared; a broken env still gets a clear line
        raise NoGPUError(
            "the nvidia-ml-py package is not installed",
            fix="pip install nvidia-ml-py",
        ) from exc
    return pynvml


def _ensure_init() -> Any:
    global _initialized
    nvml = _pynvml()
    with _lock:
        if _initialized:
            return nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError_LibraryNotFound as exc:
            raise NoGPUError(
                "no NVIDIA driver: the NVML library (libnvidia-ml.so.1) is not installed",
                why="GPU state is read through NVML, which comes with the driver",
                fix=_NO_NVML_FIX,
            ) from exc
        except nvml.NVMLError_DriverNotLoaded as exc:
            raise NoGPUError(
                "the NVIDIA kernel driver is not loaded",
                why="NVML found its library but no running driver",
                fix="load the driver (nvidia-smi should work), or run on a GPU host",
            ) from exc
        except nvml.NVMLError as exc:
            raise NoGPUError(
                f"NVML failed to initialize: {exc}", fix=_NO_NVML_FIX
            ) from exc
        _initialized = True
        atexit.register(_shutdown)
        return nvml


def _shutdown() -> None:
    global _initialized
    with _lock:
        if _initialized:
            # At exit nothing useful can be done with a failing shutdown.
            with contextlib.suppress(Exception):
                _pynvml().nvmlShutdown()
            _initialized = False


def _call(fn: Callable[..., T], *args: Any) -> T:
    nvml = _ensure_init()
    try:
        return fn(*args)
    except nvml.NVMLError as exc:
        raise NVMLError(f"NVML {fn.__name__} failed: {exc}") from exc


def _optional(fn: Callable[..., T], *args: Any) -> T | None:
    """Queries some boards or MIG instances do not support: None instead of an error."""
    nvml = _ensure_init()
    try:
        return fn(*args)
    except (nvml.NVMLError_NotSupported, nvml.NVMLError_NoPermission, nvml.NVMLError_NotFound):
        return None
    except nvml.NVMLError as exc:
        raise NVMLError(f"NVML {fn.__name__} failed: {exc}") from exc


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _processes(nvml: Any, handle: Any) -> tuple[GPUProcess, ...]:
    import psutil

    raw = _optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
    out = []
    for p in raw:
        user: str | None = None
        command: str | None = None
        try:
            proc = psutil.Process(p.pid)
            user = proc.username()
            command = " ".join(proc.cmdline()) or proc.name()
        except (psutil.Error, OSError):
            # Another PID namespace (container) or already gone: NVML still counts it.
            pass
        used = getattr(p, "usedGpuMemory", None)
        out.append(GPUProcess(pid=p.pid, user=user, command=command,
                              used_memory_bytes=used if isinstance(used, int) else None))
    return tuple(out)


def _mig_devices(nvml: Any, handle: Any, index: int, parent_uuid: str) -> tuple[GPUSnapshot, ...]:
    count = _optional(nvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0
    out = []
    for i in range(count):
        mig = _optional(nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, i)
        if mig is None:
            continue
        mem = _call(nvml.nvmlDeviceGetMemoryInfo, mig)
        out.append(GPUSnapshot(
            index=index,
            uuid=_text(_call(nvml.nvmlDeviceGetUUID, mig)),
            name=_text(_optional(nvml.nvmlDeviceGetName, mig) or "MIG instance"),
            pci_bus_id="",
            memory_total_bytes=int(mem.total),
            memory_used_bytes=int(mem.used),
            utilization_gpu_pct=None,
            compute_mode=ComputeMode.DEFAULT,
            mig_enabled=False,
            processes=_processes(nvml, mig),
            mig_parent_uuid=parent_uuid,
        ))
    return tuple(out)


def device_count() -> int:
    """How many GPUs NVML sees (raises NoGPUError without NVML)."""
    nvml = _ensure_init()
    return int(_call(nvml.nvmlDeviceGetCount))


class NvmlBackend:
    """Reads every GPU of this host through NVML."""

    name = "nvml"

    def read_host(self) -> HostSnapshot:
        nvml = _ensure_init()
        gpus = []
        for index in range(_call(nvml.nvmlDeviceGetCount)):
            handle = _call(nvml.nvmlDeviceGetHandleByIndex, index)
            uuid = _text(_call(nvml.nvmlDeviceGetUUID, handle))
            mem = _call(nvml.nvmlDeviceGetMemoryInfo, handle)
            util = _optional(nvml.nvmlDeviceGetUtilizationRates, handle)
            mode = _optional(nvml.nvmlDeviceGetComputeMode, handle)
            mig_mode = _optional(nvml.nvmlDeviceGetMigMode, handle)
            mig_enabled = bool(mig_mode and mig_mode[0] == nvml.NVML_DEVICE_MIG_ENABLE)
            gpus.append(GPUSnapshot(
                index=index,
                uuid=uuid,
                name=_text(_call(nvml.nvmlDeviceGetName, handle)),
                pci_bus_id=_text(_call(nvml.nvmlDeviceGetPciInfo, handle).busId),
                memory_total_bytes=int(mem.total),
                memory_used_bytes=int(mem.used),
                utilization_gpu_pct=None if util is None else int(util.gpu),
                compute_mode=_MODES.get(mode if mode is not None else 0, ComputeMode.DEFAULT),
                mig_enabled=mig_enabled,
                processes=_processes(nvml, handle),
                mig_devices=_mig_devices(nvml, handle, index, uuid) if mig_enabled else (),
            ))
        cuda_version = _optional(nvml.nvmlSystemGetCudaDriverVersion)
        return HostSnapshot(
            hostname=socket.gethostname(),
            driver_version=_text(_call(nvml.nvmlSystemGetDriverVersion)),
            cuda_driver_version=(
                None if cuda_version is None
                else f"{cuda_version // 1000}.{(cuda_version % 1000) // 10}"
            ),
            gpus=tuple(gpus),
            source="nvml",
        )
