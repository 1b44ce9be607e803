"""Every doctor check on fakes: simulated hosts (tests/scenarios), a fake torch, fake probes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwarden import net
from gpuwarden.doctor import Options, Probes, Report, Status, run_doctor
from gpuwarden.doctor.host_checks import check_nofile, check_start_method
from gpuwarden.doctor.net_checks import check_socket_ifname
from gpuwarden.doctor.probes import CudaDriverInfo, ShmInfo, TorchInfo, query_cuda_driver
from gpuwarden.errors import NoGPUError
from gpuwarden.inventory.simulated import SimulatedBackend
from gpuwarden.inventory.snapshot import HostSnapshot
from gpuwarden.units import GIB, MIB

SCENARIOS = Path(__file__).parent / "scenarios"

CUDA_TORCH = TorchInfo(True, version="2.5.1+cu121", cuda="12.1", cuda_compiled=True,
                       nccl_version="2.21.5", runtime_device_count=2, python="/usr/bin/python3")
CPU_TORCH = TorchInfo(True, version="2.13.0+cpu", cuda=None, cuda_compiled=False,
                      python="/usr/bin/python3")
NO_TORCH = TorchInfo(False, error="ModuleNotFoundError: No module named 'torch'")

# What libcuda answers on a healthy host, and on one whose Fabric Manager is down.
DRIVER_OK = CudaDriverInfo(result=0, name="CUDA_SUCCESS", message="no error", device_count=2)
DRIVER_NOT_READY = CudaDriverInfo(result=802, name="CUDA_ERROR_SYSTEM_NOT_READY",
                                  message="system not yet initialized")
# torch's warning when cudaGetDeviceCount meets that host (its runtime's wording)
TORCH_802 = ("CUDA initialization: Unexpected error from cudaGetDeviceCount(). Did you run some "
             "cuda functions before calling NumCudaDevices() that might have already set an "
             "error? Error 802: system not yet initialized (Triggered internally at "
             "../c10/cuda/CUDAFunctions.cpp:109.)")


def driver_of(answer: CudaDriverInfo | None) -> Callable[[Mapping[str, str], HostSnapshot],
                                                         CudaDriverInfo | None]:
    """A simulated host answers from its scenario (the real function); an NVML one *answer*."""
    return lambda env, host: answer if host.source == "nvml" else query_cuda_driver(env, host)


IFACES = {"lo": ("127.0.0.1", "::1"), "eth0": ("10.0.0.5", "fe80::1"), "ib0": ("192.168.7.5",)}


def host_from(name: str) -> Callable[[Mapping[str, str]], HostSnapshot]:
    return lambda env: SimulatedBackend(SCENARIOS / f"{name}.json").read_host()


def no_nvml(env: Mapping[str, str]) -> HostSnapshot:
    raise NoGPUError("no NVIDIA driver: the NVML library (libnvidia-ml.so.1) is not installed",
                     why="GPU state is read through NVML, which comes with the driver")


def resolver(table: Mapping[str, tuple[str, ...]]) -> Callable[[str], net.Resolution]:
    def resolve(host: str) -> net.Resolution:
        addrs = table.get(host, ())
        return net.Resolution(host, addrs, None if addrs else "[Errno -2] Name or service not known",
                              0.001)
    return resolve


def fake_probes(**over: object) -> Probes:
    base = Probes(
        read_host=host_from("doctor_idle"),
        query_torch=lambda env: CUDA_TORCH,
        query_cuda_driver=driver_of(DRIVER_OK),
        resolve=resolver({"node1": ("10.0.0.5",), "master.example": ("10.0.0.9",),
                          "localhost": ("127.0.0.1",)}),
        connect_tcp=lambda h, a, p: net.ProbeResult(h, p, net.ProbeStatus.OK, "connected", 0.001),
        port_is_free=lambda port: True,
        interfaces=lambda: dict(IFACES),
        source_address_for=lambda addr: "10.0.0.5",
        read_shm=lambda: ShmInfo("/dev/shm", 32 * GIB, 32 * GIB),
        read_nofile=lambda: (65536, 65536),
        hostname=lambda: "node1",
    )
    return replace(base, **over)  # type: ignore[arg-type]


def doctor(env: Mapping[str, str] | None = None, nproc: int | None = None,
           master_addr: str | None = None, master_port: int | None = None, nnodes: int = 1,
           **probes: object) -> Report:
    env = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", **(env or {})}
    opts = Options(nproc=nproc, master_addr=master_addr, master_port=master_port, nnodes=nnodes,
                   env=env)
    return run_doctor(opts, fake_probes(**probes))


# --- a healthy host -------------------------------------------------------------------------

def test_healthy_host_has_no_warning_and_exits_0() -> None:
    report = doctor(nproc=2)
    bad = [(c.id, c.status.value, c.what) for c in report.checks
           if c.status in (Status.WARN, Status.FAIL)]
    assert bad == []
    assert report.exit_code == 0
    assert report.by_id("nproc").what.startswith("2 rank(s) fit on GPUs of their own: 0,1")
    assert {c.id for c in report.checks} >= {
        "driver", "cuda_system_ready", "torch_cuda_build", "cuda_runtime", "visible_devices", "compute_mode",
        "gpu_memory", "mig", "nproc", "shm_dataloader", "shm_nccl", "open_files",
        "nvml_cuda_check", "start_method", "hostname", "master_addr", "master_port",
        "nccl_socket_ifname", "gloo_socket_ifname"}


# --- the simulated example host ---------------------------------------------------------------

def test_example_scenario_names_bob_carol_and_the_prohibited_gpu() -> None:
    report = doctor(read_host=host_from("example"), nproc=2)
    mode = report.by_id("compute_mode")
    assert mode.status is Status.WARN and mode.code == "CUDA_DEVICES_BUSY"
    assert "GPU 2: exclusive_process, held by pid 5151 (carol, python eval.py)" in mode.evidence
    assert any(e.startswith("GPU 3: prohibited") for e in mode.evidence)
    memory = report.by_id("gpu_memory")
    assert memory.status is Status.WARN and memory.code == "CUDA_OOM"
    assert any(e.startswith("GPU 0:") and "pid 4242 (bob, python train_llm.py)" in e
               for e in memory.evidence)
    nproc = report.by_id("nproc")
    # GPU 1 alone is idle; GPU 0 runs bob's job, which `gpuwarden launch -n 2` refuses too
    assert nproc.status is Status.FAIL and "1 of 4 visible are usable" in nproc.what
    assert "1 more run other jobs' processes" in nproc.what
    assert report.exit_code == 1


def test_example_scenario_fails_when_more_ranks_than_usable_gpus() -> None:
    report = doctor(read_host=host_from("example"), nproc=3)
    nproc = report.by_id("nproc")
    assert nproc.status is Status.FAIL and "1 of 4 visible are usable" in nproc.what
    assert nproc.fix and "--nproc 1 or fewer" in nproc.fix
    assert report.exit_code == 1


def test_every_gpu_refused_fails_compute_mode() -> None:
    report = doctor(read_host=host_from("doctor_refused"), nproc=1)
    mode = report.by_id("compute_mode")
    assert mode.status is Status.FAIL
    assert "GPU 1: exclusive_process, held by pid 777 (dave, python serve.py)" in mode.evidence
    assert report.by_id("nproc").status is Status.FAIL


def test_compute_mode_only_counts_visible_gpus() -> None:
    report = doctor(read_host=host_from("example"), env={"CUDA_VISIBLE_DEVICES": "1"})
    assert report.by_id("compute_mode").status is Status.OK
    assert report.by_id("gpu_memory").status is Status.OK


# --- driver, torch build, runtime ------------------------------------------------------------

def test_no_driver_warns_for_cpu_torch_and_fails_for_cuda_torch() -> None:
    cpu = doctor(read_host=no_nvml, query_torch=lambda env: CPU_TORCH)
    assert cpu.by_id("driver").status is Status.WARN
    assert cpu.by_id("driver").why == "GPU state is read through NVML, which comes with the driver"
    assert cpu.by_id("compute_mode").status is Status.SKIP
    assert cpu.by_id("nproc").status is Status.SKIP
    gpu = doctor(read_host=no_nvml, query_torch=lambda env: CUDA_TORCH)
    assert gpu.by_id("driver").status is Status.FAIL and gpu.exit_code == 1


@pytest.mark.parametrize(("built", "driver_cuda", "status"), [
    ("12.1", "12.2", Status.OK),
    ("12.8", "12.2", Status.WARN),   # minor-version compatibility
    ("13.0", "12.4", Status.FAIL),   # a newer major never starts
    ("11.8", "13.0", Status.OK),
])
def test_torch_cuda_build_against_driver(built: str, driver_cuda: str, status: Status) -> None:
    def host(env: Mapping[str, str]) -> HostSnapshot:
        return replace(host_from("doctor_idle")(env), cuda_driver_version=driver_cuda)

    report = doctor(read_host=host, query_torch=lambda env: replace(CUDA_TORCH, cuda=built))
    check = report.by_id("torch_cuda_build")
    assert check.status is status and check.code == "CUDA_DRIVER_TOO_OLD"
    if status is Status.FAIL:
        assert check.fix and "12.4 or older" in check.fix


@pytest.mark.parametrize("warning", [
    "CUDA initialization: The NVIDIA driver on your system is too old (found version 11040).",
    # the runtime's enum name: explain's knowledge base knows it, a hand-kept list did not
    "CUDA initialization: cudaErrorInsufficientDriver",
])
def test_runtime_warning_about_old_driver_fails_torch_build(warning: str) -> None:
    torch = replace(CUDA_TORCH, runtime_device_count=0, runtime_warnings=(warning,))
    check = doctor(query_torch=lambda env: torch).by_id("torch_cuda_build")
    assert check.status is Status.FAIL and check.why == warning


def test_torch_missing_or_cpu_only() -> None:
    missing = doctor(query_torch=lambda env: NO_TORCH)
    assert missing.by_id("torch_cuda_build").status is Status.WARN
    assert missing.by_id("cuda_runtime").status is Status.SKIP
    cpu = doctor(query_torch=lambda env: CPU_TORCH)
    assert cpu.by_id("torch_cuda_build").status is Status.SKIP
    runtime = cpu.by_id("cuda_runtime")
    assert runtime.status is Status.WARN and "CPU-only build" in runtime.what


def test_runtime_seeing_no_gpu_on_a_real_nvml_host_fails() -> None:
    def nvml_host(env: Mapping[str, str]) -> HostSnapshot:
        return replace(host_from("doctor_idle")(env), source="nvml")

    warning = "CUDA initialization: CUDA driver initialization failed, you might not have a CUDA gpu."
    torch = replace(CUDA_TORCH, runtime_device_count=0, runtime_warnings=(warning,))
    check = doctor(read_host=nvml_host, query_torch=lambda env: torch).by_id("cuda_runtime")
    assert check.status is Status.FAIL and check.why == warning


@pytest.mark.parametrize("cvd", ["-1", ""])
def test_hidden_gpus_fail_visible_devices_once_and_skip_the_runtime(cvd: str) -> None:
    def nvml_host(env: Mapping[str, str]) -> HostSnapshot:
        return replace(host_from("doctor_idle")(env), source="nvml")

    torch = replace(CUDA_TORCH, runtime_device_count=0)
    report = doctor(read_host=nvml_host, query_torch=lambda env: torch,
                    env={"CUDA_VISIBLE_DEVICES": cvd})
    assert report.by_id("visible_devices").status is Status.FAIL
    runtime = report.by_id("cuda_runtime")
    assert runtime.status is Status.SKIP and runtime.what == "visible_devices hides every GPU"


# --- CUDA_VISIBLE_DEVICES and MIG ------------------------------------------------------------

@pytest.mark.parametrize(("cvd", "status", "fragment"), [
    (None, Status.OK, "2 GPUs of 2 visible"),
    ("1", Status.OK, "1 GPU of 2 visible"),
    ("1,7,0", Status.WARN, "entry '7' is past the last GPU"),
    ("", Status.FAIL, "leaves no GPU visible"),
    ("-1", Status.FAIL, "leaves no GPU visible"),
    ("0,0", Status.FAIL, "names the same device twice"),
])
def test_visible_devices(cvd: str | None, status: Status, fragment: str) -> None:
    env = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    check = doctor(env=env).by_id("visible_devices")
    assert check.status is status and check.code == "CUDA_NO_DEVICE"
    assert fragment in f"{check.what} {check.why}"


def test_mig_enabled_gpus_warn_and_named_instances_are_ok() -> None:
    report = doctor(read_host=host_from("doctor_mig"))
    mig = report.by_id("mig")
    assert mig.status is Status.WARN
    assert any("MIG-11111111-0000-0000-0000-000000000000" in e for e in mig.evidence)
    assert any(e.startswith("GPU 1: MIG on, instances: none configured") for e in mig.evidence)
    named = doctor(read_host=host_from("doctor_mig"),
                   env={"CUDA_VISIBLE_DEVICES": "MIG-22222222-0000-0000-0000-000000000000"})
    assert named.by_id("mig").status is Status.OK
    assert named.by_id("nproc").status is Status.SKIP


# --- /dev/shm, open files, fork advice --------------------------------------------------------

@pytest.mark.parametrize(("total", "free", "status"), [
    (32 * GIB, 32 * GIB, Status.OK),
    (64 * MIB, 64 * MIB, Status.WARN),       # Docker's default
    (8 * GIB, 20 * MIB, Status.FAIL),        # big but nearly full
])
def test_shm_thresholds(total: int, free: int, status: Status) -> None:
    report = doctor(read_shm=lambda: ShmInfo("/dev/shm", total, free))
    assert report.by_id("shm_dataloader").status is status
    assert report.by_id("shm_nccl").status is status  # two GPUs: NCCL needs it too


def test_shm_missing_fails_and_nccl_is_skipped_with_one_gpu() -> None:
    report = doctor(read_shm=lambda: None, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert report.by_id("shm_dataloader").status is Status.FAIL
    assert report.by_id("shm_nccl").status is Status.SKIP


def test_open_files_limit() -> None:
    low = check_nofile((1024, 1048576))
    assert low.status is Status.WARN and low.fix and "ulimit -n 1048576" in low.fix
    stuck = check_nofile((1024, 1024))
    assert stuck.fix and "admin" in stuck.fix and "file_system" in stuck.fix
    assert check_nofile((-1, -1)).status is Status.OK
    assert check_nofile((4096, 4096)).status is Status.OK


@pytest.mark.parametrize(("value", "status"), [(None, Status.WARN), ("1", Status.OK),
                                               ("true", Status.WARN)])
def test_nvml_based_cuda_check_variable(value: str | None, status: Status) -> None:
    env = {"PYTORCH_NVML_BASED_CUDA_CHECK": value} if value is not None else {}
    opts_env = dict(env)
    report = run_doctor(Options(env=opts_env), fake_probes())
    check = report.by_id("nvml_cuda_check")
    assert check.status is status and check.code == "CUDA_FORK_REINIT"
    cpu = run_doctor(Options(env=opts_env), fake_probes(query_torch=lambda env: CPU_TORCH))
    assert cpu.by_id("nvml_cuda_check").status is Status.SKIP


def test_start_method_advice_follows_python_version() -> None:
    old = check_start_method(CUDA_TORCH, (3, 11), "linux")
    assert "fork" in old.what and old.fix and "forkserver" in old.fix
    new = check_start_method(CUDA_TORCH, (3, 14), "linux")
    assert "forkserver" in new.what
    assert "spawn" in check_start_method(CUDA_TORCH, (3, 11), "darwin").what


# --- hostname, MASTER_ADDR / MASTER_PORT (fake resolver and probes) ---------------------------

def test_hostname_on_loopback_warns_single_node_and_fails_multi_node() -> None:
    loop = {"box": ("127.0.1.1",)}
    one = doctor(hostname=lambda: "box", resolve=resolver(loop)).by_id("hostname")
    assert one.status is Status.WARN and "127.0.1.1" in one.what
    two = doctor(hostname=lambda: "box", resolve=resolver(loop), nnodes=2).by_id("hostname")
    assert two.status is Status.FAIL
    pinned = doctor(hostname=lambda: "box", resolve=resolver(loop), nnodes=2,
                    env={"GLOO_SOCKET_IFNAME": "eth0"}).by_id("hostname")
    assert pinned.status is Status.WARN
    unknown = doctor(hostname=lambda: "ghost", resolve=resolver({})).by_id("hostname")
    assert unknown.status is Status.WARN and "does not resolve" in unknown.what


def test_master_addr_unknown_is_rdzv_dns_and_port_is_not_probed() -> None:
    report = doctor(master_addr="wrong.address.invalid", master_port=29500)
    addr = report.by_id("master_addr")
    assert (addr.status, addr.code) == (Status.FAIL, "RDZV_DNS")
    assert "Name or service not known" in (addr.why or "")
    assert report.by_id("master_port").status is Status.SKIP
    assert report.exit_code == 1


def test_master_taken_from_environment() -> None:
    report = doctor(env={"MASTER_ADDR": "master.example", "MASTER_PORT": "29400"})
    assert report.by_id("master_addr").what.startswith("MASTER_ADDR master.example resolves to "
                                                       "10.0.0.9 (another host)")
    assert "route to it leaves through eth0" in report.by_id("master_addr").evidence
    assert report.by_id("master_port").status is Status.OK


def test_master_port_not_a_number_fails_as_usage() -> None:
    check = doctor(env={"MASTER_ADDR": "localhost", "MASTER_PORT": "29x"}).by_id("master_port")
    assert (check.status, check.code) == (Status.FAIL, "USAGE")


def test_master_loopback_in_multi_node_job_warns() -> None:
    """A rehearsal with every node on this host runs under torchrun and gpuwarden launch: a
    warning that says so, not a failure."""
    check = doctor(master_addr="localhost", master_port=29500, nnodes=2).by_id("master_addr")
    assert check.status is Status.WARN and "loopback" in check.what
    assert check.why is not None and "rehearsal" in check.why


def test_local_master_port_in_use() -> None:
    check = doctor(master_addr="node1", master_port=29500,
                   port_is_free=lambda port: False).by_id("master_port")
    assert (check.status, check.code) == (Status.FAIL, "RDZV_PORT_IN_USE")


@pytest.mark.parametrize(("status", "code", "result"), [
    (net.ProbeStatus.REFUSED, "RDZV_CONN_REFUSED", Status.WARN),
    (net.ProbeStatus.TIMEOUT, "RDZV_CONNECT_TIMEOUT", Status.FAIL),
    (net.ProbeStatus.NO_ROUTE, "RDZV_CONN_REFUSED", Status.FAIL),
])
def test_remote_master_port_outcomes(status: net.ProbeStatus, code: str, result: Status) -> None:
    probe = net.ProbeResult("master.example", 29500, status, "detail", 0.01)
    check = doctor(master_addr="master.example", master_port=29500,
                   connect_tcp=lambda h, a, p: probe).by_id("master_port")
    assert (check.status, check.code) == (result, code)


# --- NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME ---------------------------------------------------

@pytest.mark.parametrize(("value", "status", "chosen"), [
    ("eth", Status.OK, "eth0"),          # prefix
    ("=eth0", Status.OK, "eth0"),        # exact
    ("=eth", Status.FAIL, None),         # exact: no interface is called 'eth'
    ("^eth,ib,lo", Status.FAIL, None),   # excludes everything there is
    ("^lo,ib", Status.OK, "eth0"),
    ("en", Status.FAIL, None),
    ("lo", Status.WARN, "lo"),           # loopback only
    ("mlx5_0:1,eth", Status.OK, "eth0"), # :port suffixes ignored
])
def test_nccl_socket_ifname(value: str, status: Status, chosen: str | None) -> None:
    check = check_socket_ifname("NCCL_SOCKET_IFNAME", value, IFACES)
    assert check.status is status and check.code == "NCCL_NO_INTERFACE"
    if chosen:
        assert chosen in check.what


def test_gloo_socket_ifname_needs_exact_names() -> None:
    assert check_socket_ifname("GLOO_SOCKET_IFNAME", "eth0", IFACES).status is Status.OK
    missing = check_socket_ifname("GLOO_SOCKET_IFNAME", "eth0,eth9", IFACES)
    assert missing.status is Status.FAIL and "eth9" in missing.what
    assert check_socket_ifname("GLOO_SOCKET_IFNAME", "eth", IFACES).status is Status.FAIL


def test_ifname_that_misses_the_route_to_master_warns() -> None:
    report = doctor(master_addr="master.example", env={"NCCL_SOCKET_IFNAME": "ib"})
    check = report.by_id("nccl_socket_ifname")
    assert check.status is Status.WARN and "leaves through eth0" in check.what


def test_interface_without_address_does_not_count() -> None:
    check = check_socket_ifname("NCCL_SOCKET_IFNAME", "=eth1", {"eth1": ("fe80::2",)})
    assert check.status is Status.FAIL


# --- CUDA_SYSTEM_NOT_READY: the Fabric Manager of an NVSwitch system -------------------------

def nvml(name: str) -> Callable[[Mapping[str, str]], HostSnapshot]:
    """A scenario's host as if NVML had read it (the doctor then asks the driver and torch)."""
    return lambda env: replace(host_from(name)(env), source="nvml")


