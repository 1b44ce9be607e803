"""scripts/verify-gpu on a machine without a GPU: arguments, the report, and clean-up.

The GPU stages themselves only mean something on a GPU host; what is checked here is what the
script promises everywhere: it refuses bad input, writes a complete report (markdown + json),
and leaves no process behind — after a timeout, an escaped process, or a SIGTERM mid-story.
"""

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

from tests.conftest import wait_until_gone

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import verify_gpu  # noqa: E402

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.slow]


def carrying(run_id: str) -> list[int]:
    pids = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(verify_gpu.RUN_ENV) == run_id:
                pids.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return pids


@pytest.mark.parametrize("argv", [
    [],  # no OUTDIR and no $OUT
    ["{tmp}", "--stages", "tests,nonsense"],
    ["{tmp}", "--story", "9-no-such-story"],
    ["{tmp}", "--budget-s", "0"],
])
def test_bad_arguments_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              argv: list[str]) -> None:
    monkeypatch.delenv("OUT", raising=False)
    assert verify_gpu.main([a.format(tmp=tmp_path) for a in argv]) == 2
    assert not (tmp_path / "report.json").exists()


def test_without_a_gpu_it_refuses_with_exit_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    if verify_gpu.gpu_count(verify_gpu.nvml_facts()):
        pytest.skip("a GPU is present")
    monkeypatch.setenv("OUT", str(tmp_path))  # $OUT is the default output directory
    assert verify_gpu.main([]) == 3
    assert "no GPU" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_report_of_a_story_run(tmp_path: Path) -> None:
    code = verify_gpu.main([str(tmp_path), "--allow-no-gpu", "--stages", "stories",
                            "--story", "2-dataloader-fork", "--budget-s", "60"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["schema_version"] == 1 and report["ok"] is (code == 0), report
    assert report["versions"]["torch"]["torch"].startswith("2.")
    rows = {r["script"]: r for r in report["stories"]}
    if not verify_gpu.gpu_count(verify_gpu.nvml_facts()):
        assert rows["naive.py"]["exit_code"] == 77
        assert rows["naive.py"]["verdict"] == "skipped (needs a GPU)"
    fixed = rows["fixed.py"]
    assert fixed["exit_code"] == 0 and fixed["verdict"] == "ok", fixed
    assert "checksums match" in (tmp_path / fixed["log"]).read_text()
    md = (tmp_path / "report.md").read_text()
    assert "| 2-dataloader-fork | `fixed.py` | 0 | - |" in md
    assert "torch 2." in md and "## Clean-up" in md
    assert report["stray_processes_killed"] == []


def test_a_failing_story_is_reported_with_explains_code(tmp_path: Path) -> None:
    run = verify_gpu.catalog.NAIVE4["port-in-use"]
    fake = verify_gpu.Result("x", [], 1, 3.0, False, "logs/x.log",
                             "DistNetworkError: The server socket has failed to listen on any local "
                             "network address. port: 1, useIpv6: false, code: -98, name: EADDRINUSE")
    code = verify_gpu.catalog.explain_code(fake.output)
    assert code == "RDZV_PORT_IN_USE"
    assert verify_gpu.story_verdict(run, fake, code) == "ok"
    assert verify_gpu.story_verdict(run, fake, "NONE") == "FAILED (explain said NONE, expected RDZV_PORT_IN_USE)"
    fake.exit_code = 0
    assert verify_gpu.story_verdict(run, fake, None) == "FAILED (exit 0, expected 1)"


@pytest.mark.timeout(30)
def test_a_command_past_its_deadline_is_killed_with_its_children(tmp_path: Path) -> None:
    groups = verify_gpu.Groups("t1")
    (tmp_path / "logs").mkdir()
    script = ("import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              "print(c.pid, flush=True); time.sleep(60)")
    start = time.monotonic()
    res = verify_gpu.run_command("sleeper", [sys.executable, "-c", script], cwd=tmp_path,
                                 env=dict(os.environ), timeout_s=2, groups=groups,
                                 logs=tmp_path / "logs")
    assert res.timed_out and time.monotonic() - start < 10
    child = int(res.output.split()[0])
    assert not wait_until_gone([child])
    assert "killed at the deadline" in (tmp_path / res.log).read_text()
    assert not groups.alive


@pytest.mark.timeout(30)
def test_a_grandchild_in_its_own_session_does_not_hold_the_deadline(tmp_path: Path) -> None:
    # Story 3's hog and story 4's port holder start sessions of their own and inherit the
    # story's output: the deadline must hold all the same (reading a pipe to its end would not).
    groups = verify_gpu.Groups("t3")
    (tmp_path / "logs").mkdir()
    script = ("import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(25)'], "
              "start_new_session=True); print(c.pid, flush=True); time.sleep(60)")
    start = time.monotonic()
    res = verify_gpu.run_command("escaper", [sys.executable, "-c", script], cwd=tmp_path,
                                 env=dict(os.environ), timeout_s=2, groups=groups,
                                 logs=tmp_path / "logs")
    try:
        assert res.timed_out and time.monotonic() - start < 8
    finally:
        escaped = int(res.output.split()[0])
        try:
            os.kill(escaped, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wait_until_gone([escaped])


@pytest.mark.timeout(30)
def test_a_process_that_left_its_group_is_found_and_killed(tmp_path: Path) -> None:
    groups = verify_gpu.Groups("t2-" + str(os.getpid()))
    env = {**os.environ, verify_gpu.RUN_ENV: groups.run_id}
    # A daemon: its own session, so killing the command's group misses it.
    escaped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                               start_new_session=True)
    try:
        strays = groups.strays()
        assert [s["pid"] for s in strays] == [escaped.pid]
        assert escaped.wait(timeout=5) == -signal.SIGKILL
    finally:
        if escaped.poll() is None:
            escaped.kill()
            escaped.wait()


def _runs_a_story(pid: int) -> bool:
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "naive.py" in " ".join(child.cmdline()):
                return True
        except psutil.Error:  # it ended (or is a zombie) between the listing and the read
            continue
    return False


@pytest.mark.timeout(60)
def test_sigterm_mid_story_writes_the_report_and_leaves_nothing(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "verify_gpu.py"), str(tmp_path),
                             "--allow-no-gpu", "--stages", "stories", "--story", "4-rendezvous-stall"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        # wait until a story is running (its log appears when it ends; its ranks show up first)
        while time.monotonic() < deadline and not _runs_a_story(proc.pid):
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    finally:  # whatever went wrong above, verify-gpu must not outlive the test
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["interrupted"] == "received SIGTERM" and report["ok"] is False
    assert "**Interrupted**: received SIGTERM" in (tmp_path / "report.md").read_text()
    assert not wait_until_gone(carrying(report["run_id"]))


def tiny_wheel(directory: Path) -> Path:
    """A wheel made here, offline: one module, the metadata pip needs."""
    import zipfile

    path = directory / "tinypkg_gw-1.0-py3-none-any.whl"
    info = "tinypkg_gw-1.0.dist-info"
    files = {"tinypkg_gw/__init__.py": "VALUE = 42\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: tinypkg-gw\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(name, text)
    return path


@pytest.mark.timeout(180)
def test_wheelhouse_environment_runs_the_checkout_with_the_wheels_and_nothing_fetched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What --wheelhouse builds on the lent machine: the interpreter's own packages (torch), the
    wheels installed --no-index, gpuwarden from src/, and its commands beside the interpreter,
    guarded so that a spawned child re-importing the main script does not run it again."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    tiny_wheel(wheels)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a rehearsal: any download would fail
    monkeypatch.setattr(verify_gpu, "NEEDED_MODULES", ("tinypkg_gw", "torch", "no_such_module_gw"))
    python, info = verify_gpu.prepare_environment(sys.executable, wheels, tmp_path / "env")
    assert info["wheels"] == ["tinypkg_gw-1.0-py3-none-any.whl"]
    assert [m.split()[0] for m in info["missing_modules"]] == ["no_such_module_gw"]
    done = subprocess.run([python, "-c", "import gpuwarden, tinypkg_gw, torch; "
                           "print(gpuwarden.__file__, tinypkg_gw.VALUE)"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.split() == [str(ROOT / "src" / "gpuwarden" / "__init__.py"), "42"]
    bin_dir = Path(python).parent
    clean = {k: v for k, v in os.environ.items()  # the machine's GPU view, not a test's
             if k not in ("CUDA_VISIBLE_DEVICES", "GPUWARDEN_SIMULATE") and not k.startswith("SLURM_")}
    listing = subprocess.run([str(bin_dir / "gpuwarden"), "ls", "--simulate", "two-idle"],
                             capture_output=True, text=True, env=clean)
    assert listing.returncode == 0 and "2 GPU(s)" in listing.stdout, listing.stderr
    # A spawn child imports the main script as __mp_main__: the shim must then do nothing.
    child = subprocess.run([python, "-c", "import runpy, sys; runpy.run_path(sys.argv[1], "
                            "run_name='__mp_main__'); print('imported only')",
                            str(bin_dir / "gpuwarden")], capture_output=True, text=True)
    assert child.stdout.strip() == "imported only", child.stdout + child.stderr
