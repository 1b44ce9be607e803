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