def test_a_fabric_that_is_not_ready_fails_before_any_job_runs() -> None:
    # An HGX H100 whose Fabric Manager is down, through the simulated backend alone: NVML's
    # fabric state says it; the scenario states no cuInit answer.
    report = doctor(read_host=host_from("doctor_fabric_in_progress"), nproc=4)
    ready = report.by_id("cuda_system_ready")
    assert (ready.status, ready.code) == (Status.FAIL, "CUDA_SYSTEM_NOT_READY")
    assert ready.what == ("CUDA cannot start on this host: the NVLink fabric of GPUs 0-3 is not "
                          "ready (in_progress, not_started)")
    assert ready.evidence[:3] == ("GPU 0: NVLink fabric in_progress",
                                  "GPU 1: NVLink fabric in_progress",
                                  "GPU 2: NVLink fabric not_started")
    assert ready.fix and "nvidia-fabricmanager" in ready.fix and "550.90.07" in ready.fix
    assert ready.why and "Fabric Manager" in ready.why
    assert report.exit_code == 1


def test_a_failed_fabric_registration_fails_on_the_gpu_it_failed() -> None:
    ready = doctor(read_host=host_from("doctor_fabric_failed")).by_id("cuda_system_ready")
    assert ready.status is Status.FAIL
    assert "fabric of GPU 1 is not ready (completed, registration failed)" in ready.what
    assert "GPU 1: NVLink fabric completed, NVML: Timeout" in ready.evidence


