"""Many independent processes contending for a simulated 2-GPU host.

Every holder records when it held which slots; no slot may ever have two holders at
once, a GPU is never split two ways at once, and every request is served.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._lease_util import fork_child, hold_and_record, overlaps, read_records, wait_all

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.slow]


def _contend(tmp_path: Path, specs: list[dict[str, int]], hold_s: float = 0.02) -> list[dict]:
    out = tmp_path / "holds.jsonl"
    gate_r, gate_w = os.pipe()
    pids = [fork_child(hold_and_record(out, hold_s=hold_s, tag=str(i), **spec), gate=(gate_r, gate_w))
            for i, spec in enumerate(specs)]
    os.close(gate_r)
    os.close(gate_w)  # all start now
    codes = wait_all(pids, timeout_s=60)
    assert all(c == 0 for c in codes.values()), codes
    records = read_records(out)
    assert sorted(r["tag"] for r in records) == sorted(str(i) for i in range(len(specs)))
    return records


@pytest.mark.timeout(90)
def test_32_processes_one_slot_per_gpu_never_share_a_gpu(scenario, lease_dir, tmp_path):
    scenario("two_idle")
    specs = [{"n": 1}] * 28 + [{"n": 2}] * 4  # a few 2-GPU jobs among 1-GPU ones
    records = _contend(tmp_path, specs)
    assert overlaps(records) == []
    # Both GPUs were used, and the 2-GPU jobs got both.
    assert {c[0] for r in records for c in r["claims"]} == {
        "GPU-00000000-0000-0000-0000-00000000aa00", "GPU-00000000-0000-0000-0000-00000000aa01"}
    assert all(len(r["claims"]) == r["n"] for r in records)


@pytest.mark.timeout(90)
def test_32_processes_two_slots_per_gpu_share_only_distinct_slots(scenario, lease_dir, tmp_path):
    scenario("two_idle")
    specs = ([{"n": 1, "slots_per_gpu": 2}] * 24
             + [{"n": 1, "slots_per_gpu": 2, "slots_each": 2}] * 4  # whole GPU, 2 slots of 2
             + [{"n": 2, "slots_per_gpu": 2}] * 4)
    # Held long enough that two 1-slot holders overlap even when a loaded machine runs the 32
    # processes one after the other (at 20 ms a starved holder may be alone on its GPU).
    records = _contend(tmp_path, specs, hold_s=0.2)
    assert overlaps(records) == []
    # Two 1-slot holders did share a GPU at some point (the slots are real, not exclusive).
    shared = [(a, b) for a in records for b in records if a["pid"] < b["pid"]
              for ca in a["claims"] for cb in b["claims"]
              if ca[0] == cb[0] and a["start"] < b["end"] and b["start"] < a["end"]]
    assert shared, "no two holders ever shared a GPU: slots_per_gpu=2 acted as exclusive"


@pytest.mark.timeout(90)
def test_mixed_slot_counts_never_split_a_gpu_two_ways(scenario, lease_dir, tmp_path):
    scenario("two_idle")
    specs = [{"n": 1, "slots_per_gpu": 1}] * 8 + [{"n": 1, "slots_per_gpu": 2}] * 8 \
        + [{"n": 1, "slots_per_gpu": 3}] * 6
    records = _contend(tmp_path, specs)
    assert overlaps(records) == []
