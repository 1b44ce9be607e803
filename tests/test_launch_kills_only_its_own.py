"""`gpuwarden launch` signals nothing it did not start, and leaves nothing it started (issue 25).

- A rank that left early is not reaped until the job's end: its pid, and so its process
  group's number, cannot go to another process meanwhile. Forced with
  /proc/sys/kernel/ns_last_pid: another user's process asking for that pid does not get it,
  and no process of another user is signalled.
- Killed with SIGKILL, the supervisor leaves no descendant: not a rank's child in its group,
  not one in a session of its own, not a daemon re-parented to the launcher that later moved
  to a group of its own. Run as root (a cgroup per job) and as another user (no cgroup here:
  the subreaper with re-checks).
- A full --log-dir is a warning; a MemoryError in the supervisor is a report, ranks stopped.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests._unix_users import User, become, made_user
from tests.conftest import SCENARIOS, small_tmpfs, wait_until_gone

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "launch_scripts"
pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.slow]
NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


@pytest.fixture(autouse=True)
def _cpu_host(monkeypatch: pytest.MonkeyPatch, lease_dir: Path) -> None:
    monkeypatch.setenv("GPUWARDEN_SIMULATE", str(SCENARIOS / "nogpu.json"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.fixture(scope="module")
def mallory() -> Iterator[User]:
    with made_user("l") as user:
        yield user


def _launcher(piddir: Path, *argv: str, user: User | None = None,
              extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``gpuwarden launch ARGV`` in a process of its own (as ``user``: with the system's
    Python, which that user may run, and this checkout's packages)."""
    env = {**os.environ, "PIDDIR": str(piddir), **(extra_env or {})}
    python = sys.executable
    if user is not None:
        python = "/usr/bin/python3"
        site = next((ROOT / ".venv" / "lib").glob("python3*/site-packages"), None)
        if not os.access(python, os.X_OK) or site is None:
            pytest.skip("no Python another user may run on this host")
        env["PYTHONPATH"] = f"{ROOT / 'src'}:{site}"
        env.pop("VIRTUAL_ENV", None)
    return subprocess.Popen(
        [python, "-c", "from gpuwarden.cli import console_main; console_main()", "launch",
         *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL, preexec_fn=(lambda: become(user)) if user else None)


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()):
        assert proc.poll() is None, proc.communicate()[1].decode()
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.02)
    return path.read_text()


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@pytest.mark.timeout(120)
def test_a_reaped_ranks_pid_is_never_taken_or_signalled(tmp_path: Path, mallory: User) -> None:
    """Rank 1 leaves at once, rank 0 stays. Meanwhile another user's process asks the kernel
    for rank 1's pid (ns_last_pid = pid - 1, then fork), and makes it a group of its own:
    before issue 25 it got it, and the launcher's final SIGKILL to rank 1's group killed it."""
    if not os.access(NS_LAST_PID, os.W_OK):
        pytest.skip("cannot steer pid allocation here (ns_last_pid)")
    tmp_path.chmod(0o755)
    go = tmp_path / "go"
    proc = _launcher(tmp_path, "-n", "2", str(SCRIPTS / "early_exit.py"),
                     extra_env={"GO": str(go)})
    others: list[int] = []
    try:
        rank1 = int(_wait_for(tmp_path / "rank1.pids", proc))
        deadline = time.monotonic() + 30
        while _state(rank1) not in (None, "Z"):
            assert time.monotonic() < deadline, "rank 1 did not exit"
            time.sleep(0.02)
        for _ in range(20):  # another process of the host may take the pid between the two
            NS_LAST_PID.write_text(str(rank1 - 1))
            pid = os.fork()
            if pid == 0:
                try:
                    become(mallory)
                    os.setsid()  # a group of its own: number rank1, if the kernel gave it
                    os.execvp("sleep", ["sleep", "60"])
                finally:
                    os._exit(127)
            others.append(pid)
            if pid == rank1:
                break
        # The rank's zombie keeps its pid until the job is over: nobody can be given it.
        assert rank1 not in others, "another user's process was given a pid the job still had"
        go.touch()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        alive = [p for p in others if _state(p) not in (None, "Z")]
        assert alive == others, "the launcher signalled another user's process"
    finally:
        go.touch()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=30)
        for pid in others:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("as_user", [False, True], ids=["root-cgroup", "user-subreaper"])
