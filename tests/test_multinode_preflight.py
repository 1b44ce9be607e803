"""Multi-node preflight, Slurm settings, rank numbering, the command lines torchrun users paste,
and the job's one-decision protocol: little or no torch here.

Network cases run real launchers inside network-namespace hosts (root + iproute2; nftables for
the firewall): each stops in its preflight, before the node agent joins (its torch import runs
beside and is cut short). The rest is pure, and the job-store protocol runs two launchers' sides
against one in-memory store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.cli import build_parser
from gpuwarden.cli.launch import config_from_args
from gpuwarden.errors import UsageError
from gpuwarden.launch.multinode.slurm import slurm_settings
from gpuwarden.launch.plan import make_plan

sys.path.insert(0, str(Path(__file__).parent))
from _netns import Hosts, make_hosts, nft_unavailable_reason, remove_hosts, unavailable_reason  # noqa: E402

SCRIPT = str(Path(__file__).parent / "launch_scripts" / "sleeper.py")
GPUWARDEN = str(Path(sys.executable).parent / "gpuwarden")
_reason = unavailable_reason()
needs_netns = pytest.mark.skipif(_reason is not None, reason=_reason or "")


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    if _reason is not None:
        pytest.skip(_reason)
    h = make_hosts(3)  # three hosts on a bridge
    try:
        yield h
    finally:
        remove_hosts(h)


# A fresh launcher's interpreter start, imports and preflight on a 2-core machine loaded by
# other test suites (5 s failed there): the bound for "at once". What it rules out is a wait
# for a timeout (--rdzv-timeout's 5 min, torch's 30 min).
STARTUP_S = 25.0


def _run(h: Hosts, node: int, argv: list[str], timeout: float = 60) -> tuple[int, str, float]:
    start = time.monotonic()
    p = subprocess.run(h.cmd(node, argv), capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - start


def _launch_argv(node: int, addr: str, port: int, *extra: str) -> list[str]:
    return [GPUWARDEN, "launch", "--nnodes", "3", "--node-rank", str(node), "--master-addr", addr,
            "--master-port", str(port), "-n", "1", "--cpu", *extra, SCRIPT]


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(60)
def test_unresolvable_master_addr_is_rdzv_dns_at_once(hosts: Hosts) -> None:
    hosts.write_hosts(1, [])
    code, text, elapsed = _run(hosts, 1, _launch_argv(1, "node-zero.invalid", 29500))
    assert code == 1, text
    assert "error[RDZV_DNS]: MASTER_ADDR 'node-zero.invalid' does not resolve" in text
    assert "node 1 of 3" in text
    assert elapsed < STARTUP_S


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(60)
def test_firewall_dropping_the_port_is_connect_timeout_within_window(hosts: Hosts) -> None:
    reason = nft_unavailable_reason(hosts.names[0])
    if reason:
        pytest.skip(reason)
    port, window_s = 29517, 6.0
    hosts.nft(0, "add table inet gwtest",
              "add chain inet gwtest input { type filter hook input priority 0 ; }",
              f"add rule inet gwtest input tcp dport {port} drop")
    try:
        code, text, elapsed = _run(hosts, 2, _launch_argv(2, hosts.addrs[0], port, "--rdzv-timeout",
                                                          f"{window_s:g}s"))
    finally:
        hosts.nft(0, "delete table inet gwtest")
    assert code == 1, text
    assert "error[RDZV_CONNECT_TIMEOUT]" in text, text
    assert "packets dropped" in text  # said as it happened, and in the final reason
    assert "a firewall drops the packets" in text
    assert window_s <= elapsed < window_s + STARTUP_S


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(60)
def test_node_0_not_started_is_refused_and_retried_until_window(hosts: Hosts) -> None:
    code, text, elapsed = _run(hosts, 1, _launch_argv(1, hosts.addrs[0], 29518, "--rdzv-timeout",
                                                      "2s"))
    assert code == 1
    assert "refused the connection (the store's node not up yet, or a wrong port); retrying" \
        in text
    assert "error[RDZV_CONN_REFUSED]" in text and "node 0 with --node-rank) was not started" \
        in text


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(60)
def test_hostname_on_loopback_warns_in_doctor_and_preflight(hosts: Hosts) -> None:
    name = os.uname().nodename
    hosts.write_hosts(1, [f"127.0.1.1 {name}"])  # Debian's /etc/hosts line
    code, text, _ = _run(hosts, 1, [GPUWARDEN, "doctor", "--master-addr", hosts.addrs[0],
                                    "--master-port", "29519", "--nnodes", "3"])
    assert f"this host's name {name!r} resolves only to loopback (127.0.1.1)" in text, text
    assert "FAIL] hostname" in text
    code, text, _ = _run(hosts, 1, _launch_argv(1, hosts.addrs[0], 29519, "--rdzv-timeout", "1s"))
    warn_at = text.index("resolves only to loopback")
    assert warn_at < text.index("error[")  # before anything starts
    # Gloo would bind loopback: gpuwarden pins the interface of the route to MASTER_ADDR.
    assert f"gpuwarden sets GLOO_SOCKET_IFNAME={hosts.ifaces[1]}" in text


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(60)
def test_node_0_must_own_master_addr(hosts: Hosts) -> None:
    code, text, _ = _run(hosts, 0, _launch_argv(0, hosts.addrs[2], 29520))
    assert code == 1 and "this is node 0, but MASTER_ADDR 198.18.0.3" in text
    # Another node on node 0's own address: two nodes on one host (a rehearsal) or a swapped
    # --node-rank (which node 0's host then refuses): said, then node 0 is waited for.
    code, text, _ = _run(hosts, 1, _launch_argv(1, hosts.addrs[1], 29520, "--rdzv-timeout",
                                                 "1s"))
    assert code == 1 and "MASTER_ADDR 198.18.0.2 is this host's own address: node 0 must run " \
        "on this host too" in text
    assert "error[RDZV_CONN_REFUSED]" in text


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(60)
def test_socket_ifname_that_does_not_exist_fails_before_launch(hosts: Hosts) -> None:
    argv = ["env", "GLOO_SOCKET_IFNAME=eth7", *_launch_argv(1, hosts.addrs[0], 29521)]
    code, text, elapsed = _run(hosts, 1, argv)
    assert code == 1 and "error[NCCL_NO_INTERFACE]" in text and "eth7" in text
    assert elapsed < STARTUP_S


# ---- Slurm and numbering (pure) ---------------------------------------------------------------

SRUN_ENV = {  # as srun --nodes=4 --ntasks-per-node=1 sets them on the third node
    "SLURM_JOB_ID": "81234", "SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "4",
    "SLURM_JOB_NODELIST": "gpu[07-09,12]", "SLURM_STEP_NODELIST": "gpu[07-09,12]",
    "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4",
    "SLURM_STEP_ID": "0", "SLURM_NODEID": "2", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
    "SLURM_GPUS_ON_NODE": "2",
}


def _config(argv: list[str]):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser().parse_args(["launch", *argv, SCRIPT]))


def test_slurm_variables_give_ranks_and_master(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in SRUN_ENV.items():
        monkeypatch.setenv(k, v)
    config = _config(["--cpu", "-n", "2"])
    assert (config.nnodes, config.node_rank, config.source) == (4, 2, "slurm")
    assert config.master_addr == "gpu07"  # first host of the compressed list
    assert config.master_port == 10000 + 81234 % 20000
    plan = make_plan(config, (), master_port=config.master_port, run_id="slurm-81234",
                     run_dir="/tmp/x", supervisor_pid=1, python="python", base_env={})
    envs = [r.env for r in plan.ranks]
    assert [e["RANK"] for e in envs] == ["4", "5"] and [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"8"} and {e["GROUP_RANK"] for e in envs} == {"2"}
    assert {e["MASTER_ADDR"] for e in envs} == {"gpu07"}
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}


def test_slurm_ranks_per_node_from_the_allocation_gpus() -> None:
    settings = slurm_settings(SRUN_ENV)
    assert settings is not None and settings.nproc == 2


def test_slurm_refuses_one_launcher_per_task_and_the_batch_script() -> None:
    with pytest.raises(UsageError, match="srun started 8 tasks on 4 node"):
        slurm_settings({**SRUN_ENV, "SLURM_STEP_NUM_TASKS": "8"})
    batch = {k: v for k, v in SRUN_ENV.items() if not k.startswith("SLURM_STEP")}
    with pytest.raises(UsageError, match="runs in the batch script itself"):
        slurm_settings(batch)
    assert slurm_settings({"PATH": "/bin"}) is None


def test_explicit_flags_win_over_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in SRUN_ENV.items():
        monkeypatch.setenv(k, v)
    config = _config(["--cpu", "--master-port", "29999", "--master-addr", "10.1.1.1"])
    assert (config.master_addr, config.master_port, config.nnodes) == ("10.1.1.1", 29999, 4)
    assert _config(["--cpu", "--standalone"]).nnodes == 1


def test_single_node_slurm_step_chooses_its_own_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """One node: the job-id port is no --master-port the user gave. Two launches in one
    allocation must not collide on it, nor be refused when it is busy."""
    one_node = {"SLURM_JOB_ID": "81234", "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1",
                "SLURM_JOB_NODELIST": "gpu07", "SLURM_STEP_NODELIST": "gpu07",
                "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_ID": "0",
                "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "2"}
    for k, v in one_node.items():
        monkeypatch.setenv(k, v)
    config = _config(["--cpu"])
    assert config.nnodes == 1 and not config.multinode
    assert config.master_port is None  # chosen free at launch, as without Slurm
    # as torchrun on one node (its c10d rendezvous): this host's name, looked up at launch
    assert config.master_addr == ""
    assert _config([]).nproc == 2  # the allocation's GPUs still give the ranks per node


def test_slurm_master_is_the_same_for_the_launcher_and_detect_world() -> None:
    """srun-started ranks (detect_world) and srun-started launchers must derive one port from
    one job id, whichever spelling Slurm used, array jobs included."""
    from gpuwarden.distributed import detect_world

    for job in ({"SLURM_JOBID": "81234"}, {"SLURM_JOB_ID": "123_4"}, {"SLURM_JOBID": "123_4"}):
        env = {**{k: v for k, v in SRUN_ENV.items() if k not in ("SLURM_JOB_ID",)}, **job}
        settings = slurm_settings(env)
        assert settings is not None
        world = detect_world(env)
        assert (world.master_addr, world.master_port) == (settings.master_addr, settings.master_port)
        number = int(next(iter(job.values())).split("_")[0])
        assert settings.master_port == 10000 + number % 20000
    with pytest.raises(UsageError, match="SLURM_JOB_ID"):
        slurm_settings({**SRUN_ENV, "SLURM_JOB_ID": "abc"})


@pytest.mark.parametrize(("argv", "message"), [
    (["--nnodes", "2", "--master-addr", "10.0.0.1", "--node-rank", "0"], "needs --master-port"),
    (["--nnodes", "2", "--master-port", "29500", "--node-rank", "0"], "needs --master-addr"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "1"],
     "--node-rank 2 is not in 0..1"),
    (["--nnodes", "2", "--master-addr", "h", "--master-port", "1"],
     "only torch's c10d rendezvous assigns node ranks"),
    (["--nnodes", "1:4"], "elastic membership needs torch's dynamic rendezvous"),
    (["--nnodes", "3:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h"], "MIN is more than MAX"),
    (["--nnodes", "2", "--rdzv-backend", "c10d"], "needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "0"], "at least one node"),
    (["--nnodes", "a:b"], "not a number or MIN:MAX"),
    (["--rdzv-conf", "last_call_timeout=1.5"], "not a whole number of seconds"),
    (["--rdzv-conf", "is_host=maybe"], "not a boolean"),
    (["--rdzv-conf", "join_timeout"], "is not KEY=VALUE"),
])
def test_multinode_flags_are_validated(argv: list[str], message: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("SLURM_"):
            monkeypatch.delenv(k)
    with pytest.raises(UsageError, match=message):
        _config(["--cpu", *argv])


# ---- the command lines multi-node users paste (pure) --------------------------------------------

TORCHRUN_C10D = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-id=job1", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=node0:29400"]


def _no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("SLURM_"):
            monkeypatch.delenv(k)


def test_torchruns_c10d_line_needs_no_node_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_slurm(monkeypatch)
    c = _config(["--cpu", *TORCHRUN_C10D])
    assert (c.nnodes, c.fewest_nodes, c.node_rank, c.rdzv_id) == (2, 2, None, "job1")
    assert (c.master_addr, c.master_port, c.rdzv_backend) == ("node0", 29400, "c10d")
    assert c.dynamic and not c.elastic
    elastic = _config(["--cpu", "--nnodes=1:4", *TORCHRUN_C10D[1:], "--rdzv-conf",
                       "join_timeout=30,last_call_timeout=1,is_host=true"])
    assert (elastic.fewest_nodes, elastic.nnodes, elastic.elastic) == (1, 4, True)
    assert elastic.rdzv_timeout_s == 30  # join_timeout is --rdzv-timeout
    assert dict(elastic.rdzv_conf) == {"last_call_timeout": "1", "is_host": "true"}
    one = _config(["--cpu", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0"])
    assert (one.nnodes, one.master_port) == (1, None)  # torchrun's single-node idiom: any port


def test_slurms_srun_recipe_takes_the_hosts_and_no_node_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """`srun torchrun --nnodes=$SLURM_NNODES --nproc-per-node=2 --rdzv-backend=c10d
    --rdzv-endpoint=$head:29500`: torch's rendezvous numbers the nodes; Slurm's node list names
    the hosts a wait misses."""
    _no_slurm(monkeypatch)
    for k, v in SRUN_ENV.items():
        monkeypatch.setenv(k, v)
    c = _config(["--cpu", "--nnodes=4", "--nproc-per-node=2", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=gpu07:29500"])
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port) == (4, None, "gpu07", 29500)
    assert c.expected_hosts == ("gpu07", "gpu08", "gpu09", "gpu12")


def test_slurm_node_id_is_read_beside_nnodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug: with --nnodes given, SLURM_NODEID was never read and every node was node 0."""
    _no_slurm(monkeypatch)
    for k, v in SRUN_ENV.items():
        monkeypatch.setenv(k, v)
    c = _config(["--cpu", "--nnodes", "4", "--master-addr", "gpu07", "--master-port", "29500"])
    assert (c.node_rank, c.source) == (2, "slurm")
    assert _config(["--cpu", "--nnodes", "4", "--node-rank", "3", "--master-addr", "gpu07",
                    "--master-port", "29500"]).node_rank == 3  # a flag given wins


