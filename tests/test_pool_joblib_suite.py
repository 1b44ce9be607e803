"""joblib's own test-suite (joblib/test/test_parallel.py of the pinned joblib) with "gpuwarden"
among its process backends, as "loky" and "multiprocessing" are, on a simulated 2-GPU host.

The copy of joblib's module differs from the original by one line (PROCESS_BACKENDS); the
tests that name a backend run for "gpuwarden" (``-k gpuwarden``). Tests that cannot apply
are deselected below with their reason (also listed in docs/pool.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

joblib = pytest.importorskip("joblib")
pytest.importorskip("numpy")

HERE = Path(__file__).parent
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


@pytest.mark.timeout(300)
def test_joblib_test_parallel_passes_with_the_gpuwarden_backend(tmp_path: Path) -> None:
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
         "-W", "ignore", str(suite / "test_joblib_parallel.py")],
        cwd=suite, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=280)
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
