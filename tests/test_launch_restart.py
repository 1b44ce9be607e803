"""--max-restarts: the pure policy on recorded failures, and real gloo launches on CPU.

Each launch restarts a whole 2-rank group as torchrun does (TORCHELASTIC_RESTART_COUNT seen by
the script, a fresh rendezvous), but decides from the failure: a SIGKILLed rank is restarted,
the same KeyError twice ends the job, a GPU that showed a hardware fault is swapped for another.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpuwarden.launch.config import LaunchConfig
from gpuwarden.launch.outcome import Failure
from gpuwarden.launch.restart.policy import RestartPolicy, decide_restart, innermost_frame
from gpuwarden.launch.runner import launch as run_launch
from tests.conftest import SCENARIOS

SCRIPT = str(Path(__file__).parent / "launch_scripts" / "restart.py")
pytestmark = pytest.mark.usefixtures("no_leftover_processes")

KEYERROR = Failure("RANK_FAILED", 1, "KeyError", "/job/train.py:41", what="KeyError: 'lr'")
SIGKILLED = Failure("RANK_FAILED", 1, signal="SIGKILL")


# ---- the policy, on recorded failures ----------------------------------------------------------


def test_a_new_exception_gets_another_attempt_the_same_one_twice_ends_the_job() -> None:
    policy = RestartPolicy(max_restarts=5)
    assert decide_restart([], KEYERROR, policy).restart
    second = decide_restart([KEYERROR], KEYERROR, policy)
    assert not second.restart and second.reason == "same failure twice, not restarting"
    # the same type elsewhere, or in another rank, is another failure
    moved = Failure("RANK_FAILED", 1, "KeyError", "/job/train.py:52")
    other_rank = Failure("RANK_FAILED", 0, "KeyError", "/job/train.py:41")
    assert decide_restart([KEYERROR], moved, policy).restart
    assert decide_restart([KEYERROR], other_rank, policy).restart
    # "in a row": a different failure in between resets it
    assert decide_restart([KEYERROR, SIGKILLED], KEYERROR, policy).restart


def test_a_rank_that_raised_then_died_of_a_signal_is_said_to_have_raised() -> None:
    """torch's gloo threads can abort an interpreter that is exiting after an exception
    (SIGABRT): the attempt's line names the exception, as the policy judges the failure (a
    loaded run of the suite said "rank 0: SIGABRT" and hid the RuntimeError)."""
    raised = Failure("RANK_FAILED", 0, "RuntimeError", "/job/restart.py:31", signal="SIGABRT")
    assert raised.describe() == "RANK_FAILED (rank 0: RuntimeError at /job/restart.py:31, then SIGABRT)"
    assert SIGKILLED.describe() == "RANK_FAILED (rank 1: SIGKILL)"
    assert KEYERROR.describe() == "RANK_FAILED (rank 1: KeyError at /job/train.py:41)"
    # judged by its exception: the same one twice ends the job, a signal alone would not
    assert not decide_restart([raised], raised, RestartPolicy(5)).restart


def test_causes_that_can_pass_are_restarted_every_time_within_the_budget() -> None:
    policy = RestartPolicy(max_restarts=3)
    for failure in (SIGKILLED, Failure("NCCL_WATCHDOG_TIMEOUT", 0, "torch.distributed.DistBackendError",
                                       "/x.py:9"),
                    Failure("RDZV_CONNECT_TIMEOUT", 2, "torch.distributed.DistNetworkError", "/x.py:3"),
                    Failure("RANK_STALL"), Failure("NODE_ABORTED", 3, what="exit code -9"),
                    Failure("RANK_FAILED", 0, "RuntimeError", "/x.py:3", echo=True)):
        assert decide_restart([failure, failure], failure, policy).restart, failure
        spent = decide_restart([failure] * 3, failure, policy)
        assert not spent.restart and "no restarts left (--max-restarts 3)" in spent.reason


def test_another_nodes_same_exception_twice_ends_this_node_too() -> None:
    """Every node decides alike: node 1's KeyError reaches node 0 as NODE_ABORTED."""
    remote = Failure("NODE_ABORTED", 3, "KeyError", "node 1", what="KeyError: 'lr'")
    assert decide_restart([], remote, RestartPolicy(3)).restart
    assert decide_restart([remote], remote, RestartPolicy(3)).reason == \
        "same failure twice, not restarting"


