"""gpuwarden launch with real processes: gloo on CPU, real signals, real ports.

Select with ``pytest tests/test_launch_procs.py``. Scripts that do not need torch do not import
it (each torch import costs ~1.5 s of CPU on a shared box): the supervisor's behaviour is the
same for any rank process. The torch-importing tests are the all_reduce/DDP runs, the echo case
and the two stall cases.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from gpuwarden.cli import main
from gpuwarden.distributed import SpawnError, spawn
from gpuwarden.launch.config import DEFAULT_GRACE_S
from gpuwarden.lease import list_leases
from tests.conftest import SCENARIOS, wait_until_gone

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "launch_scripts"
pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.slow]


@pytest.fixture(autouse=True)
def _cpu_host(monkeypatch: pytest.MonkeyPatch, lease_dir: Path) -> None:
    # The same host picture on every machine: no GPU (a real one would change the binding).
    monkeypatch.setenv("GPUWARDEN_SIMULATE", str(SCENARIOS / "nogpu.json"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def launch(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["launch", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def pids_in(piddir: Path) -> list[int]:
    pids: list[int] = []
    for f in piddir.glob("rank*.pids"):
        pids += [int(p) for p in f.read_text().split()]
    return pids


def wait_for_files(piddir: Path, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len([f for f in piddir.glob("rank*.pids") if f.read_text().strip()]) < n:
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_torchrun_script_all_reduce_on_2_and_4_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    for n, total in ((2, 3), (4, 10)):
        code, out, err = launch(capsys, "-n", str(n), str(ROOT / "examples" / "allreduce.py"))
        assert code == 0, err
        for rank in range(n):
            assert f"[rank{rank}]: rank {rank}/{n}: all_reduce sum = {total}" in out


@pytest.mark.timeout(120)
def test_init_script_and_ddp_example(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNCLOSED_LOG_DIR", str(tmp_path))
    code, out, err = launch(capsys, "-n", "2", str(SCRIPTS / "init_allreduce.py"))
    assert code == 0, err
    assert "[rank1]: rank 1/2 local 1 cpu gloo launcher=gpuwarden sum=3" in out
    assert "[rank0]: atexit handler ran" in out and "[rank1]: atexit handler ran" in out
    for rank in (0, 1):  # files the script never closed are flushed by the normal exit
        assert (tmp_path / f"rank{rank}.txt").read_text() == "written without close\n"
    code, out, err = launch(capsys, "-n", "2", str(ROOT / "examples" / "train_ddp.py"))
    assert code == 0, err
    assert "[rank0]: rank 0/2 on cpu: step 59" in out and "[rank1]: rank 1/2 on cpu: step 59" in out


@pytest.mark.timeout(60)
def test_destroy_frees_the_group_that_ddp_would_keep(capsys: pytest.CaptureFixture[str]) -> None:
    # torch.distributed.nn, imported after init (by DDP), holds the default group in default
    # arguments: its gloo threads outlived destroy() and could abort the rank as it exited
    code, out, err = launch(capsys, "-n", "1", str(SCRIPTS / "ddp_group_freed.py"))
    assert code == 0, err
    assert "[rank0]: BEFORE ['gloo_tcp_loop', 'pt_gloo_runloop', 'pt_gloo_runloop']" in out
    assert "[rank0]: AFTER []" in out


@pytest.mark.timeout(60)
def test_environment_prefixes_logs_and_no_torch_import(capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path) -> None:
    script = str(SCRIPTS / "env_dump.py")
    code, out, err = launch(capsys, "-n", "2", "--log-dir", str(tmp_path / "logs"), "--tee", "3",
                            "--rdzv-id", "job7", script, "--x", "1")
    assert code == 0, err
    envs = {}
    for line in out.splitlines():  # tee'd: tagged as torchrun tags it, [default0]:
        prefix, _, rest = line.partition(":")
        if rest.startswith("ENV "):
            envs[prefix] = json.loads(rest[4:])
    assert set(envs) == {"[default0]", "[default1]"}
    assert envs["[default1]"]["RANK"] == "1" and envs["[default1]"]["WORLD_SIZE"] == "2"
    assert envs["[default0]"]["MASTER_PORT"] == envs["[default1]"]["MASTER_PORT"]
    assert "[default0]:TORCH_IMPORTED False" in out  # the bootstrap never imports torch itself
    assert '[default1]:ARGV ["--x", "1"]' in out
    assert f"[default0]:SYSPATH0 {SCRIPTS}" in out  # as `python SCRIPT` would set it
    assert "[default1]:to stderr from 1" in err
    # torchrun's layout: LOG_DIR/<run id>_<random>/attempt_0/<local rank>/std{out,err}.log
    (run_dir,) = (tmp_path / "logs").glob("job7_*")
    assert (run_dir / "attempt_0" / "1" / "stderr.log").read_text() == "to stderr from 1\n"
    assert "ENV " in (run_dir / "attempt_0" / "0" / "stdout.log").read_text()
    assert envs["[default0]"]["TORCHELASTIC_RUN_ID"] == "job7"
    code, out, err = launch(capsys, "-n", "2", "--quiet", script)
    assert code == 0 and "[rank0]: ENV" in out and "[rank1]" not in out + err
    code, out, err = launch(capsys, "-n", "1", "-m", "tests.launch_scripts.env_dump", "--y")
    assert code == 0 and '[rank0]: ARGV ["--y"]' in out


@pytest.mark.timeout(60)
def test_simulated_two_gpu_host_gives_every_rank_the_jobs_gpus(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWARDEN_SIMULATE", str(SCENARIOS / "two_gpu.json"))
    code, out, err = launch(capsys, "-n", "2", str(SCRIPTS / "env_dump.py"))
    assert code == 0, err
    seen = sorted((e["CUDA_VISIBLE_DEVICES"], e["LOCAL_RANK"]) for e in (
        json.loads(line.split("ENV ", 1)[1]) for line in out.splitlines() if "ENV " in line))
    assert seen == [("0,1", "0"), ("0,1", "1")]  # torchrun's: cuda:LOCAL_RANK is the rank's own
    code, out, err = launch(capsys, "-n", "2", "--bind", "rank", str(SCRIPTS / "env_dump.py"))
    assert code == 0, err
    seen = sorted((e["CUDA_VISIBLE_DEVICES"], e["LOCAL_RANK"]) for e in (
        json.loads(line.split("ENV ", 1)[1]) for line in out.splitlines() if "ENV " in line))
    assert seen == [("0", "0"), ("1", "0")]  # --virtual-local-rank: its one GPU as cuda:0
    # the launcher (not a rank) holds the lease on both GPUs while the ranks run, then drops it
    code, out, err = launch(capsys, "-n", "2", str(SCRIPTS / "lease_check.py"))
    assert code == 0, err
    assert f"[rank0]: LEASE {os.getpid()} 0,1" in out
    assert not list_leases().holders
    code, out, err = launch(capsys, "-n", "3", str(SCRIPTS / "env_dump.py"))
    assert code == 4 and "[rank" not in out + err  # refused before any rank started
    assert "3 rank(s) need 3 GPU(s)" in err and "GPU 0: ok" in err and "GPU 1: ok" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode, exit_code, words", [
    ("raise", 1, "rank 1 failed first: ValueError: bad batch 17"),
    ("exit3", 3, "rank 1 failed first: exit code 3"),
    ("segv", 128 + 11, "rank 1 was killed by SIGSEGV(-11)"),
    ("fpe", 128 + 8, "rank 1 was killed by SIGFPE(-8)"),
    ("kill", 128 + 9, "rank 1 was killed by SIGKILL(-9)"),
])
def test_first_failure_stops_every_rank_within_grace(capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     mode: str, exit_code: int, words: str) -> None:
    monkeypatch.setenv("PIDDIR", str(tmp_path))
    grace = 1.0
    code, out, err = launch(capsys, "-n", "3", "--grace", f"{grace}s", str(SCRIPTS / "crash.py"), mode)
    ended = time.monotonic()
    assert code == exit_code, err
    assert words in err
    failed_at = float((tmp_path / "failed_at").read_text())
    term_at = min(float(p.read_text()) for p in tmp_path.glob("term_at*"))
    # Survivors ignore SIGTERM (they note when it came): only SIGKILL after the grace period
    # ends them. From that SIGTERM to the launcher's end the bound is the default grace, which
    # a launcher ignoring --grace would wait. Measured from the failure it also held the time
    # to notice it: 5.24 s beside a 2-core CPU hog (load 11), 1.1 s quiet.
    assert term_at >= failed_at
    assert ended - term_at < DEFAULT_GRACE_S, (ended - term_at, term_at - failed_at)
    assert "rank 0: pid" in err and "stopped by gpuwarden (signal SIGKILL(-9))" in err
    assert not wait_until_gone(pids_in(tmp_path))  # ranks and their own children
    if mode == "raise":
        assert 'File "' + str(SCRIPTS / "crash.py") in err and "_bootstrap.py" not in err
    if mode in ("segv", "fpe"):
        assert "Python stack of rank 1 at the crash" in err and "crash.py\", line" in err
        assert "error[RANK_NATIVE_CRASH]" in err  # its own native code, not "a rank failed"
    if mode == "kill":
        assert "out-of-memory killer" in err


@pytest.mark.timeout(60)
def test_echo_in_peer_is_not_blamed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = launch(capsys, "-n", "2", "--json", str(SCRIPTS / "gloo_raise.py"))
    assert code == 1
    report = err[err.index("error["):]
    assert "rank 1 failed first: RuntimeError: CUDA out of memory" in report
    assert report.startswith("error[CUDA_OOM]")  # the explain knowledge base names the code
    # the same root cause as data: the rank's exit, and what explain read in its output
    fields = json.loads(out)["report"]["fields"]
    assert (fields["rank"], fields["exception"], fields["returncode"]) == (1, "RuntimeError", 1)
    assert fields["explain"]["requested_bytes"] == 2 * 1024**3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, code_name, where", [
    ("noinit", "RDZV_WORKERS_MISSING", "init_process_group"),
    ("collective", "RANK_STALL", "all_reduce"),
])
def test_stall_names_missing_rank_with_its_stack(capsys: pytest.CaptureFixture[str],
                                                 mode: str, code_name: str, where: str) -> None:
    stall_s = 4.0
    start = time.monotonic()
    code, out, err = launch(capsys, "-n", "2", "--stall-timeout", f"{stall_s}s", "--grace", "1s",
                            str(SCRIPTS / "stall.py"), mode)
    took = time.monotonic() - start
    assert code == 1
    assert f"error[{code_name}]: rank(s) 0 waited in {where} for more than {stall_s:g} s" in err
    assert "rank(s) 1 of 2 did not get there" in err
    assert "stack of rank 1 (innermost first):" in err
    stack1 = err.split("stack of rank 1 (innermost first):")[1]
    assert "stall.py\", line" in stack1 and ("line 8" in stack1 if mode == "noinit" else "line 14" in stack1)
    # Named at --stall-timeout, not at the default 300 s: rank startup (two torch imports, 20 s
    # and more on a loaded 2-core machine) + the timeout + the stack dump + stopping.
    assert took < stall_s + 60, took


def _launcher(tmp_path: Path, *argv: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PIDDIR": str(tmp_path)}
    return subprocess.Popen([sys.executable, "-c", "from gpuwarden.cli import console_main; console_main()",
                             "launch", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.timeout(60)
def test_supervisor_sigterm_stops_every_rank(tmp_path: Path) -> None:
    proc = _launcher(tmp_path, "-n", "2", "--grace", "1s", str(SCRIPTS / "sleeper.py"))
    wait_for_files(tmp_path, 2)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=10)
    assert proc.returncode == 128 + signal.SIGTERM
    assert b"error[LAUNCH_INTERRUPTED]: gpuwarden received SIGTERM" in err
    assert not wait_until_gone(pids_in(tmp_path))


@pytest.mark.timeout(60)
def test_supervisor_sigkill_leaves_no_orphan(tmp_path: Path) -> None:
    proc = _launcher(tmp_path, "-n", "2", str(SCRIPTS / "sleeper.py"))
    wait_for_files(tmp_path, 2)
    pids = pids_in(tmp_path)
    assert all(psutil.pid_exists(p) for p in pids)
    proc.kill()
    proc.communicate(timeout=10)
    left = wait_until_gone(pids)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"orphans: {left}"


@pytest.mark.timeout(60)
def test_port_taken_explicit_fails_at_once_auto_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        start = time.monotonic()
        code, out, err = launch(capsys, "-n", "2", "--master-port", str(busy), str(SCRIPTS / "port_check.py"))
        assert code == 1 and f"error[RDZV_PORT_IN_USE]: MASTER_PORT {busy} is already in use" in err
        assert time.monotonic() - start < 2 and "[rank" not in out
        code, out, err = launch(capsys, "-n", "2", str(SCRIPTS / "port_check.py"))
        assert code == 0 and "[rank0]: bound" in out


def times_ten(rank: int, base: int) -> int:
    return base + rank * 10


def fails_on_one(rank: int) -> None:
    if rank == 1:
        raise KeyError("missing shard")


@pytest.mark.timeout(60)
def test_spawn_returns_results_and_reports_failures() -> None:
    assert spawn(times_ten, 2, args=(5,)) == [5, 15]
    with pytest.raises(SpawnError) as info:
        spawn(fails_on_one, 2)
    assert "rank 1 failed first: KeyError: 'missing shard'" in str(info.value)


@pytest.mark.timeout(60)
def test_keep_waiting_reports_once_and_keeps_the_job(tmp_path: Path) -> None:
    proc = _launcher(tmp_path, "-n", "2", "--stall-timeout", "3s", "--keep-waiting", "--grace", "1s",
                     str(SCRIPTS / "stall.py"), "noinit")
    assert proc.stderr is not None
    seen = b""
    deadline = time.monotonic() + 40
    while b"still waiting" not in seen and time.monotonic() < deadline:
        seen += proc.stderr.readline()
    assert b"error[RDZV_WORKERS_MISSING]" in seen and b"(--keep-waiting: still waiting)" in seen
    time.sleep(1.0)
    assert proc.poll() is None  # the job was not stopped
    proc.send_signal(signal.SIGINT)
    _out, rest = proc.communicate(timeout=15)
    assert proc.returncode == 128 + signal.SIGINT and b"LAUNCH_INTERRUPTED" in rest


@pytest.mark.timeout(60)
def test_wait_for_gpus_then_launch(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    host = tmp_path / "host.json"
    host.write_text((SCENARIOS / "example.json").read_text())  # one usable GPU of four
    monkeypatch.setenv("GPUWARDEN_SIMULATE", str(host))

    import threading

    freed = threading.Timer(1.5, lambda: host.write_text((SCENARIOS / "two_gpu.json").read_text()))
    freed.start()
    try:
        start = time.monotonic()
        code, out, err = launch(capsys, "-n", "2", "--wait", "20s", "--json", str(SCRIPTS / "env_dump.py"))
    finally:
        freed.cancel()
    assert code == 0, err
    assert time.monotonic() - start >= 1.5
    report = json.loads(out[out.index("{\n"):])
    assert report["schema_version"] == 1 and report["report"]["ok"] is True
    code, out, err = launch(capsys, "-n", "3", "--wait", "1s", str(SCRIPTS / "env_dump.py"))
    assert code == 4 and "3 rank(s) need 3 GPU(s)" in err


@pytest.mark.timeout(60)
def test_supervisor_never_imports_torch() -> None:
    code = ("import sys; from gpuwarden.cli import main; "
            f"rc = main(['launch', '-n', '2', {str(ROOT / 'examples' / 'allreduce.py')!r}]); "
            "bad = [m for m in ('torch', 'rich', 'joblib') if m in sys.modules]; "
            "print('HEAVY', bad); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


def _multinode_crash_plan(tmp_path: Path, node_rank: int):  # type: ignore[no-untyped-def]
    from gpuwarden.launch.config import LaunchConfig
    from gpuwarden.launch.plan import make_plan

    # Two nodes on paper; crash.py imports no torch, so nothing ever connects to the address.
    config = LaunchConfig(target=str(SCRIPTS / "crash.py"), args=("raise",), nproc=2, cpu=True,
                          grace_s=1.0, nnodes=2, node_rank=node_rank, master_addr="198.18.0.1",
                          master_port=29999)
    return make_plan(config, (), master_port=29999, run_id="mn-kill", run_dir=str(tmp_path),
                     supervisor_pid=os.getpid(), python=sys.executable,
                     base_env=os.environ)


def _kill_after(piddir: Path, delay_s: float) -> threading.Thread:
    """Watchdog: if the supervisor never SIGKILLs the ranks that ignore SIGTERM, kill them here
    so run() returns and the test fails on its timing instead of hanging."""
    def kill() -> None:
        time.sleep(delay_s)
        for pid in pids_in(piddir):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    t = threading.Thread(target=kill, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(60)
@pytest.mark.parametrize("node_rank", [0, 1])
def test_multinode_ranks_ignoring_sigterm_are_killed_after_grace(
        tmp_path: Path, node_rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0 whose rank failed, and node 1 stopping because another node aborted: ranks that
    ignore SIGTERM get SIGKILL after --grace, as on one node (node 0 sets no abort key and a
    node told to stop does not send one back, so neither may wait on that step)."""
    from gpuwarden.launch.supervisor import Supervisor

    monkeypatch.setenv("PIDDIR", str(tmp_path))
    plan = _multinode_crash_plan(tmp_path, node_rank)
    sup = Supervisor(plan, stdout=open(os.devnull, "w"), stderr=open(os.devnull, "w"))  # noqa: SIM115
    if node_rank == 1:
        # Ranks 2 and 3 never fail; what node 0's rank 1 set in the store reaches this node
        # through a rank's peers file, written by its store watch (here, once both ignore SIGTERM).
        def abort_arrives() -> None:
            wait_for_files(tmp_path, 2)
            time.sleep(0.3)
            Path(plan.ranks[0].files.peers).write_text(json.dumps(
                {"connected": True, "abort": {"rank": 1, "node": 0, "what": "rank 1 failed"}}))

        threading.Thread(target=abort_arrives, daemon=True).start()
    _kill_after(tmp_path, 15.0)
    outcome = sup.run()
    took = outcome.ended_at - outcome.started_at
    survivors = [r for r in plan.local_ranks if r != 1]
    assert took < 1.0 + 6.0, f"ranks ignoring SIGTERM outlived --grace 1s by {took - 1:.1f} s"
    for rank in survivors:
        assert outcome.exits[rank].returncode == -signal.SIGKILL
    if node_rank == 1:
        assert outcome.stopped_for == "abort"
    assert not wait_until_gone(pids_in(tmp_path))
