"""The "gpuwarden" joblib backend end to end on a simulated 2-GPU host."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import weakref
from collections import defaultdict
from pathlib import Path

import pytest
from joblib import Parallel, delayed, parallel_config

import gpuwarden  # noqa: F401 - registers the backend
from gpuwarden.pool.joblib_backend import shutdown_reusable_pool
from tests import pool_tasks
from tests.conftest import until, wait_until_gone

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]


def where(x: int) -> tuple[int, int, str | None]:
    return x, os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES")


def list_me_on_gpu0(host_path: str) -> int:
    """Lists this process on GPU 0 of the simulated host in ``host_path`` (as NVML lists a
    process with a CUDA context)."""
    path = Path(host_path)
    host = json.loads(path.read_text())
    host["gpus"][0]["processes"] = [{"pid": os.getpid(), "user": "root", "command": "python",
                                     "used_memory_mib": 500}]
    path.write_text(json.dumps(host))
    return os.getpid()


def nested(x: int) -> tuple[int, set[int]]:
    inner = Parallel(n_jobs=4)(delayed(os.getpid)() for _ in range(4))
    return os.getpid(), set(inner)


class LossIsNaN(ValueError):
    pass


def fails_on_three(x: int) -> int:
    if x == 3:
        raise LossIsNaN(f"loss is nan for config {x}")
    return x


@pytest.fixture(scope="module", autouse=True)
def resource_trackers() -> None:
    """joblib's resource tracker (removes memory-mapped arrays' files if this process dies;
    the gpuwarden, loky and multiprocessing backends share it) and multiprocessing's (loky
    starts it), started once: each lives as long as this process, not a test's leftover."""
    import multiprocessing.resource_tracker

    from joblib.externals.loky.backend.resource_tracker import ensure_running

    ensure_running()
    multiprocessing.resource_tracker.ensure_running()


@pytest.fixture
def two_gpus(scenario, lease_dir, no_leftover_processes):  # type: ignore[no-untyped-def]
    scenario("two_gpu")
    yield lease_dir
    shutdown_reusable_pool()


def test_all_slots_with_n_jobs_minus_one(two_gpus, tmp_path) -> None:
    with parallel_config(backend="gpuwarden", n_jobs=-1, workers_per_gpu=2, preload=()):
        results = Parallel(batch_size=1)(delayed(pool_tasks.meet_then)(str(tmp_path), 4, where, x)
                                         for x in range(4))
    assert [r[0] for r in results] == list(range(4))
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
            meet = tmp_path / "meet"
            meet.mkdir()
            first = Parallel(batch_size=1)(delayed(pool_tasks.meet_then)(str(meet), 4, where, x)
                                           for x in range(4))
            pids_by_gpu: dict[str, set[int]] = defaultdict(set)
            for _, pid, cvd in first:
                pids_by_gpu[str(cvd)].add(pid)
            assert sum(len(p) for p in pids_by_gpu.values()) == 4
            # The warm workers now hold CUDA contexts, as they would after their first task.
            _two_gpus_running(host, pids_by_gpu)
            assert Parallel()._effective_n_jobs() == 4  # its own 4 slots, not "GPUs busy"
            second = Parallel(batch_size=1)(delayed(where)(x) for x in range(20))
        # The same warm workers (on a loaded box tiny tasks may not reach all four).
        assert {pid for _, pid, _ in second} <= {pid for _, pid, _ in first}
    finally:
        shutdown_reusable_pool()


