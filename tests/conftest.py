"""Shared test fixtures: the `gpu` marker, simulated hosts, the no-leftover-process check, and
the real Slurm cluster (tests/_slurm.py).

How the suite runs (scripts/test): in parallel with pytest-xdist (``-n``, ``--dist loadgroup``),
in a random order (pytest-randomly; ``-p no:randomly`` for the file's order, ``-p randomly -p
"randomly_seed=N"`` to repeat one). So no test may count on another having run before it, on
running in the same process as another, or on the environment another left behind (the
``_own_environment`` fixture puts ``os.environ`` back after every test).

**An expensive fixture** (a cluster, daemons, network namespaces with jobs in them, an external
test-suite, a job that several tests query) is built once per *worker process* that needs it:
module- and session-scoped fixtures are per worker under xdist. Keep its tests on one worker by
giving them one group, and its cost is paid once::

    pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]

    @pytest.fixture(scope="session")  # or "module": the group decides where it is built
    def slurm_cluster(tmp_path_factory): ...

Every module that uses the fixture names the same group (a session fixture shared by three
modules: all three say ``xdist_group("slurm")``). A group runs its tests one after another on
one worker, so a group is a chain: give one only to what is expensive to build twice or must
not run beside itself (two ``slurmctld`` on one port), and list it in ``LONG_GROUPS`` below
when its chain is long, so it starts first. Tests of a group still run in a random order: a
fixture that must see the end of its tests checks that in its own teardown, not in a test that
"runs last". Cheap fixtures (a temporary directory, a user, namespaces without jobs) need no
group.

**Slow tests** (``@pytest.mark.slow``: they start interpreters that import torch, clusters,
namespaces; over about a second on a quiet machine) are left out by ``scripts/test --quick``,
the inner loop's unit tier.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpuwarden.inventory import real_gpu_present

SCENARIOS = Path(__file__).parent / "scenarios"
EXAMPLE_SCENARIO = Path(__file__).resolve().parents[2] / "shared" / "scenarios" / "example.json"
_RUN_ROOT = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    import tempfile

    # One directory for everything this run writes outside pytest's tmp_path, removed at the
    # end: the processes tests start get it as their TMPDIR, so what they cannot remove
    # themselves goes with it (the run directory of a launcher a test killed, torch's
    # torchelastic_* trees, a Dask worker's space); 1,200 such directories had piled up in
    # /tmp over a day of runs. An xdist worker nests its own inside the controller's.
    root = tempfile.mkdtemp(prefix="gwtest-")
    config.stash[_RUN_ROOT] = root
    os.chmod(root, 0o755)  # tests run gpuwarden as another user too
    scratch = os.path.join(root, "tmp")
    os.mkdir(scratch)
    os.chmod(scratch, 0o1777)  # as /tmp
    os.environ["TMPDIR"] = scratch
    # No test (nor a process a test starts) may touch the host's real lease directory:
    # a developer's running jobs would block tests, and tests would block the jobs.
    os.environ["GPUWARDEN_LEASE_DIR"] = tempfile.mkdtemp(prefix="leases-", dir=root)
    # Nor the host's job registry: launches started by tests register their control endpoint
    # here (0700, this run's own), so `status`/`stacks` in tests see only this run's jobs.
    os.environ["GPUWARDEN_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="run-", dir=root)


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    root = config.stash.get(_RUN_ROOT, None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


# Groups whose chain of tests is the longest (minutes): started before anything else, so the
# rest of the suite runs beside them instead of after them.
LONG_GROUPS = ("external-suites", "slurm", "slurm-pgid", "slurm-two-hosts")


# trylast: after pytest-randomly's shuffle and pytest's own grouping by parametrized fixtures,
# both of which the stable sort below keeps within each rank.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not real_gpu_present():
        skip = pytest.mark.skip(reason="needs a real NVIDIA GPU (NVML reports none here)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    # The longest chains first: xdist hands out work in this order (``--no-loadscope-reorder``),
    # and a long test started last is the wall time of the whole run.
    items.sort(key=_start_rank)  # stable: the random (or the file's) order within each rank
    if os.environ.get("PYTEST_XDIST_WORKER") and config.getvalue("loadgroup"):
        _refuse_lost_groups(items)


def _group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def _start_rank(item: pytest.Item) -> int:
    group = _group(item)
    if group in LONG_GROUPS:
        return 0
    if group is not None:
        return 1
    return 2 if item.get_closest_marker("slow") else 3


def _refuse_lost_groups(items: list[pytest.Item]) -> None:
    """xdist passes a test's group to its scheduler as a suffix of the test's id ("...@dask");
    where pytest ignores that (pytest 9.2 with xdist 3.8: pytest-xdist issue 1386), grouped
    tests would be spread over the workers, each building the group's fixture again and
    running beside each other: stop instead."""
    lost = [item.nodeid for item in items if _group(item) and "@" not in item.nodeid]
    if lost:
        why = (f"--dist loadgroup is not honoured by this pytest and pytest-xdist ({lost[0]} has "
               "no @group in its id; pytest-xdist issue 1386): install the test extra's versions "
               "(scripts/setup), or run without workers (-n 0)")
        sys.stderr.write(f"\nerror: {why}\n")  # a worker's exception reaches the terminal mangled
        raise pytest.UsageError(why)


@pytest.fixture(autouse=True)
def _own_environment() -> Iterator[None]:
    """Every test starts from the environment the session started with. A command run
    in-process through ``main()`` may change ``os.environ`` as the command's own process would
    (``gpuwarden worker`` empties CUDA_VISIBLE_DEVICES for its children): that must not reach
    the tests after it, nor the processes they start (a later ``gpuwarden ls`` saw no GPU)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def scenario(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Use a scenario file from tests/scenarios (by stem) or a path as the simulated host."""

    def use(name_or_path: str | Path) -> Path:
        path = Path(name_or_path)
        if not path.is_absolute() and not path.exists():
            path = SCENARIOS / f"{name_or_path}.json"
        monkeypatch.setenv("GPUWARDEN_SIMULATE", str(path))
        return path

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for var in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
        monkeypatch.delenv(var, raising=False)
    return use


@pytest.fixture
def lease_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private lease directory, so tests never see each other's (or the host's) leases."""
    path = tmp_path / "leases"
    path.mkdir()
    monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(path))
    return path


