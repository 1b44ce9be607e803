"""`gpuwarden launch` as a newcomer meets it: bounded rank counts, a start that can be stopped
and says how far it got, and a wait in line that prints what it waits for. Through main(argv),
with real rank processes (scripts that do not import torch)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.cli import main
from gpuwarden.launch import supervisor
from gpuwarden.launch.ranks.pcontext import ProcessContext
from gpuwarden.lease import lease, list_leases
from tests.conftest import SCENARIOS

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.fixture
def sleeper(tmp_path: Path) -> str:
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    return str(script)


@pytest.fixture(autouse=True)
def _cpu_host(monkeypatch: pytest.MonkeyPatch, lease_dir: Path) -> None:
    monkeypatch.setenv("GPUWARDEN_SIMULATE", str(SCENARIOS / "nogpu.json"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_an_absurd_rank_count_is_refused_in_one_line(capsys: pytest.CaptureFixture[str],
                                                     sleeper: str) -> None:
    started = time.monotonic()
    assert main(["launch", "-n", "100000", sleeper]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error[USAGE]: -n 100000: more ranks than one node runs (at most 1024)")
    assert err.count("\n") == 1 and time.monotonic() - started < 20  # no rank was started


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_while_ranks_start_stops_the_start(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, sleeper: str,
        sig: signal.Signals) -> None:
    starts: list[int] = []
    real_start = ProcessContext.start

    def start_then_signal(self: ProcessContext, argv: Any, env: Any, **stdio: Any) -> Any:
        proc = real_start(self, argv, env, **stdio)
        starts.append(proc.pid)
        if len(starts) == 2:  # the user's Ctrl-C (or the scheduler's SIGTERM) arrives now
            os.kill(os.getpid(), sig)
        return proc

    monkeypatch.setattr(ProcessContext, "start", start_then_signal)
    started = time.monotonic()
    code = main(["launch", "-n", "6", "--grace", "2s", sleeper])
    err = capsys.readouterr().err
    assert code == 128 + sig and len(starts) == 2
    assert f"gpuwarden: {sig.name} while starting ranks: 2 of 6 started, stopping them" in err
    assert f"error[LAUNCH_INTERRUPTED]: gpuwarden received {sig.name} while starting ranks and " \
        "stopped the 2 of 6 it had started" in err
    assert time.monotonic() - started < 30


@pytest.mark.timeout(60)
def test_a_long_start_says_how_far_it_got(capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(supervisor, "START_PROGRESS_S", 0.0)  # every rank counts as slow
    script = tmp_path / "quick.py"
    script.write_text("pass\n")
    assert main(["launch", "-n", "3", str(script)]) == 0
    err = capsys.readouterr().err
    assert "gpuwarden: started 1 of 3 ranks" in err and "gpuwarden: started 2 of 3 ranks" in err


@pytest.mark.timeout(60)
def test_launch_wait_says_what_it_waits_for(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch, sleeper: str) -> None:
    monkeypatch.setenv("GPUWARDEN_SIMULATE", str(SCENARIOS / "two_gpu.json"))
    with lease(2, label="train.py"):
        assert main(["launch", "--gpus", "1", "--wait", "1s", sleeper]) == 4
    err = capsys.readouterr().err
    assert "gpuwarden: waiting for 1 GPU (0 of 2 free now): GPU0 leased by pid" in err
    assert "error[LEASE_TIMEOUT]" in err or "error[SELECT_UNSATISFIED]" in err
    assert list_leases().holders == ()


@pytest.mark.parametrize(("argv", "words"), [
    (["launch", "--min-free", "99999999999999999999GiB", "x.py"], "--min-free 99999999999999999999GiB: more memory"),
    (["launch", "--nprocs", "2", "x.py"], "did you mean --nproc-per-node?"),
    (["worker", "--workers-per-gpu", "0", "tcp://127.0.0.1:8786"], "--workers-per-gpu 0: must be 1 or more"),
    (["worker", "--min-free", "9999999999GiB", "tcp://127.0.0.1:8786"], "more memory than any GPU"),
])
def test_usage_errors_name_the_flag_and_the_fix(capsys: pytest.CaptureFixture[str],
                                                argv: list[str], words: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error[USAGE]: ") and words in err and "; fix: " in err
    assert err.count("\n") == 1


def test_launch_without_a_script_names_only_the_script_as_missing(capsys) -> None:
    """`gpuwarden launch` alone said "required: SCRIPT, ARGS": the script's arguments are
    optional, as under torchrun."""
    from gpuwarden.cli import main

    assert main(["launch"]) == 2
    err = capsys.readouterr().err
    assert "required: SCRIPT;" in err and "ARGS" not in err, err


# ---- issue 36: the rendezvous named, not waited out ---------------------------------------

C10D_DNS_LINE = ("[W1127 11:44:04.716900646 socket.cpp:764] [c10d] The IPv6 network addresses of "
                 "(no-such-host.invalid, 29534) cannot be retrieved (gai error: -2 - Name or "
                 "service not known).")


@pytest.mark.timeout(60)
def test_a_master_addr_that_does_not_resolve_is_refused_before_any_rank_starts(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, sleeper: str) -> None:
    """One node, `--master-addr no-such-host.invalid --master-port P`: the ranks retried the
    name silently for 57-90 s; `doctor` and `explain` named it at once, so does launch now."""
    from gpuwarden.net import pick_free_port

    def no_rank(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a rank was started")

    monkeypatch.setattr(ProcessContext, "start", no_rank)
    started = time.monotonic()
    code = main(["launch", "-n", "2", "--master-addr", "no-such-host.invalid", "--master-port",
                 str(pick_free_port()), sleeper])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith(
        "error[RDZV_DNS]: MASTER_ADDR 'no-such-host.invalid' does not resolve"), err
    assert "fix: give --master-addr a name or address this host resolves" in err
    assert time.monotonic() - started < 15
    assert list_leases().holders == ()


@pytest.mark.timeout(60)
def test_ctrl_c_on_ranks_stuck_in_the_rendezvous_says_why(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Ctrl-C said only LAUNCH_INTERRUPTED while every rank's stderr said why it waited: the
    report names it, from the lines the ranks wrote before the stop (torch prints a long C++
    stack for the interrupted connect, which would push them out of the tail)."""
    import threading

    script = tmp_path / "stuck.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "def stop(*_):\n"
        "    for i in range(60):\n"
        "        print(f'frame #{i}: <unknown function> + 0x3d2825', file=sys.stderr)\n"
        "    sys.exit(1)\n"
        "signal.signal(signal.SIGINT, stop)\n"
        f"line = {C10D_DNS_LINE!r}\n"
        "for i in range(600):\n"
        "    print(line, file=sys.stderr, flush=True)\n"
        "    if i == 2:\n"
        "        open(os.path.join(sys.argv[1], 'ready.' + os.environ['RANK']), 'w').close()\n"
        "    time.sleep(0.1)\n")

    def interrupt() -> None:
        deadline = time.monotonic() + 40
        while len(list(tmp_path.glob("ready.*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    helper = threading.Thread(target=interrupt)
    helper.start()
    code = main(["launch", "-n", "2", str(script), str(tmp_path)])
    helper.join()
    err = capsys.readouterr().err
    assert code == 130, err
    report = err[err.index("error[LAUNCH_INTERRUPTED]"):]
    assert "why: before the interrupt, rank(s) 0, 1 were stuck: MASTER_ADDR (or a peer's host " \
        "name) does not resolve (RDZV_DNS)" in report, report
    assert "matched in rank 0's output: " in report and "no-such-host.invalid" in report


def test_status_says_what_ranks_in_the_rendezvous_are_stuck_on() -> None:
    """`status` said "2 (2 in rendezvous) running" while the ranks retried an unknown name."""
    from gpuwarden.cli.status import build_view, to_plain
    from gpuwarden.launch.observer.observe import diagnose_waits

    rows = [{"rank": r, "pid": 4000 + r, "gpu": None, "phase": "rendezvous", "op": None,
             "for_s": 8.2, "cpu_cores": 0.0, "where": "init_process_group at train.py:4"}
            for r in (0, 1)]
    diagnose_waits(rows, {0: (C10D_DNS_LINE,), 1: ("nothing known", C10D_DNS_LINE)})
    assert [r["diagnosis"]["code"] for r in rows] == ["RDZV_DNS", "RDZV_DNS"]
    launch = {"run_id": "r", "target": "train.py", "node_rank": 0, "nnodes": 1, "attempt": 0,
              "max_restarts": 0, "uptime_s": 9.0, "sample_interval_s": 2.0, "stall": None,
              "ranks": rows}
    job = {"id": "812345", "user": "me", "kind": "launch", "age_s": 9.0, "gpus": [],
           "command": "gpuwarden launch -n 2 train.py", "launch": launch}
    text = to_plain(build_view({"host": "box", "generated_at": 0.0, "jobs": [job]}))
    assert "2 (2 in rendezvous (RDZV_DNS))" in text, text
    assert "rank(s) 0, 1 in rendezvous: RDZV_DNS: MASTER_ADDR (or a peer's host name) does " \
        "not resolve; rank 0 printed: [W1127" in text, text


@pytest.mark.parametrize("where", ["/proc/x", "read-only"])
def test_a_log_dir_that_cannot_be_made_is_one_line_and_exit_2(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        sleeper: str, where: str) -> None:
    """`--log-dir /proc/x`, or a read-only directory: an OSError traceback and exit 1 before."""
    import errno

    log_dir = where
    if where == "read-only":
        # root writes anywhere on this host's file systems: the kernel's answer is simulated
        log_dir = str(tmp_path / "ro" / "logs")
        real = os.makedirs

        def read_only(path: Any, *args: Any, **kwargs: Any) -> None:
            if str(path).startswith(str(tmp_path / "ro")):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            real(path, *args, **kwargs)

        monkeypatch.setattr(os, "makedirs", read_only)
    code = main(["launch", "--log-dir", log_dir, "-t", "3", sleeper])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"error[USAGE]: --log-dir {log_dir}: cannot create {log_dir} (")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert list_leases().holders == ()


def test_a_launch_refused_before_its_ranks_leaves_no_log_directory(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, sleeper: str) -> None:
    """The log directory is made before GPUs are leased (so an unusable one holds nothing);
    a launch refused after it (--gpus 1 on a host without one) leaves no empty run directory behind."""
    logs = tmp_path / "logs"
    assert main(["launch", "--log-dir", str(logs), "--gpus", "1", sleeper]) == 4
    assert "error[SELECT_UNSATISFIED]" in capsys.readouterr().err
    assert list(logs.iterdir()) == []


# ---- issue 36, item 8: a CPU world far beyond the cores, and a bounded stop -----------------

def test_a_cpu_world_far_beyond_the_cores_is_refused_unless_asked_for(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`launch -n 999` on a 2-core host started 121 ranks before anyone could stop it."""
    from gpuwarden.launch import config as launch_config
    from gpuwarden.launch.plan import cpu_count

    quick = tmp_path / "quick.py"
    quick.write_text("pass\n")
    cores = cpu_count()
    limit = max(launch_config.MIN_CPU_RANK_LIMIT, launch_config.CPU_RANKS_PER_CORE * cores)
    monkeypatch.setattr(ProcessContext, "start", lambda *_a, **_k: pytest.fail("a rank started"))
    assert main(["launch", "-n", str(limit + 1), str(quick)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error[USAGE]: -n {limit + 1}: {limit + 1} CPU ranks on {cores} "
                          f"core(s), more than {limit} are refused"), err
    assert "--oversubscribe to run them anyway" in err and err.count("\n") == 1
    monkeypatch.undo()
    monkeypatch.setenv("GPUWARDEN_SIMULATE", str(SCENARIOS / "nogpu.json"))
    # asked for: it runs (a smaller limit here, so that the test starts 3 ranks, not 17)
    monkeypatch.setattr(launch_config, "MIN_CPU_RANK_LIMIT", 2)
    monkeypatch.setattr(launch_config, "CPU_RANKS_PER_CORE", 1)
    n = max(2, cores) + 1
    assert main(["launch", "-n", str(n), str(quick)]) == 2
    capsys.readouterr()
    assert main(["launch", "-n", str(n), "--oversubscribe", str(quick)]) == 0, \
        capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_stop_during_the_start_has_only_the_started_ranks_to_undo(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        sleeper: str) -> None:
    """Every rank's error-file directory was made before the first rank started: 999 of them,
    and as many to remove when SIGTERM came after 34 starts (6 s on this host's disk). Each is
    made as its rank starts now, as torchrun's agent makes them for the ranks it starts."""
    starts: list[int] = []
    real_start = ProcessContext.start

    def start_then_signal(self: ProcessContext, argv: Any, env: Any, **stdio: Any) -> Any:
        proc = real_start(self, argv, env, **stdio)
        starts.append(proc.pid)
        if len(starts) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return proc

    monkeypatch.setattr(ProcessContext, "start", start_then_signal)
    logs = tmp_path / "logs"
    assert main(["launch", "-n", "12", "--grace", "2s", "--log-dir", str(logs), sleeper]) == 143
    capsys.readouterr()
    (run,) = logs.iterdir()
    assert sorted(p.name for p in (run / "attempt_0").iterdir()) == ["0", "1"]


def test_tidying_the_error_file_tree_is_bounded(tmp_path: Path) -> None:
    from gpuwarden.launch.runner import _drop_if_no_error_file

    base = tmp_path / "torchelastic_x"
    for rank in range(20):
        (base / "run_y" / "attempt_0" / str(rank)).mkdir(parents=True)
    _drop_if_no_error_file(str(base), budget_s=0.0)  # no time: left as torchrun leaves it
    assert len(list((base / "run_y" / "attempt_0").iterdir())) == 20
    _drop_if_no_error_file(str(base), budget_s=30.0)
    assert not base.exists()
    (base / "run_y" / "attempt_0" / "1").mkdir(parents=True)
    (base / "run_y" / "attempt_0" / "1" / "error.json").write_text("{}")
    _drop_if_no_error_file(str(base), budget_s=30.0)  # an error file: kept, the report names it
    assert (base / "run_y" / "attempt_0" / "1" / "error.json").exists()


# ---- issue 36, item 14: the others stopped as promptly as torchrun stops them ----------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize(("error", "settles"), [
    ("KeyError('lr')", False), ("SystemExit(3)", False),
    ("RuntimeError('[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1')",
     True),
])
def test_a_ranks_own_failure_stops_the_others_without_waiting(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        error: str, settles: bool) -> None:
    """Every failure waited 0.25 s before the others got SIGTERM (for a rank that might be
    leaving on its own: the cause of an echo). A rank's own error needs no such wait: torchrun's
    0.1 s monitor stops the others once the failing rank has exited (bench_stop.py: ~0.7 s after
    the raise here); gpuwarden now within milliseconds of it."""
    settled: list[bool] = []
    real = supervisor.Supervisor._settle

    def record(self: supervisor.Supervisor) -> None:
        settled.append(True)
        real(self)

    monkeypatch.setattr(supervisor.Supervisor, "_settle", record)
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "open(os.path.join(sys.argv[1], 'ready.' + os.environ['RANK']), 'w').close()\n"
        "while len([n for n in os.listdir(sys.argv[1]) if n.startswith('ready.')]) < 2:\n"
        "    time.sleep(0.01)\n"
        "if os.environ['RANK'] == '1':\n"
        f"    raise {error}\n"
        "time.sleep(60)\n")
    code = main(["launch", "-n", "2", str(script), str(tmp_path)])
    err = capsys.readouterr().err
    assert code != 0 and "rank 0: pid" in err and "stopped by gpuwarden" in err, err
    assert bool(settled) is settles, err
