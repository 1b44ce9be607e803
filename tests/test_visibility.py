"""CUDA_VISIBLE_DEVICES and Slurm, as CUDA reads them (see gpuwarden/visibility.py)."""

import pytest

from gpuwarden.errors import VisibilityError
from gpuwarden.inventory.simulated import SimulatedBackend
from gpuwarden.visibility import parse_int_list, parse_visibility
from tests.conftest import SCENARIOS

HOST = SimulatedBackend(SCENARIOS / "example.json").read_host().gpus
MIG_HOST = SimulatedBackend(SCENARIOS / "mig.json").read_host().gpus


def indices(value: str | None, host=HOST, **extra: str) -> list[int]:
    env = dict(extra)
    if value is not None:
        env["CUDA_VISIBLE_DEVICES"] = value
    return [g.index for g in parse_visibility(host, env).gpus]


def test_unset_means_every_gpu() -> None:
    assert indices(None) == [0, 1, 2, 3]


def test_indices_keep_the_given_order() -> None:
    assert indices("3,1") == [3, 1]
    assert indices(" 2 , 0 ") == [2, 0]


def test_enumeration_stops_at_first_invalid_entry() -> None:
    vis = parse_visibility(HOST, {"CUDA_VISIBLE_DEVICES": "1,7,2"})
    assert [g.index for g in vis.gpus] == [1]
    assert any("'7'" in n and "past the last GPU" in n for n in vis.notes)
    assert indices("2,-1,0") == [2]
    assert indices("0,GPU-1f0e8c52-6b1a-4c1e-9d7e-000000000001") == [0]


def test_strtoul_like_parsing() -> None:
    # CUDA reads the leading number of an entry: '1gpu' is 1.
    assert indices("1gpu,2") == [1, 2]


@pytest.mark.parametrize("value", ["", "-1", "  ", "7", "GPU-ffff", "nope"])
def test_nothing_visible_is_an_error_naming_the_value(value: str) -> None:
    with pytest.raises(VisibilityError) as err:
        parse_visibility(HOST, {"CUDA_VISIBLE_DEVICES": value})
    assert err.value.code == "CUDA_NO_DEVICE"
    assert err.value.exit_code == 2
    assert repr(value) in err.value.what


def test_duplicates_are_an_error() -> None:
    with pytest.raises(VisibilityError, match="same device twice"):
        parse_visibility(HOST, {"CUDA_VISIBLE_DEVICES": "1,2,1"})
    with pytest.raises(VisibilityError, match="same device twice"):
        parse_visibility(HOST, {"CUDA_VISIBLE_DEVICES": "GPU-1f0e8c52-6b1a-4c1e-9d7e-000000000001,"
                                                        "GPU-1f0e8c52-6b1a-4c1e-9d7e-000000000001"})


def test_full_and_abbreviated_uuids() -> None:
    full = "GPU-1f0e8c52-6b1a-4c1e-9d7e-000000000002"
    assert indices(full) == [2]
    assert indices("GPU-1f0e8c52-6b1a-4c1e-9d7e-000000000003,GPU-1f0e8c52-6b1a-4c1e-9d7e-000000000000") == [3, 0]


def test_ambiguous_uuid_prefix_stops_enumeration() -> None:
    vis = parse_visibility(HOST, {"CUDA_VISIBLE_DEVICES": "GPU-1f0e8c52-6b1a-4c1e-9d7e-000000000001,GPU-1f0e"})
    assert [g.index for g in vis.gpus] == [1]
    assert any("matches 4 devices" in n for n in vis.notes)


def test_mixed_forms_stop_at_the_first_entry_of_another_form() -> None:
    assert indices("GPU-1f0e8c52-6b1a-4c1e-9d7e-000000000001,2") == [1]


def test_mig_instances() -> None:
    vis = parse_visibility(MIG_HOST, {"CUDA_VISIBLE_DEVICES": "MIG-11111111-2222-4333-8444-555555555551"})
    (dev,) = vis.gpus
    assert dev.is_mig_instance and dev.index == 0
    assert dev.cuda_id == "MIG-11111111-2222-4333-8444-555555555551"
    assert dev.memory_total_bytes == 40192 * 1024**2
    with pytest.raises(VisibilityError):
        parse_visibility(MIG_HOST, {"CUDA_VISIBLE_DEVICES": "MIG-99"})


def test_slurm_allocation_narrows_the_host() -> None:
    assert indices(None, SLURM_JOB_GPUS="1,3") == [1, 3]
    # the step's GPUs win over the job's
    assert indices(None, SLURM_JOB_GPUS="0-3", SLURM_STEP_GPUS="2") == [2]
    # CUDA_VISIBLE_DEVICES as Slurm sets it without a device cgroup: global indices
    assert indices("1,3", SLURM_JOB_GPUS="1,3") == [1, 3]


def test_slurm_device_cgroup_renumbers() -> None:
    two = [g for g in HOST if g.index in (0, 1)]
    # In a cgroup NVML shows the 2 allocated GPUs as 0 and 1, while Slurm names physical 5 and 6.
    assert [g.index for g in parse_visibility(two, {"SLURM_JOB_GPUS": "5,6"}).gpus] == [0, 1]


def test_slurm_rejects_cvd_outside_the_allocation() -> None:
    with pytest.raises(VisibilityError, match="outside this Slurm job's allocation"):
        parse_visibility(HOST, {"SLURM_JOB_GPUS": "1", "CUDA_VISIBLE_DEVICES": "2"})


def test_slurm_allocation_this_host_cannot_have() -> None:
    with pytest.raises(VisibilityError, match="does not have"):
        parse_visibility(HOST, {"SLURM_JOB_GPUS": "5,6,7"})
    with pytest.raises(VisibilityError, match="not a GPU index"):
        parse_visibility(HOST, {"SLURM_JOB_GPUS": "gpu:2"})


def test_parse_int_list() -> None:
    assert parse_int_list("0,2-4,7", what="X") == [0, 2, 3, 4, 7]


def test_no_gpus_on_host_is_not_a_visibility_error() -> None:
    assert parse_visibility([], {"CUDA_VISIBLE_DEVICES": "0"}).gpus == ()
