"""Every way a Slurm user starts, stops and shares a job, on a real Slurm (tests/_slurm.py).

The commands are Slurm's own (`srun`, `sbatch`, `salloc`, `scancel`, `scontrol`), run on the
cluster's login host; nothing of Slurm is faked and no `SLURM_*` variable is set by a test. The
recipes of docs/slurm.md are run verbatim, with torchrun in gpuwarden's place beside them where
torchrun applies. After every test no process may be left in the cluster and both nodes must be
idle (the `slurm` fixture, conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._slurm import Cluster, cluster_of, unavailable_reason
from tests.conftest import slurm_checked

DOC = Path(__file__).resolve().parents[1] / "docs" / "slurm.md"
SCRIPTS = Path(__file__).parent / "launch_scripts"
KILL_WAIT_S = 10  # slurm.conf's KillWait: Slurm's SIGKILL follows its SIGTERM after this
# Ranks without torch (slurm_train.py's TRAIN_LIGHT), where a test is about what a launcher is
# given or how a job ends, not the collective: a torch import is seconds of a loaded 2-core box.
LIGHT = {"TRAIN_LIGHT": "1"}

# Under pytest-xdist (--dist loadgroup) module- and session-scoped fixtures are built once per
# worker, so the tests of one cluster must share a worker: those of the session cluster
# (conftest.py) are group "slurm", and its daemons start once. The pgid and two-host clusters,
# started here for their own tests, add a group of their own (xdist joins a test's groups into
# one name), so they may run beside it on another worker. Without xdist the marks do nothing.
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.xdist_group("slurm")]


def recipe(name: str) -> str:
    """The block of docs/slurm.md marked ``<!-- recipe: NAME -->``, verbatim."""
    found = re.search(rf"<!-- recipe: {re.escape(name)} -->\s*```sh\n(.*?)```", DOC.read_text(),
                      re.S)
    assert found, f"docs/slurm.md has no recipe {name!r}"
    return found.group(1)


def as_torchrun(text: str, nproc: int = 2) -> str:
    """The same command line with torchrun in gpuwarden's place: torchrun needs the count, and
    on one node its documented --standalone (a free port: without it every torchrun of a node
    takes 29500, and two steps of one job on a node collide there)."""
    if "--nproc-per-node" in text:
        return text.replace("gpuwarden launch", "torchrun")
    one_node = f"torchrun --standalone --nproc-per-node={nproc}"
    return text.replace("gpuwarden launch --cpu -n 2", one_node).replace("gpuwarden launch",
                                                                           one_node)


TRAIN = re.compile(r"train: rank=(?P<rank>\d+) world=(?P<world>\d+) local=(?P<local>\S+) "
                   r"node=(?P<node>\S+) host=(?P<host>\S+) gpus=(?P<gpus>\S*) "
                   r"restart=(?P<restart>\d+) sum=(?P<sum>[\d.]+|-)")


def trained(text: str) -> list[dict[str, str]]:
    """The ranks' lines of slurm_train.py, by rank."""
    return sorted((m.groupdict() for m in TRAIN.finditer(text)), key=lambda d: int(d["rank"]))


def in_cwd(tmp_path: Path, name: str = "train.py", source: str = "slurm_train.py") -> Path:
    shutil.copy(SCRIPTS / source, tmp_path / name)
    return tmp_path / name


def submit(slurm: Cluster, tmp_path: Path, script: str, *options: str,
           env: dict[str, str] | None = None) -> tuple[int, Path]:
    out = tmp_path / "slurm-%j.out"
    job = slurm.sbatch(script, f"--output={out}", *options, cwd=tmp_path, env=env)
    return job, tmp_path / f"slurm-{job}.out"


def batch(slurm: Cluster, tmp_path: Path, script: str, *options: str,
          env: dict[str, str] | None = None, timeout: float = 180) -> tuple[int, str, str]:
    """Submit, wait for the end; (job id, final state, the job's output)."""
    job, out = submit(slurm, tmp_path, script, *options, env=env)
    state = slurm.wait_state(job, timeout=timeout)
    return job, state, out.read_text(errors="replace") if out.exists() else ""


