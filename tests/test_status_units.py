"""`gpuwarden status` / `stacks`, the parts that need no running job: the straggler decision and
the stack grouping as pure functions over recorded observations (frames as the ranks' sampling
threads write them, taken from real gloo runs), the rank's answer protocol on a real FIFO, the
control endpoint and its runtime directory, the store relay between two nodes' launchers."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.cli import main
from gpuwarden.jobs import gpuwarden_kind
from gpuwarden.launch.multinode._store_stacks import StackRelay
from gpuwarden.launch.observer import control
from gpuwarden.launch.observer.observe import (
    REMOTE_WAIT_S,
    JobSnapshot,
    _ask_other_nodes,
    _merge_other_nodes,
    group_stacks,
    rank_row,
    stack_record,
)
from gpuwarden.launch.outcome import PeerView
from gpuwarden.launch.ranks._bootstrap import MAX_DUMP_FRAMES, _sampling_loop, format_stacks
from gpuwarden.launch.watch.stall import Frame, RankView, Sample, main_thread, parse_dump
from gpuwarden.launch.watch.straggler import decide_straggler

TORCH = "/venv/lib/python3.11/site-packages/torch"
BOOT = Frame("/src/gpuwarden/launch/ranks/_bootstrap.py", 176, "_run_path")
SCRIPT = "/job/train.py"


def source_line(path: str, line: int) -> str:
    return "x = 1\n"


def frames(*inner: Frame) -> tuple[Frame, ...]:
    return (*inner, BOOT)


# What the ranks of tests/launch_scripts/straggler.py showed (gloo, torch 2.13).
ALL_REDUCE = frames(Frame(f"{TORCH}/distributed/distributed_c10d.py", 3252, "all_reduce"),
                    Frame(f"{TORCH}/distributed/c10d_logger.py", 83, "wrapper"),
                    Frame(SCRIPT, 24, "<module>"))
SLEEPING = frames(Frame(SCRIPT, 22, "<module>"))
COMPUTING = frames(Frame(f"{TORCH}/nn/modules/linear.py", 125, "forward"),
                   Frame(SCRIPT, 18, "<module>"))
LOADING = frames(Frame(f"{TORCH}/utils/data/dataloader.py", 1284, "_get_data"),
                 Frame(f"{TORCH}/utils/data/dataloader.py", 1450, "_next_data"),
                 Frame(f"{TORCH}/utils/data/dataloader.py", 733, "__next__"),
                 Frame(SCRIPT, 40, "<module>"))
INIT = frames(Frame(f"{TORCH}/distributed/distributed_c10d.py", 1700, "init_process_group"),
              Frame(SCRIPT, 8, "<module>"))
BACKWARD = frames(Frame(f"{TORCH}/autograd/graph.py", 979, "_engine_run_backward"),
                  Frame(f"{TORCH}/_tensor.py", 623, "backward"), Frame(SCRIPT, 55, "<module>"))


def job(pattern: dict[int, list[tuple[Frame, ...]]], *, step: float = 2.0, t0: float = 100.0,
        cpu: dict[int, float] | None = None) -> dict[int, RankView]:
    """Views of a job sampled every ``step`` s: rank -> its stack at each tick (one tick time
    for every rank, as the supervisor asks them all at once)."""
    views = {}
    for rank, stacks in pattern.items():
        rate = (cpu or {}).get(rank, 0.01)
        samples = tuple(Sample(t0 + i * step, f, (t0 + i * step) * rate) for i, f in enumerate(stacks))
        views[rank] = RankView(rank, "running", samples)
    return views


def now_of(views: dict[int, RankView]) -> float:
    return max(s.at for v in views.values() for s in v.samples) + 0.1


def test_the_rank_the_others_wait_for_is_named_with_what_it_does() -> None:
    n = 10
    views = job({0: [ALL_REDUCE] * n, 1: [ALL_REDUCE] * n, 2: [SLEEPING] * n, 3: [ALL_REDUCE] * n})
    found = decide_straggler(views, now_of(views), source_line)
    assert found is not None and found.rank == 2
    assert found.share == 1.0 and found.consistency == 1.0 and found.waited_by == (0, 1, 3)
    assert found.waits_in == "all_reduce" and found.own_wait_share == 0.0
    assert found.doing == "in <module> at train.py:22" and found.activity.startswith("idle")
    text = found.describe()
    assert "rank 2 is the last into collectives" in text and "100% of 10 samples" in text


def test_a_balanced_job_names_nobody() -> None:
    # each rank is the last one in turn, and most ticks everyone computes
    pattern: dict[int, list[tuple[Frame, ...]]] = {r: [] for r in range(4)}
    for i in range(40):
        last = i % 4
        for r in range(4):
            pattern[r].append(COMPUTING if i % 5 else (COMPUTING if r == last else ALL_REDUCE))
    views = job(pattern, step=1.0)
    assert decide_straggler(views, now_of(views), source_line) is None


def test_a_straggler_must_be_consistent_and_cost_the_others_time() -> None:
    # rank 1 is last in half the informative ticks, rank 3 in the other half: not consistent
    pattern: dict[int, list[tuple[Frame, ...]]] = {r: [] for r in range(4)}
    for i in range(12):
        slow = 1 if i % 2 else 3
        for r in range(4):
            pattern[r].append(SLEEPING if r == slow else ALL_REDUCE)
    views = job(pattern)
    assert decide_straggler(views, now_of(views), source_line) is None
    # one rank last, but in 1 tick of 30: too rare to be worth a name
    rare = {r: [COMPUTING] * 30 for r in range(3)}
    for r in (0, 1):
        rare[r][5] = ALL_REDUCE
    views = job(rare, step=1.0)
    assert decide_straggler(views, now_of(views), source_line) is None


def test_what_chance_explains_is_not_named() -> None:
    # two balanced ranks whose steps jitter: the last one is either, 8 times of 11 rank 1
    last = [1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 1]
    views = job({0: [SLEEPING if r == 0 else ALL_REDUCE for r in last],
                 1: [SLEEPING if r == 1 else ALL_REDUCE for r in last]})
    assert decide_straggler(views, now_of(views), source_line) is None
    # rank 1 last 8 times in a row: with two ranks, chance still explains it (2 x 2^-8)...
    eight = job({0: [ALL_REDUCE] * 8, 1: [SLEEPING] * 8})
    assert decide_straggler(eight, now_of(eight), source_line) is None
    # ...11 times in a row it does not (2 x 2^-11 < 0.001); among 4 ranks, 6 times suffice
    eleven = job({0: [ALL_REDUCE] * 11, 1: [SLEEPING] * 11})
    assert decide_straggler(eleven, now_of(eleven), source_line).rank == 1  # type: ignore[union-attr]
    six = job({0: [ALL_REDUCE] * 6, 1: [ALL_REDUCE] * 6, 2: [SLEEPING] * 6, 3: [ALL_REDUCE] * 6})
    assert decide_straggler(six, now_of(six), source_line).rank == 2  # type: ignore[union-attr]


def test_too_few_samples_and_startup_say_nothing_yet() -> None:
    few = job({0: [ALL_REDUCE] * 4, 1: [SLEEPING] * 4})
    assert decide_straggler(few, now_of(few), source_line) is None
    # rendezvous is not a collective: rank 1 arriving last at init is no straggler
    init = job({0: [INIT] * 10, 1: [SLEEPING] * 10})
    assert decide_straggler(init, now_of(init), source_line) is None


def test_a_straggler_that_recovered_is_no_longer_named() -> None:
    n = 52  # 20 ticks of rank 1 straggling, then 32 of everyone computing (2 s apart)
    views = job({0: [ALL_REDUCE] * 20 + [COMPUTING] * 32, 1: [SLEEPING] * 20 + [COMPUTING] * 32})
    assert decide_straggler(views, 100.0 + 19 * 2.0 + 0.1, source_line).rank == 1  # type: ignore[union-attr]
    assert decide_straggler(views, 100.0 + (n - 1) * 2.0 + 0.1, source_line) is None


def test_a_data_loading_rank_and_a_computing_backward() -> None:
    views = job({0: [LOADING] * 8, 1: [ALL_REDUCE] * 8, 2: [ALL_REDUCE] * 8}, cpu={0: 0.02})
    found = decide_straggler(views, now_of(views), source_line)
    assert found is not None and found.rank == 0 and found.data_loading
    assert found.doing == "loading data (DataLoader)" and found.activity == "waiting for data"
    # backward that uses a core computes: it waits for nobody, so nobody waits for rank 2
    busy = job({0: [BACKWARD] * 8, 1: [BACKWARD] * 8, 2: [COMPUTING] * 8},
               cpu={0: 1.0, 1: 1.0, 2: 1.0})
    assert decide_straggler(busy, now_of(busy), source_line) is None
    idle = job({0: [BACKWARD] * 12, 1: [BACKWARD] * 12, 2: [COMPUTING] * 12},
               cpu={0: 0.01, 1: 0.01, 2: 1.0})
    found = decide_straggler(idle, now_of(idle), source_line)
    assert found is not None and found.rank == 2 and found.activity == "computing on the CPU"


def test_ranks_that_do_not_answer_or_ended_do_not_count() -> None:
    views = job({0: [ALL_REDUCE] * 8, 1: [()] * 8})  # rank 1 never answered
    views[2] = RankView(2, "exited", returncode=0)
    assert decide_straggler(views, now_of(views), source_line) is None


def test_rank_phases_from_the_supervisors_samples() -> None:
    views = job({0: [ALL_REDUCE] * 3, 1: [SLEEPING] * 3, 2: [INIT] * 3})
    now = now_of(views)
    row = rank_row(views[0], now=now)
    assert row["phase"] == "collective" and row["op"] == "all_reduce" and row["site"] == "train.py:24"
    assert row["for_s"] == pytest.approx(4.1) and row["cpu_cores"] == pytest.approx(0.01)
    assert rank_row(views[1], now=now)["phase"] == "running"
    assert rank_row(views[1], now=now)["where"] == "<module> at train.py:22"
    assert rank_row(views[2], now=now)["phase"] == "rendezvous"
    assert rank_row(views[1], now=now, failing=True)["phase"] == "failing"
    assert rank_row(RankView(3, "exited", returncode=-9), now=now)["phase"] == "exited"
    assert rank_row(RankView(3, "exited", returncode=0), now=now)["phase"] == "finished"
    assert rank_row(RankView(3, "not_started"), now=now)["phase"] == "starting"
    # backward computing (a core) is running, not a collective
    busy = job({0: [BACKWARD] * 3}, cpu={0: 1.0})
    assert rank_row(busy[0], now=now_of(busy))["phase"] == "running"


def _dump(stack: tuple[Frame, ...]) -> str:
    return ("Thread 0x01 (most recent call first):\n"
            '  File "/src/gpuwarden/launch/ranks/_bootstrap.py", line 99 in _sampling_loop\n\n'
            "Thread 0x02 (most recent call first):\n"
            + "".join(f'  File "{f.file}", line {f.line} in {f.func}\n' for f in stack))


def records(stacks: dict[int, tuple[Frame, ...]], node: dict[int, int] | None = None) -> list[dict[str, Any]]:
    out = []
    for rank, stack in stacks.items():
        rec = stack_record(rank, _dump(stack), True, all_threads=False)
        rec["node"] = (node or {}).get(rank, 0)
        out.append(rec)
    return out


def test_same_stacks_are_grouped_and_the_odd_rank_is_marked() -> None:
    groups = group_stacks(records({0: ALL_REDUCE, 1: ALL_REDUCE, 2: SLEEPING, 3: ALL_REDUCE},
                                  node={2: 1, 3: 1}))
    assert [(g["ranks"], g["odd"]) for g in groups] == [([0, 1, 3], False), ([2], True)]
    assert groups[0]["wait"]["op"] == "all_reduce" and groups[0]["nodes"] == [0, 1]
    assert [f["func"] for f in groups[0]["main"]] == ["all_reduce", "<module>"]  # wrappers hidden
    assert groups[1]["wait"] is None


def test_ties_mark_the_ranks_out_of_the_collective_and_mismatches_mark_none() -> None:
    two = group_stacks(records({0: ALL_REDUCE, 1: SLEEPING}))
    assert [(g["ranks"], g["odd"]) for g in two] == [([0], False), ([1], True)]
    broadcast = frames(Frame(f"{TORCH}/distributed/distributed_c10d.py", 3151, "broadcast"),
                       Frame(SCRIPT, 30, "<module>"))
    mismatch = group_stacks(records({0: ALL_REDUCE, 1: broadcast}))
    assert not any(g["odd"] for g in mismatch)
    assert not any(g["odd"] for g in group_stacks(records({0: SLEEPING, 1: COMPUTING})))
    one = group_stacks(records({0: ALL_REDUCE, 1: ALL_REDUCE}))
    assert len(one) == 1 and one[0]["ranks"] == [0, 1] and not one[0]["odd"]


def test_dumps_stay_bounded_for_deep_recursion_and_keep_where_the_script_began() -> None:
    def deep(n: int) -> str:  # this thread only: the suite may have left others running
        me = threading.get_ident()
        return deep(n - 1) if n else format_stacks({me: sys._current_frames()[me]}, skip=-1)

    text = deep(MAX_DUMP_FRAMES + 100)
    mine = parse_dump(text)[0]
    assert len(mine) == MAX_DUMP_FRAMES and "frames left out" in text
    assert mine[0].func == "deep" and mine[-1].func != "deep"  # the outermost frames are kept
    rec = stack_record(0, text, True, all_threads=False)
    assert len(rec["main"]) <= 64 and any(f["file"] == "..." for f in rec["main"])


def test_the_sampling_thread_answers_a_question_apart_from_the_samples(tmp_path: Path) -> None:
    fifo, sample, query = (str(tmp_path / n) for n in ("req", "sample", "query"))
    os.mkfifo(fifo, 0o600)
    t = threading.Thread(target=_sampling_loop, args=(fifo, sample, query), daemon=True)
    t.start()
    fd = os.open(fifo, os.O_WRONLY)

    def wait_for(path: str, old: float | None) -> float:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if os.path.exists(path) and os.stat(path).st_mtime_ns != old:
                return os.stat(path).st_mtime_ns
            time.sleep(0.005)
        raise AssertionError(f"{path} not written")

    os.write(fd, b"s")
    s1 = wait_for(sample, None)
    assert not os.path.exists(query)
    os.write(fd, b"q")
    wait_for(query, None)
    time.sleep(0.05)
    assert os.stat(sample).st_mtime_ns == s1  # a question leaves the supervisor's sample alone
    threads = parse_dump(Path(query).read_text())
    assert any(f.func == "test_the_sampling_thread_answers_a_question_apart_from_the_samples"
               for t in threads for f in t)
    assert not any(f.func == "_sampling_loop" for t in threads for f in t)  # itself left out
    os.close(fd)  # O_RDWR in the thread: it never sees end-of-file; it is a daemon here


def test_a_runtime_directory_another_user_made_first_is_never_used(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(control.RUNTIME_ENV, raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    squat = tmp_path / "squat"
    squat.mkdir(mode=0o777)
    squat.chmod(0o777)  # loose: as if another user made it (or a link to one)
    monkeypatch.setattr(control, "tmp_dir_for", lambda uid: squat)
    got = control.runtime_dir({})
    assert got != squat and got.name.startswith("squat-")
    st = os.lstat(got)
    assert st.st_mode & 0o777 == 0o700 and st.st_uid == os.getuid()
    got.rmdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    monkeypatch.setattr(control, "tmp_dir_for", lambda uid: link)
    assert control.runtime_dir({}) != link
    with pytest.raises(control.EndpointError):
        control.runtime_dir({control.RUNTIME_ENV: str(squat)})


def test_the_endpoint_answers_refuses_garbage_and_forgets_dead_launchers(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)

    def handler(request: dict[str, Any]) -> dict[str, Any]:
        if request.get("op") == "boom":
            raise RuntimeError("handler bug")
        return {"ok": True, "echo": request}

    server = control.ControlServer({"kind": "launch", "run_id": "r1"}, handler, directory=d).start()
    try:
        path = server.endpoint.socket_path
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        assert control.ask(path, {"op": "x"})["echo"] == {"op": "x"}
        assert control.ask(path, {"op": "boom"}) == {"ok": False, "error": "RuntimeError: handler bug"}
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(path))
        s.sendall(b"not json\n")
        assert json.loads(s.recv(1000)) == {"ok": False, "error": "malformed request"}
        s.close()
        [reg] = control.registered_jobs([d])
        assert reg.pid == os.getpid() and reg.record["run_id"] == "r1"
    finally:
        server.close()
    assert list(d.iterdir()) == []
    # a record whose pid now names another process (or none) is removed with its socket
    (d / "999999.json").write_text(json.dumps({"start_ticks": 1}))
    (d / "999999.sock").write_text("")
    assert control.registered_jobs([d]) == [] and list(d.iterdir()) == []
    with pytest.raises(control.EndpointError) as err:
        control.ask(d / "999999.sock", {"op": "status"})
    assert err.value.errno is not None


def test_loop_calls_run_in_the_loop_and_refuse_once_closed() -> None:
    calls = control.LoopCalls()
    seen: list[str] = []

    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.005):
            calls.run_pending()

    t = threading.Thread(target=loop, name="the-loop")
    t.start()
    assert calls.call(lambda now: threading.current_thread().name) == "the-loop"
    with pytest.raises(control.EndpointError, match="ZeroDivisionError"):
        calls.call(lambda now: seen.append("x") or 1 / 0)
    stop.set()
    t.join()
    calls.close()
    with pytest.raises(control.EndpointError, match="ending"):
        calls.call(lambda now: 1)


def test_gpuwarden_commands_are_recognised_in_the_process_table() -> None:
    venv = "/w/.venv/bin"
    assert gpuwarden_kind([f"{venv}/python", f"{venv}/gpuwarden", "launch", "-n", "2", "x.py"]) == "launch"
    assert gpuwarden_kind(["python3", "-m", "gpuwarden", "run", "--gpus", "1", "--", "x"]) == "run"
    assert gpuwarden_kind([f"{venv}/gpuwarden", "worker", "tcp://h:8786"]) == "worker"
    assert gpuwarden_kind(["python", "-u", "-m", "gpuwarden.launch.ranks._bootstrap", "x.py"]) is None
    assert gpuwarden_kind([f"{venv}/gpuwarden", "status"]) is None
    assert gpuwarden_kind(["python", "train.py", "gpuwarden", "launch"]) is None
    assert gpuwarden_kind(["python3.11", "-X", "dev", "-m", "gpuwarden", "launch", "x"]) == "launch"
    assert gpuwarden_kind(["python", "-m", "pytest", "gpuwarden", "launch"]) is None


class FakeStore:
    """The few TCPStore calls the relay makes, over a dict (the netns test runs the real one)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def add(self, key: str, n: int) -> int:
        with self.lock:
            value = int(self.data.get(key, b"0")) + n
            self.data[key] = str(value).encode()
            return value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def set(self, key: str, value: bytes | str) -> None:
        self.data[key] = value if isinstance(value, bytes) else value.encode()

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


