"""Stall detection from outside the ranks: PURE functions over sampled observations.

The supervisor samples every rank now and then (``launch/watch/sampler.py``): its main thread's Python
stack (a faulthandler dump) and its CPU time. Nothing inside the rank says "I am in a
collective"; the frames do:

- ``init_process_group`` (torch.distributed) on the stack: waiting for the other ranks to join;
- a collective of ``torch.distributed`` (``all_reduce``, ``broadcast``, ``barrier``, ...): the
  outermost one, so ``all_gather_object`` is named rather than the ``all_gather`` it calls;
- the innermost frame's source line calls ``.wait(``: an async handle (``async_op=True``) or a
  future being waited for (the wait itself is C++, so the caller's line is what shows);
- ``backward`` (autograd) with the process using (almost) no CPU: DDP's gradient all-reduce,
  issued in C++ from autograd hooks, waiting for a peer; a backward that computes uses CPU.

Progress is the stack changing: a rank whose stack stays the same while waiting makes none.
A rank that computes is never stalled (it is not waiting); a collective that raised and was
caught leaves the frames, so nothing stays "in a collective" by mistake.

:func:`decide_stall` says a job is stalled when some ranks have waited at one point for the
stall timeout with an unchanged stack while others are elsewhere, gone, or waiting at a
different point (mismatched collectives). Every rank at the same point is a slow collective,
not a stall.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Collectives and point-to-point calls of torch.distributed that block until peers take part.
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list", "barrier",
    "monitored_barrier", "send", "recv", "send_object_list", "recv_object_list", "new_group",
    "batch_isend_irecv", "all_reduce_coalesced", "all_gather_coalesced", "wait_tensor",
})
INIT_FUNCTIONS = frozenset({"init_process_group", "init_device_mesh"})
BACKWARD_FUNCTIONS = frozenset({"backward", "_engine_run_backward", "run_backward", "grad"})
# A rank in backward using less CPU than this (cores) over its unchanged stack is waiting for
# DDP's gradient all-reduce; a backward that computes uses a core or more.
IDLE_CPU_CORES = 0.15
_WAIT_CALL = re.compile(r"\.wait\(")
_BOOTSTRAP = "gpuwarden/launch/ranks/_bootstrap.py"
_HIDDEN = (_BOOTSTRAP, "runpy", "c10d_logger.py")  # bootstrap, runpy, torch's logging wrapper
_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def render(self) -> str:
        return f'File "{self.file}", line {self.line} in {self.func}'

    @property
    def in_torch(self) -> bool:
        return "/torch/" in self.file

    @property
    def site(self) -> str:
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line}"


def parse_dump(dump: str) -> list[list[Frame]]:
    """Every thread of a faulthandler all-threads dump, innermost frame first. Lines before the
    first thread header (the tail of a dump cut short) are ignored."""
    threads: list[list[Frame]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append([])
        elif threads:
            m = _FRAME.match(line)
            if m:
                threads[-1].append(Frame(m["file"], int(m["line"]), m["func"]))
    return threads


def main_thread(threads: Sequence[Sequence[Frame]]) -> list[Frame]:
    """The thread running the script: the one the bootstrap started it from (faulthandler does
    not say which is the main thread), without the bootstrap's and runpy's frames."""
    if not threads:
        return []
    script_threads = [t for t in threads if not any(f.func == "_sampling_loop" for f in t)]
    if not script_threads:
        return []
    main = next((t for t in script_threads if any(_BOOTSTRAP in f.file for f in t)),
                script_threads[-1])
    return [f for f in main if not any(h in f.file for h in _HIDDEN)]


def main_thread_frames(dump: str, limit: int = 6) -> list[str]:
    """The innermost frames of the script's thread, rendered as faulthandler writes them."""
    return [f.render() for f in main_thread(parse_dump(dump))[:limit]]