def wait_files(paths: list[Path], timeout: float, why: str, output: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            seen = output.read_text(errors="replace") if output and output.exists() else ""
            raise AssertionError(f"{why}: {[p.name for p in paths if not p.exists()]} missing "
                                 f"after {timeout:g} s\n{seen}")
        time.sleep(0.05)


def lines_of(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def assert_two_nodes_of_two(ranks: list[dict[str, str]], text: str, *, static: bool,
                            total: str = "10") -> None:
    """Four ranks over n1 and n2, numbered node by node (torchrun's RANK = node * 2 + local),
    every rank seeing its node's two GPUs, the all_reduce of 1+2+3+4 (``-``: light ranks)."""
    assert [r["rank"] for r in ranks] == ["0", "1", "2", "3"], text
    for r in ranks:
        local, local_world = r["local"].split("/")
        assert (r["world"], local_world, r["gpus"], r["sum"]) == ("4", "2", "0,1", total), r
        assert int(r["rank"]) == int(r["node"]) * 2 + int(local), r
    hosts = {r["node"]: r["host"] for r in ranks}
    assert sorted(hosts.values()) == ["n1", "n2"], ranks
    if static:  # node ranks from SLURM_NODEID; c10d numbers the nodes on arrival
        assert hosts == {"0": "n1", "1": "n2"}, ranks


def test_every_recipe_of_the_docs_is_run_by_a_test() -> None:
    """docs/slurm.md's promise: each recipe a user copies is one of these tests."""
    names = re.findall(r"<!-- recipe: (\S+) -->", DOC.read_text())
    source = Path(__file__).read_text()
    assert names and not [n for n in names if f'recipe("{n}")' not in source], names


# -- starting a job ----------------------------------------------------------------------------

@pytest.mark.parametrize("launcher", ["gpuwarden", "torchrun"])
def test_srun_one_node_ranks_and_gpus_come_from_slurm(slurm: Cluster, tmp_path: Path,
                                                      launcher: str) -> None:
    """`srun --gres=gpu:2 gpuwarden launch train.py`: two ranks (SLURM_GPUS_ON_NODE), each
    seeing the step's GPUs as Slurm set them; the same environment torchrun gives its ranks."""
    in_cwd(tmp_path)
    line = recipe("srun-one-node")
    r = slurm.run(["bash", "-c", line if launcher == "gpuwarden" else as_torchrun(line)],
                  cwd=tmp_path, env=LIGHT)
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = trained(r.stdout)
    assert [(x["rank"], x["world"], x["local"], x["node"], x["host"], x["gpus"])
            for x in ranks] == [("0", "2", "0/2", "0", "n1", "0,1"),
                                ("1", "2", "1/2", "0", "n1", "0,1")], r.stdout + r.stderr


def test_batch_script_two_nodes_everything_from_slurm(slurm: Cluster, tmp_path: Path) -> None:
    """The batch recipe: `srun gpuwarden launch train.py` with no flag over two nodes."""
    in_cwd(tmp_path)
    _, state, text = batch(slurm, tmp_path, recipe("batch"))
    assert state == "COMPLETED", text
    assert_two_nodes_of_two(trained(text), text, static=True)


@pytest.mark.parametrize("launcher", ["gpuwarden", "torchrun"])
def test_slurms_torchrun_recipe(slurm: Cluster, tmp_path: Path, launcher: str) -> None:
    """Slurm's torchrun recipe (c10d at $head_node:29500) runs unchanged under both. Under
    torchrun the ranks are light: its agents rendezvous through torch either way, and whether
    the ranks it starts can all_reduce is torchrun's matter, not gpuwarden's."""
    in_cwd(tmp_path)
    script = recipe("batch-torchrun")
    ours = launcher == "gpuwarden"
    _, state, text = batch(slurm, tmp_path, script if ours else as_torchrun(script),
                           env=None if ours else LIGHT)
    assert state == "COMPLETED", text
    assert_two_nodes_of_two(trained(text), text, static=False, total="10" if ours else "-")


@pytest.mark.parametrize("launcher", ["gpuwarden", "torchrun"])
def test_a_batch_script_that_starts_the_ranks_itself(slurm: Cluster, tmp_path: Path,
                                                     launcher: str) -> None:
    """`#SBATCH --ntasks=2` and the launcher in the script itself (no srun, so no step):
    torchrun runs two ranks there, and so must gpuwarden."""
    in_cwd(tmp_path)
    script = recipe("batch-no-srun")
    _, state, text = batch(slurm, tmp_path,
                           script if launcher == "gpuwarden" else as_torchrun(script), env=LIGHT)
    assert state == "COMPLETED", text
    assert [(x["rank"], x["world"], x["local"]) for x in trained(text)] == [
        ("0", "2", "0/2"), ("1", "2", "1/2")], text


@pytest.mark.parametrize("launcher", ["gpuwarden", "torchrun"])
def test_an_allocation_that_starts_the_ranks_without_srun(slurm: Cluster, tmp_path: Path,
                                                          launcher: str) -> None:
    in_cwd(tmp_path)
    line = recipe("salloc")
    r = slurm.run(["bash", "-c", line if launcher == "gpuwarden" else as_torchrun(line)],
                  cwd=tmp_path, env=LIGHT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [(x["rank"], x["world"], x["local"]) for x in trained(r.stdout)] == [
        ("0", "2", "0/2"), ("1", "2", "1/2")], r.stdout + r.stderr


INIT = re.compile(r"init: rank=(?P<rank>\d+) world=(?P<world>\d+) local=(?P<local>\d+) "
                  r"launcher=(?P<launcher>\S+) host=(?P<host>\S+) RANK=(?P<RANK>\S+) "
                  r"WORLD_SIZE=(?P<WORLD_SIZE>\S+) LOCAL_RANK=(?P<LOCAL_RANK>\S+) "
                  r"LOCAL_WORLD_SIZE=(?P<LOCAL_WORLD_SIZE>\S+) sum=(?P<sum>\S+)")


def test_srun_starts_every_rank_and_distributed_init_finds_its_place(slurm: Cluster,
                                                                     tmp_path: Path) -> None:
    """`srun --nodes=2 --ntasks=4 python train.py` with gpuwarden.distributed.init(): Slurm
    places the tasks as it likes (here unevenly: SLURM_TASKS_PER_NODE=3,1); every task finds
    its rank, its local rank and its node's task count, and exports them for the code that
    reads torchrun's variables."""
    in_cwd(tmp_path, source="slurm_init.py")
    r = slurm.run(["bash", "-c", recipe("srun-tasks")], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    tasks = sorted((m.groupdict() for m in INIT.finditer(r.stdout)), key=lambda d: d["rank"])
    assert [t["rank"] for t in tasks] == ["0", "1", "2", "3"], r.stdout + r.stderr
    per_host = {h: sorted(int(t["local"]) for t in tasks if t["host"] == h)
                for h in {t["host"] for t in tasks}}
    for t in tasks:
        assert (t["world"], t["launcher"], t["sum"]) == ("4", "slurm", "10"), t
        assert (t["RANK"], t["WORLD_SIZE"], t["LOCAL_RANK"]) == (t["rank"], "4", t["local"]), t
        assert int(t["LOCAL_WORLD_SIZE"]) == len(per_host[t["host"]]), (t, per_host)
    assert all(locals_ == list(range(len(locals_))) for locals_ in per_host.values()), per_host


POOL_STEP = '''
import os, subprocess, sys
from gpuwarden.pool import GPUPool

def child():
    """A process started from the pool's worker asks for a GPU: a job step of the pool's lease."""
    code = ("from gpuwarden.lease import acquire; g = acquire(1); "
            "print(type(g).__name__, g.gpus[0].uuid)")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return os.environ["CUDA_VISIBLE_DEVICES"], got.stdout.strip() or got.stderr[-400:]

with GPUPool(gpus="auto") as pool:
    print("pool:", [g.uuid for g in pool.gpus], *pool.submit(child).result(), flush=True)
'''


def test_another_job_holds_a_gpu_of_the_node_everything_takes_the_steps(slurm: Cluster,
                                                                        tmp_path: Path) -> None:
    """Job A holds GPU 0 of n1 (`gpuwarden run`, so leased too); job B, given GPU 1 of the same
    node by Slurm, runs a launch, a `gpuwarden run` and a GPU pool whose worker starts a
    process that asks for a lease (a job step): each takes GPU 1 and only GPU 1."""
    in_cwd(tmp_path)
    (tmp_path / "pool_step.py").write_text(POOL_STEP)
    holder = slurm.popen(["srun", "--job-name=holder", "--nodes=1", "--nodelist=n1",
                          "--gres=gpu:1", "gpuwarden", "run", "--", "sleep", "300"], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not slurm.processes("n1", "sleep 300"):
            assert holder.poll() is None and time.monotonic() < deadline, holder.communicate()
            time.sleep(0.1)
        steps = ("gpuwarden launch -n 1 train.py && gpuwarden run -- sh -c "
                 "'echo run got $CUDA_VISIBLE_DEVICES' && python pool_step.py")
        r = slurm.run(["srun", "--nodes=1", "--nodelist=n1", "--gres=gpu:1", "bash", "-c", steps],
                      cwd=tmp_path, env=LIGHT)
    finally:
        slurm.run(["scancel", "--name=holder"])
        holder.communicate(timeout=60)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    assert "Slurm allocation SLURM_STEP_GPUS=1: using GPUs 1" in text, text
    assert [x["gpus"] for x in trained(r.stdout)] == ["1"], text
    assert "run got 1" in r.stdout, text
    # GPU 1 of n1, as the node's (simulated) inventory names it
    gpu1 = json.loads((slurm.node_dir("n1") / "gpus.json").read_text())["gpus"][1]["uuid"]
    pool = re.search(r"pool: \['(\S+)'\] (\S+) StepGrant (\S+)", r.stdout)
    assert pool, text
    assert pool.groups() == (gpu1, "1", gpu1), text


@pytest.mark.parametrize("launcher", ["gpuwarden", "torchrun"])
def test_overlapping_steps_share_the_jobs_gpus(slurm: Cluster, tmp_path: Path,
                                               launcher: str) -> None:
    """Two `srun --overlap --gres=gpu:2` steps of one job: Slurm lets the second use the GPUs
    the first uses (they are the job's); so must gpuwarden."""
    in_cwd(tmp_path)
    in_cwd(tmp_path, "evaluate.py", "slurm_notice.py")
    hold = tmp_path / "hold"
    hold.mkdir()
    # The recipe starts both steps at once; the second waits here until the first one's ranks
    # run, so that it meets the GPUs held (else a quick second step may be done before the
    # first leases anything, and nothing is shared: a race seen on a loaded machine).
    script = recipe("overlap").replace("evaluate.py &\n", (
        f"evaluate.py {hold} &\n"
        f"until [ -e {hold}/ready.0 ] && [ -e {hold}/ready.1 ]; do sleep 0.05; done\n"))
    assert f"{hold}/ready.1" in script, script
    job, out = submit(slurm, tmp_path, script if launcher == "gpuwarden" else as_torchrun(script),
                      env=LIGHT)
    try:
        wait_files([hold / "ready.0", hold / "ready.1"], 120, "the first step's ranks", out)
        deadline = time.monotonic() + 120
        while (len(trained(out.read_text())) < 2 and "error[" not in out.read_text()
               and time.monotonic() < deadline):
            time.sleep(0.1)
        assert all(p.exists() for p in (hold / "ready.0", hold / "ready.1"))
    finally:
        (hold / "go").touch()
    state = slurm.wait_state(job)
    text = out.read_text()
    assert state == "COMPLETED", text
    assert [(x["rank"], x["gpus"]) for x in trained(text)] == [("0", "0,1"), ("1", "0,1")], text
    if launcher == "gpuwarden":
        assert re.search(rf"GPU\(s\) 0,1 shared with another step of Slurm job {job} \(pid \d+\)",
                         text), text


def test_a_step_that_asks_for_more_than_its_sibling_holds_is_told_about_slurm(
        slurm: Cluster, tmp_path: Path) -> None:
    """Step 0 holds one of the job's two GPUs, step 1 asks for both: no mix of leased and
    shared GPUs is made, and the refusal names the other step of the job and the fix."""
    in_cwd(tmp_path, "evaluate.py", "slurm_notice.py")
    hold = tmp_path / "hold"
    hold.mkdir()
    script = ("#!/bin/bash\n"
              f"srun --overlap --gres=gpu:1 gpuwarden launch evaluate.py {hold} &\n"
              f"while [ ! -e {hold}/ready.0 ]; do sleep 0.1; done\n"
              "srun --overlap --gres=gpu:2 gpuwarden launch -n 2 evaluate.py /nonexistent\n"
              f"touch {hold}/go\nwait\n")
    job, state, text = batch(slurm, tmp_path, script, "--nodes=1", "--gres=gpu:2")
    assert state == "COMPLETED", text  # the script's last command, wait, ends it
    assert "error[SELECT_UNSATISFIED]" in text, text
    assert f"held by another step of this Slurm job {job}: pid" in text, text
    assert "srun --overlap --gres=gpu:N in both steps" in text, text


def test_gpus_another_jobs_step_holds_are_not_shared(slurm: Cluster, tmp_path: Path) -> None:
    """Only a job's own steps share: job B, given no GPU by Slurm but seeing n1's GPUs, is
    refused those job A's launcher holds, and told who holds them."""
    in_cwd(tmp_path, "evaluate.py", "slurm_notice.py")
    hold = tmp_path / "hold"
    hold.mkdir()
    job_a, out = submit(slurm, tmp_path, f"#!/bin/bash\nsrun gpuwarden launch evaluate.py {hold}\n",
                        "--nodes=1", "--nodelist=n1", "--gres=gpu:2")
    try:
        wait_files([hold / "ready.0", hold / "ready.1"], 120, "job A's ranks", out)
        r = slurm.run(["srun", "--nodes=1", "--nodelist=n1", "gpuwarden", "launch", "--gpus", "2",
                       "evaluate.py", str(hold)], cwd=tmp_path)
    finally:
        (hold / "go").touch()
    assert slurm.wait_state(job_a) == "COMPLETED", out.read_text()
    text = r.stdout + r.stderr
    assert r.returncode == 4, text
    assert "error[SELECT_UNSATISFIED]" in text and "gpuwarden launch evaluate.py" in text, text
    assert "shared with" not in text and "this Slurm job" not in text, text


def test_doctor_in_an_allocation_checks_the_steps_gpus(slurm: Cluster, tmp_path: Path) -> None:
    """One GPU of the node's two is the step's: doctor judges that one, and says why."""
    r = slurm.run(["srun", "--nodes=1", "--gres=gpu:1", "gpuwarden", "doctor"], cwd=tmp_path)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    assert re.search(r"visible_devices +1 GPU of 2 visible \(CUDA_VISIBLE_DEVICES '0'\)", text), text
    assert "Slurm allocation SLURM_STEP_GPUS=0: using GPUs 0" in text, text
    assert "no other process on the 1 GPU visible" in text, text


# -- ending a job ------------------------------------------------------------------------------

def test_a_rank_crash_fails_the_job_with_every_tasks_exit_and_one_cause(slurm: Cluster,
                                                                        tmp_path: Path) -> None:
    in_cwd(tmp_path)
    hold = tmp_path / "hold"  # the other ranks wait there until their launcher stops them
    hold.mkdir()
    job, state, text = batch(slurm, tmp_path, recipe("batch"),
                             env={"TRAIN_CRASH_RANK": "3", "TRAIN_HOLD_DIR": str(hold), **LIGHT})
    assert state == "FAILED", text
    # gpuwarden names a node by its host name: n2's is this machine's on the one-host cluster
    cause = f"rank 3 on node 1 ({slurm.host_name_of('n2')}): RuntimeError: rank 3 crashed on purpose"
    assert "error[RANK_FAILED]: rank 3 failed first: RuntimeError: rank 3 crashed on purpose" in text
    assert f"error[NODE_ABORTED]: {cause}" in text, text
    assert text.count(f"the job's first failure (RANK_FAILED): {cause}") == 2, text
    assert re.search(r"srun: error: n2: task 1: Exited with exit code 1\b", text), text
    assert re.search(r"srun: error: n1: task 0: Exited with exit code \d+", text), text
    assert slurm.job(job).get("ExitCode") == "1:0", slurm.job(job)


def hold_two_nodes(slurm: Cluster, tmp_path: Path, script: str | None = None,
                   **env: str) -> tuple[int, Path, Path]:
    """The batch recipe with every rank holding after init: (job, output, hold dir)."""
    in_cwd(tmp_path)
    hold = tmp_path / "hold"
    hold.mkdir()
    job, out = submit(slurm, tmp_path, script or recipe("batch"),
                      env={"TRAIN_HOLD_DIR": str(hold), **env})
    wait_files([hold / f"ready.{r}" for r in range(4)], 120, "the ranks' init", out)
    return job, out, hold


def test_scancel_leaves_nothing_before_slurms_sigkill(slurm: Cluster, tmp_path: Path) -> None:
    """scancel: Slurm sends SIGTERM, and SIGKILL KillWait later; gpuwarden's launchers, node
    agents and ranks are all gone before that (checked by process, not by exit code)."""
    job, out, _ = hold_two_nodes(slurm, tmp_path, **LIGHT)
    assert slurm.processes(None, "gpuwarden launch")
    start = time.monotonic()
    slurm.check(["scancel", str(job)])
    left = slurm.wait_no_job_processes(KILL_WAIT_S - 1)
    took = time.monotonic() - start
    assert not left, f"left {took:.1f} s after scancel: {slurm.describe(left)}"
    assert slurm.wait_state(job) == "CANCELLED"


def test_the_time_limit_stops_every_rank(slurm: Cluster, tmp_path: Path) -> None:
    """An administrator shortens a running job's time limit below what it ran (TimeLimit=0):
    slurmctld's next periodic check (every 30 s) ends it as TIMEOUT; nothing is left."""
    job, out, _ = hold_two_nodes(slurm, tmp_path, **LIGHT)
    slurm.check(["scontrol", "update", f"JobId={job}", "TimeLimit=0"])
    assert slurm.wait_state(job, timeout=60) == "TIMEOUT"
    left = slurm.wait_no_job_processes(KILL_WAIT_S - 1)
    assert not left, slurm.describe(left)
    assert "DUE TO TIME LIMIT" in out.read_text(), out.read_text()


def test_a_nodes_launcher_killed_ends_the_job(slurm: Cluster, tmp_path: Path) -> None:
    """SIGKILL to the launcher on n2: its ranks die with it (PR_SET_PDEATHSIG), n1 names the
    node lost and stops its own ranks, srun ends and the job with it."""
    job, out, _ = hold_two_nodes(slurm, tmp_path, **LIGHT)
    launchers = [p for p, cmd in slurm.processes("n2", "gpuwarden launch")]
    assert len(launchers) == 1, slurm.processes("n2")
    start = time.monotonic()
    os.kill(launchers[0], signal.SIGKILL)
    assert slurm.wait_state(job, timeout=60) == "FAILED", out.read_text()
    took = time.monotonic() - start
    left = slurm.wait_no_job_processes(KILL_WAIT_S)
    text = out.read_text()
    assert not left, slurm.describe(left)
    assert "NODE_LOST" in text, text
    assert took < 30, f"the job ended {took:.1f} s after the launcher died\n{text}"


def send_notices(slurm: Cluster, job: int, notice_dir: Path, ranks: int, count: int) -> list[int]:
    """`scancel -s USR1 JOB` (what slurmctld sends at --signal=USR1@T) ``count`` times, each
    once every rank has handled the one before; the handler runs per rank."""
    files = [notice_dir / f"notice.{r}" for r in range(ranks)]
    for k in range(1, count + 1):
        slurm.check(["scancel", "-s", "USR1", str(job)])
        deadline = time.monotonic() + 20
        while min(lines_of(f) for f in files) < k and time.monotonic() < deadline:
            time.sleep(0.02)
    time.sleep(0.5)  # a second delivery of the last notice, if any, lands meanwhile
    return [lines_of(f) for f in files]


def test_a_preemption_notice_runs_each_ranks_handler_once(slurm: Cluster,
                                                          tmp_path: Path) -> None:
    """The preemption recipe under proctrack/linuxproc, which signals every process of the
    step, ranks included: each notice runs each rank's handler exactly once. (Standard signals
    that arrive together merge, so one notice proves little: three are sent.)"""
    notices = tmp_path / "notices"
    notices.mkdir()
    job, out, hold = hold_two_nodes(slurm, tmp_path, recipe("preemption"),
                                    TRAIN_NOTICE_DIR=str(notices), **LIGHT)
    try:
        counts = send_notices(slurm, job, notices, 4, 3)
    finally:
        (hold / "go").touch()
    assert slurm.wait_state(job) == "COMPLETED", out.read_text()
    assert counts == [3, 3, 3, 3], counts


def test_requeue_starts_the_job_again_clean(slurm: Cluster, tmp_path: Path) -> None:
    """`scontrol requeue` of the running preemption recipe: the first run ends, nothing of it
    is left, and the second run (SLURM_RESTART_COUNT=1) leases the same GPUs and rendezvous
    on the same derived port without meeting anything of the first."""
    job, out, hold = hold_two_nodes(slurm, tmp_path, recipe("preemption"),
                                    TRAIN_HOLD_FIRST_RUN_ONLY="1", **LIGHT)
    first = set(slurm.job_pids())
    r = slurm.run(["bash", "-c", recipe("requeue")], env={"JOBID": str(job)})
    assert r.returncode == 0, r.stdout + r.stderr
    deadline = time.monotonic() + 60
    while slurm.job(job).get("Restarts") != "1" and time.monotonic() < deadline:
        time.sleep(0.1)
    state = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=120)
    text = out.read_text()
    assert state == "COMPLETED", text
    ranks = trained(text)
    assert_two_nodes_of_two(ranks, text, static=True, total="-")
    assert {x["restart"] for x in ranks} == {"1"}, text
    assert not [p for p in first if p in slurm.job_pids()], "a process of the first run lives"
    for node in slurm.nodes:
        listed = json.loads(slurm.check(["gpuwarden", "leases", "--json", "--dir",
                                         str(slurm.leases_on(node))]))
        assert (listed["holders"], listed["waiting"]) == ([], []), listed


# -- proctrack/pgid: the launcher alone receives Slurm's signals -------------------------------

@pytest.fixture(scope="module")
def slurm_pgid_cluster() -> Iterator[Cluster]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with cluster_of(proctrack="pgid") as cluster:
        yield cluster


@pytest.fixture
def slurm_pgid(slurm_pgid_cluster: Cluster, no_leftover_processes: None) -> Iterator[Cluster]:
    yield from slurm_checked(slurm_pgid_cluster)


@pytest.mark.parametrize("proctrack", [
    pytest.param("pgid", marks=pytest.mark.xdist_group("slurm-pgid")), "linuxproc"])
def test_a_preemption_notice_reaches_each_rank_once_whatever_the_proctrack(
        request: Any, tmp_path: Path, proctrack: str) -> None:
    """One node, ranks without torch: under proctrack/pgid Slurm signals the launcher's process
    group only, and the launcher passes the notice on; under linuxproc every process gets it
    from Slurm. Either way each rank's handler runs once per notice."""
    slurm = request.getfixturevalue("slurm_pgid" if proctrack == "pgid" else "slurm")
    in_cwd(tmp_path, "rank.py", "slurm_notice.py")
    (tmp_path / "d").mkdir()
    job, out = submit(slurm, tmp_path, "#!/bin/bash\nsrun gpuwarden launch rank.py d\n",
                      "--nodes=1", "--gres=gpu:2")
    wait_files([tmp_path / "d" / f"ready.{r}" for r in range(2)], 120, "the ranks", out)
    try:
        counts = send_notices(slurm, job, tmp_path / "d", 2, 3)
    finally:
        (tmp_path / "d" / "go").touch()
    assert slurm.wait_state(job) == "COMPLETED", out.read_text()
    assert counts == [3, 3], counts


# -- two real hosts: each slurmd in its own network and UTS namespace --------------------------

@pytest.fixture(scope="module")
def slurm_two_hosts_cluster() -> Iterator[Cluster]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with cluster_of(two_hosts=True) as cluster:
        yield cluster


@pytest.fixture
def slurm_two_hosts(slurm_two_hosts_cluster: Cluster,
                    no_leftover_processes: None) -> Iterator[Cluster]:
    yield from slurm_checked(slurm_two_hosts_cluster)


@pytest.mark.xdist_group("slurm-two-hosts")
def test_two_hosts_the_batch_recipe_takes_the_cross_host_path(slurm_two_hosts: Cluster,
                                                              tmp_path: Path) -> None:
    """n2's launcher finds MASTER_ADDR n1 on another host: no rehearsal, gloo across hosts.
    (torch's c10d recipe across the two hosts, under both launchers: bench_slurm.py
    --two-hosts; c10d across namespace hosts without Slurm: test_multinode_jobs.py.)"""
    slurm = slurm_two_hosts
    in_cwd(tmp_path)
    _, state, text = batch(slurm, tmp_path, recipe("batch"))
    assert state == "COMPLETED", text
    assert_two_nodes_of_two(trained(text), text, static=True)
    assert "must run on this host too" not in text, text  # not the one-machine rehearsal
    assert "loopback" not in text, text
