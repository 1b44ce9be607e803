"""What the memory guard reads (a scenario's timelines, NVML's lean read), what the doctor says
of MPS, and the memory leases of launch, the pool and Dask workers (issue 41)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpuwarden.errors import ScenarioError, UsageError
from gpuwarden.inventory import Inventory
from gpuwarden.inventory.nvml import NvmlBackend
from gpuwarden.inventory.simulated import Live, SimulatedBackend, parse_scenario
from gpuwarden.lease import acquire, list_leases
from gpuwarden.mps import MpsState
from tests.fake_pynvml import MIB, FakeDriver, FakeGPU, FakeProcess

PY = sys.executable
GIB = 1024**3
GPU0 = "GPU-00000000-0000-0000-0000-0000000080a0"


def _host(processes: list[dict[str, Any]], used_mib: int = 500) -> dict[str, Any]:
    return {"gpus": [{"index": 0, "uuid": GPU0, "memory_total_mib": 81559,
                      "memory_used_mib": used_mib, "processes": processes}]}


# -- the scenario's timeline --------------------------------------------------------------------

def test_a_timeline_is_read_at_the_moment_of_each_read(tmp_path: Path) -> None:
    data = _host([{"pid": 4242, "user": "bob", "used_memory_mib": 1000, "timeline": [
        {"at_s": 2, "used_memory_mib": 5000}, {"at_s": 5, "used_memory_bytes": 7 * GIB},
        {"at_s": 9, "exited": True}]}])

    def at(elapsed_s: float) -> Any:
        live = Live(tmp_path, written_at=1000.0, now=1000.0 + elapsed_s)
        return parse_scenario(data, live=live).gpus[0]

    assert [p.used_memory_bytes for p in at(0.5).processes] == [1000 * MIB]
    assert [p.used_memory_bytes for p in at(2.0).processes] == [5000 * MIB]
    assert [p.used_memory_bytes for p in at(8.9).processes] == [7 * GIB]
    assert at(9.0).processes == ()
    # The GPU's used memory follows: memory_used plus what the moving processes use now.
    assert at(2.5).memory_used_bytes == 500 * MIB + 5000 * MIB
    assert at(10).memory_used_bytes == 500 * MIB


def test_a_pid_file_names_a_real_process_timed_from_its_start(tmp_path: Path) -> None:
    data = _host([{"pid_file": "job.pid", "used_memory_mib": 100,
                   "timeline": [{"at_s": 30, "used_memory_mib": 9000}]}])
    path = tmp_path / "host.json"
    path.write_text(json.dumps(data))
    backend = SimulatedBackend(path)
    assert backend.read_host().gpus[0].processes == ()  # no pid yet: nothing on the GPU
    child = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    try:
        # Popen returns once exec began; the kernel shows the new argv a moment later (an
        # empty cmdline before: the process is then named by its comm, 'python').
        deadline = time.monotonic() + 60
        while not psutil.Process(child.pid).cmdline() and time.monotonic() < deadline:
            time.sleep(0.01)
        (tmp_path / "job.pid").write_text(str(child.pid))
        [proc] = backend.read_host().gpus[0].processes
        assert (proc.pid, proc.used_memory_bytes) == (child.pid, 100 * MIB)
        assert proc.command is not None and "time.sleep(60)" in proc.command
        # The guard's read is the same path: the same process, the same memory.
        [device] = Inventory(backend, env={}).read_memory({GPU0})
        assert [(p.pid, p.used_memory_bytes) for p in device.processes] == \
            [(child.pid, 100 * MIB)]
    finally:
        child.kill()
        child.wait()
    assert backend.read_host().gpus[0].processes == ()  # it ended: NVML lists it no more


@pytest.mark.parametrize(("process", "message"), [
    ({"pid": 1, "timeline": [{"at_s": 3, "used_memory_mib": 1}, {"at_s": 1, "used_memory_mib": 2}]},
     "at_s must not decrease"),
    ({"pid": 1, "pid_file": "x.pid"}, "give pid or pid_file, not both"),
    ({"pid": 1, "timeline": [{"used_memory_mib": 1}]}, "timeline[0].at_s: missing"),
    ({"pid": 1, "timeline": [{"at_s": 1}]}, "used_memory_mib: missing"),
])
def test_a_bad_timeline_names_its_field(process: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_scenario(_host([process]))


# -- NVML: the guard's lean read ----------------------------------------------------------------

def test_nvml_read_memory_asks_three_queries_per_gpu_and_looks_nobody_up() -> None:
    driver = FakeDriver([
        FakeGPU(uuid="GPU-a", used_bytes=30 * 1024 * MIB,
                compute=[FakeProcess(os.getpid(), 20 * 1024 * MIB), FakeProcess(4242, None)],
                graphics=[FakeProcess(os.getpid(), 20 * 1024 * MIB)]),
        FakeGPU(uuid="GPU-b"),
    ])
    backend = NvmlBackend(driver.module())
    [device] = backend.read_memory({"GPU-a"})
    assert device.uuid == "GPU-a" and device.memory_used_bytes == 30 * 1024 * MIB
    assert [(p.pid, p.used_memory_bytes, p.context, p.command) for p in device.processes] == \
        [(os.getpid(), 20 * 1024 * MIB, "compute+graphics", None), (4242, None, "compute", None)]
    driver.calls.clear()
    backend.read_memory({"GPU-a"})  # the handles are known: memory and processes only
    assert sorted(driver.calls) == sorted(["nvmlDeviceGetMemoryInfo",
                                           "nvmlDeviceGetComputeRunningProcesses_v3",
                                           "nvmlDeviceGetGraphicsRunningProcesses_v3"])


# -- doctor: is MPS up -------------------------------------------------------------------------

def test_doctor_says_whether_mps_is_up() -> None:
    from tests.test_doctor_checks import doctor

    def mps(checks: Any) -> Any:
        return next(c for c in checks.checks if c.id == "mps")

    down = mps(doctor(read_mps=lambda env: MpsState(False, Path("/tmp/nvidia-mps"),
                                                     detail="no pid file")))
    assert down.status.value == "ok" and "MPS is not running" in down.what
    up = mps(doctor(read_mps=lambda env: MpsState(True, Path("/tmp/nvidia-mps"), 812)))
    assert up.status.value == "ok" and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in up.what
    from tests.test_doctor_checks import host_from

    exclusive = mps(doctor(read_mps=lambda env: MpsState(True, Path("/x"), 812),
                           read_host=host_from("example")))
    assert exclusive.status.value == "warn" and "GPU 2" in exclusive.what


# -- launch, pool, Dask workers ----------------------------------------------------------------

ONE_GPU = "import os, sys, time\n" \
    "open(sys.argv[1], 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])\n" \
    "open(sys.argv[2], 'w').write(str(os.getpid()))\ntime.sleep(20)"


@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.timeout(120)
def test_launch_mem_per_rank_stops_the_job_whose_rank_grows_past_it(scenario, lease_dir,
                                                                    tmp_path) -> None:
    data = json.loads((Path(__file__).parent / "scenarios" / "two_80.json").read_text())
    data["gpus"][0]["processes"] = [{"pid_file": "rank.pid", "used_memory_mib": 100,
                                     "timeline": [{"at_s": 1, "used_memory_mib": 30 * 1024}]}]
    host = tmp_path / "host.json"
    host.write_text(json.dumps(data))
    scenario(host)
    script = tmp_path / "train.py"
    script.write_text(ONE_GPU)
    done = subprocess.run([PY, "-m", "gpuwarden", "launch", "-n", "1", "--mem-per-rank",
                           "20GiB", "--mem-enforce", "stop", str(script),
                           str(tmp_path / "seen"), str(tmp_path / "rank.pid")],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 1, done.stderr
    assert (tmp_path / "seen").read_text() == "0"
    assert "leased 20.0 GiB of GPU(s) 0, one rank each" in done.stderr
    assert "error[LEASE_MEMORY_EXCEEDED]: stopped: pid " in done.stderr
    assert "uses 30.0 GiB of GPU 0: 10.0 GiB more than the 20.0 GiB" in done.stderr
    assert "rank 0: pid" in done.stderr and "stopped by gpuwarden" in done.stderr


def test_launch_mem_per_rank_is_refused_with_share_and_enforce_needs_it() -> None:
    from gpuwarden.launch.config import LaunchConfig

    with pytest.raises(UsageError, match="a memory lease is a share of one GPU per rank"):
        LaunchConfig("x.py", nproc=4, gpus=2, share=True, mem_per_rank_bytes=GIB)
    with pytest.raises(UsageError, match="--mem-enforce without --mem-per-rank"):
        LaunchConfig("x.py", mem_enforce="stop")


def test_a_pool_leases_its_workers_memory_and_caps_their_allocator(scenario, lease_dir) -> None:
    from gpuwarden.pool.executor import _fraction_for, _memory_per_worker
    from gpuwarden.pool.gpus import take_gpus, usable_gpu_count

    scenario("two_80")
    with pytest.raises(UsageError, match="mem_per_worker needs workers_per_gpu"):
        _memory_per_worker("6GiB", None)
    taken = take_gpus(1, 2, mem_per_worker_bytes=6 * GIB)
    try:
        [holder] = list_leases().holders
        assert [(c.index, c.memory_bytes) for c in holder.claims] == [(0, 12 * GIB)]
        # Another pool of the same kind still fits beside it, on the same GPU (best fit).
        assert usable_gpu_count("auto", workers_per_gpu=2, mem_per_worker_bytes=6 * GIB) == 2
        with acquire(mem="60GiB") as other:
            assert other.visible_devices == "0"
    finally:
        taken.release()
    # The allocator's cap leaves room for the CUDA context inside the worker's lease.
    assert _fraction_for(6 * GIB, taken.gpus) * taken.gpus[0].memory_total_bytes == \
        pytest.approx(6 * GIB - 512 * MIB)


def test_dask_workers_lease_memory_per_worker(scenario, lease_dir) -> None:
    pytest.importorskip("distributed")
    from gpuwarden.dask.workers import WorkerOptions, lease_for_workers

    scenario("two_80")
    leased = lease_for_workers(WorkerOptions("tcp://127.0.0.1:8786", 1, 2,
                                             mem_per_worker="10GiB"))
    try:
        [holder] = list_leases().holders
        assert [c.memory_bytes for c in holder.claims] == [20 * GIB]
        assert len(leased.gpus) == 1
    finally:
        leased.release()
    with pytest.raises(UsageError):
        WorkerOptions("tcp://127.0.0.1:8786", mem_per_worker="lots").check()


# -- a real GPU ----------------------------------------------------------------------------------

ALLOCATE = ("import os, sys, time, torch\n"
            "x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda')\n"
            "torch.cuda.synchronize()\n"
            "time.sleep(float(sys.argv[2]))")


@pytest.mark.gpu
@pytest.mark.usefixtures("real_host", "no_leftover_processes")
@pytest.mark.timeout(180)
def test_on_a_real_gpu_the_guard_names_a_process_past_its_lease(lease_dir) -> None:
    """Through NVML: a 256 MiB lease, a child that allocates 1 GiB (its CUDA context on top),
    named on the run's stderr while it holds it, and ended by --mem-enforce stop."""
    pytest.importorskip("torch")
    warn = subprocess.run([PY, "-m", "gpuwarden", "run", "--mem", "256MiB", "--", PY, "-c",
                           ALLOCATE, str(GIB), "6"], capture_output=True, text=True, timeout=150)
    assert warn.returncode == 0, warn.stderr
    assert "warning[LEASE_MEMORY_EXCEEDED]" in warn.stderr, warn.stderr
    started = time.monotonic()
    stop = subprocess.run([PY, "-m", "gpuwarden", "run", "--mem", "256MiB", "--mem-enforce",
                           "stop", "--", PY, "-c", ALLOCATE, str(GIB), "60"],
                          capture_output=True, text=True, timeout=150)
    assert stop.returncode in (128 + 15, 128 + 9), stop.stderr
    assert "error[LEASE_MEMORY_EXCEEDED]" in stop.stderr
    assert time.monotonic() - started < 60