@contextlib.contextmanager
def two_launchers(tmp_path: Path) -> Iterator[list[StackRelay]]:
    """Two nodes' launcher endpoints (node n answers ranks 2n, 2n+1 from host n) and each
    node's store relay; the relays are polled by the test."""
    servers = []
    relays = []
    try:
        for node in range(2):
            d = tmp_path / f"node{node}"
            d.mkdir(mode=0o700)
            answer = {"ok": True, "job": {"host": f"host{node}"},
                      "ranks": [{"rank": 2 * node + i, "pid": 100 + i, "phase": "running",
                                 "main": [{"file": "/job/x.py", "line": 3, "func": "f"}],
                                 "fresh": True} for i in range(2)]}
            reg = d / "registry"  # each node's launcher: its own endpoint (one process here)
            reg.mkdir(mode=0o700)
            server = control.ControlServer({}, lambda req, a=answer: {**a, "asked": req},
                                           directory=reg).start()
            servers.append(server)
            server.link_into(str(d))
            relays.append(StackRelay(str(d / "rank0.peers.json"), node, 2))
        yield relays
    finally:
        for server in servers:
            server.close()


@contextlib.contextmanager
def polling(store: FakeStore, relays: list[StackRelay], delays: list[float]) -> Iterator[None]:
    """Each relay polls the store every 0.05 s, from ``delays[i]`` s on (as a watch that has
    only just connected)."""
    stop = threading.Event()

    def watch(relay: StackRelay, delay: float) -> None:
        if stop.wait(delay):
            return
        while not stop.is_set():
            relay.poll(store)
            time.sleep(0.05)

    threads = [threading.Thread(target=watch, args=(r, d), daemon=True)
               for r, d in zip(relays, delays, strict=True)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_the_store_relay_brings_another_nodes_launcher_answer(tmp_path: Path) -> None:
    store = FakeStore()
    with two_launchers(tmp_path) as relays, polling(store, relays, [0.0, 0.0]):
        time.sleep(0.2)  # both relays have seen the counter once
        req = tmp_path / "node0" / "rank0.peers.json.stacks-request"
        req.write_text(json.dumps({"id": "abc", "deadline": time.time() + 3}))
        answer_file = tmp_path / "node0" / "rank0.peers.json.stacks-answer"
        deadline = time.monotonic() + 5
        while not answer_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        got = json.loads(answer_file.read_text())
        assert got["id"] == "abc" and set(got["nodes"]) == {"1"}
        remote = got["nodes"]["1"]
        assert remote["job"]["host"] == "host1" and [r["rank"] for r in remote["ranks"]] == [2, 3]
        assert remote["asked"] == {"op": "stacks", "scope": "node", "all_threads": True}
        assert not any(k.endswith(("/open", "/node/1")) for k in store.data)  # cleaned up


def _asking_snapshot(tmp_path: Path) -> JobSnapshot:
    return JobSnapshot({"nnodes": 2, "node_rank": 0}, (), str(tmp_path),
                       True, str(tmp_path / "node0" / "rank0.peers.json"))


def test_other_nodes_are_asked_even_before_this_nodes_watch_has_connected(
        tmp_path: Path) -> None:
    """Right after init_process_group a script runs ahead of its node's store watch: a stacks
    request then waits for the relay's first poll instead of giving up at once."""
    store = FakeStore()
    peers = PeerView()  # what the supervisor knows: not connected yet
    with two_launchers(tmp_path) as relays, polling(store, relays, [0.4, 0.0]):
        started = time.monotonic()
        snap = _asking_snapshot(tmp_path)
        request_id = _ask_other_nodes(snap.peers_file, started + REMOTE_WAIT_S)
        answer: dict[str, Any] = {"nodes": [], "ranks": []}
        threading.Timer(0.4, lambda: setattr(peers, "reader_connected", True)).start()
        _merge_other_nodes(answer, snap, request_id, started + REMOTE_WAIT_S, False, started,
                           peers)
    [node1] = answer["nodes"]
    assert node1["node"] == 1 and node1["answered"] and node1["host"] == "host1", node1
    assert [r["rank"] for r in answer["ranks"]] == [2, 3]


def test_a_node_whose_watch_never_connects_says_so_after_the_wait(tmp_path: Path) -> None:
    with two_launchers(tmp_path):
        started = time.monotonic()
        snap = _asking_snapshot(tmp_path)
        request_id = _ask_other_nodes(snap.peers_file, started + 0.3)
        answer: dict[str, Any] = {"nodes": [], "ranks": []}
        _merge_other_nodes(answer, snap, request_id, started + 0.3, False, started, PeerView())
    [node1] = answer["nodes"]
    assert not node1["answered"] and "holds no connection to the job's store" in node1["error"]
    assert time.monotonic() - started >= 0.3


def test_stacks_and_status_without_any_job(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    monkeypatch.setenv(control.RUNTIME_ENV, str(d))
    assert main(["stacks"]) == 1
    assert "error[JOB_NOT_FOUND]: no gpuwarden launch of yours runs on this host" in capsys.readouterr().err
    assert main(["stacks", "not-a-run-id"]) == 2
    assert main(["stacks", "999999999"]) == 2
    assert "no process 999999999" in capsys.readouterr().err
    assert main(["stacks", str(os.getpid())]) == 2  # pytest is no gpuwarden launch
    assert main(["status", "--json", "123456789"]) == 2
    capsys.readouterr()
    assert main(["status", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and isinstance(doc["jobs"], list)
    assert main(["status", "--interval", "soon"]) == 2


def test_main_thread_of_a_recorded_dump() -> None:
    # the sampler's own thread is never shown as the script's
    assert [f.func for f in main_thread(parse_dump(_dump(SLEEPING)))] == ["<module>"]


def _status_doc() -> dict:
    job = {"id": "812345", "user": "a-long-user-name", "kind": "launch", "age_s": 3725.0,
           "gpus": [{"index": 0}, {"index": 1}], "mine": True,
           "command": "gpuwarden launch -n 2 train.py --epochs 90 --lr 3e-4 --data /datasets/x",
           "launch": {"target": "train.py", "run_id": "r1", "node_rank": 0, "nnodes": 1,
                      "attempt": 0, "max_restarts": 0, "uptime_s": 61.0,
                      "sample_interval_s": 1.0, "stall": {}, "ranks": [
                          {"rank": r, "pid": 987654 + r, "gpu": r, "phase": "collective",
                           "op": "allreduce", "for_s": 1.5, "cpu_cores": 0.98,
                           "gpu_memory_bytes": 3 << 30, "where": "train.py:42 in step"}
                          for r in (0, 1)]}}
    return {"host": "box-a", "generated_at": 0.0, "jobs": [job]}


@pytest.mark.parametrize("width", [60, 80, 200])
def test_status_keeps_every_id_whole_and_its_titles_on_their_own_lines(width: int) -> None:
    """At 60 columns JOB, USER, AGE and GPUS shrank to nothing and pids read `9…`: the id that
    `stacks` needs was lost. Columns now go whole (least needed first); ids are never cut, no
    line is wider than the terminal, and at 200 columns a title is not wrapped at the table."""
    import io

    from rich.console import Console

    from gpuwarden.cli.status import build_view, to_rich

    sections = build_view(_status_doc())
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(to_rich(sections, width))
    text = out.getvalue()
    assert all(len(line) <= width for line in text.splitlines()), text
    assert "812345" in text and "987654" in text and "987655" in text, text
    if width == 200:
        assert sections[1].title in text.splitlines(), text
    # rank 0 runs on GPU 0, which is not "no GPU" (it read "cpu")
    assert [r[2] for r in sections[1].rows] == ["0", "1"]
