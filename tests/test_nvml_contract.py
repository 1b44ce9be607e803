"""The real NVML backend meets the same contract as the simulated one (runs only on a GPU)."""

import os
import subprocess
import sys

import psutil
import pytest

from gpuwarden.inventory.nvml import NvmlBackend
from gpuwarden.inventory.snapshot import ComputeMode

pytestmark = pytest.mark.gpu


def test_nvml_snapshot_agrees_with_nvml_itself() -> None:
    import pynvml

    host = NvmlBackend().read_host()
    assert host.source == "nvml" and host.driver_version
    assert host.gpus, "NVML reports a GPU, so the snapshot must have one"
    modes = {0: ComputeMode.DEFAULT, 1: ComputeMode.EXCLUSIVE_THREAD, 2: ComputeMode.PROHIBITED,
             3: ComputeMode.EXCLUSIVE_PROCESS}
    pynvml.nvmlInit()
    try:
        assert len(host.gpus) == pynvml.nvmlDeviceGetCount()
        for gpu in host.gpus:
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            assert pynvml.nvmlDeviceGetIndex(handle) == gpu.index
            pci = pynvml.nvmlDeviceGetPciInfo(handle).busId
            assert gpu.pci_bus_id == (pci.decode() if isinstance(pci, bytes) else pci)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            assert gpu.memory_total_bytes == mem.total
            # used memory moves with other jobs: the same order of magnitude, not the same byte
            assert abs(gpu.memory_used_bytes - mem.used) < 2 * 1024**3
            assert gpu.compute_mode is modes[pynvml.nvmlDeviceGetComputeMode(handle)]
            nvml_pids = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            for proc in gpu.processes:  # still on the GPU, or ended between the two reads
                assert proc.pid in nvml_pids or not psutil.pid_exists(proc.pid)
    finally:
        pynvml.nvmlShutdown()


def test_reading_nvml_creates_no_cuda_context() -> None:
    """A process that reads every GPU through gpuwarden holds no CUDA context: NVML, asked from
    outside while it waits, does not list it, and it has not imported torch.

    Not "libcuda is not mapped": the first real-GPU run (H200, driver 580.159.04) showed
    nvmlInit itself mapping libcuda.so into the process; mapping the library creates no
    context (the same run's NVML listed none for that process)."""
    import pynvml

    code = ("import sys; from gpuwarden.inventory.nvml import NvmlBackend; "
            "NvmlBackend().read_host(); print('torch' in sys.modules, flush=True); "
            "sys.stdin.readline()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env={k: v for k, v in os.environ.items() if k != "GPUWARDEN_SIMULATE"})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "False"
        pynvml.nvmlInit()
        try:
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                pids = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
                assert child.pid not in pids, f"GPU {i} lists the reading process: a context"
        finally:
            pynvml.nvmlShutdown()
    finally:
        child.communicate("\n", timeout=30)


def test_cli_ls_json_on_real_gpu(capsys, monkeypatch) -> None:
    import json

    from gpuwarden.cli import main

    monkeypatch.delenv("GPUWARDEN_SIMULATE", raising=False)
    assert main(["ls", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["host"]["source"] == "nvml" and data["gpus"]
    print(json.dumps(data, indent=1))  # shown with -s in the GPU verification run


def test_the_real_driver_answers_a_process_query_version_and_graphics() -> None:
    import pynvml

    from gpuwarden.inventory import nvml as backend

    host = NvmlBackend().read_host()
    # Some version of the running-process query answered (v3 on drivers >= 510).
    assert backend._default_session.process_suffix in ("_v3", "_v2", "")
    for gpu in host.gpus:
        assert gpu.error is None, f"{gpu.label}: {gpu.error} (check nvidia-smi / dmesg)"
        for proc in gpu.processes:
            assert proc.context in ("compute", "graphics", "compute+graphics")
    pynvml.nvmlInit()
    try:
        for gpu in host.gpus:
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            try:
                graphics = {p.pid for p in pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle)}
            except pynvml.NVMLError:
                continue  # not supported on this board: nothing to compare
            listed = {p.pid for p in gpu.processes if "graphics" in p.context}
            for pid in listed - graphics:  # ended between the two reads, or a wrong listing
                assert not psutil.pid_exists(pid), (pid, graphics)
    finally:
        pynvml.nvmlShutdown()


def test_health_readings_of_a_real_gpu_agree_with_nvml(capsys, monkeypatch) -> None:
    import pynvml

    from gpuwarden.cli import main

    host = NvmlBackend().read_host()
    pynvml.nvmlInit()
    try:
        for gpu in host.gpus:
            if gpu.error is not None or gpu.mig_enabled:
                continue
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            h = gpu.health
            # every data-center and desktop board has a temperature sensor
            assert h.temperature_c is not None and 0 < h.temperature_c < 120
            real_temp = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
            assert abs(h.temperature_c - real_temp) <= 10  # moves between two reads
            if h.power_limit_w is not None:
                assert h.power_draw_w is None or 0 <= h.power_draw_w <= 2 * h.power_limit_w
            assert h.throttle_reasons is not None  # every driver since 352 answers it
            if h.sm_clock_max_mhz is not None and h.sm_clock_mhz is not None:
                assert 0 < h.sm_clock_mhz <= h.sm_clock_max_mhz + 100
    finally:
        pynvml.nvmlShutdown()
    monkeypatch.delenv("GPUWARDEN_SIMULATE", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    assert all(len(line) <= 80 for line in out.splitlines()), out
    print(out)  # shown with -s in the GPU verification run
    assert main(["ls", "-l"]) == 0
    print(capsys.readouterr().out)


def test_fabric_state_and_the_drivers_answer_on_a_real_gpu() -> None:
    import ctypes

    import pynvml

    from gpuwarden.doctor.probes import query_cuda_driver
    from gpuwarden.inventory.snapshot import FABRIC_STATES

    host = NvmlBackend().read_host()
    pynvml.nvmlInit()
    try:
        for gpu in host.gpus:
            if gpu.error is not None:
                continue
            info = pynvml.c_nvmlGpuFabricInfo_t()
            try:
                pynvml.nvmlDeviceGetGpuFabricInfo(pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid),
                                                  ctypes.byref(info))
                state = int(info.state)
            except pynvml.NVMLError:
                state = 0  # not supported: no fabric (PCIe boards, Ampere)
            expected = FABRIC_STATES[state - 1] if state else None
            assert gpu.health.fabric_state == expected, (gpu.label, state)
            print(gpu.label, gpu.name, "fabric:", gpu.health.fabric_state, gpu.health.fabric_error)
    finally:
        pynvml.nvmlShutdown()
    # The driver's own answer, from a subprocess: a GPU that runs this test suite initializes.
    answer = query_cuda_driver(dict(os.environ), host)
    assert answer is not None and answer.error is None, answer
    assert answer.name == "CUDA_SUCCESS" and answer.device_count, answer
    print(answer.describe())
