"""verify-gpu's NVML stage: what the real driver answers, set beside the simulated backend.

    python scripts/verify_gpu_nvml.py OUTDIR      (writes OUTDIR/nvml.json; prints one summary)

Four parts, each bounded and each recorded even when it fails:

1. **raw**: every NVML query gpuwarden's backend makes (and a few it could make: fabric
   state, MIG mode, persistence, virtualization), called directly through pynvml on every GPU,
   with its answer or the exact NVML error class. This is the ground truth the simulated
   backend and tests/fake_pynvml.py must imitate.
2. **timing**: NvmlBackend().read_host() cold (NVML's init included) and warm, and
   `gpuwarden ls --json` as a whole process: the "NVML snapshot time" benchmark.
3. **process**: a child that creates a CUDA context and holds 1 GiB, as NVML and gpuwarden
   list it (pid, context, memory against what torch reserved, user, command), and the GPU's
   used memory before/while/after.
4. **round trip**: the real snapshot written as a scenario (scenario_from_snapshot), read back
   through the simulated backend, and every field that came back different.

Read-only towards the card: queries only, nothing is set.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _short(value: Any, limit: int = 300) -> Any:
    """A JSON-able, bounded form of an NVML answer (ctypes structs as their fields)."""
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return [_short(v, limit) for v in value[:32]]
    fields = getattr(value, "_fields_", None)
    if fields:
        out = {}
        for entry in fields:
            name = entry[0]
            if name.startswith("_") or name == "version":
                continue
            try:
                out[name] = _short(getattr(value, name), limit)
            except Exception as exc:  # a field pynvml cannot convert
                out[name] = f"<{type(exc).__name__}>"
        return out
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _call(nvml: Any, name: str, *args: Any) -> dict[str, Any]:
    fn = getattr(nvml, name, None)
    if fn is None:
        return {"missing_in_bindings": True}
    t0 = time.perf_counter()
    try:
        value = fn(*args)
    except Exception as exc:  # NVMLError_* subclasses: their class names are the finding
        return {"error": type(exc).__name__, "message": str(exc)[:200],
                "ms": round((time.perf_counter() - t0) * 1e3, 3)}
    return {"value": _short(value), "ms": round((time.perf_counter() - t0) * 1e3, 3)}


def _const(nvml: Any, name: str, default: int) -> int:
    return int(getattr(nvml, name, default))


def raw_readings(nvml: Any) -> dict[str, Any]:
    system = {name: _call(nvml, name) for name in (
        "nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion",
        "nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2",
        "nvmlDeviceGetCount")}
    gpus = []
    count = system["nvmlDeviceGetCount"].get("value") or 0
    sm, mem_clock = _const(nvml, "NVML_CLOCK_SM", 1), _const(nvml, "NVML_CLOCK_MEM", 2)
    for index in range(int(count)):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        queries: list[tuple[str, tuple[Any, ...]]] = [
            ("nvmlDeviceGetName", ()), ("nvmlDeviceGetUUID", ()), ("nvmlDeviceGetPciInfo", ()),
            ("nvmlDeviceGetMemoryInfo", ()), ("nvmlDeviceGetUtilizationRates", ()),
            ("nvmlDeviceGetComputeMode", ()), ("nvmlDeviceGetMigMode", ()),
            ("nvmlDeviceGetMaxMigDeviceCount", ()), ("nvmlDeviceGetPersistenceMode", ()),
            ("nvmlDeviceGetVirtualizationMode", ()), ("nvmlDeviceGetCudaComputeCapability", ()),
            ("nvmlDeviceGetBoardPartNumber", ()), ("nvmlDeviceGetSerial", ()),
            ("nvmlDeviceGetTemperature", (_const(nvml, "NVML_TEMPERATURE_GPU", 0),)),
            ("nvmlDeviceGetFanSpeed", ()), ("nvmlDeviceGetPowerUsage", ()),
            ("nvmlDeviceGetEnforcedPowerLimit", ()), ("nvmlDeviceGetPowerManagementLimit", ()),
            ("nvmlDeviceGetCurrentClocksEventReasons", ()),
            ("nvmlDeviceGetCurrentClocksThrottleReasons", ()),
            ("nvmlDeviceGetPerformanceState", ()),
            ("nvmlDeviceGetClockInfo", (sm,)), ("nvmlDeviceGetClockInfo", (mem_clock,)),
            ("nvmlDeviceGetMaxClockInfo", (sm,)),
            ("nvmlDeviceGetEccMode", ()),
            ("nvmlDeviceGetTotalEccErrors", (_const(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                                             _const(nvml, "NVML_VOLATILE_ECC", 0))),
            ("nvmlDeviceGetRetiredPages", (0,)), ("nvmlDeviceGetRetiredPages", (1,)),
            ("nvmlDeviceGetRetiredPagesPendingStatus", ()), ("nvmlDeviceGetRemappedRows", ()),
            ("nvmlDeviceGetNvLinkState", (0,)),
            ("nvmlDeviceGetComputeRunningProcesses_v3", ()),
            ("nvmlDeviceGetComputeRunningProcesses", ()),
            ("nvmlDeviceGetGraphicsRunningProcesses_v3", ()),
            ("nvmlDeviceGetMPSComputeRunningProcesses_v3", ()),
        ]
        answers: dict[str, Any] = {}
        for name, args in queries:
            key = name if not args else f"{name}{list(args)}"
            answers[key] = _call(nvml, name, handle, *args)
        links = 0
        for link in range(_const(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            if "value" not in _call(nvml, "nvmlDeviceGetNvLinkState", handle, link):
                break
            links += 1
        answers["nvlinks_answering"] = links
        answers["fabric"] = fabric_info(nvml, handle)
        gpus.append(answers)
    return {"system": system, "gpus": gpus}


def fabric_info(nvml: Any, handle: Any) -> dict[str, Any]:
    """The NVSwitch fabric state (HGX/DGX): what CUDA_SYSTEM_NOT_READY comes from. The query
    fills a struct the caller passes (the versioned one first)."""
    import ctypes

    out: dict[str, Any] = {}
    for name, struct in (("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfoV_t"),
                         ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t")):
        cls = getattr(nvml, struct, None)
        if cls is None or getattr(nvml, name, None) is None:
            out[name] = {"missing_in_bindings": True}
            continue
        info = cls()
        answer = _call(nvml, name, handle, ctypes.byref(info))
        if "error" not in answer:
            answer["value"] = {"state": int(info.state), "status": int(info.status),
                               "cliqueId": int(info.cliqueId),
                               "healthMask": int(getattr(info, "healthMask", 0))}
        out[name] = answer
    return out


_MAPS_PROBE = r"""
import json, os, sys
def mapped():
    return sorted({line.split()[-1] for line in open("/proc/self/maps") if "libcuda" in line})
