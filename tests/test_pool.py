"""GPUPool on a simulated 2-GPU host: pinning, crashes, exceptions, shutdown, parent death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter, defaultdict
from pathlib import Path

import psutil
import pytest

from gpuwarden.errors import ConstraintError, PoolBrokenError, WorkerDiedError
from gpuwarden.pool import CPUFallbackWarning, GPUPool
from gpuwarden.pool._pickling import RemoteTraceback
from tests import pool_tasks
from tests.conftest import until, wait_until_gone

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]


def where(delay_s: float = 0.0) -> tuple[int, str | None, str | None]:
    time.sleep(delay_s)
    return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER")


def sleep_then(value: int, delay_s: float) -> int:
    time.sleep(delay_s)
    return value


def report_pid_and_hang(path: str) -> None:
    Path(path).write_text(str(os.getpid()))
    time.sleep(60)


def exit_hard(code: int) -> None:
    os._exit(code)


class SweepFailed(Exception):
    def __init__(self, lr: float) -> None:
        super().__init__(f"diverged at lr={lr}")
        self.lr = lr


def train(lr: float) -> float:
    if lr > 1:
        raise SweepFailed(lr)
    return lr


@pytest.fixture
def two_gpus(scenario, lease_dir):  # type: ignore[no-untyped-def]
    scenario("two_gpu")


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_each_gpu_gets_exactly_workers_per_gpu_workers(two_gpus, no_leftover_processes,
                                                       start_method: str, tmp_path: Path) -> None:
    with GPUPool(workers_per_gpu=2, start_method=start_method, preload=()) as pool:
        # 4 tasks that wait until 4 run at once: one in each worker (tasks of a fixed length
        # could all go to the workers ready first while a spawned one still starts).
        results = list(pool.map(pool_tasks.meet_then, [str(tmp_path)] * 4, [4] * 4, [where] * 4))
        infos = pool.workers()
    pids_by_gpu: dict[str | None, set[int]] = defaultdict(set)
    for pid, cvd, order in results:
        pids_by_gpu[cvd].add(pid)
        assert order == "PCI_BUS_ID"
    # every worker ran one, two per GPU.
    assert {cvd: len(pids) for cvd, pids in pids_by_gpu.items()} == {"0": 2, "1": 2}
    assert sorted(i.cuda_visible_devices for i in infos) == ["0", "0", "1", "1"]
    assert [g.index for g in pool.gpus] == [0, 1]


def test_fewer_tasks_than_workers_spread_over_gpus(two_gpus) -> None:
    with GPUPool(workers_per_gpu=2, preload=()) as pool:
        futures = [pool.submit(where, 0.5) for _ in range(2)]
        gpus = Counter(f.result()[1] for f in futures)
    assert gpus == {"0": 1, "1": 1}


def test_worker_killed_mid_task_fails_that_task_only(two_gpus, no_leftover_processes,
                                                     tmp_path: Path) -> None:
    pid_file = tmp_path / "victim.pid"
    with GPUPool(workers_per_gpu=2, preload=()) as pool:
        victim = pool.submit(report_pid_and_hang, str(pid_file))
        others = [pool.submit(sleep_then, i, 0.2) for i in range(10)]
        deadline = time.monotonic() + 20
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the task never started"
            time.sleep(0.02)
        victim_pid = int(pid_file.read_text())
        os.kill(victim_pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as info:
            victim.result(timeout=20)
        assert [f.result(timeout=30) for f in others] == list(range(10))
        # The pool replaced the dead worker and still has all four.
        after = pool.submit(sleep_then, 42, 0).result(timeout=20)
        assert len(pool.workers()) == 4
    err = info.value
    assert f"pid {victim_pid}" in err.what and "SIGKILL(-9)" in err.what
    assert "report_pid_and_hang" in err.what and err.gpu in ("GPU 0", "GPU 1")
    assert err.code == "POOL_WORKER_DIED"
    assert after == 42
    assert wait_until_gone([victim_pid]) == []


def test_os_exit_in_task_names_exit_code(two_gpus, no_leftover_processes) -> None:
    with GPUPool(gpus=1, preload=(), start_method="spawn") as pool:
        dead = pool.submit(exit_hard, 3)
        with pytest.raises(WorkerDiedError, match=r"worker 0 \(pid \d+, GPU \d\) died with exit "
                           r"code 3 while running task \d+ \(exit_hard\(3\)\)"):
            dead.result(timeout=20)
        assert pool.submit(sleep_then, 1, 0).result(timeout=20) == 1


def test_exception_keeps_type_and_remote_traceback(two_gpus) -> None:
    with GPUPool(gpus=[1], preload=()) as pool:
        with pytest.raises(SweepFailed) as info:
            pool.submit(train, 3.0).result(timeout=20)
        assert pool.submit(train, 0.5).result(timeout=20) == 0.5
    assert info.value.lr == 3.0
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "in train" in cause.tb and "raise SweepFailed(lr)" in cause.tb and "GPU 1" in cause.tb


def test_a_task_sent_by_value_fails_with_its_file_and_source_lines(
        two_gpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A function of the user's script (or of a module registered by value) travels as code;
    its traceback still names its file and shows the failing line (cloudpickle >= 3.1.3 alone
    would name it "<dynamic-code>", with no source)."""
    import importlib

    import cloudpickle

    (tmp_path / "user_sweep.py").write_text(
        "def step(x):\n    raise ValueError(x)  # the user's failing line\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("user_sweep")
    cloudpickle.register_pickle_by_value(module)
    try:
        with GPUPool(gpus=1, preload=()) as pool, pytest.raises(ValueError) as info:
            pool.submit(module.step, 7).result(timeout=20)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        sys.modules.pop("user_sweep", None)
    tb = info.value.__cause__.tb  # type: ignore[union-attr]
    assert f'File "{tmp_path / "user_sweep.py"}", line 2, in step' in tb, tb
    assert "raise ValueError(x)  # the user's failing line" in tb, tb


def test_lambdas_and_closures_travel_by_value(two_gpus) -> None:
    offset = 10
    with GPUPool(gpus=1, preload=()) as pool:
        assert list(pool.map(lambda x: x + offset, [1, 2])) == [11, 12]


def test_too_many_gpus_requested_lists_every_verdict(two_gpus) -> None:
    with pytest.raises(ConstraintError) as info:
        GPUPool(gpus=3, preload=())
    assert len(info.value.evidence) == 2


def test_no_gpu_runs_cpu_workers_and_says_so(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUWARDEN_SIMULATE", str(tmp_path / "none.json"))
    (tmp_path / "none.json").write_text('{"gpus": []}')
    monkeypatch.setattr("gpuwarden.pool.executor._warned_cpu", False)
    with pytest.warns(CPUFallbackWarning, match="no GPU"), \
            GPUPool(cpu_workers=2, preload=()) as pool:
        assert {r[1] for r in pool.map(where, [0.1] * 4)} == {""}
        assert pool.gpus == ()


def test_auto_takes_the_gpus_another_pool_left(two_gpus, no_leftover_processes) -> None:
    with GPUPool(gpus=1, preload=()) as first, GPUPool(preload=()) as second:
        assert [g.index for g in first.gpus] == [0]
        assert [g.index for g in second.gpus] == [1]
        assert {r[1] for r in second.map(where, [0.05] * 4)} == {"1"}


def test_max_workers_leases_only_the_gpus_its_workers_use(two_gpus,
                                                          no_leftover_processes) -> None:
    from gpuwarden.lease import lease, list_leases

    with GPUPool(max_workers=1, preload=()) as pool:
        assert pool.n_workers == 1 and len(pool.gpus) == 1
        [holder] = list_leases().holders
        assert len(holder.claims) == 1
        with lease(1) as grant:  # the GPU the pool does not use stays free for others
            assert grant.gpus[0].uuid != pool.gpus[0].uuid
    with GPUPool(max_workers=3, workers_per_gpu=2, preload=()) as pool:
        assert pool.n_workers == 3 and len(pool.gpus) == 2


def test_gpus_zero_is_a_cpu_pool_on_every_host(monkeypatch, tmp_path: Path, scenario,
                                               lease_dir, no_leftover_processes) -> None:
    import warnings

    from gpuwarden.inventory import SIMULATE_ENV, real_gpu_present
    from gpuwarden.lease import list_leases

    none = tmp_path / "none.json"
    none.write_text('{"gpus": []}')
    hosts: list[str | Path | None] = ["two_gpu", none]
    if not real_gpu_present():
        hosts.append(None)  # no NVML at all
    for host in hosts:
        if host is None:
            monkeypatch.delenv(SIMULATE_ENV)
        else:
            scenario(host)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CPUFallbackWarning)  # asked for: not a fallback
            with GPUPool(gpus=0, cpu_workers=2, preload=()) as pool:
                assert pool.gpus == () and pool.n_workers == 2, host
                assert {r[1] for r in pool.map(where, [0.05] * 2)} == {""}, host
                assert list_leases().holders == (), host


def failing_initializer() -> None:
    raise RuntimeError("no dataset mounted")


def test_initializer_failure_breaks_the_pool(two_gpus, no_leftover_processes) -> None:
    pool = GPUPool(gpus=1, preload=(), initializer=failing_initializer)
    future = pool.submit(sleep_then, 1, 0)
    with pytest.raises(PoolBrokenError, match="failed to start") as info:
        future.result(timeout=20)
    assert "no dataset mounted" in str(info.value.__cause__)
    pool.shutdown()


def test_shutdown_kills_grandchildren(two_gpus, no_leftover_processes) -> None:
    pool = GPUPool(gpus=1, preload=())
    child_pid = pool.submit(spawn_sleeper).result(timeout=20)
    assert psutil.pid_exists(child_pid)
    pool.shutdown()
    assert wait_until_gone([child_pid]) == []


def spawn_sleeper() -> int:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]).pid


