"""`gpuwarden status` and `gpuwarden stacks` against real jobs: one 4-rank gloo job whose rank 2
sleeps (in a loop of short sleeps) before every all_reduce, shared by every test of the module
(each rank imports torch: one job costs ~10 s of CPU on this machine), asked from outside while
it runs; a second unix user who may list it but not read it; a `gpuwarden run` lease; and at
the end, the ranks' output, which must be exactly what the script prints.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.cli import main
from gpuwarden.inventory import Inventory
from gpuwarden.inventory.snapshot import ComputeMode, GPUProcess, GPUSnapshot, HostSnapshot
from tests._unix_users import made_user
from tests.conftest import SCENARIOS, until

SCRIPT = str(Path(__file__).parent / "launch_scripts" / "straggler.py")
GPUWARDEN = str(Path(sys.executable).parent / "gpuwarden")
STRAGGLER_WITHIN_S = 30.0
pytestmark = [pytest.mark.timeout(180), pytest.mark.slow, pytest.mark.xdist_group("status-job")]


@dataclass
class Job:
    launcher: subprocess.Popen[bytes]
    out: Path
    err: Path
    stop: Path
    stamps: Path

    @property
    def id(self) -> str:
        return str(self.launcher.pid)


def status_json(*extra: str, inventory: Inventory | None = None) -> dict[str, Any]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["status", "--json", *extra], inventory=inventory) == 0
    return json.loads(buf.getvalue())  # type: ignore[no-any-return]


def launch_of(doc: dict[str, Any], job_id: str) -> dict[str, Any] | None:
    for j in doc["jobs"]:
        if j["id"] == job_id:
            return j.get("launch")  # type: ignore[no-any-return]
    return None


def stacks(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPUWARDEN, "stacks", *argv], capture_output=True, text=True,
                          timeout=30, env=env)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    d = tmp_path_factory.mktemp("straggling-job")
    j = Job(None, d / "out", d / "err", d / "stop", d)  # type: ignore[arg-type]
    env = {**os.environ, "SLOW_RANK": "2", "SLOW_DELAY_S": "1", "STOP_FILE": str(j.stop),
           "STAMP_DIR": str(d), "GPUWARDEN_SIMULATE": str(SCENARIOS / "nogpu.json")}
    with open(j.out, "wb") as out, open(j.err, "wb") as err:
        j.launcher = subprocess.Popen([GPUWARDEN, "launch", "-n", "4", "--cpu", SCRIPT],
                                      stdout=out, stderr=err, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (d / "first_step").exists():
            assert j.launcher.poll() is None, j.err.read_text()
            time.sleep(0.2)
        assert (d / "first_step").exists(), "the job never took its first step"
        yield j
        # Checked after the module's tests, whatever their order (a test that stopped the job
        # would have to run last): every query above ran while it worked.
        the_job_ends_and_the_ranks_printed_only_their_own_lines(j)
    finally:
        j.stop.touch()
        try:
            j.launcher.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(j.launcher.pid, signal.SIGKILL)
            j.launcher.wait()


def _until(what: str, check: Any, timeout_s: float) -> Any:
    return until(what, check, timeout_s, poll_s=0.25)  # each check runs `gpuwarden status`


def test_status_shows_the_sleeping_rank_out_of_the_collective(job: Job) -> None:
    def phases() -> dict[int, str] | None:
        launch = launch_of(status_json(), job.id)
        if launch is None:
            return None
        got = {r["rank"]: r["phase"] + (f":{r['op']}" if r["op"] else "") for r in launch["ranks"]}
        want = {0: "collective:all_reduce", 1: "collective:all_reduce", 2: "running",
                3: "collective:all_reduce"}
        return got if got == want else None

    _until("ranks 0, 1, 3 in all_reduce and rank 2 running", phases, 60)
    text = subprocess.run([GPUWARDEN, "status", job.id], capture_output=True, text=True,
                          timeout=30).stdout  # piped: plain, once
    rows = [line for line in text.splitlines() if line[:2] in ("0 ", "1 ", "2 ", "3 ")]
    rank2 = next(line for line in rows if line.startswith("2 "))
    assert "running" in rank2 and "straggler.py:" in rank2, text
    # rank rows only: once rank 2 is named the straggler, its line says "in all_reduce" too
    assert sum(" in all_reduce " in line for line in rows) == 3, text


def test_stacks_groups_the_waiting_ranks_and_shows_the_odd_one(job: Job) -> None:
    # Asked until the picture has rank 2 out of the collective: at the moment of a request it
    # can be in its all_reduce with the others (then all four are one group, rightly), more
    # often on a loaded machine, where a step's all_reduce takes longer.
    def picture() -> list[str] | None:
        started = time.monotonic()
        r = stacks(job.id)
        took = time.monotonic() - started
        assert r.returncode == 0, r.stderr
        # the bound is 2 s (benchmarks/bench_status.py): 0.3 s here, and an interpreter's
        # start takes seconds at load average 20
        assert took < 20, f"stacks took {took:.1f} s"
        lines = r.stdout.splitlines()
        return lines if any(line.startswith("rank 2 (1 of 4): ") for line in lines) else None

    lines = _until("a picture with rank 2 out of the collective", picture, 60)
    assert lines[0].startswith(f"job {job.id}: ") and "4 rank(s)" in lines[0]
    head = next(i for i, line in enumerate(lines) if line.startswith("ranks 0-1, 3 (3 of 4): "
                                                                    "waiting in all_reduce at straggler.py:"))
    assert "distributed_c10d.py" in lines[head + 1] and "in all_reduce" in lines[head + 1]
    odd = next(line for line in lines if line.startswith("rank 2 (1 of 4): running: <module> at "
                                                        "straggler.py:"))
    assert odd.endswith("<-- odd one out")

    def as_json() -> dict[str, Any] | None:
        doc: dict[str, Any] = json.loads(stacks(job.id, "--json", "--all-threads").stdout)
        return doc if len(doc["groups"]) == 2 else None

    doc = _until("a JSON picture with rank 2 out of the collective", as_json, 60)
    assert doc["schema_version"] == 1
    assert [(g["ranks"], g["odd"]) for g in doc["groups"]] == [([0, 1, 3], False), ([2], True)]
    # every rank answered now (none shown from an old sample). The launcher's own time is
    # about 10 ms here and its waits add up to 2 s at most (a rank's fresh stack, the flight
    # recorder); the rest of the bound is a loaded machine's.
    assert all(r["fresh"] for r in doc["ranks"]) and doc["after_s"] < 15.0, doc["after_s"]
    assert doc["groups"][0]["wait"]["op"] == "all_reduce"
    assert [n["answered"] for n in doc["nodes"]] == [True]


STATUS_JOB_KEYS = {"id": str, "pid": int, "kind": str, "user": str, "uid": int, "mine": bool,
                   "private": bool, "command": str, "started_at": float, "age_s": float,
                   "gpus": list, "note": (str, type(None)), "launch": (dict, type(None))}
LAUNCH_KEYS = {"run_id": str, "node_rank": int, "nnodes": int, "world_size": int, "host": str,
               "attempt": int, "max_restarts": int, "target": str, "stall_timeout_s": float,
               "sample_interval_s": float, "uptime_s": float, "ranks": list,
               "stall": (dict, type(None)), "straggler": (dict, type(None))}
RANK_KEYS = {"rank": int, "local_rank": int, "node": int, "pid": int, "gpu": (str, type(None)),
             "phase": str, "op": (str, type(None)), "site": (str, type(None)),
             "for_s": (float, type(None)), "where": str, "cpu_cores": (float, int, type(None)),
             "returncode": (int, type(None)), "gpu_memory_bytes": (int, type(None))}
PHASES = {"starting", "rendezvous", "running", "collective", "finished", "failing", "exited"}


def _check(obj: dict[str, Any], schema: dict[str, Any]) -> None:
    assert set(obj) >= set(schema), set(schema) - set(obj)
    for key, kind in schema.items():
        assert isinstance(obj[key], kind), (key, obj[key])


def test_the_straggler_is_named_within_30_s_and_status_json_has_its_schema(job: Job) -> None:
    first_step = float((job.stamps / "first_step").read_text())
    doc = _until("rank 2 named as the straggler",
                 lambda: (d := status_json()) and (launch_of(d, job.id) or {}).get("straggler")
                 and d, STRAGGLER_WITHIN_S + 10)
    named_after = time.monotonic() - first_step
    launch = launch_of(doc, job.id)
    assert launch is not None
    straggler = launch["straggler"]
    assert straggler["rank"] == 2 and straggler["waited_by"] == [0, 1, 3], straggler
    assert straggler["waits_in"] == "all_reduce", straggler
    # The others lose their time to it: they wait in all_reduce in more of their own samples
    # than rank 2 does in its, which is under half. Compared with each other, not with a fixed
    # share: the rest of a step (the collective, Python) takes longer on a loaded machine while
    # rank 2's sleep does not, so the others' share shrinks with the load (0.9 quiet, under
    # 0.5 at load average 25). Not `share` either, the ticks in which every rank's stack came in
    # time: a rank's sampling thread answers late on a loaded machine (0.46 at load 15).
    assert straggler["own_wait_share"] < 0.5, straggler
    assert straggler["others_wait_share"] > straggler["own_wait_share"], straggler
    assert "in <module> at straggler.py:" in straggler["doing"]
    assert named_after < STRAGGLER_WITHIN_S, f"named {named_after:.1f} s after the first step"
    assert doc["schema_version"] == 1 and isinstance(doc["host"], str)
    [mine] = [j for j in doc["jobs"] if j["id"] == job.id]
    _check(mine, STATUS_JOB_KEYS)
    assert mine["kind"] == "launch" and mine["mine"] and not mine["private"]
    _check(launch, LAUNCH_KEYS)
    assert launch["world_size"] == 4 and launch["stall"] is None
    for row in launch["ranks"]:
        _check(row, RANK_KEYS)
        assert row["phase"] in PHASES
    # the launcher says it once on stderr when it persists (the test's stop comes later)
    _until("the straggler note", lambda: "note[RANK_STRAGGLER]: rank 2 " in job.err.read_text(), 20)


def test_gpu_memory_comes_from_nvml_by_rank_pid(job: Job) -> None:
    launch = launch_of(status_json(), job.id)
    assert launch is not None
    pid1 = next(r["pid"] for r in launch["ranks"] if r["rank"] == 1)
    gpu = GPUSnapshot(0, "GPU-00000000-0000-0000-0000-000000000001", "NVIDIA H100", "0000:01:00.0",
                      80 << 30, 3 << 30, 50, ComputeMode.DEFAULT, False,
                      (GPUProcess(pid1, "root", "python", 3 << 30),))
    host = HostSnapshot("vm", "580.0", "13.0", (gpu,), "test")
    launch = launch_of(status_json(job.id, inventory=Inventory.of(host)), job.id)
    assert launch is not None
    mem = {r["rank"]: r["gpu_memory_bytes"] for r in launch["ranks"]}
    assert mem == {0: None, 1: 3 << 30, 2: None, 3: None}


@pytest.fixture(scope="module")
def other_user() -> Iterator[tuple[int, int]]:
    with made_user("st") as user:
        yield user.uid, user.gid


def as_user(uid: int, gid: int, body: Any) -> tuple[int, str, str]:
    """Run ``body()`` (returns an exit code) in a forked child that became the user ``uid``
    (the interpreter lives in root's home, which another user may not execute); its exit
    code, stdout and stderr."""
    import tempfile

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            code = 99
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
                sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                os.environ.pop("GPUWARDEN_LEASE_DIR", None)  # root's (0700): not theirs
                code = body()
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()


def test_another_user_lists_the_job_but_the_kernel_refuses_its_stacks(
        job: Job, other_user: tuple[int, int]) -> None:
    uid, gid = other_user
    runtime = os.environ["GPUWARDEN_RUNTIME_DIR"]
    code, out, err = as_user(uid, gid, lambda: main(["status", "--json"]))
    assert code == 0, err
    [seen] = [j for j in json.loads(out)["jobs"] if j["id"] == job.id]
    assert seen["user"] == "root" and seen["kind"] == "launch" and seen["private"]
    assert seen["launch"] is None and "private to its owner" in seen["note"]
    code, out, err = as_user(uid, gid, lambda: main(["stacks", job.id]))
    assert code == 1 and out == ""
    assert f"error[JOB_DENIED]: the launch {job.id} is root's" in err
    assert "Permission denied" in err and "Traceback" not in err

    def connect() -> int:  # not gpuwarden's decision: the kernel's, for any client
        import socket

        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(os.path.join(runtime, f"{job.id}.sock"))
        except OSError as exc:
            return exc.errno or 0
        return 0

    assert as_user(uid, gid, connect)[0] == 13  # EACCES
    assert oct(os.stat(runtime).st_mode & 0o777) == "0o700"


def test_a_run_lease_is_listed_with_its_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "GPUWARDEN_SIMULATE": str(SCENARIOS / "two_idle.json")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    run = subprocess.Popen([GPUWARDEN, "run", "--gpus", "1", "--", sys.executable, "-c",
                            "import time; print('in', flush=True); time.sleep(60)"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                           start_new_session=True)
    try:
        assert run.stdout is not None and run.stdout.readline() == b"in\n"
        [mine] = [j for j in status_json()["jobs"] if j["pid"] == run.pid]
        assert mine["kind"] == "run" and [g["index"] for g in mine["gpus"]] == [0]
        assert mine["launch"] is None and mine["note"] is None
    finally:
        os.killpg(run.pid, signal.SIGTERM)
        run.communicate(timeout=20)


def the_job_ends_and_the_ranks_printed_only_their_own_lines(job: Job) -> None:
    """The shared job's end (the fixture's teardown; a failure is an error at the teardown of
    the module's last test): it exits 0, its ranks printed exactly the script's lines and
    nothing on stderr, the straggler note came once, and its control files are gone."""
    _until("the straggler note", lambda: "note[RANK_STRAGGLER]: rank 2 " in job.err.read_text(),
           STRAGGLER_WITHIN_S + 10)
    job.stop.touch()
    assert job.launcher.wait(60) == 0, job.err.read_text()
    out = job.out.read_text().splitlines()
    assert sorted(out) == sorted([f"[rank{r}]: rank {r} ready" for r in range(4)]
                                 + [f"[rank{r}]: rank {r} done" for r in range(4)]), out
    err = job.err.read_text().splitlines()
    assert [line for line in err if line.startswith("[rank")] == []  # no rank wrote to stderr
    assert sum("note[RANK_STRAGGLER]" in line for line in err) == 1
    assert all(line.startswith("gpuwarden: ") for line in err), err
    assert not list(Path(os.environ["GPUWARDEN_RUNTIME_DIR"]).glob(f"{job.id}.*"))
