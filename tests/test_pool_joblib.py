"""The "gpuwarden" joblib backend end to end on a simulated 2-GPU host."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
from joblib import Parallel, delayed, parallel_config

import gpuwarden  # noqa: F401 - registers the backend
from gpuwarden.pool.joblib_backend import shutdown_reusable_pool

pytestmark = pytest.mark.timeout(90)


def where(x: int) -> tuple[int, int, str | None]:
    return x, os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES")


def nested(x: int) -> tuple[int, set[int]]:
    inner = Parallel(n_jobs=4)(delayed(os.getpid)() for _ in range(4))
    return os.getpid(), set(inner)


class LossIsNaN(ValueError):
    pass


def fails_on_three(x: int) -> int:
    if x == 3:
        raise LossIsNaN(f"loss is nan for config {x}")
    return x


@pytest.fixture
def two_gpus(scenario, lease_dir, no_leftover_processes):  # type: ignore[no-untyped-def]
    scenario("two_gpu")
    yield
    shutdown_reusable_pool()


def test_all_slots_with_n_jobs_minus_one(two_gpus) -> None:
    with parallel_config(backend="gpuwarden", n_jobs=-1, workers_per_gpu=2, preload=()):
        results = Parallel(batch_size=1)(delayed(where)(x) for x in range(40))
    assert [r[0] for r in results] == list(range(40))
    pids_by_gpu: dict[str | None, set[int]] = defaultdict(set)
    for _, pid, cvd in results:
        pids_by_gpu[cvd].add(pid)
    assert set(pids_by_gpu) == {"0", "1"}
    assert sum(len(p) for p in pids_by_gpu.values()) == 4
    assert os.getpid() not in {pid for _, pid, _ in results}


SCENARIOS = Path(__file__).parent / "scenarios"


def _two_gpus_running(path: Path, pids_by_gpu: dict[str, set[int]], user: str = "root") -> None:
    """Rewrite the simulated host so NVML lists ``pids_by_gpu`` on their GPUs (the simulated
    backend reads the file again on every read, as NVML answers afresh)."""
    host = json.loads((SCENARIOS / "two_gpu.json").read_text())
    for gpu in host["gpus"]:
        gpu["processes"] = [{"pid": pid, "user": user, "command": "python worker",
                             "used_memory_mib": 500} for pid in sorted(pids_by_gpu.get(
                                 str(gpu["index"]), ()))]
        gpu["memory_used_mib"] = 3 + 500 * len(gpu["processes"])
    path.write_text(json.dumps(host))


def test_n_jobs_minus_one_reuses_warm_workers_that_nvml_lists(scenario, lease_dir, tmp_path,
                                                             no_leftover_processes) -> None:
    host = tmp_path / "host.json"
    _two_gpus_running(host, {})
    scenario(host)
    try:
        with parallel_config(backend="gpuwarden", n_jobs=-1, workers_per_gpu=2, preload=()):
            first = Parallel(batch_size=1)(delayed(where)(x) for x in range(20))
            pids_by_gpu: dict[str, set[int]] = defaultdict(set)
            for _, pid, cvd in first:
                pids_by_gpu[str(cvd)].add(pid)
            assert sum(len(p) for p in pids_by_gpu.values()) == 4
            # The warm workers now hold CUDA contexts, as they would after their first task.
            _two_gpus_running(host, pids_by_gpu)
            second = Parallel(batch_size=1)(delayed(where)(x) for x in range(20))
        assert {pid for _, pid, _ in second} == {pid for _, pid, _ in first}
    finally:
        shutdown_reusable_pool()


def test_n_jobs_minus_one_counts_shared_gpus_when_the_pool_allows_them(
        scenario, lease_dir, tmp_path, no_leftover_processes) -> None:
    host = tmp_path / "busy.json"
    _two_gpus_running(host, {"0": {7000}, "1": {7001}}, user="dave")  # someone else's jobs
    scenario(host)
    try:
        with parallel_config(backend="gpuwarden", n_jobs=-1, workers_per_gpu=2, preload=(),
                             allow_shared=True):
            results = Parallel(batch_size=1)(delayed(where)(x) for x in range(20))
        pids_by_gpu: dict[str | None, set[int]] = defaultdict(set)
        for _, pid, cvd in results:
            pids_by_gpu[cvd].add(pid)
        assert set(pids_by_gpu) == {"0", "1"}
        assert sum(len(p) for p in pids_by_gpu.values()) == 4
    finally:
        shutdown_reusable_pool()


def test_workers_are_reused_across_calls(two_gpus) -> None:
    with parallel_config(backend="gpuwarden", n_jobs=2, preload=()):
        first = {pid for _, pid, _ in Parallel()(delayed(where)(x) for x in range(6))}
        second = {pid for _, pid, _ in Parallel()(delayed(where)(x) for x in range(6))}
    assert second <= first


def test_nested_parallel_runs_sequentially_in_the_worker(two_gpus) -> None:
    with parallel_config(backend="gpuwarden", n_jobs=2, preload=()):
        results = Parallel()(delayed(nested)(x) for x in range(4))
    for outer_pid, inner_pids in results:
        assert inner_pids == {outer_pid}


def test_task_exception_reaches_the_caller_with_its_type(two_gpus) -> None:
    with pytest.raises(LossIsNaN, match="config 3"):
        Parallel(backend="gpuwarden", n_jobs=2, preload=())(
            delayed(fails_on_three)(x) for x in range(6))
