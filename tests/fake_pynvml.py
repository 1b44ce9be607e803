"""A double of the ``pynvml`` module that reproduces what real NVIDIA drivers vary in.

It is built from the installed nvidia-ml-py itself, so it cannot drift from it: its error
classes *are* pynvml's (``NVMLError_GpuIsLost`` ...), its constants are pynvml's, its return
values are pynvml's own ctypes structs (``c_nvmlMemory_t``, ``nvmlPciInfo_t``,
``c_nvmlUtilization_t``, process lists through ``nvmlStructToFriendlyObject`` of
``c_nvmlProcessInfo_v2_t``), and every function it defines is checked to exist in pynvml
(tests/test_nvml_backend.py). What it varies, per :class:`FakeDriver`:

- ``missing``: C symbols the driver lacks. Their Python wrappers raise
  ``NVMLError_FunctionNotFound``, as pynvml does when ``_nvmlGetFunctionPointer`` fails
  (an old driver: no ``nvmlDeviceGetComputeRunningProcesses_v3``/``_v2``, no MIG calls).
- ``absent``: Python names the bindings do not have (an old nvidia-ml-py).
- ``init_error``: an ``NVML_ERROR_*`` code ``nvmlInit`` fails with (library/driver version
  mismatch, driver not loaded).
- per GPU (:class:`FakeGPU`): memory, utilization (None: NOT_SUPPORTED, as on MIG), compute
  mode, MIG mode and instances, compute and graphics processes, a ``lost_at`` query from
  which on every query of that GPU answers ``GPU_IS_LOST``.
- the v1 C symbol of the running-process queries, reached through ``_nvmlGetFunctionPointer``
  and called with ctypes arguments exactly as the C library is (count pointer, array).
- the NVLink fabric state (``nvmlDeviceGetGpuFabricInfo`` fills pynvml's own
  ``c_nvmlGpuFabricInfo_t`` through the pointer it is given, as the C function does).
- health readings per GPU (:class:`FakeHealth`): each one a value, or an ``NVML_ERROR_*`` code
  the query answers instead (NOT_SUPPORTED on a board without the sensor, UNKNOWN as some
  power sensors answer), with NVLink answering INVALID_ARGUMENT past the last link as drivers do.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pynvml as real

MIB = 1024**2


@dataclass
class FakeProcess:
    pid: int
    used_bytes: int | None = 100 * MIB  # None: NVML_VALUE_NOT_AVAILABLE


@dataclass
class FakeHealth:
    """Sensor readings in NVML's units (mW, MHz, a reason bit mask). An ``int`` below
    ``ERROR`` marks an NVML_ERROR_* to answer instead: ``ERROR + pynvml.NVML_ERROR_NOT_SUPPORTED``."""

    temperature_c: int = 41
    fan_pct: int = 30
    power_mw: int = 87_000
    power_limit_mw: int = 400_000
    pstate: int = 0
    sm_clock_mhz: int = 1410
    sm_clock_max_mhz: int = 1980
    mem_clock_mhz: int = 1593
    clock_reasons: int = 0
    ecc_uncorrected: int = 0
    retired_sbe: list[int] = field(default_factory=list)  # page addresses
    retired_dbe: list[int] = field(default_factory=list)
    retired_pending: int = 0
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)  # corr, unc, pending, failed
    nvlink_states: list[int] = field(default_factory=list)  # per link: 1 up, 0 down
    # nvmlGpuFabricState_t (1 not started, 2 in progress, 3 completed); None: NOT_SUPPORTED,
    # as every GPU outside an NVSwitch system of Hopper or later answers. fabric_status: the
    # nvmlReturn_t of a completed registration.
    fabric_state: int | None = None
    fabric_status: int = real.NVML_SUCCESS


ERROR = -1_000_000  # health values at or below this are errors: ERROR + NVML_ERROR_*


def answer(value: Any) -> Any:
    """A health reading, or raise the NVML error it stands for."""
    if isinstance(value, int) and not isinstance(value, bool) and value <= ERROR // 2:
        raise real.NVMLError(value - ERROR)
    return value


@dataclass
class FakeGPU:
    uuid: str
    name: str = "NVIDIA A100-SXM4-80GB"
    bus_id: str = "00000000:07:00.0"
    total_bytes: int = 80 * 1024 * MIB
    used_bytes: int = 1 * MIB
    utilization: int | None = 0  # None: NOT_SUPPORTED
    compute_mode: int = real.NVML_COMPUTEMODE_DEFAULT
    mig_mode: int | None = None  # None: NOT_SUPPORTED (a board without MIG)
    migs: list[FakeGPU | None] = field(default_factory=list)  # None: an empty slot
    compute: list[FakeProcess] = field(default_factory=list)
    graphics: list[FakeProcess] = field(default_factory=list)
    process_error: int | None = None  # an NVML_ERROR_* the process queries answer
    # From this query on (a name as in FakeDriver.calls: "handle", "uuid", "memory",
    # "processes"), every query of this GPU answers GPU_IS_LOST.
    lost_at: str | None = None
    # The GPU falls off the bus between the two calls of the v1 process query (size, fill).
    lost_between_calls: bool = False
    health: FakeHealth = field(default_factory=FakeHealth)


_ORDER = ("handle", "uuid", "name", "pci", "memory", "utilization", "compute_mode", "mig",
          "processes", "health")


class _Handle:
    """An opaque device handle (pynvml's is a ctypes pointer; nothing may look inside)."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu = gpu


class FakeDriver:
    """A host's driver. ``module()`` is what gpuwarden gets instead of ``pynvml``."""

    def __init__(self, gpus: Iterable[FakeGPU], *, driver_version: str = "550.54.15",
                 cuda_version: int = 12040, missing: Iterable[str] = (),
                 absent: Iterable[str] = (), init_error: int | None = None,
                 process_names: dict[int, str | int] | None = None) -> None:
        self.gpus = list(gpus)
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.missing = set(missing)
        self.absent = set(absent)
        self.init_error = init_error
        self.process_names = process_names or {}
        self.calls: list[str] = []  # every C symbol called, in order
        self.initialized = 0

    # -- the C side -------------------------------------------------------------------
    def _symbol(self, name: str) -> None:
        if self.initialized <= 0:
            raise real.NVMLError(real.NVML_ERROR_UNINITIALIZED)
        if name in self.missing:
            raise real.NVMLError(real.NVML_ERROR_FUNCTION_NOT_FOUND)
        self.calls.append(name)

    def _gpu(self, handle: _Handle, query: str) -> FakeGPU:
        gpu = handle.gpu
        if gpu.lost_at is not None and _ORDER.index(query) >= _ORDER.index(gpu.lost_at):
            raise real.NVMLError(real.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def _processes(self, handle: _Handle, kind: str) -> list[FakeProcess]:
        gpu = self._gpu(handle, "processes")
        if gpu.process_error is not None:
            raise real.NVMLError(gpu.process_error)
        return gpu.compute if kind == "Compute" else gpu.graphics

    def _c_running_processes(self, kind: str) -> Callable[..., int]:
        """The v1 C function: (device, unsigned *count, nvmlProcessInfo_v1_t *infos) -> ret."""

        def c_function(handle: _Handle, count_ref: Any, infos: Any) -> int:
            count = count_ref._obj  # what ctypes.byref() wraps
            try:
                procs = self._processes(handle, kind)
            except real.NVMLError as exc:
                return int(exc.value)
            if infos is not None and handle.gpu.lost_between_calls:
                return real.NVML_ERROR_GPU_IS_LOST
            if infos is None or count.value < len(procs):
                count.value = len(procs)
                return real.NVML_SUCCESS if not procs else real.NVML_ERROR_INSUFFICIENT_SIZE
            for i, p in enumerate(procs):
                infos[i].pid = p.pid
                infos[i].usedGpuMemory = 2**64 - 1 if p.used_bytes is None else p.used_bytes
            count.value = len(procs)
            return real.NVML_SUCCESS

        return c_function

    # -- the Python bindings, as pynvml defines them -----------------------------------
    def module(self) -> types.ModuleType:
        mod = types.ModuleType("fake_pynvml")
        for name in dir(real):  # constants and the error classes themselves, not copies
            if name.startswith(("NVML_", "NVMLError")):
                setattr(mod, name, getattr(real, name))
        for name in ("c_nvmlGpuFabricInfo_t",):  # structs the caller allocates
            if name not in self.absent:
                setattr(mod, name, getattr(real, name))
        for name, fn in self._functions().items():
            if name not in self.absent:
                setattr(mod, name, fn)
        return mod

    def _functions(self) -> dict[str, Callable[..., Any]]:
        d = self
        fns: dict[str, Callable[..., Any]] = {}

        def nvmlInit() -> None:
            if d.init_error is not None:
                raise real.NVMLError(d.init_error)
            d.initialized += 1

        def nvmlShutdown() -> None:
            d._symbol("nvmlShutdown")
            d.initialized -= 1

        def nvmlDeviceGetCount() -> int:
            d._symbol("nvmlDeviceGetCount_v2")
            return len(d.gpus)

        def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
            d._symbol("nvmlDeviceGetHandleByIndex_v2")
            if not 0 <= index < len(d.gpus):
                raise real.NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)
            handle = _Handle(d.gpus[index])
            d._gpu(handle, "handle")
            return handle

        def nvmlDeviceGetUUID(handle: _Handle) -> str:
            d._symbol("nvmlDeviceGetUUID")
            return d._gpu(handle, "uuid").uuid

        def nvmlDeviceGetName(handle: _Handle) -> str:
            d._symbol("nvmlDeviceGetName")
            return d._gpu(handle, "name").name

        def nvmlDeviceGetPciInfo(handle: _Handle) -> Any:
            d._symbol("nvmlDeviceGetPciInfo_v3")
            info = real.nvmlPciInfo_t()
            info.busId = d._gpu(handle, "pci").bus_id.encode()
            return info

        def nvmlDeviceGetMemoryInfo(handle: _Handle, version: Any = None) -> Any:
            d._symbol("nvmlDeviceGetMemoryInfo")
            gpu = d._gpu(handle, "memory")
            mem = real.c_nvmlMemory_t()
            mem.total, mem.used = gpu.total_bytes, gpu.used_bytes
            mem.free = gpu.total_bytes - gpu.used_bytes
            return mem

        def nvmlDeviceGetUtilizationRates(handle: _Handle) -> Any:
            d._symbol("nvmlDeviceGetUtilizationRates")
            gpu = d._gpu(handle, "utilization")
            if gpu.utilization is None:
                raise real.NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
            util = real.c_nvmlUtilization_t()
            util.gpu, util.memory = gpu.utilization, 0
            return util

        def nvmlDeviceGetComputeMode(handle: _Handle) -> int:
            d._symbol("nvmlDeviceGetComputeMode")
            return d._gpu(handle, "compute_mode").compute_mode

        def nvmlDeviceGetMigMode(handle: _Handle) -> list[int]:
            d._symbol("nvmlDeviceGetMigMode")
            gpu = d._gpu(handle, "mig")
            if gpu.mig_mode is None:
                raise real.NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
            return [gpu.mig_mode, gpu.mig_mode]

        def nvmlDeviceGetMaxMigDeviceCount(handle: _Handle) -> int:
            d._symbol("nvmlDeviceGetMaxMigDeviceCount")
            return len(d._gpu(handle, "mig").migs)

        def nvmlDeviceGetMigDeviceHandleByIndex(handle: _Handle, index: int) -> _Handle:
            d._symbol("nvmlDeviceGetMigDeviceHandleByIndex")
            mig = d._gpu(handle, "mig").migs[index]
            if mig is None:
                raise real.NVMLError(real.NVML_ERROR_NOT_FOUND)
            return _Handle(mig)

        def running(kind: str, suffix: str) -> Callable[[_Handle], list[Any]]:
            def query(handle: _Handle) -> list[Any]:
                d._symbol(f"nvmlDeviceGet{kind}RunningProcesses{suffix}")
                out = []
                for p in d._processes(handle, kind):
                    info = real.c_nvmlProcessInfo_v2_t()
                    info.pid = p.pid
                    info.usedGpuMemory = 2**64 - 1 if p.used_bytes is None else p.used_bytes
                    obj = real.nvmlStructToFriendlyObject(info)
                    if obj.usedGpuMemory == real.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                        obj.usedGpuMemory = None  # what pynvml does for this value
                    out.append(obj)
                return out

            return query

        for kind in ("Compute", "Graphics"):
            for suffix in ("_v2", "_v3"):
                fns[f"nvmlDeviceGet{kind}RunningProcesses{suffix}"] = running(kind, suffix)
            # pynvml's unsuffixed wrapper calls _v3 (it has none left for the v1 symbol).
            fns[f"nvmlDeviceGet{kind}RunningProcesses"] = fns[
                f"nvmlDeviceGet{kind}RunningProcesses_v3"]

        def _nvmlGetFunctionPointer(name: str) -> Callable[..., int]:
            d._symbol(name)
            for kind in ("Compute", "Graphics"):
                if name == f"nvmlDeviceGet{kind}RunningProcesses":
                    return d._c_running_processes(kind)
            raise AssertionError(f"the fake driver has no C symbol {name} to hand out")

        def nvmlSystemGetDriverVersion() -> str:
            d._symbol("nvmlSystemGetDriverVersion")
            return d.driver_version

        def nvmlSystemGetCudaDriverVersion() -> int:
            d._symbol("nvmlSystemGetCudaDriverVersion")
            return d.cuda_version

        def nvmlSystemGetProcessName(pid: int) -> str:
            d._symbol("nvmlSystemGetProcessName")
            name = d.process_names.get(pid, real.NVML_ERROR_NOT_FOUND)
            if isinstance(name, int):  # an NVML_ERROR_* to answer with
                raise real.NVMLError(name)
            return name

        def health(handle: _Handle, symbol: str) -> FakeHealth:
            d._symbol(symbol)
            return d._gpu(handle, "health").health

        def nvmlDeviceGetTemperature(handle: _Handle, sensor: int) -> int:
            assert sensor == real.NVML_TEMPERATURE_GPU
            return answer(health(handle, "nvmlDeviceGetTemperature").temperature_c)

        def nvmlDeviceGetFanSpeed(handle: _Handle) -> int:
            return answer(health(handle, "nvmlDeviceGetFanSpeed").fan_pct)

        def nvmlDeviceGetPowerUsage(handle: _Handle) -> int:
            return answer(health(handle, "nvmlDeviceGetPowerUsage").power_mw)

        def nvmlDeviceGetEnforcedPowerLimit(handle: _Handle) -> int:
            return answer(health(handle, "nvmlDeviceGetEnforcedPowerLimit").power_limit_mw)

        def nvmlDeviceGetPowerManagementLimit(handle: _Handle) -> int:
            return answer(health(handle, "nvmlDeviceGetPowerManagementLimit").power_limit_mw)

        def nvmlDeviceGetPerformanceState(handle: _Handle) -> int:
            return answer(health(handle, "nvmlDeviceGetPerformanceState").pstate)

        def nvmlDeviceGetClockInfo(handle: _Handle, clock: int) -> int:
            h = health(handle, "nvmlDeviceGetClockInfo")
            return answer(h.sm_clock_mhz if clock == real.NVML_CLOCK_SM else h.mem_clock_mhz)

        def nvmlDeviceGetMaxClockInfo(handle: _Handle, clock: int) -> int:
            assert clock == real.NVML_CLOCK_SM
            return answer(health(handle, "nvmlDeviceGetMaxClockInfo").sm_clock_max_mhz)

        def nvmlDeviceGetCurrentClocksEventReasons(handle: _Handle) -> int:
            return answer(health(handle, "nvmlDeviceGetCurrentClocksEventReasons").clock_reasons)

        def nvmlDeviceGetCurrentClocksThrottleReasons(handle: _Handle) -> int:
            return answer(health(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").clock_reasons)

        def nvmlDeviceGetTotalEccErrors(handle: _Handle, error_type: int, counter: int) -> int:
            assert (error_type, counter) == (real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                             real.NVML_VOLATILE_ECC)
            return answer(health(handle, "nvmlDeviceGetTotalEccErrors").ecc_uncorrected)

        def nvmlDeviceGetRetiredPages(handle: _Handle, cause: int) -> list[int]:
            h = health(handle, "nvmlDeviceGetRetiredPages")
            single = cause == real.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
            return answer(h.retired_sbe if single else h.retired_dbe)

        def nvmlDeviceGetRetiredPagesPendingStatus(handle: _Handle) -> int:
            return answer(health(handle, "nvmlDeviceGetRetiredPagesPendingStatus").retired_pending)

        def nvmlDeviceGetRemappedRows(handle: _Handle) -> tuple[int, int, int, int]:
            return answer(health(handle, "nvmlDeviceGetRemappedRows").remapped_rows)

        def nvmlDeviceGetNvLinkState(handle: _Handle, link: int) -> int:
            states = health(handle, "nvmlDeviceGetNvLinkState").nvlink_states
            if not states:
                raise real.NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
            if link >= len(states):
                raise real.NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)
            return answer(states[link])

        def nvmlDeviceGetGpuFabricInfo(handle: _Handle, info_ref: Any) -> int:
            h = health(handle, "nvmlDeviceGetGpuFabricInfo")
            if h.fabric_state is None:
                raise real.NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
            info = info_ref._obj  # what ctypes.byref() wraps: the caller's struct
            assert isinstance(info, real.c_nvmlGpuFabricInfo_t)
            info.state = answer(h.fabric_state)
            info.status = h.fabric_status
            return real.NVML_SUCCESS

        for fn in (nvmlDeviceGetTemperature, nvmlDeviceGetFanSpeed, nvmlDeviceGetPowerUsage,
                   nvmlDeviceGetEnforcedPowerLimit, nvmlDeviceGetPowerManagementLimit,
                   nvmlDeviceGetPerformanceState, nvmlDeviceGetClockInfo,
                   nvmlDeviceGetMaxClockInfo, nvmlDeviceGetCurrentClocksEventReasons,
                   nvmlDeviceGetCurrentClocksThrottleReasons, nvmlDeviceGetTotalEccErrors,
                   nvmlDeviceGetRetiredPages, nvmlDeviceGetRetiredPagesPendingStatus,
                   nvmlDeviceGetRemappedRows, nvmlDeviceGetNvLinkState,
                   nvmlDeviceGetGpuFabricInfo):
            fns[fn.__name__] = fn

        for fn in (nvmlInit, nvmlShutdown, nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex,
                   nvmlDeviceGetUUID, nvmlDeviceGetName, nvmlDeviceGetPciInfo,
                   nvmlDeviceGetMemoryInfo, nvmlDeviceGetUtilizationRates,
                   nvmlDeviceGetComputeMode, nvmlDeviceGetMigMode,
                   nvmlDeviceGetMaxMigDeviceCount, nvmlDeviceGetMigDeviceHandleByIndex,
                   _nvmlGetFunctionPointer, nvmlSystemGetDriverVersion,
                   nvmlSystemGetCudaDriverVersion, nvmlSystemGetProcessName):
            fns[fn.__name__] = fn
        return fns


def fake_module(gpus: Iterable[FakeGPU], **kwargs: Any) -> tuple[FakeDriver, types.ModuleType]:
    driver = FakeDriver(gpus, **kwargs)
    return driver, driver.module()