def test_an_ampere_host_is_judged_by_the_drivers_answer_in_its_scenario() -> None:
    # A100: NVML has no fabric state; the scenario's cuda_init is the driver's answer.
    report = doctor(read_host=host_from("doctor_a100_not_ready"))
    ready = report.by_id("cuda_system_ready")
    assert ready.status is Status.FAIL
    assert "cuInit with CUDA_ERROR_SYSTEM_NOT_READY" in ready.what
    assert ready.evidence == ("cuInit: CUDA_ERROR_SYSTEM_NOT_READY (as the scenario states)",)


def test_a_registered_fabric_and_a_driver_that_initializes_pass() -> None:
    ready = doctor(read_host=host_from("doctor_fabric_ready")).by_id("cuda_system_ready")
    assert ready.status is Status.OK
    assert ready.what == ("the CUDA driver initializes; the NVLink fabric is registered on "
                          "GPUs 0-1")
    # No fabric and no statement: nothing to judge by.
    idle = doctor().by_id("cuda_system_ready")
    assert idle.status is Status.SKIP and idle.evidence == ()


def test_on_a_real_host_the_drivers_answer_fails_it_and_the_runtime_check_defers() -> None:
    torch = replace(CUDA_TORCH, runtime_device_count=0, runtime_warnings=(TORCH_802,))
    report = doctor(read_host=nvml("doctor_idle"), query_torch=lambda env: torch,
                    query_cuda_driver=driver_of(DRIVER_NOT_READY))
    ready = report.by_id("cuda_system_ready")
    assert ready.status is Status.FAIL
    assert ready.what == ("CUDA cannot start on this host: the driver answers cuInit with "
                          "CUDA_ERROR_SYSTEM_NOT_READY (802: system not yet initialized)")
    assert ready.evidence == (
        "cuInit: CUDA_ERROR_SYSTEM_NOT_READY (802: system not yet initialized)",
        f"torch's runtime (subprocess): {TORCH_802}")
    # One cause, said once: the runtime's empty device list is its consequence.
    runtime = report.by_id("cuda_runtime")
    assert runtime.status is Status.SKIP and "cuda_system_ready" in runtime.what
    assert [c.id for c in report.checks if c.status is Status.FAIL] == ["cuda_system_ready"]


