"""`gpuwarden run` and `gpuwarden leases` through main() and as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpuwarden.cli import main
from gpuwarden.lease import lease, list_leases
from tests.conftest import wait_until_gone

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

PY = sys.executable


def _gpuwarden(*args: str, **kwargs) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    return subprocess.Popen([PY, "-c", "from gpuwarden.cli import console_main; console_main()", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def test_run_gives_the_child_its_gpus_and_passes_its_exit_code(scenario, lease_dir, tmp_path,
                                                              capfd):
    scenario("two_idle")
    out = tmp_path / "env.json"
    code = ("import json, os, sys; json.dump({k: os.environ.get(k) for k in "
            "('CUDA_VISIBLE_DEVICES', 'CUDA_DEVICE_ORDER', 'GPUWARDEN_LEASE_ID')}, "
            f"open({str(out)!r}, 'w')); sys.exit(7)")
    assert main(["run", "--gpus", "2", "--", PY, "-c", code]) == 7
    env = json.loads(out.read_text())
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["GPUWARDEN_LEASE_ID"]
    assert "leased GPU 0,1" in capfd.readouterr().err
    assert list_leases().holders == ()  # released


def test_run_reports_a_signalled_child_as_128_plus_signal(scenario, lease_dir):
    scenario("two_idle")
    assert main(["run", "-q", "--", "sh", "-c", "kill -TERM $$"]) == 128 + signal.SIGTERM
    assert main(["run", "-q", "--", "sh", "-c", "kill -KILL $$"]) == 128 + signal.SIGKILL


def test_run_without_a_command_or_with_a_missing_one_is_a_usage_error(scenario, lease_dir):
    scenario("two_idle")
    assert main(["run", "--gpus", "1"]) == 2
    assert main(["run", "--", "/no/such/program"]) == 2
    assert list_leases().holders == ()


def test_run_exits_4_with_the_blocking_lease_when_the_wait_times_out(scenario, lease_dir, capfd):
    scenario("two_idle")
    with lease(2, label="train.py"):
        started = time.monotonic()
        assert main(["run", "--wait", "0.3", "--", "true"]) == 4
        assert time.monotonic() - started < 5
    err = capfd.readouterr().err
    assert "error[LEASE_TIMEOUT]" in err
    assert "GPU0 leased by pid" in err and "train.py" in err
    # Piped stderr: plain status lines, not a live display.
    assert "gpuwarden: waiting for 1 GPU (0 of 2 free now): GPU0 leased by pid" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_run_forwards_signals_and_leaves_no_process_behind(scenario, lease_dir, tmp_path, sig):
    scenario("two_idle")
    pids = tmp_path / "pids"
    # A shell that starts a background grandchild, then waits: both must go.
    script = f"sleep 60 & echo $$ $! > {pids}; wait"
    proc = _gpuwarden("run", "--", "sh", "-c", script)
    deadline = time.monotonic() + 20
    while not (pids.exists() and pids.read_text().strip()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    shell, grandchild = (int(x) for x in pids.read_text().split())
    assert len(list_leases().holders) == 1
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + sig, err  # sh dies of the forwarded signal
    assert wait_until_gone([shell, grandchild]) == []
    assert list_leases().holders == ()


@pytest.mark.timeout(60)
def test_run_leaves_no_background_leftover_after_the_command_exits(scenario, lease_dir, tmp_path):
    scenario("two_idle")
    pids = tmp_path / "pids"
    assert main(["run", "-q", "--", "sh", "-c", f"sleep 60 & echo $! > {pids}; exit 3"]) == 3
    assert wait_until_gone([int(pids.read_text())]) == []


@pytest.mark.timeout(60)
def test_killing_gpuwarden_run_kills_the_command_and_frees_the_gpu(scenario, lease_dir, tmp_path):
    scenario("two_idle")
    pids = tmp_path / "pids"
    proc = _gpuwarden("run", "--gpus", "2", "--", "sh", "-c", f"echo $$ > {pids}; sleep 60")
    deadline = time.monotonic() + 40  # a fresh interpreter's start on a loaded machine
    while not (pids.exists() and pids.read_text().strip()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.kill()  # SIGKILL: no cleanup code runs in gpuwarden
    # Its output pipes stay open until its reaper has killed the command's group (1.5-1.8 s
    # measured under load); the command dies with gpuwarden, not after its 60 s sleep.
    proc.communicate(timeout=30)
    assert wait_until_gone([int(pids.read_text())], timeout_s=20) == []
    with lease(2, wait=20) as grant:
        assert grant.visible_devices == "0,1"


def test_leases_lists_holders_and_waiting_requests_as_json(scenario, lease_dir, capsys):
    scenario("two_idle")
    with lease(1, label="train.py"):
        assert main(["leases", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["schema_version"] == 1
        [holder] = data["holders"]
        assert holder["pid"] == os.getpid() and holder["label"] == "train.py"
        assert holder["user"] == psutil.Process().username()
        assert holder["claims"][0]["index"] == 0
        assert data["waiting"] == []
        assert main(["leases"]) == 0
        table = capsys.readouterr().out
        assert "train.py" in table and str(os.getpid()) in table
        # A request waiting in line (2 GPUs, one is ours) shows in both forms.
        waiter = _gpuwarden("run", "--gpus", "2", "--slots-per-gpu", "2", "--slots-each", "2",
                            "--label", "sweep.py", "--wait", "60", "--", "true")
        try:
            deadline = time.monotonic() + 20
            while not list_leases().tickets:
                assert time.monotonic() < deadline and waiter.poll() is None, waiter.communicate()
                time.sleep(0.05)
            assert main(["leases", "--json"]) == 0
            [ticket] = json.loads(capsys.readouterr().out)["waiting"]
            assert ticket["label"] == "sweep.py" and ticket["gpus_wanted"] == 2
            assert main(["leases"]) == 0
            table = capsys.readouterr().out
            assert "sweep.py" in table and "2 GPUs (2 of 2 slots each)" in table
        finally:
            waiter.kill()
            waiter.communicate()


def test_leases_on_a_host_without_a_lease_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(tmp_path / "none"))
    assert main(["leases", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["holders"] == []
    assert not Path(tmp_path / "none").exists()


def test_run_labels_a_long_command_by_its_end(scenario, lease_dir, tmp_path):
    scenario("two_idle")
    out = tmp_path / "label"
    code = ("import sys; from gpuwarden.lease import list_leases; "
            f"open({str(out)!r}, 'w').write(list_leases().holders[0].label)")
    assert main(["run", "-q", "--", PY, "-c", code, "--config=" + "x" * 120, "END"]) == 0
    label = out.read_text()
    assert label.startswith(os.path.basename(PY)) and label.endswith(" END")
    assert len(label) <= 80


def test_shell_exit_code_and_die_with_parent_as_a_preexec_fn():
    import ctypes

    from gpuwarden.procs import shell_exit_code

    assert [shell_exit_code(r) for r in (0, 3, -9, -15)] == [0, 3, 137, 143]
    get_pdeathsig = (
        "import ctypes, sys; s = ctypes.c_int(); "
        "ctypes.CDLL(None).prctl(2, ctypes.byref(s), 0, 0, 0); sys.exit(s.value)")
    real_cdll = ctypes.CDLL

    def no_dlopen(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("dlopen between fork and exec")

    from functools import partial

    from gpuwarden.procs import die_with_parent

    ctypes.CDLL = no_dlopen  # type: ignore[misc]
    try:
        child = subprocess.run([PY, "-c", get_pdeathsig],
                               preexec_fn=partial(die_with_parent, os.getpid()))
    finally:
        ctypes.CDLL = real_cdll  # type: ignore[misc]
    assert child.returncode == signal.SIGKILL  # PR_GET_PDEATHSIG in the command


# ---- what can be checked at once is checked before any wait in line -----------------------------

@pytest.mark.parametrize(("argv", "code", "words"), [
    (["--wait", "1m", "--", "nosuchcommand-29"], 2, "command not found: 'nosuchcommand-29' is not on PATH"),
    (["--wait", "1m", "--", "/etc/passwd"], 2, "'/etc/passwd' is not executable"),
    (["--include", "9", "--wait", "1m", "--", "true"], 2, "--include 9: no visible GPU is '9'"),
    (["--gpus", "3", "--wait", "1m", "--", "true"], 4, "at most 2 of 2 could ever be usable"),
    (["--min-free", "90GiB", "--wait", "1m", "--", "true"], 4, "too small for --min-free 90.0 GiB"),
    (["--min-free", "99999999999999999999999999999GiB", "--", "true"], 2, "more memory than any GPU"),
    (["--slots-per-gpu", "100000", "--", "true"], 2, "--slots-per-gpu 100000: must be between 1 and 64"),
    (["--slots-per-gpu", "2", "--slots-each", "3", "--", "true"], 2, "--slots-each 3 is more than"),
    (["--gpus", "0", "--", "true"], 2, "--gpus 0: must be 1 or more"),
    (["--bogus", "--", "true"], 2, "gpuwarden run: unrecognized argument --bogus"),
])
def test_run_refuses_at_once_what_no_wait_could_serve(scenario, lease_dir, capfd, argv, code, words):
    scenario("two_idle")
    started = time.monotonic()
    assert main(["run", *argv]) == code
    err = capfd.readouterr().err
    # every case that waits would wait a minute: 20 s is a bound a loaded machine keeps
    assert time.monotonic() - started < 20, "checked before waiting in line"
    assert words in err and "waiting for" not in err
    assert list_leases().holders == () and list_leases().tickets == ()


def test_run_gpus_all_leases_every_usable_gpu(scenario, lease_dir, tmp_path, capfd):
    scenario("example")  # GPU 1 is the only usable one
    out = tmp_path / "cvd"
    assert main(["run", "--gpus", "all", "--", "sh", "-c", f"echo $CUDA_VISIBLE_DEVICES > {out}"]) == 0
    assert out.read_text().strip() == "1"
    scenario("two_idle")
    assert main(["run", "--gpus", "all", "--", "sh", "-c", f"echo $CUDA_VISIBLE_DEVICES > {out}"]) == 0
    assert out.read_text().strip() == "0,1"


def test_leases_init_refuses_a_slot_count_it_would_not_honour(capsys):
    for value in ("0", "65", "x"):
        assert main(["leases", "init", "--slots-per-gpu", value]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error[USAGE]: --slots-per-gpu") and err.count("\n") == 1


def test_leases_init_refuses_to_prepare_the_hosts_directory_for_simulated_gpus(
        capsys, scenario, tmp_path):
    """As root with GPUWARDEN_SIMULATE set, `leases init` made real lock files under
    /run/gpuwarden for GPUs that do not exist. Refused; a directory of one's own is fine."""
    from gpuwarden.lease._fs import SHARED_LEASE_DIR

    scenario("two_idle")
    existed = os.path.exists(SHARED_LEASE_DIR)
    assert main(["leases", "init"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error[USAGE]: leases init would prepare") and "simulated" in err
    assert os.path.exists(SHARED_LEASE_DIR) == existed
    if os.geteuid() == 0:  # init proper needs root: root-owned lock files
        assert main(["leases", "init", "--dir", str(tmp_path / "mine")]) == 0
        assert len(list((tmp_path / "mine").iterdir())) >= 2


@pytest.mark.timeout(60)
def test_ctrl_c_while_waiting_in_line_says_so(scenario, lease_dir):
    scenario("two_idle")
    with lease(2, label="train.py"):
        # As from a terminal, SIGINT at its default: a suite started in the background by a
        # non-interactive shell (`scripts/test &`) has it ignored, and that is inherited (then
        # Python, and so gpuwarden, rightly leaves Ctrl-C ignored). PYTHONFAULTHANDLER: should
        # it ever not end, SIGABRT makes it print where it is.
        proc = _gpuwarden("run", "--wait", "1m", "--", "true",
                          env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 20
        while not list_leases().tickets:  # in line
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        try:
            _out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            _out, err = proc.communicate(timeout=20)
            pytest.fail(f"still running 20 s after SIGINT; its stacks then:\n{err}")
    assert proc.returncode == 130
    assert "interrupted after" in err and "waiting in line; nothing was leased" in err
    assert "Traceback" not in err