def test_a_given_topology_inside_a_batch_script_ignores_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_slurm(monkeypatch)
    for k, v in SRUN_ENV.items():
        if not k.startswith("SLURM_STEP"):
            monkeypatch.setenv(k, v)  # the batch script: no step
    c = _config(["--cpu", *TORCHRUN_C10D])  # nothing left for Slurm to say: no refusal
    assert c.nnodes == 2 and c.dynamic
    with pytest.raises(UsageError, match="runs in the batch script itself"):
        _config(["--cpu"])


def test_waits_name_the_missing_nodes() -> None:
    from gpuwarden.launch.config import LaunchConfig
    from gpuwarden.launch.multinode.node_agent import NodeInfo
    from gpuwarden.launch.multinode.rendezvous import missing_nodes

    static = LaunchConfig(SCRIPT, nnodes=3, node_rank=0, master_addr="h", master_port=1,
                          expected_hosts=("a", "b", "c"))
    assert missing_nodes(static, [{"host": "a", "node_rank": 0}]) == ["node 1 (b)", "node 2 (c)"]
    dynamic = LaunchConfig(SCRIPT, nnodes=3, node_rank=None, rdzv_backend="c10d",
                           master_addr="h", master_port=1)
    slurm = LaunchConfig(SCRIPT, nnodes=3, node_rank=None, rdzv_backend="c10d", master_addr="h",
                         master_port=1, expected_hosts=("gpu07", "gpu08.cluster", "gpu09"))
    joined = [{"host": "gpu07.cluster"}, {"host": "gpu09"}]
    assert missing_nodes(slurm, joined) == ["gpu08.cluster"]
    previous = (NodeInfo(0, "gpu07.cluster", "", None, 1), NodeInfo(1, "gpu11", "", None, 1))
    assert missing_nodes(dynamic, joined, previous) == ["gpu11"]  # lost since the last round
    assert missing_nodes(dynamic, joined) == []  # nothing says who: only the count is known