def test_no_descendant_outlives_a_sigkilled_supervisor(tmp_path: Path, mallory: User,
                                                       as_user: bool) -> None:
    piddir = Path(tempfile.mkdtemp(prefix="gpuwarden-descendants-"))  # hers to write too
    piddir.chmod(0o777)
    user = mallory if as_user else None
    proc = _launcher(piddir, "-n", "1", str(SCRIPTS / "descendants.py"), user=user,
                     extra_env={"GPUWARDEN_LEASE_DIR": str(piddir / "leases")})
    try:
        rank_pids = [int(p) for p in _wait_for(piddir / "rank0.pids", proc).split()]
        daemon = int(_wait_for(piddir / "daemon.pids", proc))
        _wait_for(piddir / "daemon.moved", proc)
        pids = [*rank_pids, daemon]
        st = psutil.Process(daemon)
        assert os.getpgid(daemon) == daemon and st.ppid() == proc.pid  # adopted, moved
        time.sleep(1.5)  # the supervisor's once-a-second look at its descendants
        assert all(_state(p) not in (None, "Z") for p in pids)
    except BaseException:
        proc.kill()
        proc.communicate(timeout=30)
        shutil.rmtree(piddir, ignore_errors=True)
        raise
    proc.kill()  # SIGKILL: no cleanup code of the supervisor runs
    proc.communicate(timeout=30)
    shutil.rmtree(piddir, ignore_errors=True)
    left = wait_until_gone(pids)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"outlived the supervisor: {[psutil.Process(p).cmdline() for p in left]}"
    if not as_user:  # the watcher removes the job's cgroup once it is empty
        deadline = time.monotonic() + 5
        while list(Path("/sys/fs/cgroup").glob(f"*/gpuwarden-job-{proc.pid}-*")):
            assert time.monotonic() < deadline, "the job's cgroup was left behind"
            time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_full_log_dir_is_a_warning_and_the_job_finishes(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    with small_tmpfs(logs, "128k"):
        proc = _launcher(tmp_path, "-n", "1", "--log-dir", str(logs), "--tee", "3",
                         str(SCRIPTS / "chatty.py"))
        out, err = proc.communicate(timeout=90)
    text = err.decode()
    assert proc.returncode == 0, text
    assert "Traceback" not in text
    assert "warning: the log file" in text and "No space left on device" in text, text
    # tee'd: tagged as torchrun tags it
    # (twice in loaded runs 1998 of 2000 reached the console, not reproduced alone: say which)
    said = {int(m) for m in re.findall(rb"\[default0\]:line (\d+) ", out)}
    missing = sorted(set(range(2000)) - said)
    where = out.find(f"line {missing[0] - 1} ".encode()) if missing else -1
    assert b"[default0]:DONE" in out and not missing, \
        (missing, out[max(where - 20, 0):where + 1200] if where >= 0 else out[:1200])


@pytest.mark.timeout(120)
def test_a_memory_error_in_the_supervisor_is_a_report_and_stops_the_ranks(tmp_path: Path
                                                                          ) -> None:
    """The allocation that fails is injected (a real one cannot be aimed): at the first
    output a rank relays, the position a flood of output would hit."""
    code = ("import gpuwarden.launch.ranks.relay as relay\n"
            "def feed(self, is_err, data):\n"
            "    raise MemoryError\n"
            "relay.RankRelay.feed = feed\n"
            "from gpuwarden.cli import console_main\n"
            "console_main()\n")
    env = {**os.environ, "PIDDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", code, "launch", "-n", "1",
                             str(SCRIPTS / "talk_then_sleep.py")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    text = err.decode()
    assert proc.returncode == 1, text
    assert "error[OUT_OF_MEMORY]" in text and "Traceback" not in text, text
    pids = [int(p) for p in (tmp_path / "rank0.pids").read_text().split()] \
        if (tmp_path / "rank0.pids").exists() else []
    assert not wait_until_gone(pids)