def test_the_jobs_configuration_is_not_restarted_unless_always() -> None:
    guard = Failure("MAIN_GUARD_MISSING", 0, "RuntimeError", "/x.py:1")
    assert not decide_restart([], guard, RestartPolicy(2)).restart
    # the host's NVSwitch fabric is down: no attempt on this host can create a context
    fabric = Failure("CUDA_SYSTEM_NOT_READY", 0, "RuntimeError", "/x.py:5")
    assert not decide_restart([], fabric, RestartPolicy(2)).restart
    # gloo's peer went away: an echo of another rank's death, which can pass
    lost = Failure("GLOO_PEER_LOST", 1, "RuntimeError", "/x.py:9")
    assert decide_restart([lost], lost, RestartPolicy(3)).restart
    assert decide_restart([], guard, RestartPolicy(2, "always")).restart
    # --restart-on always: torchrun's blind restarts, the same bug included
    assert decide_restart([KEYERROR], KEYERROR, RestartPolicy(2, "always")).restart
    stopped = Failure("LAUNCH_INTERRUPTED")
    assert not decide_restart([], stopped, RestartPolicy(2, "always")).restart
    assert not decide_restart([], KEYERROR, RestartPolicy(0)).restart


def test_a_faulty_or_busy_gpu_is_excluded() -> None:
    fault = Failure("GPU_HARDWARE_FAULT", 1, "RuntimeError", "/x.py:3", gpu="GPU-1")
    busy = Failure("CUDA_DEVICES_BUSY", 0, "RuntimeError", "/x.py:3", gpu="GPU-0")
    assert decide_restart([], fault, RestartPolicy(1)).exclude_gpus == ("GPU-1",)
    assert decide_restart([fault], fault, RestartPolicy(2)).exclude_gpus == ("GPU-1",)
    assert decide_restart([], busy, RestartPolicy(1, "always")).exclude_gpus == ("GPU-0",)
    assert decide_restart([], KEYERROR, RestartPolicy(1)).exclude_gpus == ()


def test_innermost_frame_is_where_the_exception_was_raised() -> None:
    tb = ('Traceback (most recent call last):\n  File "/job/train.py", line 80, in <module>\n'
          '    main()\n  File "/job/cfg.py", line 12, in main\n    x = c["lr"]\nKeyError: \'lr\'\n')
    assert innermost_frame(tb) == "/job/cfg.py:12"
    assert innermost_frame("KeyError: 'lr'") is None


# ---- real launches (gloo on CPU) ---------------------------------------------------------------