def test_torchs_warning_alone_names_it_on_a_real_host_and_nowhere_else() -> None:
    torch = replace(CUDA_TORCH, runtime_device_count=0, runtime_warnings=(TORCH_802,))
    unasked = doctor(read_host=nvml("doctor_idle"), query_torch=lambda env: torch,
                     query_cuda_driver=driver_of(CudaDriverInfo(error="libcuda.so.1 cannot be "
                                                                "loaded: not found")))
    ready = unasked.by_id("cuda_system_ready")
    assert ready.status is Status.FAIL and "torch's CUDA runtime says" in ready.what
    assert "cuInit could not be asked: libcuda.so.1 cannot be loaded: not found" in ready.evidence
    # A simulated host is not judged by the torch of the machine the doctor runs on.
    simulated = doctor(query_torch=lambda env: torch).by_id("cuda_system_ready")
    assert simulated.status is Status.SKIP


def test_other_driver_answers_are_not_this_checks_to_name() -> None:
    no_device = CudaDriverInfo(result=100, name="CUDA_ERROR_NO_DEVICE",
                               message="no CUDA-capable device is detected")
    report = doctor(read_host=nvml("doctor_idle"), query_cuda_driver=driver_of(no_device))
    ready = report.by_id("cuda_system_ready")
    assert ready.status is Status.OK and "CUDA_ERROR_NO_DEVICE" in ready.what
    ok = doctor(read_host=nvml("doctor_idle")).by_id("cuda_system_ready")
    assert ok.status is Status.OK and ok.what == "the CUDA driver initializes"
    assert ok.evidence == ("cuInit: CUDA_SUCCESS (0: no error), 2 device(s)",)


def test_the_driver_is_asked_once_with_the_host_and_not_without_one() -> None:
    asked: list[tuple[str | None, str]] = []

    def record(env: Mapping[str, str], host: HostSnapshot) -> CudaDriverInfo | None:
        asked.append((env.get("CUDA_VISIBLE_DEVICES"), host.hostname))
        return DRIVER_OK

    doctor(read_host=nvml("doctor_idle"), query_cuda_driver=record,
           env={"CUDA_VISIBLE_DEVICES": "1"})
    assert asked == [("1", "box-i")]
    report = doctor(read_host=no_nvml, query_cuda_driver=record)
    assert len(asked) == 1 and report.by_id("cuda_system_ready").status is Status.SKIP
