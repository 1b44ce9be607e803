"""The launcher's pure layers: config validation, the per-rank plan, preflight refusals, the
report's choice of root cause, the progress record, stack parsing; and the worker side's
launcher detection and Slurm node lists. Nothing here starts a rank."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gpuwarden.distributed import WorldEnv, choose_device, detect_world
from gpuwarden.errors import ConstraintError, GpuwardenError, PortInUseError, UsageError
from gpuwarden.launch.config import LaunchConfig
from gpuwarden.launch.outcome import RankExit
from gpuwarden.launch.plan import make_plan
from gpuwarden.launch.preflight import choose_port, take_gpus
from gpuwarden.launch.report import root_cause
from gpuwarden.launch.watch.stall import main_thread_frames
from gpuwarden.launch.watch.status import Phase, StatusReader, StatusWriter
from gpuwarden.nodelist import expand_nodelist, first_host

SCRIPT = str(Path(__file__).parent / "launch_scripts" / "env_dump.py")


@pytest.fixture(autouse=True)
def _private_leases(lease_dir: Path) -> None:
    """take_gpus leases through gpuwarden.lease: never in the host's lease directory."""


def taken_gpus(config: LaunchConfig):  # type: ignore[no-untyped-def]
    taken = take_gpus(config)
    taken.release()  # the plan only needs the snapshots
    return taken.gpus


def cfg(**kw) -> LaunchConfig:  # type: ignore[no-untyped-def]
    return LaunchConfig(target=kw.pop("target", SCRIPT), **kw)


def plan_for(config: LaunchConfig, gpus=(), env=None):  # type: ignore[no-untyped-def]
    return make_plan(config, gpus, master_port=29511, run_id="abc", run_dir="/run/x",
                     supervisor_pid=4242, python="/usr/bin/python3", base_env=env or {})


def test_plan_gives_torchrun_environment_on_cpu() -> None:
    plan = plan_for(cfg(nproc=4, args=("--lr", "3")))
    assert [r.rank for r in plan.ranks] == [0, 1, 2, 3]
    env = plan.ranks[2].env
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                "TORCHELASTIC_RUN_ID")} == {
        "RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
        "ROLE_RANK": "2", "ROLE_WORLD_SIZE": "4", "MASTER_ADDR": "localhost", "MASTER_PORT": "29511",
        "TORCHELASTIC_RUN_ID": "abc"}
    # rank 0 hosts the store: a worker told to use an agent store would wait for one forever
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert env["OMP_NUM_THREADS"] == "1" and env["GPUWARDEN_DEVICE"] == "cpu"
    assert "CUDA_VISIBLE_DEVICES" not in env  # no GPU host: nothing to hide
    # torchrun's `python -u SCRIPT` with the bootstrap in between; torchrun sets no PYTHONUNBUFFERED
    assert plan.ranks[2].argv == ("/usr/bin/python3", "-u", "-m", "gpuwarden.launch.ranks._bootstrap", SCRIPT, "--lr", "3")
    assert "PYTHONUNBUFFERED" not in env
    assert env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert plan_for(cfg(target="pkg.mod", module=True)).ranks[0].argv[4:6] == ("-m", "pkg.mod")


def test_plan_keeps_users_thread_count_and_hides_gpus_with_cpu_flag() -> None:
    plan = plan_for(cfg(nproc=2, cpu=True), env={"OMP_NUM_THREADS": "8"})
    assert "OMP_NUM_THREADS" not in plan.ranks[0].env  # inherited as is
    assert plan.ranks[0].env["CUDA_VISIBLE_DEVICES"] == ""


