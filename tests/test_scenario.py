"""Scenario files: every field of shared/scenarios/example.json kept; bad input named precisely."""

import json
from pathlib import Path

import pytest

from gpuwarden.errors import ScenarioError
from gpuwarden.inventory import read_host
from gpuwarden.inventory.simulated import SimulatedBackend, parse_scenario
from tests.conftest import EXAMPLE_SCENARIO, SCENARIOS


def example() -> dict:
    return json.loads((SCENARIOS / "example.json").read_text())


def test_shared_example_is_read_unchanged() -> None:
    path = EXAMPLE_SCENARIO if EXAMPLE_SCENARIO.exists() else SCENARIOS / "example.json"
    host = SimulatedBackend(path).read_host()
    assert host.hostname == "box-a" and host.driver_version == "580.159.04"
    assert host.cuda_driver_version == "13.0"
    assert [g.compute_mode.value for g in host.gpus] == ["default", "default", "exclusive_process", "prohibited"]
    assert host.gpus[0].memory_free_bytes == (81559 - 71200) * 1024**2


def test_env_variable_selects_the_simulated_backend(scenario) -> None:
    scenario("mixed")
    assert read_host().hostname == "mixed-6"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["gpus"][1].pop("uuid"), "gpus[1].uuid: missing"),
        (lambda d: d["gpus"][0].__setitem__("memory_total_mib", "80GB"), "gpus[0].memory_total_mib: expected an integer, got '80GB'"),
        (lambda d: d["gpus"][0].__setitem__("index", True), "gpus[0].index: expected an integer"),
        (lambda d: d["gpus"][2].__setitem__("compute_mode", "exclusive"), "gpus[2].compute_mode: 'exclusive' is not a compute mode"),
        (lambda d: d["gpus"][0]["processes"][0].pop("pid"), "gpus[0].processes[0].pid: missing"),
        (lambda d: d.__setitem__("gpus", {}), "scenario.gpus: expected a list"),
        (lambda d: d["gpus"][1].__setitem__("index", 0), "two GPUs have index 0"),
        (lambda d: d["gpus"][1].__setitem__("memory_used_mib", 90000), "gpus[1].memory_used_mib is larger"),
        (lambda d: d["gpus"][1].__setitem__("memory_used_mib", -5), "gpus[1].memory_used_mib: must not be negative"),
        (lambda d: d["gpus"][0].__setitem__("health", {"fabric_state": "down"}),
         "gpus[0].health.fabric_state: 'down' is not a fabric state"),
        (lambda d: d["gpus"][0].__setitem__("health", {"fabric_state": "in_progress",
                                                        "fabric_error": "NVML: Timeout"}),
         "gpus[0].health.fabric_error: only a completed registration has a result"),
        (lambda d: d.__setitem__("cuda_init", "802"), "scenario.cuda_init: '802' is not a CUDA driver result"),
    ],
)
def test_invalid_field_is_named(mutate, message: str) -> None:
    data = example()
    mutate(data)
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data)
    assert message in err.value.what
    assert err.value.exit_code == 2


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="does not exist"):
        SimulatedBackend(tmp_path / "missing.json").read_host()
    bad = tmp_path / "bad.json"
    bad.write_text("{\"gpus\": [")
    with pytest.raises(ScenarioError, match="not valid JSON") as err:
        SimulatedBackend(bad).read_host()
    assert "line 1" in (err.value.why or "")
    with pytest.raises(ScenarioError, match="is a directory, not a regular file"):
        SimulatedBackend(tmp_path).read_host()  # a directory


def test_scenario_fields_reach_the_snapshot() -> None:
    data = json.loads((SCENARIOS / "example.json").read_text())
    gpu0 = SimulatedBackend(SCENARIOS / "example.json").read_host().gpus[0]
    raw = data["gpus"][0]
    assert gpu0.uuid == raw["uuid"] and gpu0.pci_bus_id == raw["pci_bus_id"]
    assert gpu0.memory_used_bytes == raw["memory_used_mib"] * 1024**2
    assert gpu0.processes[0].user == "bob" and gpu0.processes[0].pid == 4242


def test_a_scenario_can_hold_a_lost_gpu_and_graphics_processes(tmp_path: Path) -> None:
    data = example()
    data["gpus"][1]["error"] = "NVML: GPU is lost"
    data["gpus"][0]["processes"].append({"pid": 77, "command": "Xorg", "context": "graphics",
                                         "note": "pid not in this PID namespace (container)"})
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    host = SimulatedBackend(path).read_host()
    assert host.gpus[1].error == "NVML: GPU is lost" and host.gpus[0].error is None
    xorg = host.gpus[0].processes[-1]
    assert (xorg.context, xorg.note, xorg.has_compute) == \
        ("graphics", "pid not in this PID namespace (container)", False)
    data["gpus"][0]["processes"][-1]["context"] = "video"
    path.write_text(json.dumps(data))
    with pytest.raises(ScenarioError, match=r"gpus\[0\].processes\[1\].context: 'video' is not"):
        SimulatedBackend(path).read_host()


def test_a_scenario_states_the_fabric_and_the_drivers_cuda_answer() -> None:
    data = example()
    data["cuda_init"] = "CUDA_ERROR_SYSTEM_NOT_READY"
    data["gpus"][0]["health"] = {"fabric_state": "in_progress"}
    data["gpus"][1]["health"] = {"fabric_state": "completed", "fabric_error": "NVML: Timeout"}
    data["gpus"][2]["health"] = {"fabric_state": "completed"}
    host = parse_scenario(data)
    assert host.cuda_init == "CUDA_ERROR_SYSTEM_NOT_READY"
    assert [(g.health.fabric_state, g.health.fabric_error, g.health.fabric_ready)
            for g in host.gpus] == [("in_progress", None, False),
                                    ("completed", "NVML: Timeout", False),
                                    ("completed", None, True), (None, None, None)]
    assert parse_scenario(example()).cuda_init is None  # not stated: unknown
