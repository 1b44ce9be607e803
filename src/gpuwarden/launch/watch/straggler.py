"""Stragglers, from the samples the supervisor already takes: PURE functions over recorded
observations, as :mod:`gpuwarden.launch.watch.stall` for stalls.

Every sample tick the supervisor asks every rank for its stack at the same moment
(``Sample.at`` is one value for the whole tick), so a tick is a picture of the job: which ranks
wait in a collective (the frames say so, :func:`gpuwarden.launch.watch.stall.classify`) and which are
elsewhere. When most ranks wait and a few do not, the few are what the others wait for: they
are the last to enter the collective. A straggler is a rank that is, consistently, that one:

- over a recent window, in ticks where the waiting ranks outnumber the others, the credit for
  being waited for (shared among the ranks out) goes to one rank for at least
  :data:`MIN_CONSISTENCY` of the total, and
- the others lose a share of their time to it worth naming (:data:`MIN_SHARE`), measured on at
  least :data:`MIN_TICKS` such ticks,
- and chance cannot explain it: were the last rank drawn at random among the ranks at every
  informative tick, one of them would get that much credit with a probability under
  :data:`MAX_CHANCE` (a binomial tail; two ranks need 11 informative ticks in a row, four
  need 6).

A balanced job spreads the credit over its ranks (each is last now and then), a job that
computes most of the time has few informative ticks, and neither names anyone. What the
straggler does meanwhile comes from its own frames (the most frequent line of the script, the
DataLoader when its frames are in ``torch/utils/data``) and its CPU time (idle: sleeping, I/O or
waiting for data; busy: computing on the CPU).

Sampling is coarse (a tick every 0.25-2 s): a straggler that costs the others a few percent is
below what it can see. On GPUs, a rank whose GPU is slow waits for it in ``.item()`` or
``synchronize()``, which the frames show as its own line.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from gpuwarden.launch.watch.stall import (
    IDLE_CPU_CORES,
    Frame,
    RankView,
    Sample,
    SourceLine,
    Wait,
    classify,
)

WINDOW_S = 60.0  # only the last minute counts: a straggler that recovered stops being named
MIN_TICKS = 6  # informative ticks (most ranks waiting, a few out) needed before naming anyone
MIN_SHARE = 0.2  # the others wait for it in at least this share of the window's ticks
MIN_CONSISTENCY = 0.7  # of the credit for being waited for, this much goes to the one rank
MAX_CHANCE = 1e-3  # how likely it may be that a balanced job's random last ranks look like this
BUSY_CPU_CORES = 0.5  # a straggler using more than this while out computes on the CPU
_WAIT_KINDS = ("collective", "wait", "backward")


@dataclass(frozen=True)
class Straggler:
    """The rank the others keep waiting for, and by how much."""

    rank: int
    share: float  # of the window's ticks, those in which the others waited for this rank
    consistency: float  # of all credit for being waited for, this rank's part
    ticks: int  # ticks in the window with two or more sampled ranks
    informative: int  # of those, ticks where most ranks waited and a few did not
    window_s: float  # the time the ticks span
    waited_by: tuple[int, ...]  # ranks seen waiting while it was out
    waits_in: str  # the collective they waited in most often ("all_reduce")
    own_wait_share: float  # its own share of ticks spent waiting in a collective
    others_wait_share: float  # the other ranks' mean share
    doing: str  # what it did while out: "in slow_step at train.py:14", "loading data (DataLoader)"
    doing_share: float  # of its ticks out, the share at ``doing``
    cpu_cores: float | None  # its CPU use over the window (all threads), None when unknown
    data_loading: bool = False

    def describe(self) -> str:
        """One line: who, by how much, what it does meanwhile."""
        others = ", ".join(map(str, self.waited_by)) or "the other ranks"
        text = (f"rank {self.rank} is the last into collectives: rank(s) {others} waited for it "
                f"in {self.waits_in} in {self.share:.0%} of {self.ticks} samples over "
                f"{self.window_s:.0f} s (it waits in collectives {self.own_wait_share:.0%} of "
                f"its time, they {self.others_wait_share:.0%})")
        if self.doing:
            text += f"; meanwhile it is {self.doing}"
            if self.doing_share < 0.75:
                text += f" ({self.doing_share:.0%} of its samples outside collectives)"
        if self.cpu_cores is not None:
            text += f", using {self.cpu_cores:.2f} CPU cores ({self.activity})"
        return text

    @property
    def activity(self) -> str:
        if self.cpu_cores is None:
            return "unknown"
        if self.data_loading:
            return "waiting for data"
        if self.cpu_cores >= BUSY_CPU_CORES:
            return "computing on the CPU"
        if self.cpu_cores < IDLE_CPU_CORES:
            return "idle: sleeping, I/O, or waiting for data or its GPU"
        return "partly idle"

    def to_dict(self) -> dict[str, object]:
        return {"rank": self.rank, "share": round(self.share, 3),
                "consistency": round(self.consistency, 3), "samples": self.ticks,
                "informative_samples": self.informative, "window_s": round(self.window_s, 1),
                "waited_by": list(self.waited_by), "waits_in": self.waits_in,
                "own_wait_share": round(self.own_wait_share, 3),
                "others_wait_share": round(self.others_wait_share, 3), "doing": self.doing,
                "doing_share": round(self.doing_share, 3),
                "cpu_cores": None if self.cpu_cores is None else round(self.cpu_cores, 3),
                "activity": self.activity, "text": self.describe()}


def decide_straggler(views: Mapping[int, RankView], now: float, source_line: SourceLine, *,
                     window_s: float = WINDOW_S) -> Straggler | None:
    """The straggler among the running ranks of ``views``, or None."""
    waits: dict[tuple[Frame, ...], Wait | None] = {}  # each distinct stack classified once

    def wait_of(frames: tuple[Frame, ...]) -> Wait | None:
        if frames not in waits:
            waits[frames] = classify(frames, source_line)
        return waits[frames]

    # tick time -> rank -> (waiting, sample); CPU per sample from the rank's previous one.
    ticks: dict[float, dict[int, tuple[Wait | None, Sample]]] = defaultdict(dict)
    for rank, v in views.items():
        if v.state != "running":
            continue
        prev: Sample | None = None
        for s in v.samples:
            if s.at < now - window_s or not s.frames:
                prev = s if s.frames else prev
                continue
            w = wait_of(s.frames)
            if w is not None and w.kind == "backward" and not _idle(prev, s):
                w = None  # a backward that computes is not waiting for anyone
            ticks[s.at][rank] = (w, s)
            prev = s
    credit: dict[int, float] = defaultdict(float)
    waited_by: dict[int, Counter[int]] = defaultdict(Counter)
    waited_in: dict[int, Counter[str]] = defaultdict(Counter)
    waiting_ticks: Counter[int] = Counter()
    known_ticks: Counter[int] = Counter()
    informative = 0
    used: list[float] = []
    for at, seen in ticks.items():
        if len(seen) < 2 or any(w is not None and w.kind == "init" for w, _ in seen.values()):
            continue  # one rank says nothing about the others; rendezvous is not a collective
        used.append(at)
        waiting = [r for r, (w, _) in seen.items() if w is not None and w.kind in _WAIT_KINDS]
        out = [r for r in seen if r not in waiting]
        for r in seen:
            known_ticks[r] += 1
        for r in waiting:
            waiting_ticks[r] += 1
        if waiting and out and len(waiting) >= len(out):
            informative += 1
            for r in out:
                credit[r] += 1 / len(out)
                waited_by[r].update(waiting)
                waited_in[r].update(seen[w][0].op for w in waiting)  # type: ignore[union-attr]
    if informative < MIN_TICKS or not credit:
        return None
    rank, best = max(credit.items(), key=lambda kv: (kv[1], -kv[0]))
    total_credit = sum(credit.values())
    share = best / len(used)
    consistency = best / total_credit
    if share < MIN_SHARE or consistency < MIN_CONSISTENCY or \
            chance(informative, int(best), len(known_ticks)) > MAX_CHANCE:
        return None
    others = [r for r in known_ticks if r != rank]
    others_wait = (sum(waiting_ticks[r] / known_ticks[r] for r in others) / len(others)
                   if others else 0.0)
    doing, doing_share, loading = _what_it_does(views[rank].samples, now - window_s, wait_of)
    return Straggler(
        rank=rank, share=share, consistency=consistency, ticks=len(used),
        informative=informative, window_s=max(used) - min(used) if used else 0.0,
        waited_by=tuple(sorted(waited_by[rank])), waits_in=waited_in[rank].most_common(1)[0][0],
        own_wait_share=waiting_ticks[rank] / known_ticks[rank],
        others_wait_share=others_wait, doing=doing, doing_share=doing_share,
        cpu_cores=_cpu_cores(views[rank].samples, now - window_s), data_loading=loading)


def chance(n: int, k: int, ranks: int) -> float:
    """Bound on the probability that, with the last rank drawn at random among ``ranks`` at each
    of ``n`` ticks, some rank is last at least ``k`` times (union bound over the ranks)."""
    if ranks < 2:
        return 1.0
    p = 1 / ranks
    tail = sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))
    return min(1.0, ranks * tail)


def _idle(prev: Sample | None, s: Sample) -> bool:
    if prev is None or prev.cpu_s is None or s.cpu_s is None or s.at <= prev.at:
        return False
    return (s.cpu_s - prev.cpu_s) / (s.at - prev.at) < IDLE_CPU_CORES


def _what_it_does(samples: tuple[Sample, ...], since: float,
                  wait_of: object) -> tuple[str, float, bool]:
    """The most frequent place of the rank's samples outside collectives, and its share."""
    places: Counter[str] = Counter()
    loading = 0
    for s in samples:
        if s.at < since or not s.frames:
            continue
        w = wait_of(s.frames)  # type: ignore[operator]
        if w is not None and w.kind in (*_WAIT_KINDS, "init"):
            continue
        if any("torch/utils/data/" in f.file for f in s.frames):
            loading += 1
            places["loading data (DataLoader)"] += 1
            continue
        top = next((f for f in s.frames if not f.in_torch), s.frames[0])
        places[f"in {top.func} at {top.site}"] += 1
    if not places:
        return "", 0.0, False
    place, n = places.most_common(1)[0]
    total = sum(places.values())
    return place, n / total, loading * 2 > total


def _cpu_cores(samples: tuple[Sample, ...], since: float) -> float | None:
    timed = [s for s in samples if s.at >= since and s.cpu_s is not None]
    if len(timed) < 2 or timed[-1].at <= timed[0].at:
        return None
    return (timed[-1].cpu_s - timed[0].cpu_s) / (timed[-1].at - timed[0].at)  # type: ignore[operator]