def test_simulated_two_gpu_host_gives_every_rank_the_jobs_gpus_in_rank_order(scenario) -> None:  # type: ignore[no-untyped-def]
    scenario("two_gpu")
    gpus = taken_gpus(cfg(nproc=2))
    plan = plan_for(cfg(nproc=2), gpus)  # torchrun's visibility: cuda:LOCAL_RANK is the rank's own
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in plan.ranks] == ["0,1", "0,1"]
    assert all(r.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for r in plan.ranks)
    assert [r.env["LOCAL_RANK"] for r in plan.ranks] == ["0", "1"]
    assert [r.gpu.cuda_id for r in plan.ranks] == ["0", "1"]  # type: ignore[union-attr]
    # --bind rank = torchrun's --virtual-local-rank: one GPU, as cuda:0, and LOCAL_RANK=0
    bound = plan_for(cfg(nproc=2, bind="rank"), gpus)
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in bound.ranks] == ["0", "1"]
    assert [r.env["LOCAL_RANK"] for r in bound.ranks] == ["0", "0"]
    assert [r.env["RANK"] for r in bound.ranks] == ["0", "1"]


def test_launch_reads_the_gpus_once(scenario, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The preflight's snapshot feeds the lease's first attempt: NVML is read once per launch.
    from gpuwarden.inventory.simulated import SimulatedBackend

    scenario("two_gpu")
    reads = []
    real = SimulatedBackend.read_host
    monkeypatch.setattr(SimulatedBackend, "read_host", lambda self: reads.append(1) or real(self))
    assert len(taken_gpus(cfg(nproc=2))) == 2
    assert len(reads) == 1


def test_more_ranks_than_usable_gpus_is_refused_with_a_reason_per_gpu(scenario) -> None:  # type: ignore[no-untyped-def]
    scenario("two_gpu")
    with pytest.raises(ConstraintError) as info:
        take_gpus(cfg(nproc=3))
    err = info.value
    assert err.exit_code == 4 and "3 rank(s) need 3 GPU(s)" in err.what
    assert "Duplicate GPU detected" in (err.why or "") and "--share" in (err.fix or "")
    assert [e.split(":")[0] for e in err.evidence] == ["GPU 0", "GPU 1"]
    scenario("example")  # one usable GPU of four: the three others refused, each for its reason
    with pytest.raises(ConstraintError) as info:
        take_gpus(cfg(nproc=2))
    text = "\n".join(info.value.evidence)
    assert "GPU 0: refused: in use by 1 other process(es): pid 4242" in text
    assert "GPU 3: refused: prohibited compute mode" in text


def test_share_puts_ranks_on_one_gpu_and_says_so(scenario) -> None:  # type: ignore[no-untyped-def]
    scenario("two_gpu")
    config = cfg(nproc=3, share=True)
    plan = plan_for(config, taken_gpus(config))
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in plan.ranks] == ["0", "1", "0"]
    assert plan.ranks[0].shares_gpu_with == (2,) and plan.ranks[1].shares_gpu_with == ()
    assert plan.ranks[2].env["GPUWARDEN_SHARED_GPU"] == "1"
    assert any("NCCL_DUPLICATE_GPU" in n for n in plan.notes)


def test_gpus_all_takes_every_usable_gpu(scenario) -> None:  # type: ignore[no-untyped-def]
    scenario("example")
    assert [g.index for g in taken_gpus(cfg(gpus="all"))] == [1]


def test_nproc_per_node_auto_is_one_rank_per_usable_gpu_else_per_core(scenario) -> None:  # type: ignore[no-untyped-def]
    import os

    scenario("two_gpu")
    config = cfg(nproc_auto=True)
    gpus = taken_gpus(config)
    assert len(plan_for(config, gpus).ranks) == 2 == len(gpus)
    scenario("nogpu")
    assert taken_gpus(config) == ()
    assert len(plan_for(config).ranks) == len(os.sched_getaffinity(0))


def test_no_gpu_host_runs_on_cpu_unless_gpus_were_required(scenario) -> None:  # type: ignore[no-untyped-def]
    scenario("nogpu")
    assert taken_gpus(cfg(nproc=2)) == ()
    # The driver answers and shows no GPU: not NVML_UNAVAILABLE (NoGPUError) but too few GPUs.
    with pytest.raises(ConstraintError) as info:
        take_gpus(cfg(gpus=2))
    assert info.value.exit_code == 4 and "2 GPU(s) requested, 0 of 0 usable" in info.value.what


