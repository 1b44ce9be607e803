"""An Inventory handed to acquire, GPUPool, the launcher and the CLI is the host they use: no
GPUWARDEN_SIMULATE, no NVML (this machine has no driver), no CUDA_VISIBLE_DEVICES read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuwarden.cli import main
from gpuwarden.errors import NoGPUError
from gpuwarden.inventory import Inventory, StaticBackend, read_host, read_visible
from gpuwarden.inventory.simulated import SimulatedBackend
from gpuwarden.lease import acquire
from gpuwarden.pool import GPUPool
from tests import pool_tasks

SCENARIOS = Path(__file__).parent / "scenarios"
SCRIPT = str(Path(__file__).parent / "launch_scripts" / "env_dump.py")


@pytest.fixture
def no_default_host(monkeypatch: pytest.MonkeyPatch, lease_dir: Path) -> None:
    """The default inventory must not be what answers: point it at a file that does not exist
    and hide every GPU from it."""
    monkeypatch.setenv("GPUWARDEN_SIMULATE", str(SCENARIOS / "no-such-scenario.json"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def example(env: dict[str, str] | None = None) -> Inventory:
    # Env {} : this inventory ignores the process's CUDA_VISIBLE_DEVICES (set to "" above).
    return Inventory(SimulatedBackend(SCENARIOS / "example.json"), env={} if env is None else env)


def test_the_environment_only_chooses_the_default(no_default_host: None) -> None:
    from gpuwarden.errors import ScenarioError

    with pytest.raises(ScenarioError):
        read_host()
    host = example().read_host()
    assert Inventory.of(host, env={}).read_visible()[1] == host.gpus
    assert [g.index for g in example({"CUDA_VISIBLE_DEVICES": "2,0"}).read_visible()[1]] == [2, 0]
    assert isinstance(Inventory.of(host).backend, StaticBackend) and "static" in repr(
        Inventory.of(host))
    # The module functions read the variables given to them, the same way.
    env = {"GPUWARDEN_SIMULATE": str(SCENARIOS / "example.json"), "CUDA_VISIBLE_DEVICES": "1"}
    assert [g.index for g in read_visible(env)[1]] == [1]


def test_acquire_leases_from_the_injected_host(no_default_host: None) -> None:
    with acquire(1, min_free="20GiB", inventory=example()) as grant:
        assert grant.visible_devices == "1"  # the example's only idle GPU with 20 GiB
    with pytest.raises(NoGPUError):
        acquire(1, inventory=Inventory(_NoNvml()))


class _NoNvml:
    name = "none"

    def read_host(self):  # type: ignore[no-untyped-def]
        raise NoGPUError("no NVIDIA driver (test)")


def visible_devices(_: int) -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")  # in the worker


@pytest.mark.slow
def test_gpu_pool_takes_gpus_from_the_injected_host(no_default_host: None) -> None:
    inventory = Inventory(SimulatedBackend(SCENARIOS / "two_gpu.json"), env={})
    with GPUPool(gpus="auto", inventory=inventory, preload=(), start_method="spawn") as pool:
        seen = set(pool.map(visible_devices, range(4)))
    assert seen <= {"0", "1"} and seen


def test_launch_and_doctor_read_the_inventory_given_to_main(no_default_host: None,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    two = Inventory(SimulatedBackend(SCENARIOS / "two_gpu.json"), env={})
    assert main(["launch", "-n", "2", "--min-free", "20GiB", SCRIPT], inventory=two) == 0
    out = capsys.readouterr().out
    envs = [json.loads(line.split("ENV ", 1)[1]) for line in out.splitlines() if "ENV " in line]
    # torchrun's visibility: every rank sees the job's two GPUs of the injected host, in rank order.
    assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs) == ["0,1", "0,1"]
    # The example host has one GPU free for two ranks: refused with its verdicts (exit 4).
    assert main(["launch", "-n", "2", SCRIPT], inventory=example()) == 4
    assert "GPU 2: refused: exclusive_process mode" in capsys.readouterr().err
    assert main(["doctor", "--json"], inventory=example()) in (0, 1)
    checks = {c["id"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert "4 GPU" in json.dumps(checks)


@pytest.mark.slow
def test_the_joblib_backend_passes_the_inventory_on(no_default_host: None, tmp_path: Path) -> None:
    from joblib import Parallel, delayed, parallel_config

    from gpuwarden.pool.joblib_backend import shutdown_reusable_pool

    inventory = Inventory(SimulatedBackend(SCENARIOS / "two_gpu.json"), env={})
    try:
        with parallel_config(backend="gpuwarden", n_jobs=-1, inventory=inventory, preload=(),
                             start_method="spawn"):
            # Two tasks that meet: 4 tiny ones all ran on the first worker ready while the
            # other (spawned) was still starting, in CI (1 failed).
            seen = set(Parallel()(delayed(pool_tasks.meet_then)(str(tmp_path), 2, visible_devices, 0)
                                 for _ in range(2)))
    finally:
        shutdown_reusable_pool()
    assert seen == {"0", "1"}  # n_jobs=-1: one worker per GPU of the injected host
