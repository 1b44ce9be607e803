"""Selection: every refusal reason, ordering, ties — a pure function over snapshots."""

from dataclasses import replace

import pytest

from gpuwarden.errors import ConstraintError
from gpuwarden.inventory.simulated import SimulatedBackend
from gpuwarden.select import Constraints, Refusal, select
from gpuwarden.units import GIB
from tests.conftest import SCENARIOS


def host(name: str):
    return SimulatedBackend(SCENARIOS / f"{name}.json").read_host().gpus


def reasons(sel) -> dict[int, str]:
    return {v.gpu.index: v.reason for v in sel.verdicts if not v.accepted}


def test_example_scenario_reasons() -> None:
    sel = select(host("example"), Constraints(count=1, min_free_bytes=20 * GIB))
    assert [g.index for g in sel.selected] == [1]
    why = reasons(sel)
    assert why[0] == "in use by 1 other process(es): pid 4242 (bob, python train_llm.py)"
    assert why[2] == "exclusive_process mode, held by pid 5151 (carol, python eval.py)"
    assert why[3].startswith("prohibited compute mode")


def test_unsatisfied_request_raises_exit_4_with_every_gpu() -> None:
    sel = select(host("example"), Constraints(count=2, min_free_bytes=20 * GIB))
    assert not sel.satisfied and sel.selected == ()
    with pytest.raises(ConstraintError) as err:
        sel.require()
    assert err.value.exit_code == 4
    assert len(err.value.evidence) == 4
    assert "--allow-shared" in (err.value.fix or "")


def test_allow_shared_accepts_default_mode_but_never_a_held_exclusive_gpu() -> None:
    sel = select(host("example"), Constraints(count=2, allow_shared=True))
    assert [g.index for g in sel.selected] == [1, 0]
    assert "exclusive_process mode, held by" in reasons(sel)[2]


def test_idle_exclusive_gpu_is_acceptable() -> None:
    sel = select(host("mixed"), Constraints(count=6, allow_shared=True))
    accepted = {g.index for g in sel.acceptable}
    assert 1 in accepted  # exclusive_process, nobody on it
    assert 2 not in accepted and 3 not in accepted


def test_min_free_and_max_util() -> None:
    gpus = host("mixed")
    sel = select(gpus, Constraints(count=1, min_free_bytes=50 * GIB, max_util_pct=20, allow_shared=True))
    why = reasons(sel)
    assert "required" in why[4] and "free" in why[4]
    sel = select(gpus, Constraints(count=1, max_util_pct=20, allow_shared=True))
    assert reasons(sel)[4] == "utilization 60% > 20%"
    assert 5 in {g.index for g in sel.acceptable}


def test_order_most_free_then_lowest_util_then_index() -> None:
    base = host("idle8")[0]
    gpus = [
        replace(base, index=0, uuid="GPU-a", memory_used_bytes=10 * GIB, utilization_gpu_pct=0),
        replace(base, index=1, uuid="GPU-b", memory_used_bytes=0, utilization_gpu_pct=50),
        replace(base, index=2, uuid="GPU-c", memory_used_bytes=0, utilization_gpu_pct=10),
        replace(base, index=3, uuid="GPU-d", memory_used_bytes=0, utilization_gpu_pct=10),
    ]
    sel = select(gpus, Constraints(count=4))
    assert [g.index for g in sel.selected] == [2, 3, 1, 0]
    # deterministic: the same input in another order gives the same answer
    assert [g.index for g in select(list(reversed(gpus)), Constraints(count=4)).selected] == [2, 3, 1, 0]


def test_include_exclude_by_index_and_uuid() -> None:
    gpus = host("idle8")
    sel = select(gpus, Constraints(count=2, exclude=("0", "GPU-00000000-0000-4000-8000-000000000001")))
    assert {g.index for g in sel.selected}.isdisjoint({0, 1})
    assert reasons(sel)[0] == "excluded on request"
    sel = select(gpus, Constraints(count=2, include=("5", "6")))
    assert sorted(g.index for g in sel.selected) == [5, 6]
    assert reasons(sel)[0] == "not in the requested list"


def test_own_processes_are_not_foreign() -> None:
    gpus = host("example")
    sel = select(gpus, Constraints(count=2, own_pids=frozenset({4242})))
    assert [g.index for g in sel.selected] == [1, 0]


def test_unavailable_reason_from_a_caller() -> None:
    gpus = host("two_gpu")
    uuid = gpus[0].uuid
    sel = select(gpus, Constraints(count=1, unavailable={uuid: "leased by pid 812 (alice, train.py) for 3m"}))
    assert [g.index for g in sel.selected] == [1]
    assert reasons(sel)[0] == "leased by pid 812 (alice, train.py) for 3m"


def test_mig_enabled_gpu_is_refused_with_its_instances_named() -> None:
    sel = select(host("mig"), Constraints(count=1))
    assert [g.index for g in sel.selected] == [1]
    assert "MIG-11111111-2222-4333-8444-555555555550" in reasons(sel)[0]


def test_no_gpus() -> None:
    sel = select((), Constraints(count=1))
    assert not sel.satisfied
    assert sel.error().why == "no GPU is visible to this process"


def test_fix_hints_follow_the_refusal_not_words_in_a_command_line() -> None:
    # A foreign process whose command mentions "free" and "utilization" must not make the
    # error suggest --min-free or --max-util, which were never the reason.
    gpu = host("example")[0]
    proc = replace(gpu.processes[0], command="python high_utilization_free_mem.py")
    sel = select([replace(gpu, processes=(proc,))], Constraints(count=1))
    assert sel.verdicts[0].refusal is Refusal.IN_USE
    fix = sel.error().fix or ""
    assert "--allow-shared" in fix
    assert "--min-free" not in fix and "--max-util" not in fix


def test_a_gpu_whose_nvlink_fabric_is_not_ready_is_refused_with_the_admins_fix() -> None:
    """CUDA fails on every GPU of an HGX board with error 802 while the Fabric Manager has not
    registered it (CUDA_SYSTEM_NOT_READY): selection refuses such GPUs before any job starts on
    them, and says who can fix it."""
    from gpuwarden.inventory.simulated import SimulatedBackend
    from gpuwarden.select import Constraints, Refusal, select

    host = SimulatedBackend("fabric-down").read_host()
    sel = select(host.gpus, Constraints(count=1))
    assert not sel.satisfied
    assert {v.refusal for v in sel.verdicts} == {Refusal.FABRIC}
    assert all("CUDA_SYSTEM_NOT_READY" in v.reason for v in sel.verdicts)
    assert "nvidia-fabricmanager" in sel.error().fix