# How long a process the test stopped may take to finish dying before it counts as left behind:
# an interpreter with torch loaded takes seconds to tear down on a loaded 2-core machine, and
# a leaked process never ends (the tests' own sleep a minute or more), so a generous bound
# costs time only when something leaked.
LEFTOVER_GRACE_S = 15.0


def wait_until_gone(pids: list[int], timeout_s: float = LEFTOVER_GRACE_S) -> list[int]:
    """Pids among ``pids`` still alive (zombies count as gone) after up to ``timeout_s``: it
    returns as soon as all are gone, so the bound is spent only on a leak."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.05)
    return alive


def until(what: str, check: Callable[[], Any], timeout_s: float = 60.0,
          poll_s: float = 0.02) -> Any:
    """``check()``'s first true value, polled every ``poll_s``; fails naming ``what`` after
    ``timeout_s``: a wait for an event, with a cap far above a loaded machine's times."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {what}"
        time.sleep(poll_s)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real file system of ``size`` (``64k``) mounted on the empty folder ``path`` for the
    block, to fill up or make read-only; skips the test where it cannot be mounted."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def no_leftover_processes() -> Iterator[None]:
    """Fail the test if it leaves any descendant of the test process running."""
    me = psutil.Process(os.getpid())
    before = {p.pid for p in me.children(recursive=True)}
    yield
    new = [p.pid for p in me.children(recursive=True) if p.pid not in before]
    left = wait_until_gone(new, LEFTOVER_GRACE_S)
    for pid in left:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, f"processes left behind: {left}"


def real_gpu_count() -> int:
    """GPUs the real NVML backend reports (gpu-marked tests only: they skip without a GPU)."""
    from gpuwarden.inventory.nvml import NvmlBackend

    return len(NvmlBackend().read_host().gpus)


@pytest.fixture
def real_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's own GPUs: no simulated host, no inherited CUDA_VISIBLE_DEVICES."""
    monkeypatch.delenv("GPUWARDEN_SIMULATE", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


# -- a real Slurm cluster (tests/_slurm.py) ---------------------------------------------------

@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Any]:
    """Two slurmd nodes beside slurmctld on this machine, started once per session (the
    first test that asks) and stopped at its end; skips with the reason where it cannot be had.
    Under pytest-xdist a session is a worker: every test that uses it is in
    ``xdist_group("slurm")``, so that one worker starts the daemons (tests/test_slurm.py)."""
    from tests import _slurm

    reason = _slurm.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = _slurm.start_cluster()
    yield cluster
    problems = _slurm.destroy_cluster(cluster)
    assert not problems, problems


@pytest.fixture
def slurm(slurm_cluster: Any, no_leftover_processes: None) -> Iterator[Any]:
    """The session's Slurm cluster, checked after the test: see :func:`slurm_checked`."""
    yield from slurm_checked(slurm_cluster)


def slurm_checked(cluster: Any) -> Iterator[Any]:
    """Yield ``cluster``; afterwards cancel whatever still runs and fail the test when a
    process is left in the cluster's namespaces (slurmstepd, a task, a rank whose parent died)
    or a node is not idle: the next test gets a clean cluster either way."""
    import signal

    yield cluster
    cluster.cancel_all()
    left = cluster.wait_no_job_processes(30)
    described = cluster.describe(left)
    for pid in left:  # processes of this cluster's jobs, in its own namespaces
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        cluster.wait_idle(30)
        not_idle = ""
    except RuntimeError as exc:
        not_idle = str(exc).splitlines()[0]
        cluster.run(["scontrol", "update", f"NodeName={','.join(cluster.nodes)}",
                     "State=RESUME"], timeout=30)
    assert not left, f"processes left in the Slurm cluster: {described}"
    assert not not_idle, not_idle