def test_n_jobs_minus_one_beside_a_warm_pool_reads_the_host_once_in_a_while(
        two_gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    """What n_jobs=-1 means beside the warm pool is counted afresh after BESIDE_TTL_S,
    not at every call: the count (NVML and the leases) was ~1 ms of a ~11 ms call."""
    from gpuwarden.pool import gpus, joblib_backend

    counted = []
    real = gpus.usable_gpu_count

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        counted.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(gpus, "usable_gpu_count", counting)
    with parallel_config(backend="gpuwarden", n_jobs=-1, preload=()):
        assert Parallel()(delayed(abs)(-x) for x in range(4)) == [0, 1, 2, 3]  # the warm pool
        counted.clear()
        # An hour: the 30 calls are within it however long a loaded box takes over them
        monkeypatch.setattr(joblib_backend, "BESIDE_TTL_S", 3600.0)
        for _ in range(30):
            assert Parallel()._effective_n_jobs() == 2  # its own GPUs, none beside them
        assert len(counted) == 1
        monkeypatch.setattr(joblib_backend, "BESIDE_TTL_S", 0.0)
        for _ in range(3):
            assert Parallel()._effective_n_jobs() == 2
        assert len(counted) == 4  # past the time: counted at every call
        warm = weakref.ref(joblib_backend._reusable["pool"])
    shutdown_reusable_pool()
    # The answers keep nothing of the pool they were counted for (a cancelled idle timer's
    # thread may hold it a moment longer, until it ends)
    assert joblib_backend._beside_seen
    until("the shut-down pool collected", lambda: gc.collect() is not None and warm() is None,
          timeout_s=20)


def test_n_jobs_minus_one_counts_shared_gpus_when_the_pool_allows_them(
        scenario, lease_dir, tmp_path, no_leftover_processes) -> None:
    host = tmp_path / "busy.json"
    _two_gpus_running(host, {"0": {7000}, "1": {7001}}, user="dave")  # someone else's jobs
    scenario(host)
    try:
        with parallel_config(backend="gpuwarden", n_jobs=-1, workers_per_gpu=2, preload=(),
                             allow_shared=True):
            meet = tmp_path / "meet"
            meet.mkdir()
            results = Parallel(batch_size=1)(delayed(pool_tasks.meet_then)(str(meet), 4, where, x)
                                             for x in range(4))
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


def describe_array(a):  # type: ignore[no-untyped-def]
    import numpy as np

    return type(a).__name__, bool(a.flags.writeable), str(getattr(a, "filename", "")), \
        float(np.asarray(a).sum())


def test_large_arrays_travel_as_memory_maps_and_their_files_go(two_gpus, tmp_path) -> None:
    np = pytest.importorskip("numpy")
    tmp_path = tmp_path / "memmaps"
    tmp_path.mkdir()
    big = np.arange(100_000, dtype=np.float64)  # 800 kB, above max_nbytes below
    small = np.arange(10, dtype=np.float64)
    with Parallel(backend="gpuwarden", n_jobs=2, preload=(), max_nbytes="100K",
                  temp_folder=str(tmp_path)) as parallel:
        results = parallel(delayed(describe_array)(a) for a in [big, small, big])
        folders = list(tmp_path.iterdir())
        # One dump of the big array for both tasks, in this call's folder.
        assert len(folders) == 1 and len(list(folders[0].iterdir())) == 1
    assert [r[0] for r in results] == ["memmap", "ndarray", "memmap"]
    assert results[0][1] is False  # mmap_mode="r": the task cannot write the caller's data
    assert results[0][2].startswith(str(tmp_path))
    assert results[0][3] == float(big.sum()) and results[1][3] == float(small.sum())
    assert list(tmp_path.iterdir()) == []


def test_large_results_come_back_as_arrays(two_gpus) -> None:
    np = pytest.importorskip("numpy")
    out = Parallel(backend="gpuwarden", n_jobs=2, preload=())(
        delayed(np.full)(200_000, i) for i in range(4))
    assert [type(a) for a in out] == [np.ndarray] * 4
    assert [float(a[0]) for a in out] == [0.0, 1.0, 2.0, 3.0]


def _wait_parked(timeout_s: float = 20) -> object:
    from gpuwarden.pool import joblib_backend

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pool = joblib_backend._reusable["pool"]
        if pool is not None and pool.parked:
            return pool
        time.sleep(0.05)
    raise AssertionError(f"the warm pool did not park: {joblib_backend._reusable}")


def test_idle_warm_pool_releases_its_gpus_and_keeps_its_workers(two_gpus) -> None:
    """Issue 39: after idle_worker_timeout the warm pool lets its GPUs go (another process can
    lease both), but keeps its workers, which hold nothing on a GPU: the next call leases the
    GPUs again and runs on the same workers, with what they imported, instead of a new pool
    whose every worker imports scikit-learn again (seconds each)."""
    from gpuwarden.lease import jobstep, list_leases

    with parallel_config(backend="gpuwarden", n_jobs=2, preload=(), idle_worker_timeout=0.3):
        first = {pid for _x, pid, _cvd in Parallel()(delayed(where)(x) for x in range(4))}
        _wait_parked()
        assert list_leases().holders == ()
        # Nor does this process pass the released lease down as a job step (env_for skips it).
        assert jobstep.STEP_ENV not in os.environ
        # Released, not only forgotten: another process can lease both GPUs now.
        code = "from gpuwarden.pool import GPUPool; GPUPool(gpus=2, preload=()).shutdown()"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        again = Parallel()(delayed(where)(x) for x in range(4))
        assert {pid for _x, pid, _cvd in again} <= first
        assert len(list_leases().holders) == 1  # leased again while warm
        assert jobstep.STEP_ENV in os.environ  # and passed down again


def test_one_idle_clock_serves_every_call_and_still_rings(two_gpus, monkeypatch) -> None:
    """The warm pool's idle clock is one timer thread: a call that ends moves the deadline
    (a timer started and cancelled per call cost more than the rest of its bookkeeping). It
    is set anew only for an earlier deadline, and when it rings before the deadline it sets
    itself for what is left: the pool still parks once idle."""
    import threading

    from gpuwarden.pool import joblib_backend

    started: list[threading.Timer] = []

    class CountedTimer(threading.Timer):
        def start(self) -> None:
            started.append(self)
            super().start()

    monkeypatch.setattr(joblib_backend.threading, "Timer", CountedTimer)
    with parallel_config(backend="gpuwarden", n_jobs=2, preload=(), idle_worker_timeout=60):
        first = {pid for _x, pid, _cvd in Parallel()(delayed(where)(x) for x in range(4))}
        for _ in range(30):
            Parallel()(delayed(where)(y) for y in range(2))
    assert len(started) == 1  # before: one per call
    with parallel_config(backend="gpuwarden", n_jobs=2, preload=(), idle_worker_timeout=1.0):
        Parallel()(delayed(where)(x) for x in range(2))  # an earlier deadline: a new clock
        assert len(started) == 2
        time.sleep(0.5)
        Parallel()(delayed(where)(x) for x in range(2))  # the clock rings early, sets again
        pool = _wait_parked()
    assert len(started) >= 3
    assert {pid for _x, pid, _cvd in Parallel(backend="gpuwarden", n_jobs=2, preload=())(
        delayed(where)(x) for x in range(4))} <= first
    assert joblib_backend._reusable["pool"] is pool


def test_a_parked_pool_whose_gpu_was_taken_meanwhile_is_replaced(two_gpus) -> None:
    from gpuwarden.lease import acquire
    from tests._lease_util import kept_in_child

    with parallel_config(backend="gpuwarden", n_jobs=2, preload=(), idle_worker_timeout=0.3):
        first = {pid for _x, pid, _cvd in Parallel()(delayed(where)(x) for x in range(4))}
        _wait_parked()
        with kept_in_child(lambda: acquire(1)):  # GPU 0, the first free one
            again = Parallel()(delayed(where)(x) for x in range(4))
    assert {cvd for _x, _pid, cvd in again} == {"1"}
    assert not {pid for _x, pid, _cvd in again} & first
    assert not wait_until_gone(list(first), timeout_s=20)


def test_a_pool_with_a_process_on_its_gpu_is_shut_down_when_idle(two_gpus, scenario,
                                                                  tmp_path) -> None:
    """A worker that made a CUDA context holds GPU memory: parking it would leave its GPU
    leased to nobody but still used. NVML (here the simulated host) lists it: the pool is
    shut down at the idle timeout, as before issue 39."""
    from gpuwarden.pool import joblib_backend

    host = json.loads((Path(__file__).parent / "scenarios" / "two_gpu.json").read_text())
    path = tmp_path / "host.json"
    path.write_text(json.dumps(host))
    scenario(path)
    with parallel_config(backend="gpuwarden", n_jobs=2, preload=(), idle_worker_timeout=1.0):
        results = Parallel()(delayed(where)(x) for x in range(4))
        # A worker lists itself on its GPU while a call runs on it, so the listing is there
        # before the idle clock starts (written here afterwards, on a loaded box the clock
        # could run out first and park the pool).
        [listed] = Parallel()(delayed(list_me_on_gpu0)(str(path)) for _ in range(1))
        deadline = time.monotonic() + 20
        while joblib_backend._reusable["pool"] is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert joblib_backend._reusable["pool"] is None
    assert not wait_until_gone([listed, *(pid for _x, pid, _cvd in results)], timeout_s=20)


def test_a_parked_pool_goes_after_the_parked_timeout(two_gpus, monkeypatch) -> None:
    from gpuwarden.pool import joblib_backend

    monkeypatch.setattr(joblib_backend, "PARKED_WORKER_TIMEOUT_S", 0.5)
    results = Parallel(backend="gpuwarden", n_jobs=2, preload=(), idle_worker_timeout=0.3)(
        delayed(where)(x) for x in range(4))
    _wait_parked()
    deadline = time.monotonic() + 20
    while joblib_backend._reusable["pool"] is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert joblib_backend._reusable["pool"] is None
    assert not wait_until_gone([pid for _x, pid, _cvd in results], timeout_s=20)


def test_a_gpupool_after_parallel_takes_the_idle_warm_pools_gpus(two_gpus,
                                                                 no_leftover_processes) -> None:
    from gpuwarden.pool import GPUPool

    Parallel(backend="gpuwarden", n_jobs=2, preload=())(delayed(where)(x) for x in range(4))
    with GPUPool(gpus=2, preload=()) as pool:
        assert len(pool.gpus) == 2


def test_n_jobs_above_the_gpu_count_spreads_workers_over_the_gpus(two_gpus) -> None:
    results = Parallel(backend="gpuwarden", n_jobs=4, preload=(), batch_size=1)(
        delayed(where)(0.2) for _ in range(8))
    pids_by_gpu: dict[str | None, set[int]] = defaultdict(set)
    for _, pid, cvd in results:
        pids_by_gpu[cvd].add(pid)
    assert {gpu: len(pids) for gpu, pids in pids_by_gpu.items()} == {"0": 2, "1": 2}


def inner_gpuwarden(x: int) -> list[int]:
    return Parallel(backend="gpuwarden", n_jobs=2, preload=())(
        delayed(abs)(-i) for i in range(x))


@pytest.mark.parametrize("outer", ["threading", "multiprocessing", "loky"])
def test_nested_under_another_backend_runs_sequentially(two_gpus, outer: str) -> None:
    # Before: under multiprocessing a forked child waited on the parent's warm pool forever;
    # under threads and loky the inner pools competed for the GPUs (LeaseUnavailableError).
    Parallel(backend="gpuwarden", n_jobs=2, preload=())(delayed(where)(x) for x in range(2))
    try:
        assert Parallel(backend=outer, n_jobs=2)(
            delayed(inner_gpuwarden)(x) for x in range(4)) == [list(range(x)) for x in range(4)]
    finally:
        if outer == "loky":  # loky keeps its workers for the next call: not this test's
            from joblib.externals.loky import get_reusable_executor

            get_reusable_executor().shutdown(wait=True)


def test_nested_under_threads_warns_like_loky(two_gpus) -> None:
    with pytest.warns(UserWarning, match="cannot be nested .*setting n_jobs=1"):
        Parallel(backend="threading", n_jobs=2)(delayed(inner_gpuwarden)(3) for _ in range(2))


def test_a_forked_child_does_not_inherit_the_warm_pool(two_gpus) -> None:
    from gpuwarden.pool import joblib_backend

    Parallel(backend="gpuwarden", n_jobs=2, preload=())(delayed(where)(x) for x in range(2))
    assert joblib_backend._reusable["pool"] is not None
    child = os.fork()
    if child == 0:  # pragma: no cover - reports through its exit status
        os._exit(0 if joblib_backend._reusable["pool"] is None else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_n_jobs_minus_one_with_one_usable_slot_runs_in_a_pinned_worker(
        scenario, lease_dir, tmp_path, no_leftover_processes) -> None:
    """joblib runs n_jobs == 1 in the caller: there the tasks would have no lease and no
    CUDA_VISIBLE_DEVICES, on whatever GPU the caller sees (GPU 1, someone else's)."""
    host = tmp_path / "one_free.json"
    _two_gpus_running(host, {"1": {7001}}, user="dave")
    scenario(host)
    try:
        results = Parallel(backend="gpuwarden", n_jobs=-1, preload=())(
            delayed(where)(x) for x in range(6))
        assert {cvd for _, _, cvd in results} == {"0"}
        assert os.getpid() not in {pid for _, pid, _ in results}
    finally:
        shutdown_reusable_pool()


def test_alternating_n_jobs_resizes_the_warm_pool_instead_of_restarting(two_gpus) -> None:
    from gpuwarden.pool import joblib_backend

    pools, pids = set(), []
    for n_jobs in (2, 4, 2, 4):
        results = Parallel(backend="gpuwarden", n_jobs=n_jobs, preload=(), batch_size=1)(
            delayed(where)(x) for x in range(8))
        pools.add(id(joblib_backend._reusable["pool"]))
        pids.append({pid for _, pid, _ in results})
        assert joblib_backend._reusable["pool"].n_workers == n_jobs
    assert len(pools) == 1  # one pool throughout
    assert pids[2] <= pids[0] | pids[1]  # shrinking kept workers that were there
    # Workers a resize adds have joblib.parallel before their first batch (the fork server
    # preloads it): they take work at once instead of importing it while the others wait.
    pool = joblib_backend._reusable["pool"]
    pool.resize(6)
    # short tasks are not held for a worker still starting
    until("six workers ready", lambda: sum(w.ready for w in pool.workers()) == 6)
    loaded = [f.result(timeout=60) for f in
              [pool.submit(pool_tasks.pid_and_loaded, "joblib.parallel", 0.05) for _ in range(18)]]
    assert all(ok for _, ok in loaded), loaded
    assert {pid for pid, _ in loaded} - set().union(*pids)  # fresh workers answered too


def slow_where(x: int) -> tuple[int, int, str | None]:
    time.sleep(0.05)
    return where(x)


@pytest.mark.parametrize("other", [{"n_jobs": 4}, {"n_jobs": 2, "workers_per_gpu": 1}],
                         ids=["other-n_jobs", "other-settings"])
def test_two_threads_with_different_settings_neither_hangs(two_gpus, other) -> None:
    """Neither call shuts down (or shrinks) the pool the other one is running on: more
    n_jobs grows the shared pool; other settings need a pool of their own, whose GPUs this
    process's running pool holds — a named error at once, not a wait (loky deadlocks)."""
    import threading

    from gpuwarden.errors import ConstraintError

    results: dict[str, list[int]] = {}

    def run(name: str, **kw) -> None:  # type: ignore[no-untyped-def]
        out = Parallel(backend="gpuwarden", preload=(), batch_size=1, **kw)(
            delayed(slow_where)(x) for x in range(20))
        results[name] = [r[0] for r in out]

    first = threading.Thread(target=run, args=("first",), kwargs={"n_jobs": 2})
    first.start()
    time.sleep(0.3)
    if "workers_per_gpu" in other:
        with pytest.raises(ConstraintError, match="this process's own pools hold GPUs"):
            run("second", **other)
    else:
        run("second", **other)
        assert results["second"] == list(range(20))
    first.join(60)
    assert not first.is_alive() and results["first"] == list(range(20))


CTRL_C = """
import os, sys, time
import gpuwarden
from joblib import Parallel, delayed
def slow(i, where):
    open(os.path.join(where, str(os.getpid())), "w").close()
    time.sleep(60)
    return i
try:
    Parallel(backend="gpuwarden", n_jobs=2, preload=(), batch_size=1)(
        delayed(slow)(i, sys.argv[1]) for i in range(8))
except KeyboardInterrupt:
    print("interrupted", flush=True)
    raise
"""


def test_ctrl_c_during_parallel_stops_everything(two_gpus, tmp_path) -> None:
    import signal

    from gpuwarden.lease import list_leases
    from tests.conftest import wait_until_gone

    marks = tmp_path / "started"
    marks.mkdir()
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C)
    # SIGINT at its default, as a terminal starts a command: a suite run started in the
    # background by a shell without job control ignores SIGINT, the script would inherit that
    # and Python then raises no KeyboardInterrupt (the script would sleep on, past 60 s).
    proc = subprocess.Popen([sys.executable, str(script), str(marks)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while len(list(marks.iterdir())) < 2:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - started < 15
    assert "interrupted" in out and "KeyboardInterrupt" in err
    workers = [int(p.name) for p in marks.iterdir()]
    assert wait_until_gone(workers) == []
    assert list_leases(two_gpus).holders == ()


IN_A_RANK = """
import os, sys
import gpuwarden          # before joblib: the registration waits for joblib.parallel
from joblib import Parallel, delayed, parallel_config
with parallel_config(backend="gpuwarden", n_jobs=2, preload=()):
    pids = set(Parallel()(delayed(os.getpid)() for _ in range(4)))
print("RANK", os.environ["RANK"], "ran on", len(pids), "worker(s), not", os.getpid() in pids,
      flush=True)
"""


def test_the_backend_exists_inside_a_gpuwarden_launch_rank_as_under_torchrun(tmp_path) -> None:
    """The rank's bootstrap imported gpuwarden before the script did; the script's own
    `import gpuwarden` still registers the backend (under torchrun the import is the first)."""
    script = tmp_path / "rank.py"
    script.write_text(IN_A_RANK)
    env = {**os.environ, "GPUWARDEN_SIMULATE": str(SCENARIOS / "nogpu.json")}
    done = subprocess.run([sys.executable, "-m", "gpuwarden", "launch", "--nproc-per-node", "1",
                           str(script)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RANK 0 ran on" in done.stdout and "not False" in done.stdout, done.stdout


def test_the_cpu_fallback_warning_points_at_the_users_line(scenario, lease_dir,  # type: ignore[no-untyped-def]
                                                           monkeypatch, no_leftover_processes) -> None:
    """It pointed at gpuwarden's own joblib backend (a fixed stacklevel), not at the user's
    Parallel call; a GPUPool made directly, or by a subclass, points at its caller too."""
    import linecache
    import warnings

    from gpuwarden.pool import CPUFallbackWarning, GPUPool

    scenario("nogpu")

    class MyPool(GPUPool):
        def __init__(self) -> None:
            super().__init__(cpu_workers=1, preload=())

    def named_line(make) -> str:  # type: ignore[no-untyped-def]
        monkeypatch.setattr("gpuwarden.pool.executor._warned_cpu", False)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            make()
        (w,) = [w for w in got if issubclass(w.category, CPUFallbackWarning)]
        assert w.filename == __file__, (w.filename, w.lineno)
        return linecache.getline(w.filename, w.lineno)

    try:
        assert "Parallel(" in named_line(
            lambda: Parallel(n_jobs=2, backend="gpuwarden")(delayed(abs)(-i) for i in range(2)))
    finally:
        shutdown_reusable_pool()
    assert "GPUPool(" in named_line(lambda: GPUPool(cpu_workers=1, preload=()).shutdown())
    assert "super().__init__" in named_line(lambda: MyPool().shutdown())


def test_the_warm_pool_is_kept_when_the_caller_imports_torch_after_it_started(two_gpus) -> None:
    """Without a preload of the caller's, the pool's is chosen when the pool is made (torch
    only when the caller has imported it): a caller that imports torch between two Parallel
    calls (scikit-learn's tests do, half way) keeps the warm pool and its workers, as loky
    keeps its executor; the workers import torch when a task needs it. (It was replaced, and
    every worker started again.)"""
    code = """if True:
        import os, sys, time
        from joblib import Parallel, delayed, parallel_config
        import gpuwarden
        from gpuwarden.pool import joblib_backend
        assert "torch" not in sys.modules
        with parallel_config(backend="gpuwarden", n_jobs=2):
            Parallel()(delayed(os.getpid)() for _ in range(4))
            pool = joblib_backend._reusable["pool"]
            # The four tiny tasks may all have run on the worker ready first: the other is
            # listed once the server has started it.
            deadline = time.monotonic() + 60
            while len(pool.workers()) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            workers = {w.pid for w in pool.workers()}
            assert len(workers) == 2, workers
            import torch  # noqa: F401
            Parallel()(delayed(os.getpid)() for _ in range(4))
            assert joblib_backend._reusable["pool"] is pool, "the warm pool was replaced"
            assert {w.pid for w in pool.workers()} == workers
        print("kept")
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "kept", done.stderr[-3000:]