@pytest.fixture
def cpu_host(monkeypatch: pytest.MonkeyPatch, lease_dir: Path) -> None:
    monkeypatch.setenv("GPUWARDEN_SIMULATE", str(SCENARIOS / "nogpu.json"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _launch(capsys: pytest.CaptureFixture[str], mode: str, **kw: object):  # type: ignore[no-untyped-def]
    config = LaunchConfig(target=SCRIPT, args=(mode,), nproc=2, grace_s=2.0,
                          restart_backoff_s=0.2, **kw)  # type: ignore[arg-type]
    report, outcome = run_launch(config)
    out, err = capsys.readouterr()
    return report, outcome, out, err


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("cpu_host")
def test_a_rank_sigkilled_after_init_is_restarted_and_the_job_finishes(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    report, outcome, out, err = _launch(capsys, "kill_once", cpu=True, max_restarts=2,
                                        log_dir=str(tmp_path), run_id="job")
    assert report.exit_code == 0, report.render() + err
    for rank in (0, 1):
        assert f"[rank{rank}]: rank {rank} done, restart count 1 of 2, sum 4" in out
    assert re.search(r"attempt 1/3 failed: RANK_FAILED \(rank 1: SIGKILL\); a cause that can "
                     r"pass: restarting in 0.2 s", err), err
    assert outcome.plan.attempt == 1
    # torchrun's log layout: one attempt_<k> per attempt, each with its error-file directories
    (run,) = tmp_path.glob("job_*")
    assert sorted(p.name for p in run.iterdir()) == ["attempt_0", "attempt_1"]
    assert (run / "attempt_1" / "1").is_dir()
    assert outcome.plan.ranks[1].env["TORCHELASTIC_ERROR_FILE"] == str(
        run / "attempt_1" / "1" / "error.json")
    assert "on attempt 2 of 3 (after 1 restart(s)" in report.what


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("cpu_host")
def test_a_failure_of_the_stores_rank_after_init_leaves_the_next_rendezvous_working(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 0 hosts the TCPStore: its attempt-0 store dies with it; attempt 1 rendezvous on a
    fresh port (torchrun's restarted gloo ranks can reach the old attempt's addresses)."""
    report, outcome, out, err = _launch(capsys, "raise_rank0", cpu=True, max_restarts=1)
    assert report.exit_code == 0, report.render() + err
    assert "[rank1]: rank 1 done, restart count 1 of 1, sum 4" in out
    assert "RuntimeError at " in err and "restart.py:" in err
    assert "Connection refused" not in out + err


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("cpu_host")
def test_the_same_keyerror_twice_ends_the_job_after_the_second_attempt(
        capsys: pytest.CaptureFixture[str]) -> None:
    report, outcome, out, err = _launch(capsys, "keyerror", cpu=True, max_restarts=5)
    assert report.exit_code == 1 and outcome.plan.attempt == 1, report.render() + err
    assert "attempt 1/6 failed: RANK_FAILED (rank 1: KeyError at " in err
    assert "attempt 2/6 failed" in err and "same failure twice, not restarting" in err
    assert "attempt 3/6" not in err
    assert report.evidence[-1] == "--max-restarts 5: same failure twice, not restarting"
    assert "KeyError" in report.what


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_gpu_that_showed_a_hardware_fault_is_swapped_for_another(
        capsys: pytest.CaptureFixture[str], scenario, lease_dir: Path) -> None:  # type: ignore[no-untyped-def]
    scenario("idle8")
    report, outcome, out, err = _launch(capsys, "ecc_once", max_restarts=1)
    assert report.exit_code == 0, report.render() + err
    first, second = (s.gpu for s in outcome.plan.ranks)
    assert first is not None and second is not None
    line = next(ln for ln in err.splitlines() if "attempt 1/2 failed" in ln)
    assert "GPU_HARDWARE_FAULT (rank 1" in line, line
    faulty, fresh = re.search(r"excluded (GPU \d+) replaced by (GPU \d+) \(newly leased\)",
                              line).groups()  # type: ignore[union-attr]
    assert fresh == second.label and faulty not in (first.label, fresh)
    visible = outcome.plan.ranks[1].env["CUDA_VISIBLE_DEVICES"].split(",")
    assert faulty.split()[1] not in visible and len(visible) == 2
    assert f"[rank1]: rank 1 done, restart count 1 of 1, gpu {second.label}" in out


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_on_real_gpus_a_sigkilled_nccl_rank_is_restarted_and_the_job_finishes(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL after a restart: the new attempt's communicator on the same (kept) GPUs."""
    from gpuwarden.inventory.nvml import NvmlBackend

    monkeypatch.delenv("GPUWARDEN_SIMULATE", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    n = min(2, len(NvmlBackend().read_host().gpus))
    config = LaunchConfig(target=SCRIPT, args=("kill_once",), nproc=n, gpus=n, grace_s=5.0,
                          restart_backoff_s=0.5, max_restarts=1, min_free_bytes=1 << 30)
    report, outcome = run_launch(config)
    out, err = capsys.readouterr()
    assert report.exit_code == 0, report.render() + err
    assert f"attempt 1/2 failed: RANK_FAILED (rank {n - 1}: SIGKILL)" in err
    for rank in range(n):
        assert f"[rank{rank}]: rank {rank} done, restart count 1 of 1, sum {n * n}" in out