@pytest.mark.parametrize("kw, words", [
    ({"nproc": 0}, "at least one rank"),
    ({"nproc": 2, "gpus": 3}, "disagree"),
    ({"cpu": True, "gpus": 2}, "contradict"),
    ({"cpu": True, "share": True}, "--share"),
    ({"bind": "all", "share": True}, "twice"),
    ({"redirects": "4"}, "not 0, 1, 2 or 3"),
    ({"tee": "0:1,x"}, "LOCAL_RANK:STREAMS"),
    ({"signals_to_handle": ("SIGNOPE",)}, "not a signal name"),
    ({"signals_to_handle": ("SIGKILL",)}, "cannot be caught"),
    ({"start_method": "thread"}, "--start-method"),
    ({"run_path": True, "target": "rel/train.py"}, "absolute script path"),
    ({"master_port": 70000}, "not a TCP port"),
    ({"target": "/nonexistent/train.py"}, "does not exist"),
])
def test_inconsistent_settings_are_refused_before_anything_starts(kw, words) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError) as info:
        cfg(**kw)
    assert words in info.value.what and info.value.exit_code == 2


def test_a_script_no_rank_could_run_is_named_for_what_it_is(tmp_path: Path) -> None:
    import os

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__main__.py").write_text("print(1)\n")
    os.mkfifo(tmp_path / "train.fifo")
    locked = tmp_path / "locked.py"
    locked.write_text("print(1)\n")
    locked.chmod(0)
    plain = tmp_path / "plain.py"
    plain.write_text("print(1)\n")
    cases = [(tmp_path / "pkg", "is a directory"), (tmp_path / "train.fifo", "is a FIFO"),
             (tmp_path / "missing.py", "does not exist")]
    if os.geteuid() != 0:  # root reads a file whatever its mode
        cases.append((locked, "is not readable"))
    for path, words in cases:
        with pytest.raises(UsageError) as info:
            cfg(target=str(path))
        assert words in info.value.what and info.value.exit_code == 2, info.value.what
    with pytest.raises(UsageError) as info:
        cfg(target=str(tmp_path / "pkg"))
    assert "__main__.py" in (info.value.fix or "")
    with pytest.raises(UsageError) as info:  # --no-python runs the file itself
        cfg(target=str(plain), no_python=True)
    assert "not executable" in info.value.what
    assert cfg(target="true", no_python=True).target == "true"  # a command from PATH, as torchrun


def test_explicit_busy_port_fails_at_once_and_auto_port_is_free() -> None:
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        with pytest.raises(PortInUseError) as info:
            choose_port(cfg(master_port=busy))
        assert info.value.code == "RDZV_PORT_IN_USE" and str(busy) in info.value.what
        auto = choose_port(cfg())
        assert auto != busy
        with socket.socket() as probe:
            probe.bind(("0.0.0.0", auto))  # really free


