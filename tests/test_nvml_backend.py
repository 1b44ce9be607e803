"""The real NVML backend (inventory/nvml.py) against the drivers it meets: a double of pynvml
(tests/fake_pynvml.py) built from nvidia-ml-py's own classes, constants and structs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pynvml
import pytest

from gpuwarden.cli import main
from gpuwarden.errors import NoGPUError, NVMLError
from gpuwarden.inventory import Inventory
from gpuwarden.inventory import nvml as nvml_backend
from gpuwarden.inventory.nvml import EXITED, NOT_IN_PID_NAMESPACE, NvmlBackend
from gpuwarden.inventory.snapshot import ComputeMode
from gpuwarden.select import Constraints, Refusal, select
from tests.fake_pynvml import MIB, FakeDriver, FakeGPU, FakeHealth, FakeProcess

NO_SUCH_PID = 4_194_304 + 17  # above Linux's highest pid_max: never a live process
PROCESS_QUERIES = {f"nvmlDeviceGet{k}RunningProcesses{v}" for k in ("Compute", "Graphics")
                   for v in ("_v3", "_v2")}


def gpu(n: int, **kwargs: object) -> FakeGPU:
    return FakeGPU(uuid=f"GPU-{n:08x}-1111-2222-3333-444444444444",
                   bus_id=f"00000000:{n + 7:02x}:00.0", **kwargs)  # type: ignore[arg-type]


def read(driver: FakeDriver, *, nested: bool = False):  # type: ignore[no-untyped-def]
    return NvmlBackend(driver.module(), nested_pid_namespace=nested).read_host()


def test_the_double_only_defines_what_pynvml_has() -> None:
    module = FakeDriver([]).module()
    defined = [n for n in vars(module) if n.startswith(("nvml", "_nvml"))]
    assert defined and all(hasattr(pynvml, n) for n in defined), \
        [n for n in defined if not hasattr(pynvml, n)]
    # Its errors are pynvml's classes themselves: `except pynvml.NVMLError_GpuIsLost` sees them.
    assert module.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost
    assert module.NVML_ERROR_LIB_RM_VERSION_MISMATCH == pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
    assert isinstance(pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND),
                      module.NVMLError_FunctionNotFound)


def test_a_current_driver_gives_every_field() -> None:
    driver = FakeDriver([
        gpu(0, used_bytes=70 * 1024 * MIB, utilization=97,
            compute=[FakeProcess(os.getpid(), 69 * 1024 * MIB)]),
        gpu(1, compute_mode=pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS),
        gpu(2, compute_mode=pynvml.NVML_COMPUTEMODE_PROHIBITED),
        gpu(3, compute_mode=pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD),
    ], driver_version="550.54.15", cuda_version=12040)
    host = read(driver)
    assert (host.source, host.driver_version, host.cuda_driver_version) == \
        ("nvml", "550.54.15", "12.4")
    g0 = host.gpus[0]
    assert g0.uuid.startswith("GPU-00000000") and g0.pci_bus_id == "00000000:07:00.0"
    assert g0.memory_total_bytes == 80 * 1024 * MIB and g0.memory_used_bytes == 70 * 1024 * MIB
    assert g0.utilization_gpu_pct == 97 and g0.error is None
    me = g0.processes[0]
    assert (me.pid, me.used_memory_bytes, me.context, me.note) == \
        (os.getpid(), 69 * 1024 * MIB, "compute", None)
    assert me.command and "python" in me.command.lower() and me.user
    assert [g.compute_mode for g in host.gpus] == [
        ComputeMode.DEFAULT, ComputeMode.EXCLUSIVE_PROCESS, ComputeMode.PROHIBITED,
        ComputeMode.EXCLUSIVE_THREAD]
    assert "nvmlDeviceGetComputeRunningProcesses_v3" in driver.calls


@pytest.mark.parametrize(("missing", "used"), [
    (set(), "nvmlDeviceGetComputeRunningProcesses_v3"),
    ({"nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3"},
     "nvmlDeviceGetComputeRunningProcesses_v2"),
    (PROCESS_QUERIES, "nvmlDeviceGetComputeRunningProcesses"),  # v1, through ctypes
])
def test_running_processes_fall_back_v3_v2_v1(missing: set[str], used: str) -> None:
    driver = FakeDriver([gpu(0, compute=[FakeProcess(NO_SUCH_PID, 300 * MIB),
                                         FakeProcess(NO_SUCH_PID + 1, None)])],
                        missing=missing)
    backend = NvmlBackend(driver.module(), nested_pid_namespace=False)
    procs = backend.read_host().gpus[0].processes
    assert [(p.pid, p.used_memory_bytes) for p in procs] == \
        [(NO_SUCH_PID, 300 * MIB), (NO_SUCH_PID + 1, None)]
    assert used in driver.calls and not (set(driver.calls) & missing)
    # The version is decided once: a second read asks no missing symbol again.
    driver.missing.clear()
    driver.calls.clear()
    backend.read_host()
    assert used in driver.calls and not (set(driver.calls) & missing)


def test_old_bindings_without_v3_wrappers_use_v2() -> None:
    absent = {"nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3"}
    driver = FakeDriver([gpu(0, compute=[FakeProcess(NO_SUCH_PID)])], absent=absent)
    assert [p.pid for p in read(driver).gpus[0].processes] == [NO_SUCH_PID]
    assert "nvmlDeviceGetComputeRunningProcesses_v2" in driver.calls


def test_an_old_driver_without_mig_or_cuda_version_calls() -> None:
    driver = FakeDriver([gpu(0, mig_mode=1, migs=[gpu(9)])],
                        missing={"nvmlDeviceGetMigMode", "nvmlSystemGetCudaDriverVersion",
                                 *PROCESS_QUERIES},
                        driver_version="418.226.00")
    host = read(driver)
    assert host.cuda_driver_version is None and host.driver_version == "418.226.00"
    assert not host.gpus[0].mig_enabled and host.gpus[0].mig_devices == ()


def test_no_process_query_at_all_means_no_processes_known() -> None:
    driver = FakeDriver([gpu(0, compute=[FakeProcess(1)])], missing=PROCESS_QUERIES,
                        absent={"_nvmlGetFunctionPointer"})
    assert read(driver).gpus[0].processes == ()


def test_not_supported_utilization_is_unknown_not_zero(capsys: pytest.CaptureFixture[str]) -> None:
    driver = FakeDriver([gpu(0, utilization=None)])
    assert read(driver).gpus[0].utilization_gpu_pct is None
    assert main(["ls"], inventory=Inventory(NvmlBackend(driver.module()), env={})) == 0
    row = capsys.readouterr().out.splitlines()[2].split()
    assert "?" in row


@pytest.mark.parametrize("lost_at", ["handle", "uuid", "memory", "processes"])
def test_a_lost_gpu_is_shown_as_lost_and_never_chosen(lost_at: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    driver = FakeDriver([gpu(0, lost_at=lost_at), gpu(1)])
    host = read(driver)
    lost, ok = host.gpus
    assert lost.error == "NVML: GPU is lost" and lost.index == 0 and ok.error is None
    if lost_at not in ("handle", "uuid"):
        assert lost.uuid == driver.gpus[0].uuid  # what was read before the failure is kept
    verdicts = {v.gpu.index: v for v in select(host.gpus, Constraints(count=1)).verdicts}
    assert verdicts[0].refusal is Refusal.UNREADABLE and "GPU is lost" in verdicts[0].reason
    assert verdicts[1].accepted

    inventory = Inventory(NvmlBackend(driver.module()), env={})
    assert main(["ls"], inventory=inventory) == 0
    assert "unusable: NVML: GPU is lost" in capsys.readouterr().out
    assert main(["select", "-n", "1"], inventory=inventory) == 0
    assert capsys.readouterr().out.strip() == "1"
    assert main(["select", "-n", "2"], inventory=inventory) == 4
    assert "GPU 0: refused: unusable: NVML: GPU is lost" in capsys.readouterr().err


def test_a_host_wide_failure_is_an_nvml_error() -> None:
    driver = FakeDriver([gpu(0)], missing={"nvmlSystemGetDriverVersion"})
    with pytest.raises(NVMLError, match="NVML failed to list this host's GPUs: Function Not Found"):
        read(driver)


def test_mig_instances_processes_and_empty_slots() -> None:
    mig_a = gpu(10, name="NVIDIA A100-SXM4-80GB MIG 3g.40gb", total_bytes=40 * 1024 * MIB,
                compute=[FakeProcess(NO_SUCH_PID, 2 * 1024 * MIB)])
    mig_b = gpu(11, name="NVIDIA A100-SXM4-80GB MIG 3g.40gb", total_bytes=40 * 1024 * MIB)
    mig_a.uuid = "MIG-aaaaaaaa-1111-2222-3333-444444444444"
    mig_b.uuid = "MIG-bbbbbbbb-1111-2222-3333-444444444444"
    parent = gpu(0, mig_mode=pynvml.NVML_DEVICE_MIG_ENABLE, utilization=None,
                 migs=[mig_a, None, mig_b],
                 process_error=pynvml.NVML_ERROR_NO_PERMISSION)  # aggregate needs privileges
    host = read(FakeDriver([parent, gpu(1, mig_mode=0)]))
    p, plain = host.gpus
    assert p.mig_enabled and p.utilization_gpu_pct is None and p.processes == ()
    assert [m.uuid for m in p.mig_devices] == [mig_a.uuid, mig_b.uuid]
    a = p.mig_devices[0]
    assert a.mig_parent_uuid == p.uuid and a.cuda_id == mig_a.uuid and a.index == 0
    assert a.memory_total_bytes == 40 * 1024 * MIB and a.processes[0].pid == NO_SUCH_PID
    assert not plain.mig_enabled
    # CUDA_VISIBLE_DEVICES naming an instance reaches it through the same inventory.
    inventory = Inventory(NvmlBackend(FakeDriver([parent]).module()),
                          env={"CUDA_VISIBLE_DEVICES": mig_b.uuid})
    assert [g.uuid for g in inventory.read_visible()[1]] == [mig_b.uuid]


def test_graphics_processes_are_listed_and_marked() -> None:
    driver = FakeDriver([gpu(0, compute=[FakeProcess(NO_SUCH_PID, 500 * MIB)],
                             graphics=[FakeProcess(NO_SUCH_PID, 500 * MIB),
                                       FakeProcess(NO_SUCH_PID + 1, 40 * MIB)]),
                         gpu(1, graphics=[FakeProcess(NO_SUCH_PID + 2, 40 * MIB)])],
                        process_names={NO_SUCH_PID + 2: "/usr/lib/xorg/Xorg"})
    host = read(driver)
    both, graphics_only = host.gpus[0].processes
    assert (both.context, graphics_only.context) == ("compute+graphics", "graphics")
    xorg = host.gpus[1].processes[0]
    assert xorg.command == "/usr/lib/xorg/Xorg" and "graphics context" in xorg.describe()
    # A display server on a GPU does not make it busy for CUDA; a compute context does.
    verdicts = {v.gpu.index: v for v in select(host.gpus, Constraints(count=1)).verdicts}
    assert verdicts[1].accepted and verdicts[0].refusal is Refusal.IN_USE


def test_pids_of_another_pid_namespace_are_explained() -> None:
    driver = FakeDriver([gpu(0, compute=[FakeProcess(os.getpid()), FakeProcess(NO_SUCH_PID)])],
                        process_names={NO_SUCH_PID: "python train.py"})
    here, gone = read(driver, nested=False).gpus[0].processes
    assert here.user and here.note is None and gone.note == EXITED
    # In a container NVML's pids are the host's: a process here with the same number is
    # another one, so none is looked up; NVML's own name for it is still shown.
    mine, other = read(driver, nested=True).gpus[0].processes
    assert mine.user is None and mine.note == NOT_IN_PID_NAMESPACE
    assert other.command == "python train.py"
    assert other.describe() == f"pid {NO_SUCH_PID} (python train.py, {NOT_IN_PID_NAMESPACE})"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_a_new_pid_namespace_is_detected() -> None:
    code = ("from gpuwarden.inventory.nvml import _in_nested_pid_namespace as f; "
            "print(f())")
    outside = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout.strip()
    inside = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                             "-c", code], capture_output=True, text=True)
    if inside.returncode != 0:
        pytest.skip(f"cannot create a PID namespace here: {inside.stderr.strip()[:200]}")
    assert inside.stdout.strip() == "True"
    assert outside == str(os.readlink("/proc/self/ns/pid") != "pid:[4026531836]")


@pytest.mark.parametrize(("code", "message", "fix"), [
    (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "driver/library version mismatch", "reboot"),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "kernel driver is not loaded", "load the driver"),
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1", "GPUWARDEN_SIMULATE"),
    (pynvml.NVML_ERROR_NO_PERMISSION, "no permission", "/dev/nvidia"),
    (pynvml.NVML_ERROR_UNKNOWN, "NVML failed to initialize: Unknown Error", "GPUWARDEN_SIMULATE"),
])
def test_init_failures_are_one_line_exit_3(code: int, message: str, fix: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    driver = FakeDriver([gpu(0)], init_error=code)
    with pytest.raises(NoGPUError, match=message) as err:
        read(driver)
    assert fix in (err.value.fix or "") and isinstance(err.value.__cause__, pynvml.NVMLError)
    assert main(["ls"], inventory=Inventory(NvmlBackend(driver.module()))) == 3
    out = capsys.readouterr().err
    assert out.count("\n") == 1 and out.startswith("error[NVML_UNAVAILABLE]: ")


def test_nvml_is_initialized_once_and_shut_down(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = FakeDriver([gpu(0)])
    session = nvml_backend._Session(driver.module())
    monkeypatch.setattr(nvml_backend, "_default_session", session)
    assert nvml_backend.device_count() == 1
    NvmlBackend(nested_pid_namespace=False).read_host()
    assert driver.initialized == 1
    session.shutdown()
    session.shutdown()
    assert driver.initialized == 0 and driver.calls.count("nvmlShutdown") == 1
    driver.missing.add("nvmlDeviceGetCount_v2")
    with pytest.raises(NVMLError, match="nvmlDeviceGetCount failed"):
        nvml_backend.device_count()


def test_without_nvidia_ml_py_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.raises(NoGPUError, match="nvidia-ml-py package is not installed"):
        nvml_backend._Session().ensure_init()


def test_an_injected_inventory_reaches_ls_select_and_json(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPUWARDEN_SIMULATE and no driver here: only the inventory given to main() is read.
    monkeypatch.delenv("GPUWARDEN_SIMULATE", raising=False)
    driver = FakeDriver([gpu(0, compute=[FakeProcess(NO_SUCH_PID)]), gpu(1)])
    inventory = Inventory(NvmlBackend(driver.module(), nested_pid_namespace=True), env={})
    assert main(["ls", "--json"], inventory=inventory) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["host"]["source"] == "nvml" and len(data["gpus"]) == 2
    assert data["gpus"][0]["processes"][0]["note"] == NOT_IN_PID_NAMESPACE
    assert main(["select", "-n", "1", "--exclude", "1", "--allow-shared"], inventory=inventory) == 0
    assert capsys.readouterr().out.strip() == "0"


def test_edges_of_process_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    # v1 answering an error: the GPU's processes are unknown, the GPU is still read.
    driver = FakeDriver([gpu(0, compute=[FakeProcess(1)],
                             process_error=pynvml.NVML_ERROR_NO_PERMISSION)],
                        missing=PROCESS_QUERIES)
    assert read(driver).gpus[0].processes == ()
    # Memory known only from the graphics list; NVML failing to name a process.
    driver = FakeDriver([gpu(0, compute=[FakeProcess(NO_SUCH_PID, None)],
                             graphics=[FakeProcess(NO_SUCH_PID, 7 * MIB)])],
                        process_names={NO_SUCH_PID: pynvml.NVML_ERROR_UNKNOWN},
                        absent={"nvmlDeviceGetUtilizationRates"})
    g = read(driver).gpus[0]
    assert g.processes[0].used_memory_bytes == 7 * MIB and g.processes[0].command is None
    assert g.utilization_gpu_pct is None  # bindings without the call
    # Another user's process we may not inspect: the pid stays, without a note.

    def denied(pid: int) -> psutil.Process:
        raise psutil.AccessDenied(pid)

    monkeypatch.setattr(psutil, "Process", denied)
    proc = read(FakeDriver([gpu(0, compute=[FakeProcess(1)])])).gpus[0].processes[0]
    assert (proc.pid, proc.user, proc.note) == (1, None, None)


def test_namespace_check_without_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_proc(path: str) -> str:
        raise FileNotFoundError(path)

    monkeypatch.setattr(os, "readlink", no_proc)
    assert nvml_backend._in_nested_pid_namespace() is False


def test_the_default_session_uses_the_installed_pynvml() -> None:
    assert nvml_backend._Session().nvml is pynvml


def test_a_gpu_lost_between_the_two_v1_calls_is_lost() -> None:
    driver = FakeDriver([gpu(0, compute=[FakeProcess(1)], lost_between_calls=True), gpu(1)],
                        missing=PROCESS_QUERIES)
    lost, ok = read(driver).gpus
    assert lost.error == "NVML: GPU is lost" and ok.error is None


def test_the_doctor_fails_a_lost_gpu_with_its_code(capsys: pytest.CaptureFixture[str]) -> None:
    inventory = Inventory(NvmlBackend(FakeDriver([gpu(0), gpu(1, lost_at="memory")]).module(),
                                      nested_pid_namespace=False), env={})
    assert main(["doctor", "--json"], inventory=inventory) == 1
    driver = {c["id"]: c for c in json.loads(capsys.readouterr().out)["checks"]}["driver"]
    assert (driver["status"], driver["code"]) == ("fail", "GPU_HARDWARE_FAULT")
    assert "GPU 1 (NVML: GPU is lost)" in driver["what"]


# ---- health: temperature, power, clocks and their reasons, ECC, retired memory, NVLink ------

def test_health_readings_come_in_their_units() -> None:
    sick = FakeHealth(temperature_c=88, power_mw=301_500, clock_reasons=0x4 | 0x40 | 0x1,
                      ecc_uncorrected=3, retired_dbe=[0x1000, 0x2000], retired_pending=1,
                      nvlink_states=[1, 1, 0, 1])
    driver = FakeDriver([gpu(0, health=sick), gpu(1)])
    host = read(driver)
    h = host.gpus[0].health
    assert (h.temperature_c, h.fan_speed_pct, h.power_draw_w, h.power_limit_w) == (88, 30, 301.5, 400.0)
    assert (h.performance_state, h.sm_clock_mhz, h.sm_clock_max_mhz, h.memory_clock_mhz) == \
        (0, 1410, 1980, 1593)
    assert h.throttle_reasons == ("gpu_idle", "sw_power_cap", "hw_thermal_slowdown")
    assert h.slowdowns == ("sw_power_cap", "hw_thermal_slowdown")
    assert (h.ecc_errors_uncorrected, h.retired_pages, h.memory_repair_pending) == (3, 2, True)
    assert (h.nvlinks_active, h.nvlinks_total) == (3, 4)
    assert h.problems() == ("3 uncorrectable ECC error(s)", "memory repair pending a GPU reset",
                            "slowed: sw_power_cap, hw_thermal_slowdown", "1 of 4 NVLinks down")
    healthy = host.gpus[1].health
    assert healthy.problems() == () and healthy.nvlinks_total is None  # no NVLink: unknown
    assert "nvmlDeviceGetCurrentClocksEventReasons" in driver.calls


def test_health_on_old_drivers_and_boards_without_sensors() -> None:
    from tests.fake_pynvml import ERROR

    # Old bindings: no "event reasons" name, no enforced limit; a board whose power sensor
    # answers UNKNOWN, without ECC, retired pages or a fan; a driver lacking the row remapper.
    bare = FakeHealth(power_mw=ERROR + pynvml.NVML_ERROR_UNKNOWN,
                      fan_pct=ERROR + pynvml.NVML_ERROR_NOT_SUPPORTED,
                      ecc_uncorrected=ERROR + pynvml.NVML_ERROR_NOT_SUPPORTED,
                      retired_sbe=ERROR + pynvml.NVML_ERROR_NOT_SUPPORTED,  # type: ignore[arg-type]
                      retired_dbe=ERROR + pynvml.NVML_ERROR_NOT_SUPPORTED,  # type: ignore[arg-type]
                      retired_pending=ERROR + pynvml.NVML_ERROR_NOT_SUPPORTED,
                      pstate=32, clock_reasons=0x200)
    driver = FakeDriver([gpu(0, health=bare)], missing={"nvmlDeviceGetRemappedRows"},
                        absent={"nvmlDeviceGetCurrentClocksEventReasons",
                                "nvmlDeviceGetEnforcedPowerLimit"})
    g = read(driver).gpus[0]
    h = g.health
    assert g.error is None and h.temperature_c == 41
    assert (h.power_draw_w, h.fan_speed_pct, h.ecc_errors_uncorrected) == (None, None, None)
    assert (h.retired_pages, h.memory_repair_pending, h.performance_state) == (None, None, None)
    assert h.power_limit_w == 400.0  # from the older nvmlDeviceGetPowerManagementLimit
    assert h.throttle_reasons == ("0x200",)  # a reason newer than this table: shown, not lost
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" in driver.calls


def test_the_nvlink_fabric_state_is_read_through_the_callers_struct() -> None:
    # An HGX H100 whose Fabric Manager is down (in progress), one that never started, one
    # registered, one whose registration failed, and a GPU outside any fabric.
    driver = FakeDriver([
        gpu(0, health=FakeHealth(fabric_state=pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS)),
        gpu(1, health=FakeHealth(fabric_state=pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED)),
        gpu(2, health=FakeHealth(fabric_state=pynvml.NVML_GPU_FABRIC_STATE_COMPLETED)),
        gpu(3, health=FakeHealth(fabric_state=pynvml.NVML_GPU_FABRIC_STATE_COMPLETED,
                                 fabric_status=pynvml.NVML_ERROR_TIMEOUT)),
        gpu(4),
    ])
    hs = [g.health for g in read(driver).gpus]
    assert [(h.fabric_state, h.fabric_ready) for h in hs] == [
        ("in_progress", False), ("not_started", False), ("completed", True),
        ("completed", False), (None, None)]
    assert hs[3].fabric_error is not None and hs[3].fabric_error.startswith("NVML: ")
    assert (hs[0].fabric_error, hs[2].fabric_error, hs[4].fabric_error) == (None, None, None)
    assert hs[0].problems() == ("NVLink fabric in_progress: CUDA will not start (Fabric Manager)",)
    assert hs[3].problems()[0].startswith("NVLink fabric registration failed: NVML: ")
    assert hs[2].problems() == hs[4].problems() == ()
    assert driver.calls.count("nvmlDeviceGetGpuFabricInfo") == 5


def test_bindings_without_the_fabric_struct_or_function_leave_the_state_unknown() -> None:
    in_progress = FakeHealth(fabric_state=pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS)
    for absent in ({"c_nvmlGpuFabricInfo_t"}, {"nvmlDeviceGetGpuFabricInfo"}):
        driver = FakeDriver([gpu(0, health=in_progress)], absent=absent)
        g = read(driver).gpus[0]
        assert g.error is None and g.health.fabric_state is None, absent
        assert "nvmlDeviceGetGpuFabricInfo" not in driver.calls
    # A driver older than the symbol (525): FUNCTION_NOT_FOUND is "unknown" too.
    driver = FakeDriver([gpu(0, health=in_progress)], missing={"nvmlDeviceGetGpuFabricInfo"})
    assert read(driver).gpus[0].health.fabric_state is None


def test_a_gpu_lost_while_its_health_is_read_is_lost() -> None:
    driver = FakeDriver([gpu(0, lost_at="health"), gpu(1)])
    host = read(driver)
    assert host.gpus[0].error == "NVML: GPU is lost" and host.gpus[1].error is None


def test_a_process_on_a_gpu_gets_its_host_memory_cpu_time_and_age() -> None:
    driver = FakeDriver([gpu(0, compute=[FakeProcess(os.getpid()), FakeProcess(NO_SUCH_PID)])])
    me, gone = read(driver).gpus[0].processes
    assert me.host_memory_rss_bytes and me.host_memory_rss_bytes > 10 * MIB
    assert me.cpu_time_s is not None and me.cpu_time_s > 0
    assert me.elapsed_s is not None and me.elapsed_s >= 0
    assert gone.note == EXITED and gone.host_memory_rss_bytes is None


def test_host_stats_a_process_hides_are_unknown() -> None:
    import psutil

    class Hidden:  # another user's process under hidepid: its pid answers, its details do not
        def memory_info(self) -> object:
            raise psutil.AccessDenied(1)

        def cpu_times(self) -> object:
            raise psutil.AccessDenied(1)

        def create_time(self) -> float:
            raise psutil.NoSuchProcess(1)

    assert nvml_backend._host_stats(Hidden()) == {
        "host_memory_rss_bytes": None, "cpu_time_s": None, "elapsed_s": None}


def test_the_h200_of_the_first_real_run_reads_alike_through_the_driver_double_and_the_scenario(
        ) -> None:
    """What the lent H200 answered (docs/gpu-report.md), set up twice: as the driver double
    answering what NVML answered (fan, retired pages, their pending status and NVLink refused
    with NOT_SUPPORTED, MIG mode disabled, 615.06 MiB used with no process), and as the scenario
    captured from that card. Both must give gpuwarden the same GPU, field for field."""
    from gpuwarden.inventory.simulated import SimulatedBackend
    from tests.conftest import SCENARIOS
    from tests.fake_pynvml import ERROR

    refused = ERROR + pynvml.NVML_ERROR_NOT_SUPPORTED
    h200 = FakeGPU(
        uuid="GPU-fade5c7c-782c-0525-3fcc-8cee7dcdacc4", name="NVIDIA H200",
        bus_id="00000000:00:06.0", total_bytes=150_754_820_096, used_bytes=644_939_776,
        utilization=0, mig_mode=pynvml.NVML_DEVICE_MIG_DISABLE,
        health=FakeHealth(temperature_c=35, fan_pct=refused, power_mw=113_100,
                          power_limit_mw=700_000, pstate=0, sm_clock_mhz=1980,
                          sm_clock_max_mhz=1980, mem_clock_mhz=3201, clock_reasons=0,
                          ecc_uncorrected=0, retired_sbe=refused, retired_dbe=refused,  # type: ignore[arg-type]
                          retired_pending=refused, remapped_rows=(0, 0, 0, 0),
                          nvlink_states=[]))  # no link: NOT_SUPPORTED, as the H200 answered
    through_nvml = read(FakeDriver([h200], driver_version="580.159.04", cuda_version=13000))
    captured = SimulatedBackend(SCENARIOS / "h200-verified.json").read_host()
    assert (through_nvml.driver_version, through_nvml.cuda_driver_version) == ("580.159.04", "13.0")
    assert through_nvml.gpus == captured.gpus
    gpu0 = captured.gpus[0]
    assert gpu0.memory_used_bytes % MIB and gpu0.health.fan_speed_pct is None
    assert gpu0.health.retired_pages is None and gpu0.health.nvlinks_total is None