@dataclass(frozen=True)
class Wait:
    """Where a rank waits for its peers."""

    kind: str  # "init", "collective", "wait" (an async handle), "backward" (DDP's all-reduce)
    op: str  # init_process_group, all_reduce, .wait(), backward
    site: str  # the script's own line that called it, "train.py:42"

    @property
    def point(self) -> tuple[str, str]:
        """Ranks at the same point wait for the same thing."""
        return (self.kind, self.op)

    def describe(self) -> str:
        """What the rank waits in, in words: 'all_reduce', 'a .wait() on an async collective'."""
        if self.kind == "wait":
            return "a .wait() on an async collective"
        if self.kind == "backward":
            return "backward (DDP's gradient all-reduce)"
        return self.op


def _user_site(frames: Sequence[Frame]) -> str:
    for f in frames:
        if not f.in_torch:
            return f.site
    return frames[0].site if frames else "?"


SourceLine = Callable[[str, int], str]


def classify(frames: Sequence[Frame], source_line: SourceLine) -> Wait | None:
    """The wait the stack shows (innermost frame first), or None when the rank is elsewhere."""
    if not frames:
        return None
    site = _user_site(frames)
    dist = [f for f in frames if "torch/distributed/" in f.file]
    if any(f.func in INIT_FUNCTIONS for f in dist):
        return Wait("init", next(f.func for f in reversed(dist) if f.func in INIT_FUNCTIONS), site)
    collectives = [f for f in dist if f.func in COLLECTIVES]
    if collectives:
        return Wait("collective", collectives[-1].func, site)
    if _WAIT_CALL.search(source_line(frames[0].file, frames[0].line)):
        return Wait("wait", ".wait()", frames[0].site)
    if any(f.in_torch and f.func in BACKWARD_FUNCTIONS and ("autograd" in f.file or
                                                            f.file.endswith("_tensor.py"))
           for f in frames):
        return Wait("backward", "backward", site)
    return None


@dataclass(frozen=True)
class Sample:
    """One look at a live rank."""

    at: float  # monotonic time the dump was asked for
    frames: tuple[Frame, ...]  # the script's thread, innermost first; () when no dump came
    cpu_s: float | None  # the process's CPU time (all threads), None when unreadable


@dataclass(frozen=True)
class RankView:
    """What the supervisor knows of one rank at decision time."""

    rank: int
    state: str  # "not_started", "running", "finished", "exited" (ended, any code), "remote"
    samples: tuple[Sample, ...] = ()  # oldest first
    returncode: int | None = None
    remote_where: str = ""  # another node's rank: what the store says ("" = it arrived)


@dataclass
class Stall:
    """Ranks waiting longer than the stall timeout while others were elsewhere."""

    waiting: list[int]  # the ranks stuck at the reference point
    elsewhere: list[int]  # the odd ones out: missing, dead, finished, elsewhere, another point
    where: dict[int, str]  # rank -> what it was doing
    stacks: dict[int, list[str]]  # rank -> frames of its main thread, innermost first
    detected_at: float
    point: str  # "init_process_group" or "all_reduce"
    kind: str  # "init", "collective", "wait", "backward", "mismatch"
    waits: dict[int, str] = field(default_factory=dict)  # rank -> the collective it waits in
    flight_records: list[str] = field(default_factory=list)  # NCCL flight recorder summary


@dataclass(frozen=True)
class _Waiting:
    wait: Wait
    since: float
    cpu_cores: float | None


def current_wait(samples: Sequence[Sample], source_line: SourceLine) -> _Waiting | None:
    """The rank's wait in its latest sample and since when its stack has not changed."""
    usable = [s for s in samples if s.frames]
    if not usable:
        return None
    last = usable[-1]
    wait = classify(last.frames, source_line)
    if wait is None:
        return None
    first = last
    for s in reversed(usable):
        if s.frames != last.frames:
            break
        first = s
    cores = None
    if first.cpu_s is not None and last.cpu_s is not None and last.at > first.at:
        cores = (last.cpu_s - first.cpu_s) / (last.at - first.at)
    return _Waiting(wait, first.at, cores)