def test_an_auto_port_is_one_no_outgoing_connection_can_take_meanwhile() -> None:
    """Rank 0 binds the picked port seconds later (after importing torch). Ports the kernel
    hands out for port 0 come from the ephemeral range, which outgoing connections draw from
    too: beside other work one took the port first (EADDRINUSE in a restarted job's rank 0)."""
    from gpuwarden.net import PICKED_PORT_FLOOR

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low - PICKED_PORT_FLOOR < 1000:
        pytest.skip(f"this host's ephemeral range starts at {low}: no room below it")
    ports = {choose_port(cfg()) for _ in range(20)}
    assert all(PICKED_PORT_FLOOR <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # random, not one port every launcher on the host would pick


def _exit(rank: int, at: float, code: int = 1, message: str = "", stopped: bool = False) -> RankExit:
    error = {"type": "RuntimeError", "message": message, "monotonic": at} if message else None
    return RankExit(rank, 100 + rank, code, at + 0.01, stopped, error)


def test_root_cause_is_first_in_time_but_never_an_echo_of_a_real_failure() -> None:
    raised = _exit(1, 10.0, message="ValueError: bad batch")
    echo = _exit(0, 9.99, message="[../gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    assert root_cause([echo, raised]).rank == 1  # type: ignore[union-attr]
    killed = RankExit(3, 103, -9, 10.2, False)  # a signal death is never an echo
    assert root_cause([echo, killed]).rank == 3  # type: ignore[union-attr]
    assert root_cause([_exit(2, 5.0, 3), _exit(0, 6.0, 1)]).rank == 2  # type: ignore[union-attr]
    # an echo far apart from anything else is still the first failure
    assert root_cause([echo, _exit(1, 30.0, message="later")]).rank == 0  # type: ignore[union-attr]
    # A rank that left with exit code 0 just before the echo is the cause (os._exit(0) mid-job).
    left = RankExit(1, 101, 0, 10.0, False)
    assert root_cause([_exit(0, 9.99, message="Connection closed by peer"), left]) is left
    assert root_cause([left]) is None  # nothing failed
    assert root_cause([_exit(0, 9.99, message="ValueError: mine"), left]).rank == 0  # type: ignore[union-attr]


def test_progress_record_round_trip(tmp_path: Path) -> None:
    path = str(tmp_path / "rank0.status")
    reader = StatusReader(path)
    assert reader.read().phase is Phase.NOT_STARTED
    writer = StatusWriter(path)
    writer.set(Phase.STARTED)
    assert reader.read().phase is Phase.STARTED
    writer.set(Phase.FAILED)
    st = reader.read()
    assert st.phase is Phase.FAILED and st.since > 0
    reader.close()


def test_stack_dump_parsing_keeps_the_scripts_frames() -> None:
    dump = (
        "Thread 0x00007f1 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
        "Current thread 0x00007f2 (most recent call first):\n"
        '  File "/site/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
        '  File "/src/gpuwarden/launch/ranks/_bootstrap.py", line 125 in collective\n'
        '  File "/job/train.py", line 15 in step\n'
        '  File "<frozen runpy>", line 88 in _run_code\n'
        '  File "/src/gpuwarden/launch/ranks/_bootstrap.py", line 229 in main\n'
    )
    assert main_thread_frames(dump) == [
        'File "/site/torch/distributed/distributed_c10d.py", line 3252 in all_reduce',
        'File "/job/train.py", line 15 in step']


def test_detect_world_under_each_launcher() -> None:
    assert detect_world({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h",
                         "MASTER_PORT": "123"}) == WorldEnv(1, 4, 1, 4, "h", 123, "torchrun")
    slurm = detect_world({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                          "SLURM_JOB_ID": "123456", "SLURM_NTASKS_PER_NODE": "4",
                          "SLURM_JOB_NODELIST": "gpu[07-08,11],login1"})
    assert slurm == WorldEnv(5, 8, 1, 4, "gpu07", 10000 + 123456 % 20000, "slurm")
    mpi = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(UsageError, match="MASTER_ADDR"):
        detect_world(mpi)
    assert detect_world({**mpi, "MASTER_ADDR": "n1"}) == WorldEnv(2, 4, 0, 2, "n1", 29500, "mpi")
    assert detect_world({}).launcher == "single"


def test_device_choice_per_visibility() -> None:
    world = WorldEnv(1, 2, 1, 2, "h", 1, "torchrun")
    assert choose_device(world, 0, {}) is None
    assert choose_device(world, 1, {}) == 0  # narrowed to its own GPU
    assert choose_device(world, 2, {}) == 1  # torchrun: all GPUs visible
    with pytest.raises(GpuwardenError) as info:
        choose_device(WorldEnv(3, 4, 3, 4, "h", 1, "torchrun"), 2, {})
    assert info.value.code == "CUDA_INVALID_ORDINAL"


@pytest.mark.parametrize("text, hosts", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a1", ["a1"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("x[1,3],y,z[2-3]-ib", ["x1", "x3", "y", "z2-ib", "z3-ib"]),
])
def test_slurm_nodelist_expansion(text, hosts) -> None:  # type: ignore[no-untyped-def]
    assert expand_nodelist(text) == hosts
    assert first_host(text) == hosts[0]


@pytest.mark.parametrize("bad", ["n[1-", "n1]", "n[a-b]", "n[5-2]", "n[[1]]"])
def test_malformed_nodelist_is_a_usage_error(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError):
        expand_nodelist(bad)