steps = {"pid": os.getpid(), "LD_PRELOAD": os.environ.get("LD_PRELOAD"),
         "modules_at_start": sorted(m for m in sys.modules if "torch" in m or "cuda" in m)}
steps["start"] = mapped()
import pynvml
steps["import pynvml"] = mapped()
pynvml.nvmlInit()
steps["nvmlInit"] = mapped()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
pynvml.nvmlDeviceGetMemoryInfo(handle)
steps["memory query"] = mapped()
pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
steps["process query"] = mapped()
from gpuwarden.inventory.nvml import NvmlBackend
NvmlBackend().read_host()
steps["read_host"] = mapped()
steps["modules_at_end"] = sorted(m for m in sys.modules if "torch" in m or "cuda" in m)
print(json.dumps(steps), flush=True)
sys.stdin.readline()
"""


def libcuda() -> dict[str, Any]:
    """Which step maps libcuda into a process that only reads NVML, and whether that process
    then holds a CUDA context (NVML lists it): mapping a library is not creating a context."""
    out: dict[str, Any] = {}
    for label, argv in (("with site", [sys.executable, "-c", _MAPS_PROBE]),):
        child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            line = child.stdout.readline() if child.stdout else ""
            try:
                steps = json.loads(line)
            except ValueError:
                out[label] = {"error": line + (child.stderr.read()[-1500:] if child.stderr else "")}
                continue
            import pynvml

            pynvml.nvmlInit()
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(0)
                pids = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            finally:
                pynvml.nvmlShutdown()
            steps["holds_a_cuda_context"] = steps["pid"] in pids
            out[label] = steps
        finally:
            if child.stdin:
                child.stdin.close()
            child.wait(30)
    return out


def timing(repeat: int = 20) -> dict[str, Any]:
    from gpuwarden.inventory.nvml import NvmlBackend

    backend = NvmlBackend()
    t0 = time.perf_counter()
    backend.read_host()
    cold = time.perf_counter() - t0
    warm = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        backend.read_host()
        warm.append(time.perf_counter() - t0)
    gpuwarden = Path(sys.executable).with_name("gpuwarden")
    ls = []
    for _ in range(5):
        t0 = time.perf_counter()
        done = subprocess.run([str(gpuwarden), "ls", "--json"], capture_output=True, text=True,
                              timeout=60, env={k: v for k, v in os.environ.items()
                                               if k != "GPUWARDEN_SIMULATE"})
        ls.append(time.perf_counter() - t0)
        if done.returncode != 0:
            return {"read_host_cold_ms": round(cold * 1e3, 2), "error":
                    f"gpuwarden ls --json exit {done.returncode}: {done.stderr[-500:]}"}
    smi = None
    if subprocess.run(["sh", "-c", "command -v nvidia-smi"], capture_output=True).returncode == 0:
        smi_times = []
        for _ in range(5):
            t0 = time.perf_counter()
            subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv"],
                           capture_output=True, timeout=60)
            smi_times.append(time.perf_counter() - t0)
        smi = round(statistics.median(smi_times) * 1e3, 1)
    return {"read_host_cold_ms": round(cold * 1e3, 2),
            "read_host_warm_median_ms": round(statistics.median(warm) * 1e3, 3),
            "read_host_warm_min_ms": round(min(warm) * 1e3, 3),
            "gpuwarden_ls_json_median_ms": round(statistics.median(ls) * 1e3, 1),
            "nvidia_smi_query_median_ms": smi}


_HOLDER = r"""
import sys, torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", torch.cuda.memory_reserved(), flush=True)
sys.stdin.readline()
"""


def process_shape() -> dict[str, Any]:
    """A CUDA context holding 1 GiB, as NVML and gpuwarden list it."""
    from gpuwarden.inventory.nvml import NvmlBackend

    backend = NvmlBackend()
    before = {g.index: g.memory_used_bytes for g in backend.read_host().gpus}
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["CUDA_VISIBLE_DEVICES"] = "0"
    child = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out: dict[str, Any] = {"pid": child.pid}
    try:
        line = child.stdout.readline() if child.stdout else ""
        if not line.startswith("ready"):
            out["error"] = f"the holder did not start: {line!r} " + (
                child.stderr.read()[-800:] if child.stderr else "")
            return out
        out["torch_reserved_bytes"] = int(line.split()[1])
        host = backend.read_host()
        gpu0 = host.gpus[0]
        out["gpu0_used_before_bytes"] = before.get(0)
        out["gpu0_used_while_bytes"] = gpu0.memory_used_bytes
        mine = [p for p in gpu0.processes if p.pid == child.pid]
        out["listed_by_gpuwarden"] = [vars(p) for p in mine]
        out["other_processes"] = [vars(p) for p in gpu0.processes if p.pid != child.pid]
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            out["nvml_compute_processes"] = _short(
                pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        finally:
            pynvml.nvmlShutdown()
        if mine and mine[0].used_memory_bytes is not None:
            out["context_overhead_bytes"] = mine[0].used_memory_bytes - out["torch_reserved_bytes"]
    finally:
        if child.stdin:
            child.stdin.close()
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the driver frees the context a moment after exit
        after = backend.read_host().gpus[0]
        if all(p.pid != child.pid for p in after.processes):
            break
        time.sleep(0.1)
    out["gpu0_used_after_bytes"] = after.memory_used_bytes
    out["still_listed_after_exit"] = any(p.pid == child.pid for p in after.processes)
    return out


def round_trip() -> dict[str, Any]:
    """The real snapshot written as a scenario and read back: each field that changed."""
    from gpuwarden.inventory.nvml import NvmlBackend
    from gpuwarden.inventory.simulated import parse_scenario, scenario_from_snapshot

    real = NvmlBackend().read_host()
    scenario = scenario_from_snapshot(real)
    back = parse_scenario(json.loads(json.dumps(scenario)))
    diffs: list[dict[str, Any]] = []
    for key in ("hostname", "driver_version", "cuda_driver_version"):
        if getattr(real, key) != getattr(back, key):
            diffs.append({"field": key, "nvml": getattr(real, key), "simulated": getattr(back, key)})
    for r, b in zip(real.gpus, back.gpus, strict=False):
        _diff(r.to_dict(), b.to_dict(), f"gpus[{r.index}]", diffs)
    if len(real.gpus) != len(back.gpus):
        diffs.append({"field": "gpus", "nvml": len(real.gpus), "simulated": len(back.gpus)})
    return {"scenario": scenario, "differences": diffs}


def _diff(a: Any, b: Any, where: str, out: list[dict[str, Any]]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            _diff(a.get(key), b.get(key), f"{where}.{key}", out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff(x, y, f"{where}[{i}]", out)
    elif a != b:
        out.append({"field": where, "nvml": _short(a), "simulated": _short(b)})


def main() -> int:
    outdir = Path(sys.argv[1])
    outdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"schema_version": 1}
    import pynvml

    from gpuwarden.inventory.nvml import _in_nested_pid_namespace

    result["nested_pid_namespace"] = _in_nested_pid_namespace()
    try:
        result["pynvml_version"] = __import__("importlib.metadata").metadata.version("nvidia-ml-py")
    except Exception:
        result["pynvml_version"] = None
    parts = (("raw", lambda: _with_nvml(pynvml, raw_readings)), ("libcuda", libcuda),
             ("timing", timing),
             ("process", process_shape), ("round_trip", round_trip))
    for name, part in parts:
        t0 = time.perf_counter()
        try:
            result[name] = part()
        except Exception:
            import traceback

            result[name] = {"error": traceback.format_exc()[-3000:]}
        result.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 2)
    (outdir / "nvml.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    failed = [name for name, _ in parts
              if isinstance(result[name], dict) and "error" in result[name]]
    print(json.dumps({"failed_parts": failed, "seconds": result["seconds"]}))
    return 1 if failed else 0


def _with_nvml(nvml: Any, fn: Any) -> Any:
    nvml.nvmlInit()
    try:
        return fn(nvml)
    finally:
        nvml.nvmlShutdown()


if __name__ == "__main__":
    sys.exit(main())