POOL_SCRIPT = textwrap.dedent("""
    import sys, time
    from gpuwarden.pool import GPUPool
    pool = GPUPool(workers_per_gpu=2, preload=(), start_method=sys.argv[1])
    list(pool.map(abs, range(8)))
    while len(pool.workers()) < 4 or not all(w.pid for w in pool.workers()):
        time.sleep(0.05)   # a worker's pid is known once the server has started it
    print(" ".join(str(w.pid) for w in pool.workers()), flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_workers_die_with_the_pools_process(two_gpus, tmp_path: Path, start_method: str) -> None:
    script = tmp_path / "owner.py"
    script.write_text(POOL_SCRIPT)
    owner = subprocess.Popen([sys.executable, str(script), start_method], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert owner.stdout is not None
        worker_pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(worker_pids) == 4
        owner.kill()
        owner.wait()
        assert wait_until_gone(worker_pids, timeout_s=10) == []
    finally:
        owner.kill()
        owner.wait()


def test_import_gpuwarden_registers_backend_without_importing_joblib() -> None:
    code = textwrap.dedent("""
        import sys
        import gpuwarden
        assert "joblib" not in sys.modules and "torch" not in sys.modules
        import joblib.parallel
        assert "gpuwarden" in joblib.parallel.BACKENDS
        assert "gpuwarden.pool.executor" not in sys.modules
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def read_shared(proxy, key: str) -> str:  # type: ignore[no-untyped-def]
    proxy[key] = f"seen by {os.getpid()}"
    return str(proxy[key])


def test_manager_proxies_work_in_tasks(two_gpus, no_leftover_processes) -> None:
    import multiprocessing

    with multiprocessing.Manager() as manager, GPUPool(preload=()) as pool:
        shared = manager.dict()
        result = pool.submit(read_shared, shared, "a").result(timeout=30)
        assert result.startswith("seen by ")
        assert dict(shared) == {"a": result}


def test_a_pool_inherited_through_fork_is_refused_in_the_child(two_gpus,
                                                               no_leftover_processes) -> None:
    with GPUPool(gpus=1, preload=()) as pool:
        assert pool.submit(abs, -1).result(timeout=30) == 1
        read_fd, write_fd = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through the pipe
            try:
                pool.submit(abs, -2)
                verdict = b"accepted"
            except Exception as exc:  # noqa: BLE001
                verdict = f"{type(exc).__name__}: {exc}".encode()
            pool.shutdown()  # a no-op in the child: it must not stop the parent's workers
            os.write(write_fd, verdict)
            os._exit(0)
        os.close(write_fd)
        _, status = os.waitpid(child, 0)
        verdict = os.read(read_fd, 4096).decode()
        os.close(read_fd)
        # str(e) is what the CLI prints: the code, the why and the fix, not the headline only
        assert verdict.startswith("PoolError: error[POOL_BROKEN]: this GPUPool belongs to "
                                  "process"), verdict
        assert "\n  fix: create a new GPUPool in the child" in verdict
        # The parent's pool is untouched by the child's attempts.
        assert pool.submit(abs, -3).result(timeout=30) == 3


def test_shutdown_timeout_kills_a_hung_task(two_gpus, no_leftover_processes,
                                            tmp_path: Path) -> None:
    pool = GPUPool(gpus=1, preload=())
    hung = pool.submit(report_pid_and_hang, str(tmp_path / "pid"))
    deadline = time.monotonic() + 30
    while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    pool.shutdown(wait=True, timeout_s=0.5)
    assert time.monotonic() - started < 10
    with pytest.raises(PoolBrokenError, match="shutdown's timeout"):
        hung.result(timeout=1)
    assert wait_until_gone([int((tmp_path / "pid").read_text())]) == []


EXIT_SCRIPT = """
import sys, threading, time
from gpuwarden.pool import GPUPool
pool = GPUPool(gpus=1, preload=(), exit_timeout_s=0.5)
hung = pool.submit(time.sleep, 3600)
while not pool.workers() or not all(w.pid for w in pool.workers()):
    time.sleep(0.05)   # the worker's pid is known once the server has forked it
print(" ".join(str(w.pid) for w in pool.workers()), flush=True)
def wait_for_it():
    try:
        hung.result()
    except Exception as exc:
        print("waiter got", type(exc).__name__, flush=True)
if sys.argv[1] == "waiter":
    threading.Thread(target=wait_for_it).start()   # an ordinary (non-daemon) thread
# The script ends with the task still running: interpreter exit must not wait for it.
"""


@pytest.mark.parametrize("waiter", ["alone", "waiter"])
def test_interpreter_exit_kills_a_hung_task_after_exit_timeout(two_gpus, tmp_path: Path,
                                                              waiter: str) -> None:
    """Bounded even while an ordinary thread waits on the hung task's future: the exit hook
    runs before the interpreter joins threads (threading._register_atexit)."""
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script), waiter], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 30
    lines = done.stdout.splitlines()
    assert wait_until_gone([int(p) for p in lines[0].split()]) == []
    if waiter == "waiter":
        assert lines[1:] == ["waiter got PoolBrokenError"]