def _stalled(w: _Waiting, now: float, timeout_s: float) -> bool:
    if now - w.since < timeout_s:
        return False
    # backward is only a wait when it does not compute: no CPU reading, no verdict.
    return w.wait.kind != "backward" or (w.cpu_cores is not None and w.cpu_cores < IDLE_CPU_CORES)


def decide_stall(views: Mapping[int, RankView], now: float, timeout_s: float,
                 source_line: SourceLine) -> Stall | None:
    """A stall, or None. ``views`` covers every rank of the job (other nodes' as ``remote``)."""
    waits: dict[int, _Waiting] = {}
    for rank, v in views.items():
        if v.state == "running":
            w = current_wait(v.samples, source_line)
            if w is not None:
                waits[rank] = w
    stalled = {r: w for r, w in waits.items() if _stalled(w, now, timeout_s)}
    if not stalled:
        return None
    # Remote ranks take part only in init: the store says who arrived, nothing more.
    init_stall = any(w.wait.kind == "init" for w in stalled.values())
    members = [r for r, v in views.items() if v.state != "remote" or init_stall]
    point: dict[int, tuple[str, str] | None] = {}
    for r in members:
        if r in waits:
            point[r] = waits[r].wait.point
        elif views[r].state == "remote" and not views[r].remote_where:
            point[r] = ("init", "init_process_group")  # arrived on its node
        else:
            point[r] = None
    if len(set(point.values())) == 1 and None not in point.values():
        return None  # everyone waits at the same point: a slow collective, not a missing rank
    # The reference point: where most stalled ranks wait (ties: the lowest rank's).
    ref = _most_common({r: w.wait.point for r, w in stalled.items()}, list(stalled))
    mismatch = all(point[r] is not None for r in members if point[r] != ref)
    if mismatch:
        # Every rank waits in some collective: the odd ones out are the fewer, whichever of
        # them passed the timeout first (on a busy machine a lone rank's wait can be the oldest).
        ref = _most_common(point, members)
    same = sorted(r for r in members if point[r] == ref)
    elsewhere = sorted(r for r in members if point[r] != ref)
    where = {r: describe_rank(views[r], waits.get(r), now) for r in members}
    ref_wait = waits[min(r for r in waits if waits[r].wait.point == ref)].wait
    return Stall(same, elsewhere, where, {}, now, ref_wait.op,
                 "mismatch" if mismatch else ref_wait.kind,
                 {r: waits[r].wait.op for r in members if r in waits})


def _most_common(point: Mapping[int, Any], ranks: Sequence[int]) -> Any:
    """The point most of ``ranks`` wait at (ties: the lowest rank's)."""
    counts = Counter(point[r] for r in ranks)
    best = max(counts.values())
    return min((p for p, n in counts.items() if n == best),
               key=lambda p: min(r for r in ranks if point[r] == p))


def describe_rank(v: RankView, w: _Waiting | None, now: float) -> str:
    if v.state == "remote":
        return v.remote_where or "arrived (another node)"
    if v.state == "not_started":
        return "has not started Python yet"
    if v.state == "finished":
        return "finished its script"
    if v.state == "exited":
        return "exited" if v.returncode is None else _ended(v.returncode)
    if w is not None:
        return (f"waiting in {w.wait.describe()} for {now - w.since:.1f} s at {w.wait.site} "
                "(stack unchanged)")
    frames = next((s.frames for s in reversed(v.samples) if s.frames), ())
    if not frames:
        return "running (no stack sampled yet)"
    top = next((f for f in frames if not f.in_torch), frames[0])
    return f"running elsewhere: {top.func} at {top.site}"


def _ended(returncode: int) -> str:
    from gpuwarden.procs import describe_exit

    how = "exited with" if returncode >= 0 else "killed by"
    return f"{how} {describe_exit(returncode)}"
