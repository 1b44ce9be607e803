"""Ranks on the wrong GPU, seen from outside: the script that forgot ``set_device``.

Under torchrun's visibility (every rank sees the job's GPUs) a script that never calls
``torch.cuda.set_device(LOCAL_RANK)`` (nor passes ``device_id``/``device_ids``) puts every
rank's CUDA context on ``cuda:0``: one GPU does all the work, or NCCL stops with
``Duplicate GPU detected``. gpuwarden cannot prevent that without replacing torch's functions,
so it looks: NVML (or the simulated host) lists the processes on each GPU, the supervisor knows
each rank's pids and which GPU is its own. :func:`misplaced_ranks` is the pure judgement over
one snapshot; :class:`PlacementWatch` takes the snapshots, a few seconds apart, and says it once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuwarden.inventory.snapshot import GPUSnapshot

CHECK_EVERY_S = 2.0  # an NVML process query costs milliseconds; a misplaced rank lives for minutes


@dataclass(frozen=True)
class Misplacement:
    """Ranks whose CUDA work sits on GPUs that belong to other ranks, none on their own."""

    ranks: tuple[int, ...]
    on: dict[int, tuple[str, ...]]  # rank -> labels of the foreign GPUs it uses
    own: dict[int, str]  # rank -> label of its own GPU

    def describe(self) -> str:
        crowded: dict[str, list[int]] = {}
        for rank in self.ranks:
            for label in self.on[rank]:
                crowded.setdefault(label, []).append(rank)
        where = "; ".join(f"{label} holds rank(s) {', '.join(map(str, rs))}"
                          for label, rs in sorted(crowded.items()))
        names = ", ".join(f"rank {r} ({self.own[r]})" for r in self.ranks)
        return (f"ranks run on GPUs that are not their own: {where}; their own GPUs are unused "
                f"by them: {names}")


def misplaced_ranks(gpus: Sequence[GPUSnapshot], rank_pids: Mapping[int, Collection[int]],
                    own_gpu: Mapping[int, str]) -> Misplacement | None:
    """The ranks that have a CUDA context on another rank's GPU and none on their own.

    ``gpus``: one snapshot of the host (each GPU with its processes); ``rank_pids``: every pid of
    each rank (the rank and its children); ``own_gpu``: each rank's GPU uuid. A rank with no
    context anywhere yet (still loading data) or one stray context beside its own (a library
    probing cuda:0) is not misplaced: the judgement errs on the side of silence.
    """
    label = {g.uuid: g.label for g in gpus}
    on: dict[int, set[str]] = {}
    for gpu in gpus:
        pids = {p.pid for p in gpu.processes}
        for rank, mine in rank_pids.items():
            if pids.intersection(mine):
                on.setdefault(rank, set()).add(gpu.uuid)
    wrong = sorted(r for r, used in on.items() if r in own_gpu and own_gpu[r] not in used)
    if not wrong:
        return None
    return Misplacement(
        tuple(wrong),
        {r: tuple(sorted(label[u] for u in on[r])) for r in wrong},
        {r: label.get(own_gpu[r], own_gpu[r]) for r in wrong})


MISPLACED_WHY = ("every rank sees the job's GPUs (torchrun's visibility) and CUDA starts on "
                 "cuda:0 unless the script picks its device; ranks that share a GPU crowd its "
                 "memory, and NCCL refuses them ('Duplicate GPU detected')")
MISPLACED_FIX = ("torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before any CUDA work (or "
                 "init_process_group(..., device_id=torch.device('cuda', local_rank)) and "
                 "model.to(local_rank)); or launch with --bind rank, where each rank sees only "
                 "its own GPU as cuda:0")


class PlacementWatch:
    """Looks every :data:`CHECK_EVERY_S` while ranks run; says it once, then stops looking."""

    def __init__(self, own_gpu: Mapping[int, str], read_gpus: Callable[[], Sequence[GPUSnapshot]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.own_gpu = dict(own_gpu)
        self.read_gpus = read_gpus
        self.clock = clock
        self.found: Misplacement | None = None
        self._next = clock() + CHECK_EVERY_S
        self._done = not own_gpu

    def check(self, rank_pids: Callable[[], Mapping[int, Collection[int]]]) -> Misplacement | None:
        """The finding, the first time there is one; None otherwise (and on any read error:
        a failed look must never disturb the job)."""
        if self._done or self.clock() < self._next:
            return None
        self._next = self.clock() + CHECK_EVERY_S
        try:
            found = misplaced_ranks(self.read_gpus(), rank_pids(), self.own_gpu)
        except Exception:  # NVML hiccup, a scenario file being rewritten: look again later
            return None
        if found is not None:
            self.found, self._done = found, True
        return found


def render_warning(found: Misplacement) -> str:
    return (f"gpuwarden: warning[NCCL_DUPLICATE_GPU]: {found.describe()}\n"
            f"  why: {MISPLACED_WHY}\n  fix: {MISPLACED_FIX}")


def watch_for(ranks: Sequence[tuple[int, GPUSnapshot | None]], bind: str) -> PlacementWatch | None:
    """A watch for a launch whose ranks see several GPUs (``--bind all`` with two or more); None
    when no rank can land on another's GPU."""
    own = {rank: gpu.uuid for rank, gpu in ranks if gpu is not None}
    if bind != "all" or len(set(own.values())) < 2:
        return None

    def read_gpus() -> Sequence[GPUSnapshot]:
        from gpuwarden.inventory import read_host

        return read_host().gpus

    return PlacementWatch(own, read_gpus)


def pids_of(pid: int) -> set[int]:
    """A rank's pid and its children's (a DataLoader worker may hold the CUDA context)."""
    import psutil

    try:
        return {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
    except psutil.Error:
        return {pid}