# ---- one decision for the job (job_store.py), two launchers' sides on one store ---------------


class _FakeAgent:
    """The node agent's store commands over a dict: what two launchers share through it."""

    def __init__(self, store: dict[str, str]) -> None:
        self.store = store

    def call(self, op: str, timeout_s: float = 0, on_event=None, **kw):  # type: ignore[no-untyped-def]
        key = kw.get("key", "")
        if op == "get":
            return {"value": self.store.get(key)}
        if op == "cas":
            if key not in self.store or self.store[key] == kw["expected"]:
                self.store[key] = kw["desired"]
            return {"value": self.store[key]}
        if op == "set":
            self.store[key] = kw["value"]
            return {}
        raise AssertionError(op)

    def send(self, op: str, **kw):  # type: ignore[no-untyped-def]
        self.call(op, **kw)
        return 0

    def forget(self, rid: int) -> None:
        pass


def test_the_first_failure_and_the_decision_are_the_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 1's rank raised a KeyError; node 0's rank only saw the echo. Both settle to node
    1's failure and node 1's decision, twice in a row ("same failure twice"), whatever each
    would have decided alone."""
    from gpuwarden.launch.multinode import job_store
    from gpuwarden.launch.multinode.node_agent import Round
    from gpuwarden.launch.outcome import Failure
    from gpuwarden.launch.restart.policy import RestartPolicy

    store: dict[str, str] = {}
    policy = RestartPolicy(3)
    keyerror = Failure("RANK_FAILED", 3, "KeyError", "/train.py:40", what="KeyError: 'lr'")
    echo = Failure("RANK_FAILED", 0, "RuntimeError", "/gloo.py:1", echo=True,
                   what="RuntimeError: Connection closed by peer")
    ids = iter(["node1-launcher", "node0-launcher"] * 2)
    results = []
    for rnd in (0, 1):
        history: dict[str, list[Failure]] = {"node1": [], "node0": []}
        job = json.loads(store["gpuwarden-job"]) if "gpuwarden-job" in store else None
        del job
        for node, local, is_echo in (("node1", keyerror, False), ("node0", echo, True)):
            monkeypatch.setattr(job_store, "LAUNCHER_ID", next(ids))
            jr = job_store.JobRound(_FakeAgent(store),  # type: ignore[arg-type]
                                    Round(rnd, int(node[-1]), 2, "h", 1, (), None))
            own = job_store.new_record(job_store.ECHO if is_echo else job_store.RANK,
                                       node=int(node[-1]), rank=local.rank or 0,
                                       what=local.what, echo=is_echo, code=local.code,
                                       exc_type=local.exc_type, where=local.where)
            rec, gone = jr.first_failure(own, None)
            assert rec is not None and not gone
            prior = [job_store.failure_from_dict(d) for d in
                     json.loads(store.get("job", '{"history": []}'))["history"]]
            used = json.loads(store.get("job", '{"restarts_used": 0}'))["restarts_used"]
            settled = jr.settle(rec, lambda f=local: f, policy, used, prior or history[node])
            results.append((rnd, node, settled.failure.describe(), settled.decision.restart,
                            settled.decision.reason))
    assert [r[2] for r in results] == ["RANK_FAILED (rank 3: KeyError at /train.py:40)"] * 4
    assert [r[3] for r in results] == [True, True, False, False]
    assert results[-1][4] == results[-2][4] == "same failure twice, not restarting"


def test_records_from_other_nodes_are_escaped_and_typed() -> None:
    from gpuwarden.launch.multinode import job_store
    from gpuwarden.launch.restart.policy import RestartPolicy, decide_restart

    f = job_store.failure_from_dict({"code": "RANK_FAILED\x1b[31m", "rank": "3",
                                     "what": "boom\u202e"})
    assert "\x1b" not in f.describe() and f.rank is None
    lost = job_store.failure_of_record({"kind": "node_lost", "node": 1, "host": "gpu08",
                                        "what": "went silent"})
    assert lost.describe() == "NODE_LOST (node 1 (gpu08): went silent)"
    assert decide_restart([], lost, RestartPolicy(1)).restart
    joined = job_store.failure_of_record({"kind": "membership", "node": 0, "what": "1 waiting"})
    decision = decide_restart([lost], joined, RestartPolicy(1))
    assert decision.restart and not decision.counts  # no restart used, even with none left
    gone = job_store.failure_of_record({"kind": "store_lost", "node": 0, "what": "gone"})
    assert not decide_restart([], gone, RestartPolicy(5)).restart

def test_the_agent_is_ready_as_soon_as_its_ready_line_is_read(monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """The store's node starts the rendezvous the moment the agent says ready: no further wait
    on the pipe once the line is read (it cost every node 0.5 s on the critical path)."""
    import select as select_module

    from gpuwarden.launch.multinode import node_agent

    line = json.dumps({"event": "ready", "import_s": 0.1}) + "\n"
    proc = subprocess.Popen([sys.executable, "-c", f"import sys, time; sys.stdout.write({line!r}); "
                             "sys.stdout.flush(); time.sleep(30)"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    agent = node_agent.NodeAgent(proc, os.devnull)
    try:
        assert proc.stdout is not None
        real_select = select_module.select
        real_select([proc.stdout], [], [], 20)  # the line is in the pipe
        waits: list[float] = []

        def no_wait(r: list[int], w: list[int], x: list[int], timeout: float) -> tuple[
                list[int], list[int], list[int]]:
            waits.append(timeout)
            return real_select(r, w, x, timeout)

        monkeypatch.setattr(node_agent.select, "select", no_wait)
        agent.wait_ready(timeout_s=20)
        assert agent.ready and agent.import_s == 0.1 and waits == []
    finally:
        proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()



@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_two_node_rehearsal_on_one_machine(tmp_path: Path) -> None:
    """`--nnodes 2 --master-addr 127.0.0.1`, both launchers on this machine (torchrun allows
    it): said to be a rehearsal, not refused, and the job runs. No root needed."""
    import re

    from gpuwarden.net import pick_free_port

    script = str(Path(__file__).parent / "launch_scripts" / "mn_allreduce.py")
    port = pick_free_port()
    procs = [subprocess.Popen([GPUWARDEN, "launch", "--nnodes", "2", "--node-rank", str(n),
                               "--master-addr", "127.0.0.1", "--master-port", str(port), "-n",
                               "1", "--cpu", script], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for n in (1, 0)]
    texts = [p.communicate(timeout=100)[0] for p in procs]
    for p, text in zip(procs, texts, strict=True):
        assert p.returncode == 0, text
        assert "is loopback (127.0.0.1): every node of this job must run on this host " \
            "(a rehearsal)" in text
    assert sorted(re.findall(r"rank (\d)/2 on (\d): all_reduce=(\S+)", "".join(texts))) == [
        ("0", "0", "3"), ("1", "1", "3")]


def _probes(hostname: str, hosts: dict[str, tuple[str, ...]], interfaces: dict[str, tuple[str, ...]],
            *, port_free: bool = True):  # type: ignore[no-untyped-def]
    from gpuwarden import net
    from gpuwarden.doctor.probes import Probes

    def resolve(name: str) -> net.Resolution:
        return net.Resolution(name, hosts.get(name, (name,) if name[0].isdigit() else ()),
                              None if name in hosts or name[0].isdigit() else "unknown", 0.0)

    def connect(host: str, addresses: tuple[str, ...], port: int) -> net.ProbeResult:
        return net.ProbeResult(host, port, net.ProbeStatus.OK, "connected", 0.0)

    return Probes(resolve=resolve, interfaces=lambda: interfaces, hostname=lambda: hostname,
                  port_is_free=lambda port: port_free, connect_tcp=connect,
                  source_address_for=lambda a: None if a.startswith("127.") else "10.0.0.4")


def _c10d_config(endpoint: str, **kw):  # type: ignore[no-untyped-def]
    from gpuwarden.launch.config import LaunchConfig

    return LaunchConfig(SCRIPT, nnodes=2, node_rank=None, rdzv_backend="c10d",
                        master_addr=endpoint, master_port=29400, **kw)


def test_an_endpoint_named_by_this_host_on_127_0_1_1_advertises_a_routable_address() -> None:
    """Debian's /etc/hosts on the store's host: its own name on 127.0.1.1. torchrun runs this;
    the preflight hosts the store here and advertises the interface address, named."""
    import io

    from gpuwarden.launch.multinode.rendezvous import check_rendezvous

    ifaces = {"lo": ("127.0.0.1",), "eth0": ("10.0.0.4",)}
    err = io.StringIO()
    pre = check_rendezvous(_c10d_config("node0"), {}, err=err,
                           probes=_probes("node0", {"node0": ("127.0.1.1",)}, ifaces))
    assert (pre.hosting, pre.local_addr, pre.env) == (True, "10.0.0.4",
                                                      {"GLOO_SOCKET_IFNAME": "eth0"})
    assert "advertises 10.0.0.4 (eth0) to the other nodes" in err.getvalue()
    # the same name from another host: it resolves to the network there, nothing to choose
    assert check_rendezvous(_c10d_config("node0", local_addr="10.0.0.9"), {}, err=io.StringIO(),
                            probes=_probes("node0", {"node0": ("127.0.1.1",)}, ifaces)
                            ).local_addr == "10.0.0.9"  # --local-addr wins


def test_a_loopback_endpoint_is_a_rehearsal_and_a_taken_port_joins_as_client() -> None:
    import io

    from gpuwarden.launch.multinode.rendezvous import check_rendezvous

    ifaces = {"lo": ("127.0.0.1",), "eth0": ("10.0.0.4",)}
    err = io.StringIO()
    pre = check_rendezvous(_c10d_config("127.0.0.1"), {}, err=err,
                           probes=_probes("box", {"box": ("10.0.0.4",)}, ifaces, port_free=False))
    assert "every node of this job must run on this host (a rehearsal)" in err.getvalue()
    assert "joins the store there as a client" in err.getvalue()
    assert (pre.hosting, pre.local_addr) == (False, "127.0.0.1")
