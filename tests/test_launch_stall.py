"""The stall decision and its inputs, as pure functions over recorded observations: frames as
the rank's sampling thread writes them, CPU times, exits. Nothing here starts a rank."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

from gpuwarden.launch.ranks._bootstrap import format_stacks
from gpuwarden.launch.watch import flight_recorder
from gpuwarden.launch.watch.stall import (
    Frame,
    RankView,
    Sample,
    classify,
    decide_stall,
    main_thread,
    parse_dump,
)

TORCH = "/venv/lib/python3.11/site-packages/torch"
BOOT = Frame("/src/gpuwarden/launch/ranks/_bootstrap.py", 150, "main")
SOURCE = {("/job/train.py", 30): "        handle.wait()\n"}


def source_line(path: str, line: int) -> str:
    return SOURCE.get((path, line), "x = 1\n")


def frames(*inner: Frame) -> tuple[Frame, ...]:
    return (*inner, BOOT)


ALL_REDUCE = frames(Frame(f"{TORCH}/distributed/distributed_c10d.py", 3252, "all_reduce"),
                    Frame(f"{TORCH}/distributed/c10d_logger.py", 83, "wrapper"),
                    Frame("/job/train.py", 14, "<module>"))
BROADCAST = frames(Frame(f"{TORCH}/distributed/distributed_c10d.py", 3151, "broadcast"),
                   Frame("/job/train.py", 16, "<module>"))
INIT = frames(Frame(f"{TORCH}/distributed/rendezvous.py", 200, "_create_c10d_store"),
              Frame(f"{TORCH}/distributed/distributed_c10d.py", 1700, "init_process_group"),
              Frame("/job/train.py", 8, "<module>"))
ASYNC_WAIT = frames(Frame("/job/train.py", 30, "step"), Frame("/job/train.py", 40, "<module>"))
BACKWARD = frames(Frame(f"{TORCH}/autograd/graph.py", 979, "_engine_run_backward"),
                  Frame(f"{TORCH}/autograd/__init__.py", 395, "backward"),
                  Frame(f"{TORCH}/_tensor.py", 623, "backward"),
                  Frame("/job/train.py", 55, "<module>"))
SLEEPING = frames(Frame("/job/train.py", 22, "load_batch"), Frame("/job/train.py", 50, "<module>"))


def computing(i: int) -> tuple[Frame, ...]:
    return frames(Frame("/job/train.py", 60 + i % 3, "forward"), Frame("/job/train.py", 70, "<module>"))


def running(stack_at: list[tuple[float, tuple[Frame, ...]]], cpu_per_s: float = 0.0) -> list[Sample]:
    return [Sample(t, f, t * cpu_per_s) for t, f in stack_at]


def same(stack: tuple[Frame, ...], start: float, end: float, step: float = 0.5,
         cpu_per_s: float = 0.0) -> list[Sample]:
    n = int((end - start) / step) + 1
    return running([(start + i * step, stack) for i in range(n)], cpu_per_s)


def view(rank: int, samples: list[Sample]) -> RankView:
    return RankView(rank, "running", tuple(samples))


def test_each_kind_of_wait_is_recognized_from_frames() -> None:
    assert classify(ALL_REDUCE, source_line).point == ("collective", "all_reduce")  # type: ignore[union-attr]
    assert classify(INIT, source_line).op == "init_process_group"  # type: ignore[union-attr]
    wait = classify(ASYNC_WAIT, source_line)
    assert wait is not None and wait.kind == "wait" and wait.site == "train.py:30"
    assert classify(BACKWARD, source_line).kind == "backward"  # type: ignore[union-attr]
    assert classify(SLEEPING, source_line) is None
    gather_obj = frames(Frame(f"{TORCH}/distributed/distributed_c10d.py", 10, "all_gather"),
                        Frame(f"{TORCH}/distributed/distributed_c10d.py", 20, "all_gather_object"),
                        Frame("/job/train.py", 5, "<module>"))
    assert classify(gather_obj, source_line).op == "all_gather_object"  # type: ignore[union-attr]


@pytest.mark.parametrize("stuck", [ALL_REDUCE, ASYNC_WAIT, BACKWARD])
def test_a_rank_waiting_past_the_timeout_while_another_is_elsewhere_is_a_stall(stuck) -> None:  # type: ignore[no-untyped-def]
    views = {0: view(0, same(stuck, 10.0, 15.0)), 1: view(1, same(SLEEPING, 10.0, 15.0))}
    stall = decide_stall(views, 15.2, 4.0, source_line)
    assert stall is not None and stall.waiting == [0] and stall.elsewhere == [1]
    assert "running elsewhere: load_batch at train.py:22" in stall.where[1]
    assert "(stack unchanged)" in stall.where[0]
    assert decide_stall(views, 13.9, 4.0, source_line) is None  # not yet: 3.9 s < 4 s


def test_no_false_stall() -> None:
    # rank 0 prepares data while the others wait at a barrier for less than the timeout
    barrier = frames(Frame(f"{TORCH}/distributed/distributed_c10d.py", 4000, "barrier"),
                     Frame("/job/train.py", 12, "<module>"))
    views = {0: view(0, running([(10 + i * 0.5, computing(i)) for i in range(7)], 1.0)),
             1: view(1, same(barrier, 10.5, 13.0))}
    assert decide_stall(views, 13.1, 4.0, source_line) is None
    # every rank in the same collective for long: a slow collective, not a missing rank
    views = {r: view(r, same(ALL_REDUCE, 10.0, 30.0)) for r in range(4)}
    assert decide_stall(views, 30.0, 4.0, source_line) is None
    # a collective that raised and was caught: the stack moved on, the clock restarts
    caught = same(ALL_REDUCE, 10.0, 10.5) + same(SLEEPING, 11.0, 20.0)
    views = {0: view(0, caught), 1: view(1, same(SLEEPING, 10.0, 20.0))}
    assert decide_stall(views, 20.0, 4.0, source_line) is None
    # a long computation in one rank while the others compute too
    views = {r: view(r, running([(10 + i * 0.5, computing(i + r)) for i in range(40)], 1.0))
             for r in range(2)}
    assert decide_stall(views, 30.0, 4.0, source_line) is None
    # backward that computes (CPU busy) is not DDP waiting for a peer
    views = {0: view(0, same(BACKWARD, 10.0, 20.0, cpu_per_s=1.0)), 1: view(1, same(SLEEPING, 10.0, 20.0))}
    assert decide_stall(views, 20.0, 4.0, source_line) is None


def test_mismatched_collectives_name_the_odd_one_out() -> None:
    views = {0: view(0, same(ALL_REDUCE, 10.0, 16.0))}
    views.update({r: view(r, same(BROADCAST, 10.0, 16.0)) for r in (1, 2, 3)})
    stall = decide_stall(views, 16.0, 4.0, source_line)
    assert stall is not None and stall.kind == "mismatch"
    assert stall.waiting == [1, 2, 3] and stall.elsewhere == [0] and stall.point == "broadcast"
    assert stall.waits == {0: "all_reduce", 1: "broadcast", 2: "broadcast", 3: "broadcast"}
    two = decide_stall({0: views[0], 1: views[1]}, 16.0, 4.0, source_line)
    assert two is not None and two.waiting == [0] and two.elsewhere == [1]  # tie: rank 0's point


def test_a_mismatch_names_the_fewer_ranks_odd_whichever_waited_longest() -> None:
    """Seen beside a CPU hog: rank 3 reached its broadcast a second before ranks 0-2 reached
    their all_reduce, so it alone was past the timeout when the check ran; the report then
    said ranks 0, 1, 2 "took another path". The odd ones out are the fewer."""
    views = {r: view(r, same(ALL_REDUCE, 11.0, 18.0)) for r in (0, 1, 2)}
    views[3] = view(3, same(BROADCAST, 10.0, 18.0))
    stall = decide_stall(views, 18.0, 7.5, source_line)  # only rank 3 waited 7.5 s or more
    assert stall is not None and stall.kind == "mismatch"
    assert stall.waiting == [0, 1, 2] and stall.elsewhere == [3] and stall.point == "all_reduce"


def test_gone_and_unstarted_ranks_are_the_odd_ones_out() -> None:
    views = {0: view(0, same(INIT, 10.0, 15.0)), 1: RankView(1, "exited", returncode=0),
             2: RankView(2, "not_started"), 3: view(3, same(INIT, 10.0, 15.0))}
    stall = decide_stall(views, 15.0, 4.0, source_line)
    assert stall is not None and stall.kind == "init" and stall.waiting == [0, 3]
    assert stall.elsewhere == [1, 2]
    assert stall.where[1] == "exited with exit code 0" and "not started" in stall.where[2]


def test_other_nodes_count_only_for_init_and_by_what_the_store_says() -> None:
    local = {0: view(0, same(INIT, 10.0, 15.0)), 1: view(1, same(INIT, 10.0, 15.0))}
    arrived = {**local, 2: RankView(2, "remote"), 3: RankView(3, "remote")}
    assert decide_stall(arrived, 15.0, 4.0, source_line) is None  # all four in init
    missing = {**arrived, 3: RankView(3, "remote", remote_where="(node 1) has not reached init")}
    stall = decide_stall(missing, 15.0, 4.0, source_line)
    assert stall is not None and stall.elsewhere == [3]
    # in a collective, other nodes' ranks are unknown: this node alone decides
    coll = {0: view(0, same(ALL_REDUCE, 10.0, 15.0)), 1: view(1, same(ALL_REDUCE, 10.0, 15.0)),
            2: RankView(2, "remote", remote_where="x")}
    assert decide_stall(coll, 15.0, 4.0, source_line) is None


def test_bootstrap_stack_format_round_trips_and_the_sampler_thread_is_left_out() -> None:
    text = format_stacks(sys._current_frames(), skip=-1)
    threads = parse_dump(text)
    assert threads and threads[0][0].func == "test_bootstrap_stack_format_round_trips_and_the_sampler_thread_is_left_out"
    dump = ("Thread 0x01 (most recent call first):\n"
            '  File "/src/gpuwarden/launch/ranks/_bootstrap.py", line 99 in _sampling_loop\n\n'
            + "Thread 0x02 (most recent call first):\n"
            + "".join(f'  File "{f.file}", line {f.line} in {f.func}\n' for f in ALL_REDUCE))
    assert [f.func for f in main_thread(parse_dump(dump))] == ["all_reduce", "<module>"]
    assert parse_dump('  File "/x.py", line 3 in cut\n') == []  # a dump's tail without its header


def _entry(seq: int, name: str, state: str = "completed") -> dict[str, object]:
    return {"collective_seq_id": seq, "p2p_seq_id": 0, "profiling_name": f"nccl:{name}",
            "state": state, "process_group": ("0", "default_pg")}


def test_flight_recorder_dumps_name_the_ranks_that_did_not_join(tmp_path: Path) -> None:
    env = flight_recorder.recorder_env(str(tmp_path), {})
    names = flight_recorder.installed_recorder_names()
    assert env[names.buffer_size] and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env[names.dump_file].startswith(str(tmp_path))
    assert flight_recorder.recorder_env(str(tmp_path), {"TORCH_NCCL_TRACE_BUFFER_SIZE": "9"}) == {}
    for rank, last in ((0, 7), (1, 7), (2, 6)):
        entries = [_entry(s, "all_reduce") for s in range(1, last)] + [_entry(last, "all_reduce", "started")]
        (tmp_path / f"{flight_recorder.DUMP_PREFIX}{rank}").write_bytes(
            pickle.dumps({"version": "2.10", "pg_config": {}, "entries": entries}))
    lines = flight_recorder.summary(str(tmp_path), wait_s=0)
    assert lines[0] == "process group 0: collective #7 (nccl:all_reduce): rank(s) 2 never joined it"
    assert "  rank 2: last collective #6 nccl:all_reduce (started)" in lines
    # a planted dump cannot run code in the launcher
    (tmp_path / f"{flight_recorder.DUMP_PREFIX}3").write_bytes(pickle.dumps(Path("/etc")))
    assert 3 not in flight_recorder.read_dumps(str(tmp_path))
