"""Other projects' test-suites, run against the pool as written, on a simulated 2-GPU host:

- joblib's own test_parallel.py (of the pinned joblib) with "gpuwarden" among its process
  backends, as "loky" and "multiprocessing" are: the copy differs from the original by that
  one line (PROCESS_BACKENDS); the tests that name a backend run for "gpuwarden" (their
  subprocesses' hang guard is 6 times joblib's, for a loaded machine: joblib_suite/conftest.py);
- CPython's own test_concurrent_futures.py (Debian's libpython3.11-testsuite, which .ci/run
  installs), its executor tests that apply to a process executor, with GPUPool as the
  executor (tests/cpython_suite/run_executor_tests.py: imported by path, never copied).

The two run at the same time, each in its own process and lease directory (CPython's is
mostly sleeps): the module's fixture starts CPython's when the first test asks for it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

joblib = pytest.importorskip("joblib")
pytest.importorskip("numpy")

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("external-suites")]

HERE = Path(__file__).parent
CPYTHON_START_METHOD = "forkserver"  # the default; spawn passes too (docs/pool.md), at 2x cost
ORIGINAL = 'PROCESS_BACKENDS = ["multiprocessing", "loky"]'
PATCHED = 'PROCESS_BACKENDS = ["multiprocessing", "loky", "gpuwarden"]'
# test id fragment -> why it cannot apply to a GPU pool
NOT_APPLICABLE: dict[str, str] = {}


def _suite_dir(tmp_path: Path) -> Path:
    source = Path(joblib.__file__).parent / "test" / "test_parallel.py"
    text = source.read_text()
    assert text.count(ORIGINAL) == 1, f"joblib {joblib.__version__} changed its backend list"
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_joblib_parallel.py").write_text(text.replace(ORIGINAL, PATCHED))
    shutil.copy(HERE / "joblib_suite" / "conftest.py", suite / "conftest.py")
    shutil.copy(HERE / "joblib_suite" / "sitecustomize.py", suite / "sitecustomize.py")
    return suite


def cpython_tests() -> Path | None:
    """This interpreter's test_concurrent_futures.py: its own, or Debian's for its version."""
    import sysconfig

    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for base in (Path(sysconfig.get_path("stdlib")), Path(f"/usr/lib/python{version}")):
        path = base / "test" / "test_concurrent_futures.py"
        if path.is_file():
            return path
    return None


@pytest.fixture(scope="module")
def cpython_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[str]]:
    path = cpython_tests()
    if path is None:
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        pytest.skip(f"CPython's test_concurrent_futures.py for Python {version} is not "
                    f"installed (Debian: apt-get install libpython{version}-testsuite, which "
                    ".ci/run does as root)")
    leases = tmp_path_factory.mktemp("cpython-leases")
    env = {**os.environ, "GPUWARDEN_SIMULATE": str(HERE / "scenarios" / "two_gpu.json"),
           "GPUWARDEN_LEASE_DIR": str(leases)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "cpython_suite" / "run_executor_tests.py"), str(path),
         CPYTHON_START_METHOD], cwd=HERE / "cpython_suite", env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    yield proc
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
        proc.wait()


# Generous bounds: ~1.5-2.5 min on a quiet 2-core box, ~4 min at load average 20.
@pytest.mark.timeout(600)
def test_joblib_test_parallel_passes_with_the_gpuwarden_backend(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    with contextlib.suppress(pytest.skip.Exception):
        request.getfixturevalue("cpython_run")  # let CPython's suite run meanwhile
    suite = _suite_dir(tmp_path)
    leases = tmp_path / "leases"
    leases.mkdir()
    env = dict(os.environ)
    env.update(
        GPUWARDEN_SIMULATE=str(HERE / "scenarios" / "two_gpu.json"),
        GPUWARDEN_LEASE_DIR=str(leases),
        PYTHONPATH=os.pathsep.join([str(suite), env.get("PYTHONPATH", "")]),
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    selection = " and ".join(["gpuwarden", *(f"not {k}" for k in NOT_APPLICABLE)])
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         "-o", "addopts=", "--rootdir", str(suite), "-k", selection, "--timeout", "120",
         "--durations", "10",
         "-W", "ignore", str(suite / "test_joblib_parallel.py")],
        cwd=suite, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=560)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    tail = out[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail, tail
    # Nothing of the run survives it: no pool worker, fork server or lease. (loky's workers,
    # started by the nested-loop tests, notice that their parent has gone within seconds.)
    deadline = time.monotonic() + 20
    leftovers = [p for p in psutil.process_iter(["environ"]) if _from_run(p, leases)]
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.2)
        leftovers = [p for p in leftovers if _still_running(p)]
    assert not leftovers, [(p.pid, _cmdline(p)) for p in leftovers]
    assert not [p for p in leases.rglob("*") if p.is_file() and p.stat().st_size], \
        list(leases.rglob("*"))


# After joblib's (which started it): the two suites ran at the same time.
@pytest.mark.timeout(600)
def test_cpython_executor_tests_pass_with_gpupool(cpython_run: subprocess.Popen[str]) -> None:
    out, _ = cpython_run.communicate(timeout=560)
    tail = out[-6000:]
    assert cpython_run.returncode == 0, tail
    ran, skipped, failed = (int(x) for x in re.findall(r"RAN (\d+) SKIPPED (\d+) FAILED (\d+)",
                                                       tail)[-1])
    assert failed == 0 and ran - skipped >= 40, tail


def _still_running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _from_run(proc: psutil.Process, leases: Path) -> bool:
    try:
        return (proc.info["environ"] or {}).get("GPUWARDEN_LEASE_DIR") == str(leases)
    except psutil.Error:
        return False
