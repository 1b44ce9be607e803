"""The real backend: GPU state through NVML (nvidia-ml-py), never through CUDA.

NVML does not create a CUDA context, so reading it in a launcher or a pool's parent leaves
the process fork-safe. Every query goes through one :class:`_Session` per ``pynvml`` module,
which initializes NVML lazily under a lock and maps NVML's errors to gpuwarden's; NVML is
shut down at interpreter exit. ``NvmlBackend(nvml=module)`` runs on any module with
pynvml's names (the test-suite's double of a driver, see tests/fake_pynvml.py).

What real drivers vary in, and what is done about it:

- **Missing symbols.** A driver older than the bindings lacks ``*_v3`` (and older still
  ``*_v2``) of the running-process queries: they are tried newest first and fall back on
  ``NVMLError_FunctionNotFound`` down to the original (v1) C symbol, called through
  ``ctypes`` with the v1 struct, as nvitop does. A query for a detail (name, PCI id,
  utilization, compute mode, MIG, CUDA version, process names) missing from the driver or
  from an old ``pynvml`` is an answer "unknown" (None), never a failure; only the core
  queries (count, handle, UUID, memory, driver version) are required.
- **NOT_SUPPORTED / NO_PERMISSION / NOT_FOUND**: utilization on a MIG-enabled GPU, processes
  on a MIG parent without privileges, an empty MIG slot: "unknown" for that field.
- **A lost GPU** (``GPU_IS_LOST``, fallen off the bus; or any error while reading one GPU):
  that GPU is reported with ``error`` set, selection refuses it, every other GPU is read.
- **Graphics processes** are listed beside compute ones, marked ``context="graphics"``.
- **Pids from another PID namespace**: NVML reports the host's pid numbers; in a container
  with its own PID namespace they name nothing (or the wrong process) here, so they are not
  looked up and are marked as such. NVML's own process name is used when it has one.
- **Driver/library version mismatch** (the driver was upgraded, the kernel module not
  reloaded): one clear NVML_UNAVAILABLE error with the fix.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import socket
import threading
from collections.abc import Callable, Collection
from types import SimpleNamespace
from typing import Any

from gpuwarden.errors import NoGPUError, NVMLError
from gpuwarden.inventory.snapshot import (
    FABRIC_COMPLETED,
    FABRIC_STATES,
    ComputeMode,
    GPUHealth,
    GPUProcess,
    GPUSnapshot,
    HostSnapshot,
    throttle_reason_names,
)

_NO_NVML_FIX = (
    "on a GPU host install the NVIDIA driver (it ships libnvidia-ml.so.1); in a container start it "
    "with GPUs (--gpus all); to try gpuwarden without a GPU: `gpuwarden ls --simulate example`, "
    "or GPUWARDEN_SIMULATE=<scenario name or file> for every command (docs/scenarios.md)"
)

_MODES = {0: ComputeMode.DEFAULT, 1: ComputeMode.EXCLUSIVE_THREAD, 2: ComputeMode.PROHIBITED,
          3: ComputeMode.EXCLUSIVE_PROCESS}

# What NVML answers when a value is not available (usedGpuMemory under WDDM, some MIG setups).
_ULLONG_MAX = 2**64 - 1

NOT_IN_PID_NAMESPACE = "pid not in this PID namespace (container)"
EXITED = "exited since NVML listed it"


class _ProcessInfoV1(ctypes.Structure):
    """nvmlProcessInfo_v1_t: what drivers without the _v2 symbols fill in."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


def _import_pynvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:  # the dependency is declared; a broken env still gets a clear line
        raise NoGPUError(
            "the nvidia-ml-py package is not installed",
            fix="pip install nvidia-ml-py",
        ) from exc
    return pynvml


