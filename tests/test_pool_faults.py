"""The fault matrix, with real processes: a worker dies (SIGKILL, SIGSEGV, os._exit(3)) at each
position (the first task, the middle one, the last one, while its result is being sent,
during shutdown), with 1 or 2 workers per GPU, forkserver and spawn, each among many tiny
tasks. Every future completes exactly once — with its result, or (the task that killed its
worker) with one WorkerDiedError naming the signal or exit code; no pool thread raises; no
process and no lease is left. The state machine behind it is tested alone in
test_pool_states.py; the outcomes are the table in docs/pool.md.

Cost: one pool per (start method, workers per GPU) serves the four positions that do not
stop it; "during shutdown" takes a fresh pool per case. Tasks are tiny and workers import
nothing (preload=()).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future, wait
from pathlib import Path

import psutil
import pytest

from gpuwarden.errors import WorkerDiedError
from gpuwarden.pool import GPUPool
from tests import pool_tasks
from tests.conftest import SCENARIOS, until, wait_until_gone

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow, pytest.mark.xdist_group("pool-faults")]

SIGNALS = ["SIGKILL", "SIGSEGV", "exit3"]
POSITIONS = ["first", "middle", "last", "sending"]
CONFIGS = [("forkserver", 1), ("forkserver", 2), ("spawn", 1), ("spawn", 2)]
TASKS = 16
EXIT_TEXT = {"SIGKILL": "SIGKILL(-9)", "SIGSEGV": "SIGSEGV(-11)", "exit3": "exit code 3"}


class Watch(logging.Handler):
    """Every ERROR the pool logs and every exception a thread dies of, for the checks."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.problems: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.problems.append(record.getMessage())

    def thread_hook(self, args: threading.ExceptHookArgs) -> None:
        self.problems.append(f"{args.thread}: {args.exc_type.__name__}: {args.exc_value}")


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The simulated 2-GPU host, a private lease directory, and the watch on pool threads."""
    leases = tmp_path_factory.mktemp("leases")
    watch = Watch()
    logger = logging.getLogger("gpuwarden.pool")
    logger.addHandler(watch)
    previous_hook = threading.excepthook
    threading.excepthook = watch.thread_hook
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPUWARDEN_SIMULATE", str(SCENARIOS / "two_gpu.json"))
        mp.setenv("GPUWARDEN_LEASE_DIR", str(leases))
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        yield leases
    threading.excepthook = previous_hook
    logger.removeHandler(watch)
    assert not watch.problems, watch.problems


@pytest.fixture
def own_leases(host: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A lease directory of the test's own: the module's shared pool holds the GPUs in the
    other one."""
    monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(tmp_path))
    return tmp_path


def no_lease_left(leases: Path) -> None:
    from gpuwarden.lease import list_leases

    assert list_leases(leases).holders == ()


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{m}-wpg{w}" for m, w in CONFIGS])
def config(request: pytest.FixtureRequest) -> tuple[str, int]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def shared_pool(config: tuple[str, int], host: Path) -> Iterator[GPUPool]:
    before = children()
    method, per_gpu = config
    pool = GPUPool(workers_per_gpu=per_gpu, start_method=method, preload=())
    yield pool
    pool.shutdown()
    assert wait_until_gone(list(children() - before)) == []
    no_lease_left(host)


def submit_around(pool: GPUPool, position: str, how: str, *, delay_s: float = 0.0
                  ) -> tuple[list[Future[object]], int, collections.Counter[int]]:
    """TASKS tiny tasks with the fault at ``position``; counts every future's callbacks."""
    at = {"first": 0, "middle": TASKS // 2, "last": TASKS, "sending": TASKS // 2,
          "shutdown": TASKS // 2}[position]
    done: collections.Counter[int] = collections.Counter()
    futures: list[Future[object]] = []
    for i in range(TASKS + 1):
        if i != at:
            future = pool.submit(pool_tasks.tiny, i)
        elif position == "sending":
            future = pool.submit(pool_tasks.fault_while_sending, how)
        else:
            future = pool.submit(pool_tasks.fault, how, delay_s)
        future.add_done_callback(lambda _f, i=i: done.update([i]))
        futures.append(future)
    return futures, at, done


def check_outcomes(futures: list[Future[object]], at: int, done: collections.Counter[int],
                   how: str) -> WorkerDiedError:
    finished, pending = wait(futures, timeout=60)
    assert not pending, f"{len(pending)} future(s) never completed"
    assert all(done[i] == 1 for i in range(len(futures))), done  # each exactly once
    for i, future in enumerate(futures):
        if i != at:
            assert future.result() == i + 1
    error = futures[at].exception()
    assert isinstance(error, WorkerDiedError), repr(error)
    assert EXIT_TEXT[how] in error.what and error.code == "POOL_WORKER_DIED"
    return error


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("how", SIGNALS)
def test_a_worker_death_fails_exactly_its_task(shared_pool: GPUPool, host: Path, how: str,
                                               position: str) -> None:
    futures, at, done = submit_around(shared_pool, position, how)
    error = check_outcomes(futures, at, done, how)
    assert wait_until_gone([error.fields["pid"]]) == []
    # The slot was refilled: the pool still has every worker and runs tasks.
    assert shared_pool.submit(pool_tasks.tiny, 41).result(timeout=30) == 42
    # ... and its replacement process exists: a worker is listed from the moment the pool asks
    # for it, its pid once the server has started it. (Waiting only for the listing let a
    # slow spawn come up during the next test, which took it for a process it had leaked.)
    until("every slot's worker running", lambda: len(shared_pool.workers()) == shared_pool.n_workers
          and all(w.pid is not None and w.pid in children() for w in shared_pool.workers()),
          timeout_s=60)


@pytest.mark.parametrize("how", SIGNALS)
def test_a_worker_death_during_shutdown_fails_exactly_its_task(
        config: tuple[str, int], own_leases: Path, how: str) -> None:
    before = children()
    method, per_gpu = config
    pool = GPUPool(workers_per_gpu=per_gpu, start_method=method, preload=())
    futures, at, done = submit_around(pool, "shutdown", how, delay_s=0.2)
    pool.shutdown(wait=True)  # the fault happens while shutdown waits for the queue to drain
    assert all(f.done() for f in futures)  # nothing pending once shutdown returned
    check_outcomes(futures, at, done, how)
    assert wait_until_gone(list(children() - before)) == []
    no_lease_left(own_leases)


def test_twenty_deaths_in_a_row_do_not_break_the_pool(own_leases: Path) -> None:
    before = children()
    with GPUPool(gpus=1, preload=()) as pool:
        deaths = [pool.submit(pool_tasks.fault, "SIGKILL") for _ in range(20)]
        for future in deaths:
            assert isinstance(future.exception(timeout=60), WorkerDiedError)
        assert pool.submit(pool_tasks.tiny, 1).result(timeout=30) == 2
    assert wait_until_gone(list(children() - before)) == []
    no_lease_left(own_leases)


def test_a_worker_killed_in_the_middle_of_its_result_frame(host: Path, own_leases: Path) -> None:
    """The result is half-written to the socket when the worker dies: the partial frame is
    dropped and the task fails, named; the next task runs on the replacement."""
    with GPUPool(gpus=1, preload=()) as pool:
        future = pool.submit(pool_tasks.dies_in_the_middle_of_its_result, 128 << 20)
        error = future.exception(timeout=60)
        assert isinstance(error, WorkerDiedError) and "SIGKILL(-9)" in error.what, repr(error)
        assert pool.submit(pool_tasks.tiny, 1).result(timeout=30) == 2
