"""gpuwarden worker on a real Dask scheduler: two simulated hosts on loopback.

A real ``dask scheduler`` process and two ``gpuwarden worker`` processes, each with its own
scenario file (host box-a, host box-b; different GPU UUIDs) and its own lease directory, as two
machines would have. One scheduler and the two hosts' workers are shared by the tests of this
module (Dask start-up takes seconds on a loaded machine); the test of a scheduler going away
has its own.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

pytest.importorskip("distributed")

from distributed import Client  # noqa: E402

from gpuwarden.cli import main  # noqa: E402
from gpuwarden.dask.plan import plan_workers  # noqa: E402
from gpuwarden.errors import DaskWorkerDiedError  # noqa: E402
from gpuwarden.inventory.snapshot import GPUSnapshot  # noqa: E402
from gpuwarden.lease import acquire, list_leases  # noqa: E402
from gpuwarden.select import Constraints  # noqa: E402
from tests import pool_tasks  # noqa: E402
from tests.conftest import SCENARIOS, until, wait_until_gone  # noqa: E402

# A hang guard, far above a loaded machine's times (each test may start a scheduler and
# workers; the 120 s default ran out at load average 30-50).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dask-cluster"),
              pytest.mark.timeout(300)]

DASK = str(Path(sys.executable).parent / "dask")
REPO = Path(__file__).resolve().parents[1]


def dask_env(**extra: str) -> dict[str, str]:
    """The scheduler and the workers import the tasks' module (tests.test_dask) by name, as
    Dask wants the same software everywhere."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env
START_TIMEOUT_S = 90.0  # Dask on 2 shared cores: ~10 s to start a handful of workers


def host_scenario(tmp: Path, host: str, uuid_prefix: str) -> Path:
    data = json.loads((SCENARIOS / "two_gpu.json").read_text())
    data["hostname"] = host
    for gpu in data["gpus"]:
        gpu["uuid"] = f"GPU-{uuid_prefix}-0000-4000-8000-00000000000{gpu['index']}"
    path = tmp / f"{host}.json"
    path.write_text(json.dumps(data))
    return path