class _Session:
    """One ``pynvml``-like module: lazy initialization under a lock, errors classified."""

    def __init__(self, module: Any | None = None) -> None:
        self._module = module
        self._lock = threading.Lock()
        self._initialized = False
        self._shutdown_registered = False
        # The running-process query version this driver answers (None: not decided yet).
        self.process_suffix: str | None = None

    @property
    def nvml(self) -> Any:
        if self._module is None:
            self._module = _import_pynvml()
        return self._module

    def ensure_init(self) -> Any:
        nvml = self.nvml
        with self._lock:
            if self._initialized:
                return nvml
            try:
                nvml.nvmlInit()
            except nvml.NVMLError as exc:
                raise _init_error(nvml, exc) from exc
            self._initialized = True
            if not self._shutdown_registered:
                self._shutdown_registered = True
                atexit.register(self.shutdown)
            return nvml

    def shutdown(self) -> None:
        with self._lock:
            if self._initialized:
                # At exit nothing useful can be done with a failing shutdown.
                with contextlib.suppress(Exception):
                    self.nvml.nvmlShutdown()
                self._initialized = False

    def function(self, name: str) -> Callable[..., Any] | None:
        """``nvml.<name>``, or None when these bindings do not have it (an old nvidia-ml-py)."""
        fn = getattr(self.nvml, name, None)
        return fn if callable(fn) else None

    def optional(self, name: str, *args: Any) -> Any:
        """A query some drivers, boards or MIG instances cannot answer: None then.

        Other NVML errors propagate as pynvml's exceptions (callers decide: a whole host
        failing, or one GPU).
        """
        nvml = self.nvml
        fn = self.function(name)
        if fn is None:
            return None
        try:
            return fn(*args)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_NoPermission,
                nvml.NVMLError_NotFound, nvml.NVMLError_FunctionNotFound):
            return None

    def detail(self, name: str, *args: Any) -> Any:
        """A reading nothing depends on (temperature, clocks, ECC ...): None whenever NVML
        cannot give it, for any reason but a lost GPU, which the core queries report.

        Drivers answer these with more than the usual three refusals (UNKNOWN on some boards'
        power sensors, INVALID_ARGUMENT past the last NVLink, ...); none of them may cost the
        GPU its place in the listing.
        """
        nvml = self.nvml
        try:
            return self.optional(name, *args)
        except nvml.NVMLError as exc:
            lost = getattr(nvml, "NVMLError_GpuIsLost", None)
            if lost is not None and isinstance(exc, lost):
                raise
            return None

    def required(self, name: str, *args: Any) -> Any:
        fn = self.function(name)
        if fn is None:
            raise self.nvml.NVMLError(self.nvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return fn(*args)


def _init_error(nvml: Any, exc: Exception) -> NoGPUError:
    checks: list[tuple[str, str, str, str]] = [
        ("NVMLError_LibraryNotFound",
         "no NVIDIA driver: the NVML library (libnvidia-ml.so.1) is not installed",
         "GPU state is read through NVML, which comes with the driver", _NO_NVML_FIX),
        ("NVMLError_DriverNotLoaded", "the NVIDIA kernel driver is not loaded",
         "NVML found its library but no running driver",
         "load the driver (nvidia-smi should work), or run on a GPU host"),
        ("NVMLError_LibRmVersionMismatch",
         "NVIDIA driver/library version mismatch: libnvidia-ml and the loaded kernel module "
         "are different versions",
         "the driver was upgraded without reloading its kernel module, or a container brings "
         "its own libnvidia-ml instead of the host's",
         "reboot (or unload and reload the nvidia kernel modules); in a container use the "
         "host's driver libraries (NVIDIA container toolkit)"),
        ("NVMLError_NoPermission", "no permission to use the NVIDIA devices (/dev/nvidia*)",
         "NVML could not open the device nodes as this user",
         "ask an admin for access to /dev/nvidia* (often the 'video' group)"),
    ]
    for class_name, what, why, fix in checks:
        cls = getattr(nvml, class_name, None)
        if cls is not None and isinstance(exc, cls):
            return NoGPUError(what, why=why, fix=fix)
    return NoGPUError(f"NVML failed to initialize: {exc}", fix=_NO_NVML_FIX)


_default_session = _Session()


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


# The kernel's fixed inode number of the initial PID namespace (PROC_PID_INIT_INO, Linux >= 3.8).
_INIT_PID_NAMESPACE = "pid:[4026531836]"


def _in_nested_pid_namespace() -> bool:
    """Whether this process runs in a PID namespace below the host's (a container).

    /proc/self/ns/pid names the namespace by inode, and the host's has a fixed one. (The NSpid
    line of /proc/self/status cannot tell: a container mounts its own /proc, which shows only
    its own level.)
    """
    try:
        return os.readlink("/proc/self/ns/pid") != _INIT_PID_NAMESPACE
    except OSError:  # no /proc, or not Linux: nothing to compare with
        return False


class NvmlBackend:
    """Reads every GPU of this host through NVML.

    ``nvml``: a module with pynvml's names to use instead of ``pynvml`` (a test's double).
    ``nested_pid_namespace``: whether NVML's pids are foreign here; None detects it.
    """

    name = "nvml"

    def __init__(self, nvml: Any | None = None, *, nested_pid_namespace: bool | None = None
                 ) -> None:
        self._session = _default_session if nvml is None else _Session(nvml)
        self._nested = nested_pid_namespace
        # uuid -> (index, handle, parent uuid): what read_memory polls, found once.
        self._devices: dict[str, tuple[int, Any, str | None]] | None = None

    def read_memory(self, uuids: Collection[str] | None = None) -> tuple[GPUSnapshot, ...]:
        """The memory of the devices ``uuids`` (GPUs or MIG instances; every one when None) and
        each process's on them: the guard's poll, three NVML calls per device (memory, compute
        and graphics processes), no /proc lookup, no health reading. Processes carry pid, memory
        and context only."""
        s = self._session
        nvml = s.ensure_init()
        try:
            devices = self._device_handles()
            reader = _Reader(s, True)
            out = []
            for uuid, (index, handle, parent) in devices.items():
                if uuids is not None and uuid not in uuids:
                    continue
                mem = s.required("nvmlDeviceGetMemoryInfo", handle)
                out.append(GPUSnapshot(
                    index=index, uuid=uuid, name="", pci_bus_id="",
                    memory_total_bytes=int(mem.total), memory_used_bytes=int(mem.used),
                    utilization_gpu_pct=None, compute_mode=ComputeMode.DEFAULT,
                    mig_enabled=False, processes=reader.bare_processes(handle),
                    mig_parent_uuid=parent))
        except nvml.NVMLError as exc:
            self._devices = None  # a GPU lost or reset: find the handles again next time
            raise NVMLError(f"NVML failed to read GPU memory: {exc}",
                            fix="check `nvidia-smi`") from exc
        return tuple(out)

    def _device_handles(self) -> dict[str, tuple[int, Any, str | None]]:
        if self._devices is None:
            s = self._session
            found: dict[str, tuple[int, Any, str | None]] = {}
            for index in range(int(s.required("nvmlDeviceGetCount"))):
                handle = s.required("nvmlDeviceGetHandleByIndex", index)
                uuid = _text(s.required("nvmlDeviceGetUUID", handle))
                found[uuid] = (index, handle, None)
                mig_mode = s.optional("nvmlDeviceGetMigMode", handle)
                if mig_mode and mig_mode[0] == self._session.nvml.NVML_DEVICE_MIG_ENABLE:
                    for i in range(s.optional("nvmlDeviceGetMaxMigDeviceCount", handle) or 0):
                        mig = s.optional("nvmlDeviceGetMigDeviceHandleByIndex", handle, i)
                        if mig is not None:
                            found[_text(s.required("nvmlDeviceGetUUID", mig))] = (index, mig,
                                                                                 uuid)
            self._devices = found
        return self._devices

    def read_host(self) -> HostSnapshot:
        s = self._session
        nvml = s.ensure_init()
        nested = _in_nested_pid_namespace() if self._nested is None else self._nested
        try:
            count = int(s.required("nvmlDeviceGetCount"))
            gpus = tuple(_Reader(s, nested).gpu(index) for index in range(count))
            driver = _text(s.required("nvmlSystemGetDriverVersion"))
            cuda_version = s.optional("nvmlSystemGetCudaDriverVersion")
        except nvml.NVMLError as exc:
            raise NVMLError(f"NVML failed to list this host's GPUs: {exc}",
                            fix="check `nvidia-smi`; a driver in this state usually needs a "
                            "reset or a reboot by an admin") from exc
        return HostSnapshot(
            hostname=socket.gethostname(),
            driver_version=driver,
            cuda_driver_version=(
                None if cuda_version is None
                else f"{cuda_version // 1000}.{(cuda_version % 1000) // 10}"
            ),
            gpus=gpus,
            source="nvml",
        )


class _Reader:
    """Reads GPUs one at a time; a GPU NVML fails on is reported as such, not raised."""

    def __init__(self, session: _Session, nested_pid_namespace: bool) -> None:
        self.s = session
        self.nvml = session.nvml
        self.nested = nested_pid_namespace

    def gpu(self, index: int) -> GPUSnapshot:
        seen: dict[str, Any] = {}
        try:
            return self._gpu(index, seen)
        except self.nvml.NVMLError as exc:
            return _failed_gpu(index, seen, exc)

    def _gpu(self, index: int, seen: dict[str, Any]) -> GPUSnapshot:
        s = self.s
        handle = s.required("nvmlDeviceGetHandleByIndex", index)
        seen["uuid"] = uuid = _text(s.required("nvmlDeviceGetUUID", handle))
        seen["name"] = name = _text(s.optional("nvmlDeviceGetName", handle) or "NVIDIA GPU")
        pci = s.optional("nvmlDeviceGetPciInfo", handle)
        seen["pci_bus_id"] = pci_bus_id = "" if pci is None else _text(pci.busId)
        mem = s.required("nvmlDeviceGetMemoryInfo", handle)
        util = s.optional("nvmlDeviceGetUtilizationRates", handle)
        mode = s.optional("nvmlDeviceGetComputeMode", handle)
        mig_mode = s.optional("nvmlDeviceGetMigMode", handle)
        mig_enabled = bool(mig_mode and mig_mode[0] == self.nvml.NVML_DEVICE_MIG_ENABLE)
        return GPUSnapshot(
            index=index,
            uuid=uuid,
            name=name,
            pci_bus_id=pci_bus_id,
            memory_total_bytes=int(mem.total),
            memory_used_bytes=int(mem.used),
            utilization_gpu_pct=None if util is None else int(util.gpu),
            compute_mode=_MODES.get(mode if mode is not None else 0, ComputeMode.DEFAULT),
            mig_enabled=mig_enabled,
            processes=self.processes(handle),
            mig_devices=self.mig_devices(handle, index, uuid) if mig_enabled else (),
            health=self.health(handle),
        )

    def health(self, handle: Any) -> GPUHealth:
        """Temperature, power, clocks and their event reasons, ECC, retired memory, NVLink."""
        nvml, d = self.nvml, self.s.detail
        power_mw = d("nvmlDeviceGetPowerUsage", handle)
        limit_mw = d("nvmlDeviceGetEnforcedPowerLimit", handle)
        if limit_mw is None:
            limit_mw = d("nvmlDeviceGetPowerManagementLimit", handle)
        # Renamed "event reasons" in drivers 535+; older bindings have only the old name.
        reasons = d("nvmlDeviceGetCurrentClocksEventReasons", handle)
        if reasons is None:
            reasons = d("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        pstate = d("nvmlDeviceGetPerformanceState", handle)
        fabric_state, fabric_error = self._fabric(handle)
        return GPUHealth(
            temperature_c=_int(d("nvmlDeviceGetTemperature", handle,
                                 getattr(nvml, "NVML_TEMPERATURE_GPU", 0))),
            fan_speed_pct=_int(d("nvmlDeviceGetFanSpeed", handle)),
            power_draw_w=None if power_mw is None else round(power_mw / 1000, 1),
            power_limit_w=None if limit_mw is None else round(limit_mw / 1000, 1),
            performance_state=None if pstate is None or pstate == 32 else int(pstate),  # 32: unknown
            sm_clock_mhz=_int(d("nvmlDeviceGetClockInfo", handle, _const(nvml, "NVML_CLOCK_SM", 1))),
            sm_clock_max_mhz=_int(d("nvmlDeviceGetMaxClockInfo", handle,
                                    _const(nvml, "NVML_CLOCK_SM", 1))),
            memory_clock_mhz=_int(d("nvmlDeviceGetClockInfo", handle,
                                    _const(nvml, "NVML_CLOCK_MEM", 2))),
            throttle_reasons=None if reasons is None else throttle_reason_names(int(reasons)),
            ecc_errors_uncorrected=_int(d(
                "nvmlDeviceGetTotalEccErrors", handle,
                _const(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                _const(nvml, "NVML_VOLATILE_ECC", 0))),
            retired_pages=self._retired_pages(handle),
            memory_repair_pending=self._repair_pending(handle),
            **self._nvlinks(handle),
            fabric_state=fabric_state,
            fabric_error=fabric_error,
        )

    def _fabric(self, handle: Any) -> tuple[str | None, str | None]:
        """The GPU's NVLink fabric registration (nvmlDeviceGetGpuFabricInfo, driver 525+).

        Only NVSwitch systems of Hopper and later answer; others (and old bindings without
        the struct) answer NOT_SUPPORTED: both None. ``status`` means something only once
        the state is COMPLETED: NVML_SUCCESS, or why the registration failed.
        """
        nvml = self.nvml
        struct = getattr(nvml, "c_nvmlGpuFabricInfo_t", None)
        if struct is None:
            return None, None
        info = struct()
        if self.s.detail("nvmlDeviceGetGpuFabricInfo", handle, ctypes.byref(info)) is None:
            return None, None
        state = int(info.state)  # 0 NOT_SUPPORTED, 1 NOT_STARTED, 2 IN_PROGRESS, 3 COMPLETED
        name = FABRIC_STATES[state - 1] if 1 <= state <= len(FABRIC_STATES) else None
        status = int(info.status)
        error = None
        if name == FABRIC_COMPLETED and status != _const(nvml, "NVML_SUCCESS", 0):
            error = f"NVML: {nvml.NVMLError(status)}"
        return name, error

    def _retired_pages(self, handle: Any) -> int | None:
        """Pages retired for ECC errors (both causes); None where the GPU does not retire
        pages (Ampere and later remap rows instead) or NVML cannot say."""
        total = None
        for cause in ("NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS",
                      "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR"):
            pages = self.s.detail("nvmlDeviceGetRetiredPages", handle, _const(self.nvml, cause, 0))
            if pages is not None:
                total = (total or 0) + len(pages)
        return total

    def _repair_pending(self, handle: Any) -> bool | None:
        """A retired page or a remapped row that takes effect at the next GPU reset."""
        d = self.s.detail
        pending = d("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        rows = d("nvmlDeviceGetRemappedRows", handle)  # (corrected, uncorrected, pending, failed)
        answers = [bool(pending)] if pending is not None else []
        if rows is not None and len(rows) >= 3:
            answers.append(bool(rows[2]))
        return any(answers) if answers else None

    def _nvlinks(self, handle: Any) -> dict[str, int | None]:
        """Links that answer, and those up. A GPU without NVLink answers none: both None."""
        nvml = self.nvml
        total = active = 0
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            state = self.s.detail("nvmlDeviceGetNvLinkState", handle, link)
            if state is None:  # past the last link (NOT_SUPPORTED / INVALID_ARGUMENT)
                break
            total += 1
            active += int(state == _const(nvml, "NVML_FEATURE_ENABLED", 1))
        return {"nvlinks_total": total or None, "nvlinks_active": active if total else None}

    def mig_devices(self, handle: Any, index: int, parent_uuid: str) -> tuple[GPUSnapshot, ...]:
        s = self.s
        count = s.optional("nvmlDeviceGetMaxMigDeviceCount", handle) or 0
        out = []
        for i in range(count):
            mig = s.optional("nvmlDeviceGetMigDeviceHandleByIndex", handle, i)
            if mig is None:  # an empty slot: NOT_FOUND
                continue
            mem = s.required("nvmlDeviceGetMemoryInfo", mig)
            out.append(GPUSnapshot(
                index=index,
                uuid=_text(s.required("nvmlDeviceGetUUID", mig)),
                name=_text(s.optional("nvmlDeviceGetName", mig) or "MIG instance"),
                pci_bus_id="",
                memory_total_bytes=int(mem.total),
                memory_used_bytes=int(mem.used),
                utilization_gpu_pct=None,  # NVML has no per-instance utilization
                compute_mode=ComputeMode.DEFAULT,
                mig_enabled=False,
                processes=self.processes(mig),
                mig_parent_uuid=parent_uuid,
            ))
        return tuple(out)

    def processes(self, handle: Any) -> tuple[GPUProcess, ...]:
        """Compute and graphics processes, one entry per pid (context says which)."""
        return tuple(self._describe(pid, contexts, used)
                     for pid, (contexts, used) in self._merged(handle).items())

    def bare_processes(self, handle: Any) -> tuple[GPUProcess, ...]:
        """:meth:`processes` without looking any of them up: pid, memory, context."""
        return tuple(GPUProcess(pid, None, None, used, "compute+graphics" if len(contexts) == 2
                                else next(iter(contexts)))
                     for pid, (contexts, used) in self._merged(handle).items())

    def _merged(self, handle: Any) -> dict[int, tuple[set[str], int | None]]:
        merged: dict[int, tuple[set[str], int | None]] = {}
        for context in ("compute", "graphics"):
            for p in self.running(handle, context) or ():
                used = getattr(p, "usedGpuMemory", None)
                used = used if isinstance(used, int) and used != _ULLONG_MAX else None
                contexts, known = merged.setdefault(int(p.pid), (set(), used))
                contexts.add(context)
                if known is None and used is not None:
                    merged[int(p.pid)] = (contexts, used)
        return merged

    def running(self, handle: Any, context: str) -> list[Any] | None:
        """nvmlDeviceGet{Compute,Graphics}RunningProcesses, newest version the driver has.

        None when NVML cannot say (not supported, no permission, no symbol at all).
        """
        kind = "Compute" if context == "compute" else "Graphics"
        base = f"nvmlDeviceGet{kind}RunningProcesses"
        s = self.s
        suffixes = ("_v3", "_v2", "") if s.process_suffix is None else (s.process_suffix,)
        for suffix in suffixes:
            try:
                result = (self._running_v1(base, handle) if suffix == ""
                          else s.required(base + suffix, handle))
            except self.nvml.NVMLError_FunctionNotFound:
                continue
            except (self.nvml.NVMLError_NotSupported, self.nvml.NVMLError_NoPermission,
                    self.nvml.NVMLError_NotFound):
                return None
            s.process_suffix = suffix  # the driver's version: no failed lookups next time
            return list(result)
        return None

    def _running_v1(self, base: str, handle: Any) -> list[Any]:
        """The original C symbol with the v1 struct (pid, usedGpuMemory): drivers < 470.

        nvidia-ml-py has no Python wrapper left for it, so it is called through ctypes.
        """
        nvml = self.nvml
        lookup = getattr(nvml, "_nvmlGetFunctionPointer", None)
        if lookup is None:
            raise nvml.NVMLError(nvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        fn = lookup(base)
        count = ctypes.c_uint(0)
        ret = fn(handle, ctypes.byref(count), None)
        if ret == nvml.NVML_SUCCESS:
            return []
        if ret != nvml.NVML_ERROR_INSUFFICIENT_SIZE:
            raise nvml.NVMLError(ret)
        count.value = count.value * 2 + 5  # room for processes started meanwhile
        infos = (_ProcessInfoV1 * count.value)()
        ret = fn(handle, ctypes.byref(count), infos)
        if ret != nvml.NVML_SUCCESS:
            raise nvml.NVMLError(ret)
        return [SimpleNamespace(pid=infos[i].pid, usedGpuMemory=infos[i].usedGpuMemory)
                for i in range(count.value)]

    def _describe(self, pid: int, contexts: set[str], used: int | None) -> GPUProcess:
        context = "compute+graphics" if len(contexts) == 2 else next(iter(contexts))
        user, command, note = None, None, None
        stats: dict[str, Any] = {}
        if self.nested:
            # NVML's pid is the host's; a process here with that number is another one.
            note = NOT_IN_PID_NAMESPACE
        else:
            import psutil

            try:
                proc = psutil.Process(pid)
                with proc.oneshot():
                    user = proc.username()
                    command = " ".join(proc.cmdline()) or proc.name()
                    stats = _host_stats(proc)
            except psutil.NoSuchProcess:
                note = EXITED
            except (psutil.Error, OSError):
                pass  # another user's process we may not inspect: the pid is still right
        if command is None:
            # The driver knows the process by its host pid, from any namespace.
            name = _quiet(lambda: self.s.optional("nvmlSystemGetProcessName", pid), self.nvml)
            command = _text(name) if name else None
        return GPUProcess(pid=pid, user=user, command=command, used_memory_bytes=used,
                          context=context, note=note, **stats)


def _host_stats(proc: Any) -> dict[str, Any]:
    """Resident memory, CPU time and age of a process, each None when it cannot be read
    (another user's process under hidepid, a process that just ended)."""
    import time

    import psutil

    out: dict[str, Any] = {}
    for key, read in (("host_memory_rss_bytes", lambda: int(proc.memory_info().rss)),
                      ("cpu_time_s", lambda: _cpu_seconds(proc.cpu_times())),
                      ("elapsed_s", lambda: max(0.0, round(time.time() - proc.create_time(), 1)))):
        try:
            out[key] = read()
        except (psutil.Error, OSError):
            out[key] = None
    return out


def _cpu_seconds(times: Any) -> float:
    return round(float(times.user) + float(times.system), 2)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _const(nvml: Any, name: str, default: int) -> int:
    """An NVML constant from the bindings, or its C value when old bindings lack it."""
    return int(getattr(nvml, name, default))


def _quiet(query: Callable[[], Any], nvml: Any) -> Any:
    try:
        return query()
    except nvml.NVMLError:
        return None


def _failed_gpu(index: int, seen: dict[str, Any], exc: Exception) -> GPUSnapshot:
    """A GPU NVML could not read: shown with the error, refused by selection."""
    return GPUSnapshot(
        index=index,
        uuid=seen.get("uuid", f"GPU-unreadable-{index}"),
        name=seen.get("name", "?"),
        pci_bus_id=seen.get("pci_bus_id", ""),
        memory_total_bytes=0,
        memory_used_bytes=0,
        utilization_gpu_pct=None,
        compute_mode=ComputeMode.DEFAULT,
        mig_enabled=False,
        error=f"NVML: {exc}",
    )


def device_count() -> int:
    """How many GPUs NVML sees (raises NoGPUError without NVML)."""
    nvml = _default_session.ensure_init()
    try:
        return int(nvml.nvmlDeviceGetCount())
    except nvml.NVMLError as exc:
        raise NVMLError(f"NVML nvmlDeviceGetCount failed: {exc}") from exc
