"""`gpuwarden doctor` end to end on this machine: real NVML (absent here), real torch
subprocess, real sockets; the JSON output validated; exit codes; the wall time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.cli import main
from gpuwarden.errors import GPUWARDEN_CODES
from gpuwarden.inventory import real_gpu_present

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leftover_processes")]

SCENARIOS = Path(__file__).parent / "scenarios"
GPUWARDEN = Path(sys.executable).with_name("gpuwarden")

# The failure vocabulary of failure-codes.md; a check may also carry one of gpuwarden's own.
FAILURE_CODES = {
    "CUDA_FORK_REINIT", "MAIN_GUARD_MISSING", "CUDA_DEVICES_BUSY", "CUDA_OOM", "CUDA_NO_DEVICE",
    "CUDA_DRIVER_TOO_OLD", "CUDA_INVALID_ORDINAL", "NCCL_DUPLICATE_GPU", "NCCL_SHM",
    "NCCL_NO_INTERFACE", "NCCL_WATCHDOG_TIMEOUT", "DATALOADER_SHM", "DATALOADER_WORKER_KILLED",
    "RDZV_PORT_IN_USE", "RDZV_DNS", "RDZV_CONNECT_TIMEOUT", "RDZV_CONN_REFUSED",
    "RDZV_WORKERS_MISSING", "CUDA_SYSTEM_NOT_READY",
}
RANK = {"skip": 0, "ok": 1, "warn": 2, "fail": 3}
# A doctor run, interpreter start included, answers within this on a loaded 2-core machine: its
# network probes are cut at 3 s; a hang would run into the 50 s subprocess timeout.
ANSWER_S = 15.0


def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("GPUWARDEN_SIMULATE", "MASTER_ADDR", "MASTER_PORT",
                             "CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}
    full_env.update(env or {})
    start = time.monotonic()
    proc = subprocess.run([str(GPUWARDEN), "doctor", *args], capture_output=True, text=True,
                          timeout=50, env=full_env)
    return proc.returncode, proc.stdout, time.monotonic() - start


def validate(doc: dict[str, Any], rc: int) -> dict[str, dict[str, Any]]:
    """The documented schema; returns the checks by id."""
    assert doc["schema_version"] == 1
    assert isinstance(doc["checks"], list) and doc["checks"]
    ids = [c["id"] for c in doc["checks"]]
    assert len(ids) == len(set(ids))
    for c in doc["checks"]:
        # the common finding's keys (gpuwarden.findings), plus the check's id and status
        assert set(c) == {"id", "code", "status", "severity", "what", "why", "fix", "evidence",
                          "details", "next", "sections", "fields"}
        assert c["status"] in RANK
        assert c["severity"] == {"fail": "error", "warn": "warning"}.get(c["status"], "ok")
        assert c["code"] in FAILURE_CODES or c["code"] in GPUWARDEN_CODES, c["code"]
        assert isinstance(c["what"], str) and c["what"]
        assert c["why"] is None or isinstance(c["why"], str)
        assert c["fix"] is None or isinstance(c["fix"], str)
        assert all(isinstance(e, str) for e in c["evidence"])
        if c["status"] in ("warn", "fail"):
            assert c["why"] or c["fix"], f"{c['id']}: a problem without why or fix"
    worst = max((c["status"] for c in doc["checks"]), key=RANK.__getitem__)
    assert rc == (1 if worst == "fail" else 0)
    assert doc["exit_code"] == rc
    assert sum(doc["summary"].values()) == len(ids)
    return {c["id"]: c for c in doc["checks"]}


def test_doctor_json_on_this_machine_is_valid_and_fast() -> None:
    rc, out, wall = run_cli("--json", "--nproc", "2")
    checks = validate(json.loads(out), rc)
    assert any("torch 2." in e for e in checks["torch_cuda_build"]["evidence"])
    assert checks["shm_dataloader"]["status"] in ("ok", "warn", "fail")
    assert wall < ANSWER_S, f"doctor took {wall:.1f} s"
    if not real_gpu_present():
        # No GPU and a CPU-only torch: nothing can fail, GPU checks are skipped.
        assert rc == 0
        assert checks["driver"]["status"] == "warn"
        assert checks["compute_mode"]["status"] == "skip"
        assert checks["torch_cuda_build"]["status"] == "skip"
        assert checks["cuda_system_ready"]["status"] == "skip"
    else:
        # A GPU host (the gpu test run): the driver is found and its GPUs are judged.
        assert checks["driver"]["status"] == "ok"
        assert checks["compute_mode"]["status"] in ("ok", "warn")
        assert checks["torch_cuda_build"]["status"] in ("ok", "warn", "fail")
        # The driver itself was asked (cuInit in a subprocess), whatever it answered.
        assert any(e.startswith("cuInit") for e in checks["cuda_system_ready"]["evidence"])


def test_doctor_on_the_example_scenario() -> None:
    rc, out, wall = run_cli("--json", env={"GPUWARDEN_SIMULATE": str(SCENARIOS / "example.json")})
    checks = validate(json.loads(out), rc)
    mode = checks["compute_mode"]
    assert mode["status"] == "warn" and mode["code"] == "CUDA_DEVICES_BUSY"
    assert "GPU 0: default (shared), in use by pid 4242 (bob, python train_llm.py)" in mode["evidence"]
    assert "GPU 2: exclusive_process, held by pid 5151 (carol, python eval.py)" in mode["evidence"]
    assert any(e.startswith("GPU 3: prohibited") for e in mode["evidence"])
    assert any("pid 4242 (bob" in e for e in checks["gpu_memory"]["evidence"])
    assert wall < ANSWER_S


def test_unresolvable_master_addr_fails_the_doctor_within_budget() -> None:
    rc, out, wall = run_cli("--json", "--master-addr", "wrong.address.invalid",
                            "--master-port", "29500")
    checks = validate(json.loads(out), rc)
    assert rc == 1
    assert (checks["master_addr"]["status"], checks["master_addr"]["code"]) == ("fail", "RDZV_DNS")
    assert wall < ANSWER_S


def test_text_report_lists_every_check_and_a_summary(capsys: pytest.CaptureFixture[str],
                                                     scenario: Any) -> None:
    scenario("example")
    rc = main(["doctor", "--nproc", "3"])
    out = capsys.readouterr().out
    assert rc == 1  # 3 ranks, 2 usable GPUs
    assert out.startswith("gpuwarden doctor ")
    assert "[FAIL] nproc" in out and "[WARN] compute_mode" in out
    assert "GPU 2: exclusive_process, held by pid 5151 (carol, python eval.py)" in out
    assert "1 failed," in out.splitlines()[-1]


def test_doctor_and_launch_agree_on_a_gpu_another_job_uses(capsys: pytest.CaptureFixture[str],
                                                          scenario: Any, lease_dir: Path) -> None:
    scenario("example")  # GPU 1 idle; GPU 0 runs bob's job
    assert main(["doctor", "--nproc", "2"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] nproc" in out and "1 of 4 visible are usable" in out
    assert main(["launch", "-n", "2", "--", __file__]) == 4  # refused before any rank starts
    assert "2 rank(s) need 2 GPU(s)" in capsys.readouterr().err
    assert main(["doctor", "--nproc", "1"]) == 0


def test_a_garbage_scenario_is_bad_input_for_doctor_as_for_ls(
        capsys: pytest.CaptureFixture[str], scenario: Any, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    scenario(garbage)
    for command in (["ls"], ["doctor"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith("error[SCENARIO_INVALID]") and err.count("\n") == 1


@pytest.mark.parametrize("args", [["--master-port", "70000"], ["--nproc", "0"],
                                  ["--nnodes", "x"], ["--bogus"]])
def test_bad_arguments_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", *args]) == 2


def test_doctor_never_imports_torch_or_cuda_in_its_own_process() -> None:
    # Nor the CUDA driver: libcuda is only ever loaded by the driver probe's own interpreter.
    code = ("import sys\nfrom gpuwarden.cli import main\n"
            "rc = main(['doctor', '--json'])\n"
            "maps = open('/proc/self/maps').read()\n"
            "dirty = 'torch' in sys.modules or 'libcuda' in maps\n"
            "print('DIRTY' if dirty else 'CLEAN', file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.stderr.strip().splitlines()[-1] == "CLEAN"


# --- torch's view: version file for CPU builds, a real subprocess otherwise --------------------

@pytest.mark.slow
@pytest.mark.timeout(150)
def test_torch_probe_subprocess_agrees_with_the_version_file() -> None:
    import torch  # the test process may import it; the doctor's own process never does

    from gpuwarden.doctor.probes import query_torch, read_torch_build

    static = read_torch_build()
    # The doctor gives `import torch` 20 s, which a 2-core machine loaded by other test suites
    # did not keep; this test is about what the probe reports, not how fast torch imports.
    probed = query_torch(always_import=True, timeout_s=100)
    assert probed.imported and probed.installed and not static.imported, probed.error
    assert probed.version == static.version == torch.__version__
    assert probed.cuda == static.cuda == torch.version.cuda
    assert probed.cuda_compiled == static.cuda_compiled
    assert probed.elapsed_s < 100


def test_torch_probe_is_bounded_and_reports_a_missing_torch(tmp_path: Path) -> None:
    from gpuwarden.doctor.probes import query_torch

    slow = query_torch(timeout_s=0.05, always_import=True)
    assert not slow.installed and slow.error and "did not finish within 0.05 s" in slow.error
    no_torch = tmp_path / "python"  # an interpreter that cannot find torch
    no_torch.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    no_torch.chmod(0o755)
    missing = query_torch(python=str(no_torch))
    assert not missing.installed and missing.error and "No module named 'torch'" in missing.error


def test_torch_probe_runs_in_the_environment_it_is_given(tmp_path: Path) -> None:
    from gpuwarden.doctor.probes import query_torch

    echo = tmp_path / "python"  # answers with the CUDA_VISIBLE_DEVICES it was started with
    echo.write_text('#!/bin/sh\necho "{\\"installed\\": true, \\"version\\": \\"$CUDA_VISIBLE_DEVICES\\"}"\n')
    echo.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "GPU-from-options"}
    assert query_torch(env, python=str(echo)).version == "GPU-from-options"


# --- the CUDA driver's answer: libcuda's cuInit in a fresh interpreter ------------------------

# A libcuda.so.1 of our own: cuInit answers what FAKE_CUINIT says (802: system not yet
# initialized), or NO_DEVICE when CUDA_VISIBLE_DEVICES reaches it.
_FAKE_LIBCUDA = r"""
#include <stdlib.h>
static const char *names[][3] = {
    {"0", "CUDA_SUCCESS", "no error"},
    {"100", "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {"802", "CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized"},
};
static int find(int e) {
    for (int i = 0; i < 3; i++) if (atoi(names[i][0]) == e) return i;
    return -1;
}
int cuInit(unsigned int flags) {
    if (getenv("CUDA_VISIBLE_DEVICES")) return 100;
    const char *v = getenv("FAKE_CUINIT");
    return v ? atoi(v) : 0;
}
int cuGetErrorName(int e, const char **s) { int i = find(e); if (i < 0) return 1; *s = names[i][1]; return 0; }
int cuGetErrorString(int e, const char **s) { int i = find(e); if (i < 0) return 1; *s = names[i][2]; return 0; }
int cuDeviceGetCount(int *n) { *n = 8; return 0; }
"""


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stand-in libcuda.so.1")
    where = tmp_path_factory.mktemp("libcuda")
    (where / "cuda.c").write_text(_FAKE_LIBCUDA)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(where / "libcuda.so.1"),
                    str(where / "cuda.c")], check=True, timeout=60)
    return where


def _nvml_host() -> Any:
    from dataclasses import replace

    from gpuwarden.inventory.simulated import SimulatedBackend

    return replace(SimulatedBackend(SCENARIOS / "doctor_idle.json").read_host(), source="nvml")


@pytest.mark.parametrize(("answer", "name", "message", "count"), [
    ("802", "CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized", None),
    ("0", "CUDA_SUCCESS", "no error", 8),
])
def test_the_driver_probe_reports_what_cuinit_answers(fake_libcuda: Path, answer: str, name: str,
                                                      message: str, count: int | None) -> None:
    from gpuwarden.doctor.probes import query_cuda_driver

    # CUDA_VISIBLE_DEVICES is left out: readiness is the host's, and "" would answer NO_DEVICE.
    env = {"LD_LIBRARY_PATH": str(fake_libcuda), "FAKE_CUINIT": answer, "CUDA_VISIBLE_DEVICES": ""}
    info = query_cuda_driver(env, _nvml_host())
    assert info is not None and info.error is None
    assert (info.result, info.name, info.message, info.device_count) == \
        (int(answer), name, message, count)
    assert info.not_ready is (answer == "802")


def test_the_driver_probe_without_libcuda_or_gpus_or_for_a_scenario(tmp_path: Path) -> None:
    from dataclasses import replace

    from gpuwarden.doctor.probes import query_cuda_driver

    host = _nvml_host()
    python = tmp_path / "python"  # an interpreter whose libcuda cannot be loaded
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import json; print(json.dumps("
                      "{\"error\": \"libcuda.so.1 cannot be loaded: not found\"}))'\n")
    python.chmod(0o755)
    info = query_cuda_driver({}, host, python=str(python))
    assert info is not None and info.error == "libcuda.so.1 cannot be loaded: not found"
    assert info.describe() == "cuInit could not be asked: libcuda.so.1 cannot be loaded: not found"
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho 'Segmentation fault' >&2; exit 139\n")
    broken.chmod(0o755)
    info = query_cuda_driver({}, host, python=str(broken))
    assert info is not None and info.error == "the driver probe exited 139: Segmentation fault"
    assert query_cuda_driver({}, replace(host, gpus=())) is None  # no GPU: nothing to ask
    scenario = replace(host, source="simulated:x", cuda_init="CUDA_ERROR_SYSTEM_NOT_READY")
    stated = query_cuda_driver({}, scenario, python=str(broken))  # never runs a probe
    assert stated is not None and stated.not_ready and stated.source == "scenario"


def test_doctor_on_the_shipped_fabric_down_host_names_the_fabric_manager() -> None:
    rc, out, wall = run_cli("--json", "--simulate", "fabric-down")
    checks = validate(json.loads(out), rc)
    ready = checks["cuda_system_ready"]
    assert rc == 1 and (ready["status"], ready["code"]) == ("fail", "CUDA_SYSTEM_NOT_READY")
    assert "the NVLink fabric of GPUs 0-7 is not ready (in_progress)" in ready["what"]
    assert "cuInit with CUDA_ERROR_SYSTEM_NOT_READY" in ready["what"]
    assert "systemctl start nvidia-fabricmanager" in ready["fix"]
    assert wall < ANSWER_S