@dataclass
class Host:
    """One simulated machine: its scenario, its lease directory, its `gpuwarden worker`."""

    name: str
    scenario: Path
    lease_dir: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    descendants: list[int] = field(default_factory=list)
    args: tuple[str, ...] = ()  # the worker command's arguments, to start it again

    @property
    def env(self) -> dict[str, str]:
        return dask_env(GPUWARDEN_SIMULATE=str(self.scenario),
                        GPUWARDEN_LEASE_DIR=str(self.lease_dir))

    def start(self, scheduler: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.args = args
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpuwarden", "worker", scheduler, *args],
                env={**self.env, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Dask worker(s) for" not in self.log.read_text():
            assert self.proc.poll() is None, f"{self.name} exited: {self.log.read_text()}"
            assert time.monotonic() < deadline, f"{self.name} not ready: {self.log.read_text()}"
            time.sleep(0.1)
        self.note_descendants()

    def note_descendants(self) -> None:
        """Its nannies' workers now (a restarted worker is a new process)."""
        assert self.proc is not None
        self.descendants = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]

    def leases(self) -> list[tuple[int, int, tuple[int, ...], int]]:
        """(GPU index, slots per GPU, slots, holder pid) of every lease on this host."""
        table = list_leases(self.lease_dir)
        return sorted((c.index, c.slots_per_gpu, c.slots, h.pid)
                      for h in table.holders for c in h.claims)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.note_descendants()
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def start_scheduler(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    info = tmp / "scheduler.json"
    with open(tmp / "scheduler.log", "wb") as log:
        proc = subprocess.Popen(
            [DASK, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
             "--scheduler-file", str(info)],
            env=dask_env(), stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not info.exists() or not info.read_text().strip():
        assert proc.poll() is None, (tmp / "scheduler.log").read_text()
        assert time.monotonic() < deadline, "dask scheduler did not start"
        time.sleep(0.1)
    return proc, json.loads(info.read_text())["address"]


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Cluster:
    address: str
    a: Host
    b: Host
    other_lease: Any
    scheduler_log: Path

    def logs(self) -> str:
        """The ends of the scheduler's and the hosts' logs, for a failure's message."""
        return "\n".join(f"--- {path.name}:\n{path.read_text(errors='replace')[-4000:]}"
                         for path in (self.scheduler_log, self.a.log, self.b.log)
                         if path.exists())


# A killed worker's tasks wait this long for its nanny's report (gpuwarden's default: 10 s,
# then Dask's own retry, as for a host that is gone). The module's tests lose no whole host
# while a task runs; on a loaded machine the report may come later (at load average 18-25 the
# killed task ran again elsewhere, so its result never came), and a task retried elsewhere is
# not the one whose death the test checks.
SHARED_HOLD = {"GPUWARDEN_DASK_HOLD_S": "60"}


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("dask")
    scheduler, address = start_scheduler(tmp)
    hosts = []
    for name, prefix in (("box-a", "aaaaaaaa"), ("box-b", "bbbbbbbb")):
        lease_dir = tmp / f"leases-{name}"
        lease_dir.mkdir()
        hosts.append(Host(name, host_scenario(tmp, name, prefix), lease_dir, tmp / f"{name}.log"))
    a, b = hosts
    # Another job on box-a holds GPU 0: box-a's workers must leave it alone.
    other = acquire(1, constraints=Constraints(count=1, include=("0",)), lease_dir=a.lease_dir,
                    env=a.env, label="someone else's job")
    try:
        # Either host's command installs the plugin (the first one to reach the scheduler).
        a.start(address, "--workers-per-gpu", "2", env=SHARED_HOLD)
        b.start(address, env=SHARED_HOLD)
        a.wait_ready()
        b.wait_ready()
        yield Cluster(address, a, b, other, tmp / "scheduler.log")
    finally:
        for host in hosts:
            if host.proc is not None and host.proc.poll() is None:
                host.stop(signal.SIGTERM)
        other.release()
        stop_process(scheduler)


@pytest.fixture
def cluster(shared_cluster: Cluster) -> Cluster:
    """The module's cluster with both hosts' worker commands running and all four workers
    registered: some tests stop a host or kill a worker, and the order is random. A host
    stopped by an earlier test is started again (its log then starts afresh)."""
    for host in (shared_cluster.a, shared_cluster.b):
        assert host.proc is not None
        if host.proc.poll() is not None:
            host.start(shared_cluster.address, *host.args)
            host.wait_ready()
    with Client(shared_cluster.address) as client:
        for name in EXPECTED_WORKERS:  # a killed worker's nanny starts it again
            wait_for_worker(client, name)
    for host in (shared_cluster.a, shared_cluster.b):
        host.note_descendants()
    return shared_cluster


def where_am_i(i: int, sleep_s: float = 0.0) -> dict[str, Any]:
    from distributed import get_worker

    time.sleep(sleep_s)
    return {"i": i, "worker": get_worker().name, "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "order": os.environ.get("CUDA_DEVICE_ORDER")}


def wait_for_worker(client: Client, name: str, timeout_s: float = 60.0) -> str:
    """The address of the worker called ``name``, once it is registered."""
    deadline = time.monotonic() + timeout_s
    while True:
        for address, w in client.scheduler_info(n_workers=-1)["workers"].items():
            if w["name"] == name:
                return str(address)
        assert time.monotonic() < deadline, f"no worker {name}"
        time.sleep(0.1)


EXPECTED_WORKERS = {"box-a/GPU1/0": "1", "box-a/GPU1/1": "1", "box-b/GPU0/0": "0",
                    "box-b/GPU1/0": "1"}


def test_joblib_dask_sweep_runs_each_task_on_its_workers_gpu(cluster: Cluster) -> None:
    from joblib import Parallel, delayed, parallel_config

    with Client(cluster.address) as client:
        info = client.scheduler_info(n_workers=-1)["workers"].values()
        assert {w["name"]: w["resources"] for w in info} == {
            name: {"GPU": 1.0} for name in EXPECTED_WORKERS}
        with parallel_config(backend="dask"):
            results = Parallel()(delayed(where_am_i)(i, 0.05) for i in range(24))
    assert sorted(r["i"] for r in results) == list(range(24))
    for r in results:
        # Each task saw its own worker's GPU, never box-a's GPU 0 (another job's lease).
        assert r["cuda_visible_devices"] == EXPECTED_WORKERS[r["worker"]], r
        assert r["order"] == "PCI_BUS_ID"
    assert len({r["worker"] for r in results}) >= 3  # spread over the hosts


def test_a_task_asking_for_a_gpu_gets_one_worker_of_it(cluster: Cluster) -> None:
    with Client(cluster.address) as client:
        futures = [client.submit(where_am_i, i, 0.3, resources={"GPU": 1}, pure=False)
                   for i in range(8)]
        results = client.gather(futures)
    assert {r["worker"] for r in results} <= set(EXPECTED_WORKERS)


def test_leases_are_held_by_the_worker_command_while_it_runs(cluster: Cluster) -> None:
    a, b = cluster.a, cluster.b
    assert a.proc is not None and b.proc is not None
    # box-a: GPU 0 is the other job's (this test process), GPU 1 is the workers', both slots.
    assert a.leases() == [(0, 1, (0,), os.getpid()), (1, 2, (0, 1), a.proc.pid)]
    assert b.leases() == [(0, 1, (0,), b.proc.pid), (1, 1, (0,), b.proc.pid)]
    # `gpuwarden run` on box-a, wanting a GPU now, is refused: nothing is free.
    env = a.env
    out = subprocess.run([sys.executable, "-m", "gpuwarden", "run", "--gpus", "1", "--", "true"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 4, out.stderr
    assert "gpuwarden worker" in out.stderr


def test_sigkilled_worker_fails_its_task_naming_host_gpu_and_signal(cluster: Cluster,
                                                                  tmp_path: Path) -> None:
    marker, done = tmp_path / "victim.pid", tmp_path / "done"

    def job(i: int) -> dict[str, Any]:
        if i == 3:
            marker.write_text(str(os.getpid()))
            pool_tasks.wait_for_file(str(done), 60)  # a run elsewhere ends with the test
        return where_am_i(i, 0.5)

    with Client(cluster.address) as client:
        futures = [client.submit(job, i, pure=False) for i in range(8)]
        try:
            until("task 3 started", lambda: marker.exists() and marker.read_text())
            victim = int(marker.read_text())
            victim_info = next(r for r in client.run(lambda: (os.getpid(), os.environ.get(
                "CUDA_VISIBLE_DEVICES"))).items() if r[1][0] == victim)
            os.kill(victim, signal.SIGKILL)
            with pytest.raises(DaskWorkerDiedError) as err:
                try:
                    futures[3].result(timeout=60)
                except TimeoutError as exc:  # it ran again elsewhere: say what the logs say
                    raise AssertionError(f"task 3 neither failed nor finished:\n"
                                         f"{cluster.logs()}") from exc
            others = [f.result(timeout=60) for i, f in enumerate(futures) if i != 3]
        finally:
            done.touch()
    e = err.value
    assert e.exit_status == "SIGKILL(-9)"
    assert e.host in ("box-a", "box-b")
    assert e.worker in EXPECTED_WORKERS and e.worker.startswith(e.host)
    assert e.gpu == f"GPU {victim_info[1][1]}"
    text = e.render()
    assert "died with SIGKILL(-9) while running task" in text
    assert f"pid {victim}" in text and e.host in text and "OOM killer" in text
    assert sorted(r["i"] for r in others) == [0, 1, 2, 4, 5, 6, 7]


def test_no_gpu_exits_3(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
                        ) -> None:
    monkeypatch.setenv("GPUWARDEN_SIMULATE", str(SCENARIOS / "nogpu.json"))
    assert main(["worker", "tcp://127.0.0.1:1"]) == 3
    assert "no GPU is visible" in capsys.readouterr().err


def test_sigterm_stops_the_workers_and_releases_the_gpus(cluster: Cluster) -> None:
    # It ends box-b's workers (the cluster fixture starts them again for a later test).
    b = cluster.b
    assert b.stop(signal.SIGTERM) == 0
    assert b.leases() == []
    assert wait_until_gone(b.descendants, 15) == []
    assert "workers stopped, GPU 0,1 released" in b.log.read_text()
    with Client(cluster.address) as client:
        deadline = time.monotonic() + 30
        while any(w["name"].startswith("box-b") for w in
                  client.scheduler_info(n_workers=-1)["workers"].values()):
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_scheduler_gone_stops_workers_and_frees_leases(tmp_path: Path) -> None:
    scheduler, address = start_scheduler(tmp_path)
    lease_dir = tmp_path / "leases"
    lease_dir.mkdir()
    host = Host("box-c", host_scenario(tmp_path, "box-c", "cccccccc"), lease_dir,
                tmp_path / "box-c.log")
    try:
        host.start(address, "--gpus", "1", "--workers-per-gpu", "2")
        host.wait_ready()
        assert host.proc is not None
        assert host.leases() == [(0, 2, (0, 1), host.proc.pid)]
        assert len(host.descendants) >= 2
        host.note_descendants()
        stop_process(scheduler)
        assert host.proc.wait(60) == 0  # as dask worker: the scheduler's end ends the job
        assert host.leases() == []
        assert wait_until_gone(host.descendants, 15) == []
        assert "closed or went away; workers stopped, GPU 0 released" in host.log.read_text()
    finally:
        if host.proc is not None and host.proc.poll() is None:
            host.stop(signal.SIGKILL)
        stop_process(scheduler)


def test_a_whole_host_gone_its_task_runs_elsewhere_after_the_hold(tmp_path: Path) -> None:
    """No nanny is left to report (the command was SIGKILLed): after the hold, Dask's own retry."""
    scheduler, address = start_scheduler(tmp_path)
    hosts = []
    for name in ("box-d", "box-e"):
        lease_dir = tmp_path / f"leases-{name}"
        lease_dir.mkdir()
        hosts.append(Host(name, host_scenario(tmp_path, name, name[-1] * 8), lease_dir,
                          tmp_path / f"{name}.log"))
    d, e = hosts
    marker = tmp_path / "first-run.pid"

    def once() -> str:
        from distributed import get_worker

        if not marker.exists():
            marker.write_text(str(os.getpid()))
            time.sleep(60)
        return str(get_worker().name)

    try:
        d.start(address, "--gpus", "1", env={"GPUWARDEN_DASK_HOLD_S": "1"})  # installs the plugin
        d.wait_ready()
        e.start(address, "--cpu")
        e.wait_ready()
        with Client(address) as client:
            on_d = wait_for_worker(client, "box-d/GPU0/0")
            future = client.submit(once, workers=[on_d], allow_other_workers=True, pure=False)
            while not marker.exists() or not marker.read_text():
                time.sleep(0.05)
            assert d.proc is not None
            d.note_descendants()
            d.proc.kill()
            killed_at = time.monotonic()
            assert future.result(timeout=60) == "box-e/CPU/0"
            assert time.monotonic() - killed_at >= 1.0  # held back first
        assert wait_until_gone(d.descendants, 20) == []
    finally:
        for host in hosts:
            if host.proc is not None and host.proc.poll() is None:
                host.stop(signal.SIGTERM)
        stop_process(scheduler)


# -- pure parts --------------------------------------------------------------------------------


def _gpu(index: int) -> GPUSnapshot:
    return GPUSnapshot(index=index, uuid=f"GPU-{index}", name="H100", pci_bus_id="",
                       memory_total_bytes=1, memory_used_bytes=0, utilization_gpu_pct=0,
                       compute_mode="default", mig_enabled=False, processes=())


def test_plan_names_say_host_and_gpu_and_each_worker_sees_one_gpu() -> None:
    specs = plan_workers("box-a", [_gpu(1), _gpu(3)], 2, parent_env={}, cpu_count=8)
    assert [s.name for s in specs] == ["box-a/GPU1/0", "box-a/GPU3/0", "box-a/GPU1/1",
                                       "box-a/GPU3/1"]
    assert [s.cuda_visible_devices for s in specs] == ["1", "3", "1", "3"]
    assert all(s.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for s in specs)
    assert all(s.resources == {"GPU": 1.0} for s in specs)
    cpu = plan_workers("box-a", [], 1, cpu_workers=2, parent_env={}, cpu_count=8)
    assert [(s.name, s.cuda_visible_devices, dict(s.resources)) for s in cpu] == [
        ("box-a/CPU/0", "", {}), ("box-a/CPU/1", "", {})]


def test_the_death_error_crosses_processes_whole() -> None:
    from gpuwarden.dask.scheduler_plugin import describe_death

    err = describe_death({"name": "box-a/GPU1/0", "host": "box-a", "device": "GPU 1",
                          "cuda_visible_devices": "1", "pid": 4242,
                          "address": "tcp://10.0.0.5:40000"}, "SIGKILL(-9)", "train-123")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is DaskWorkerDiedError
    assert back.render() == err.render()
    assert (back.host, back.gpu, back.exit_status, back.worker) == (
        "box-a", "GPU 1", "SIGKILL(-9)", "box-a/GPU1/0")
    assert back.code == "POOL_WORKER_DIED"


@pytest.mark.parametrize("argv", [["worker", "tcp://x:1", "--gpus", "two"],
                                  ["worker", "tcp://x:1", "--workers-per-gpu", "0"],
                                  ["worker", "tcp://x:1", "--memory-fraction", "1.5"]])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    assert main(argv) == 2


def test_a_task_with_retries_runs_again_after_its_worker_died(cluster: Cluster,
                                                             tmp_path: Path) -> None:
    marker = tmp_path / "first-run.pid"

    def once() -> str:
        if not marker.exists():  # the first run dies with its worker, the retry succeeds
            marker.write_text(str(os.getpid()))
            time.sleep(60)
        return "second run"

    with Client(cluster.address) as client:
        future = client.submit(once, retries=1, pure=False)
        deadline = time.monotonic() + 60
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(int(marker.read_text()), signal.SIGKILL)
        assert future.result(timeout=60) == "second run"


def test_a_report_before_the_removal_fails_the_task_at_once(cluster: Cluster,
                                                           tmp_path: Path) -> None:
    """The nanny's report can beat the closed connection to the scheduler: the task then fails
    as if its worker had reported the error (here the report is sent by hand, the worker lives).
    """
    from distributed.core import rpc
    from distributed.protocol.pickle import dumps
    from distributed.utils import sync

    marker = tmp_path / "started"

    def slow() -> int:
        marker.write_text("x")
        time.sleep(3)
        return 1

    with Client(cluster.address) as client:
        worker = wait_for_worker(client, "box-a/GPU1/0")  # restarted after an earlier kill
        future = client.submit(slow, workers=[worker], pure=False)
        while not marker.exists():
            time.sleep(0.02)

        async def report() -> None:
            async with rpc(cluster.address) as scheduler:
                await scheduler.gpuwarden_worker_died(address=worker, exit_status="SIGSEGV(-11)",
                                                      executing=dumps([future.key]))

        sync(client.loop, report)
        with pytest.raises(DaskWorkerDiedError, match=r"box-a/GPU1/0 .*GPU 1 on box-a.* "
                           r"died with SIGSEGV\(-11\)"):
            future.result(timeout=30)


def _steal(dask_scheduler: Any, key: str, victim: str, thief: str) -> str:
    """On the scheduler: ask Dask's own work stealing to move a queued task (what its balancer
    does on a busy cluster, here at a moment the test chooses), unless it has moved it already
    (on a loaded machine the balancer may be first)."""
    ts = dask_scheduler.tasks.get(key)
    if ts is None or ts.state != "processing":
        return "not yet"
    if ts.processing_on is None or ts.processing_on.address != victim:
        return "moved already"
    stealing = dask_scheduler.extensions["stealing"]
    return str(stealing.move_task_request(ts, ts.processing_on, dask_scheduler.workers[thief]))


def test_a_task_moved_by_work_stealing_fails_with_the_worker_it_moved_to(cluster: Cluster,
                                                                         tmp_path: Path) -> None:
    """Stealing moves a task without a transition: the death of the worker it moved to, not of
    the one it was first sent to, fails it (on a loaded machine Dask steals on its own; the
    task then ran again instead of failing)."""
    gate, marker, done = tmp_path / "gate", tmp_path / "stolen.pid", tmp_path / "done"

    def block() -> int:
        while not gate.exists():
            time.sleep(0.02)
        return 0

    def moved() -> int:
        marker.write_text(str(os.getpid()))
        pool_tasks.wait_for_file(str(done), 60)  # a run elsewhere ends with the test
        return 1

    with Client(cluster.address) as client:
        victim = wait_for_worker(client, "box-b/GPU0/0")
        thief = wait_for_worker(client, "box-b/GPU1/0")
        try:
            blocker = client.submit(block, workers=[victim], pure=False)
            future = client.submit(moved, workers=[victim], allow_other_workers=True,
                                   pure=False)
            until("the steal asked for or done", lambda: client.run_on_scheduler(
                _steal, key=future.key, victim=victim, thief=thief) not in ("not yet",
                                                                             "in-flight"))
            until("the stolen task started", lambda: marker.exists() and marker.read_text())
            pid = int(marker.read_text())
            ran_on = [a for a, p in client.run(os.getpid).items() if p == pid]
            assert ran_on and ran_on[0] != victim, "the task was not moved"
            name = client.scheduler_info(n_workers=-1)["workers"][ran_on[0]]["name"]
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(DaskWorkerDiedError) as err:
                try:
                    future.result(timeout=60)
                except TimeoutError as exc:
                    raise AssertionError(f"the stolen task neither failed nor finished:\n"
                                         f"{cluster.logs()}") from exc
        finally:
            gate.touch()
            done.touch()
        assert blocker.result(timeout=60) == 0
    assert err.value.worker == name and err.value.exit_status == "SIGKILL(-9)"


def _forget_announcement(dask_scheduler: Any, address: str) -> bool:
    """On the scheduler: the plugin's state as if the worker's announcement never arrived."""
    return dask_scheduler.plugins["gpuwarden"].workers.pop(address, None) is not None


def test_a_worker_whose_announcement_was_lost_still_fails_its_task_when_killed(
        cluster: Cluster, tmp_path: Path) -> None:
    """Beside a CPU hog the scheduler missed a nanny's announcement (a 5 s timeout); the plugin
    then held nothing when that worker died, and Dask ran the task again. The nanny now tries
    again, and its death report says who the worker was: the task fails with the death."""
    marker, done = tmp_path / "unannounced.pid", tmp_path / "done"

    def slow() -> int:
        if not marker.exists():
            marker.write_text(str(os.getpid()))
        # A second run, elsewhere, may still run when the report comes: it ends with the test
        # (a running task outlives its client, and held a GPU of the shared cluster for the
        # next test's tasks to wait up to a minute behind it).
        pool_tasks.wait_for_file(str(done), 60)
        return 1

    with Client(cluster.address) as client:
        worker = wait_for_worker(client, "box-b/GPU0/0")
        assert client.run_on_scheduler(_forget_announcement, address=worker)
        future = client.submit(slow, workers=[worker], allow_other_workers=True, pure=False)
        try:
            until("the task started", lambda: marker.exists() and marker.read_text())
            os.kill(int(marker.read_text()), signal.SIGKILL)
            with pytest.raises(DaskWorkerDiedError) as err:
                future.result(timeout=60)
        finally:
            done.touch()
    assert err.value.worker == "box-b/GPU0/0" and err.value.exit_status == "SIGKILL(-9)"
    assert err.value.host == "box-b" and err.value.gpu == "GPU 0"


def test_sigkill_of_the_worker_command_leaves_no_process_and_no_lease(cluster: Cluster) -> None:
    # box-a's supervisor dies without any clean-up: its nannies die with it, Dask's workers
    # follow their nanny (a pipe to it closes), the kernel drops the lease locks.
    a = cluster.a
    assert a.proc is not None
    pid = a.proc.pid
    a.note_descendants()
    a.proc.kill()
    a.proc.wait()
    assert wait_until_gone(a.descendants, 20) == []
    assert a.leases() == [(0, 1, (0,), os.getpid())]  # only the other job's lease is left
    assert all(h.pid != pid for h in list_leases(a.lease_dir).holders)


@pytest.fixture
def resource_tracker() -> None:
    """multiprocessing's resource tracker: one helper per parent process, for that process's
    life, started by its first spawn (Dask's nannies spawn). Started before the leftover
    check takes its snapshot, it is not counted as left behind."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def test_local_cluster_runs_a_joblib_sweep_on_this_hosts_gpus(
        scenario: Any, lease_dir: Path, resource_tracker: None, no_leftover_processes: None
        ) -> None:
    from joblib import Parallel, delayed, parallel_config

    from gpuwarden.dask import local_cluster

    scenario("two_gpu")
    # Four workers start at once: Dask's 30 s for a nanny's start ran out at load average 20.
    with local_cluster(workers_per_gpu=2, connect_timeout_s=120) as cluster:
        assert cluster.names == ["two-gpu/GPU0/0", "two-gpu/GPU1/0", "two-gpu/GPU0/1",
                                 "two-gpu/GPU1/1"]
        assert [(c.index, c.slots) for h in list_leases(lease_dir).holders
                for c in h.claims] == [(0, (0, 1)), (1, (0, 1))]
        with Client(cluster.scheduler_address), parallel_config(backend="dask"):
            results = Parallel()(delayed(where_am_i)(i) for i in range(12))
    assert {(r["worker"], r["cuda_visible_devices"]) for r in results} <= {
        (name, name.split("/")[1][3:]) for name in cluster.names}
    assert list_leases(lease_dir).holders == ()


def test_a_scheduler_that_does_not_answer_is_named() -> None:
    import asyncio
    import socket

    from gpuwarden.dask.workers import register_scheduler_plugin
    from gpuwarden.errors import SchedulerUnreachableError

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SchedulerUnreachableError, match=f"tcp://127.0.0.1:{port} does not answer"):
        asyncio.run(register_scheduler_plugin(f"tcp://127.0.0.1:{port}", 1.0))