def test_refusal_by_the_callers_own_pool_says_so(two_gpus, no_leftover_processes) -> None:
    with GPUPool(preload=()) as holder:
        assert len(holder.gpus) == 2
        with pytest.raises(ConstraintError) as info:
            GPUPool(gpus=1, preload=())
    error = info.value
    assert "this process's own pools hold GPUs" in error.what
    assert "shutdown_reusable_pool()" in (error.fix or "")
    assert any(f"pid {os.getpid()}" in e for e in error.evidence)



def test_a_worker_a_resize_adds_imports_what_loading_the_pools_tasks_imported(
        two_gpus, no_leftover_processes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39: a worker added later (resize, replacement) used to import the modules of its
    first task while holding it — scikit-learn's take a second, so a tiny task waited that long
    on a fresh worker while the warm ones were idle (loky's new workers are still starting
    then, and take nothing). Now it imports them before it is ready."""
    from tests import pool_tasks

    (tmp_path / "warm_module_of_the_tasks.py").write_text("def same(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers get the caller's sys.path
    import warm_module_of_the_tasks  # type: ignore[import-not-found]

    met = tmp_path / "met"
    met.mkdir()
    with GPUPool(max_workers=1, workers_per_gpu=None, preload=()) as pool:
        assert pool.submit(warm_module_of_the_tasks.same, 7).result(timeout=60) == 7
        pool.resize(2)
        until("both workers ready", lambda: sum(w.ready for w in pool.workers()) == 2)
        both = [pool.submit(pool_tasks.meet_then_report, str(met), 2,
                            "warm_module_of_the_tasks") for _ in range(2)]
        answers = [f.result(timeout=90) for f in both]
    assert len({pid for pid, _ in answers}) == 2, answers  # the old worker and the new one
    assert all(loaded for _, loaded in answers), answers


def test_a_tiny_task_never_waits_behind_a_slow_one_while_a_worker_is_free(
        two_gpus, no_leftover_processes, tmp_path: Path) -> None:
    """Beside a CPU hog joblib's test_parallel_unordered_generator_returns_fastest_first failed:
    after many tiny tasks the pool sent a second task to a busy worker (pipelining), the first
    turned out to take 30 s, and the second waited for it while the other worker was idle."""
    import concurrent.futures

    from tests import pool_tasks

    gate = tmp_path / "gate"
    with GPUPool(max_workers=2, workers_per_gpu=None, preload=()) as pool:
        for f in [pool.submit(pool_tasks.tiny, i) for i in range(300)]:
            f.result(timeout=60)  # the pool has seen only tiny tasks
        slow = pool.submit(pool_tasks.wait_for_file, str(gate))
        fast = [pool.submit(pool_tasks.tiny, i) for i in range(8)]
        try:
            _, stuck = concurrent.futures.wait(fast, timeout=60)
            assert not stuck and not slow.done(), f"{len(stuck)} tiny task(s) waited for the slow one"
        finally:
            gate.touch()
        assert slow.result(timeout=60)


def test_a_worker_that_dies_in_its_warm_start_leaves_later_ones_starting_cold(
        two_gpus, no_leftover_processes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm start at its one new position: a module a task loaded kills a fresh process
    (here once a flag file exists). The worker dies before it is ready; without a fallback
    every replacement would die the same way and the third death would break the pool. Its
    replacement starts cold, and the pool runs on."""
    from tests import pool_tasks

    flag = tmp_path / "kill-on-import"
    (tmp_path / "kills_fresh_workers.py").write_text(
        "import os, signal\n"
        f"if os.path.exists({str(flag)!r}):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "def same(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import kills_fresh_workers  # type: ignore[import-not-found]

    (tmp_path / "met").mkdir()
    with GPUPool(max_workers=1, workers_per_gpu=None, preload=()) as pool:
        assert pool.submit(kills_fresh_workers.same, 3).result(timeout=60) == 3
        flag.touch()
        pool.resize(2)
        until("both workers ready", lambda: sum(w.ready for w in pool.workers()) == 2)
        pids = {f.result(timeout=60)[0] for f in
                [pool.submit(pool_tasks.meet_then_report, str(tmp_path / "met"), 2, "x")
                 for _ in range(2)]}
    assert len(pids) == 2


def test_tasks_taken_back_from_behind_running_ones_run_exactly_once(
        two_gpus, no_leftover_processes, tmp_path: Path) -> None:
    """Tiny tasks are pipelined behind running ones and taken back by workers that go idle
    first; the claim decides who runs a task when the busy worker reaches it at the same
    moment. Bursts of tiny tasks of uneven length make that moment happen again and again:
    every task runs once, in one worker, and its future has its result."""
    import random

    from tests import pool_tasks

    log = tmp_path / "runs.log"
    rng = random.Random(7)
    expected: list[int] = []
    with GPUPool(max_workers=4, workers_per_gpu=None, preload=()) as pool:
        for f in [pool.submit(pool_tasks.tiny, i) for i in range(300)]:
            f.result(timeout=60)  # tiny tasks: the pool pipelines
        manager = pool._manager
        bursts = 0
        while bursts < 30 or (manager.taken_back < 20 and bursts < 300):
            bursts += 1
            ids = range(len(expected), len(expected) + rng.randint(5, 40))
            futures = [pool.submit(pool_tasks.note_run, str(log), i, rng.choice((0, 0, 0.002)))
                       for i in ids]
            assert [f.result(timeout=60) for f in futures] == list(ids)
            expected.extend(ids)
        taken_back = manager.taken_back
    ran = Counter(int(line.split()[0]) for line in log.read_text().splitlines())
    assert sorted(ran) == expected and set(ran.values()) == {1}, \
        {i: n for i, n in ran.items() if n != 1}
    assert taken_back > 0, f"no task was taken back in {bursts} bursts: the test proves nothing"
