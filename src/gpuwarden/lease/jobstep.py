"""Job steps: a process started by a lease holder uses the holder's GPUs, as a Slurm job step
uses its job's allocation, instead of waiting in line for GPUs its own ancestor holds.

The holder passes down, in the environment (:data:`STEP_ENV`, see :func:`env_for`), what it
holds: per grant, the lease directory, its pid, and per slot the GPU's uuid, its split, the
slot and the GPU's lock file. A process
that inherits the variable and asks for a lease (``acquire``, a GPUPool, joblib's backend)
is served from those GPUs at once, after checking what only the kernel can say:

- the holder is an ancestor of this process (the /proc parent chain): the variable came
  down from it, and a pid reused since cannot pass;
- the kernel's ``F_GETLK`` on the slot's byte of that GPU's lock file, in the lease directory
  this process uses, names the holder's pid with a write lock: the slot is held, by the
  holder, now (lease/_locks.py).

Nothing written in the lease directory is believed, and the variable itself is only a list
of things to check: copied to an unrelated process, left over after the holder released, or
forged, it fails a check and the request queues like any other. A step takes no lock of its
own: its GPUs stay leased exactly as long as the holder holds them, nothing else on the host
can take them meanwhile, and a step does not arbitrate between itself and the holder's other
steps (they are one job). A request larger than the holder's allocation fails at once
(LeaseUnavailableError) rather than waiting for GPUs its own ancestor holds.

**Slurm's steps** (:func:`serve_slurm_job`). The steps of one Slurm job are siblings, not
descendants: ``srun --overlap --gres=gpu:2`` twice in one allocation gives both steps the same
GPUs, which Slurm gave the job and no other job can have. So inside a Slurm job, GPUs that a
process of the *same job* holds are this request's to share, as a job step of that holder,
when a lease of its own cannot be had (a free GPU is still leased). Which job a process
belongs to is the kernel's word (:func:`slurm_job_of`): the process title of its nearest
ancestor that is a slurmstepd running as root, which no user can forge; the slots are checked
held by the holder (``F_GETLK``), as above. The same processes are not foreign on those
GPUs (:func:`same_slurm_job`): the job's other steps' ranks use them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwarden.errors import LeaseUnavailableError
from gpuwarden.inventory.snapshot import GPUSnapshot
from gpuwarden.lease._fs import gpu_path, lease_dir_path
from gpuwarden.lease.grant import Grant, LeaseRequest
from gpuwarden.lease.records import SlotClaim
from gpuwarden.visibility import CHILD_ORDER_ENV

if TYPE_CHECKING:
    from gpuwarden.inventory import Inventory

STEP_ENV = "GPUWARDEN_JOB_STEP"
MAX_ENV_BYTES = 64 * 1024  # a variable this process did not write is read bounded


@dataclass(frozen=True)
class HeldSlot:
    uuid: str
    index: int
    slots_per_gpu: int
    slot: int
    path: str


@dataclass(frozen=True)
class Allocation:
    """One grant of an ancestor, as passed down (checked by :func:`inherited`)."""

    holder_pid: int
    lease_dir: str
    holder_id: str
    slots: tuple[HeldSlot, ...]

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.uuid for s in self.slots))

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.holder_pid, "dir": self.lease_dir, "id": self.holder_id,
                "slots": [[s.uuid, s.index, s.slots_per_gpu, s.slot, s.path]
                          for s in self.slots]}


def allocation_of(grant: Grant) -> tuple[Allocation, ...]:
    """What ``grant`` holds, as its children are told (a step passes its holder's on)."""
    if isinstance(grant, StepGrant):
        return grant.allocations
    held = tuple(HeldSlot(claim.uuid, claim.index, claim.slots_per_gpu, slot,
                          str(gpu_path(grant.lease_dir, claim.uuid)))
                 for claim in grant.claims for slot in claim.slots)
    return (Allocation(os.getpid(), str(grant.lease_dir), grant.holder_id, held),)


def env_for(grants: Sequence[Grant]) -> dict[str, str]:
    """The variable that makes a process started with it a job step of ``grants``."""
    allocations = [a.to_json() for g in grants if g.held for a in allocation_of(g)]
    if not allocations:
        return {}
    return {STEP_ENV: json.dumps({"v": 2, "grants": allocations}, separators=(",", ":"))}


# -- the checks ------------------------------------------------------------------------------

def ancestors() -> list[int]:
    """This process's ancestors, nearest first (the kernel's word, through psutil)."""
    import psutil

    try:
        return [p.pid for p in psutil.Process().parents()]
    except psutil.Error:
        return []


def _holds_lock(pid: int, slot: HeldSlot) -> bool:
    """Process ``pid`` holds the write lock on ``slot``'s byte of its GPU's lock file, as the
    kernel says (F_GETLK names the holder; a file put in the lock file's place is not it)."""
    from gpuwarden.lease import _locks

    try:
        with _locks.peek(Path(slot.path)) as fd:
            if fd is None:
                return False
            owner = _locks.test_lock(fd, _locks.slot_offset(slot.slots_per_gpu, slot.slot), 1)
    except (OSError, ValueError):
        return False
    return owner is not None and owner.write and owner.pid == pid


def _parse(text: str) -> list[Allocation]:
    if len(text) > MAX_ENV_BYTES:
        return []
    try:
        data = json.loads(text)
        out = []
        for g in data["grants"]:
            slots = tuple(HeldSlot(str(u), int(i), int(k), int(s), str(p))
                          for u, i, k, s, p in g["slots"])
            out.append(Allocation(int(g["pid"]), str(g["dir"]), str(g["id"]), slots))
        return out
    except (ValueError, TypeError, KeyError, RecursionError):
        return []


def inherited(env: Mapping[str, str] | None = None,
              lease_dir: str | Path | None = None) -> tuple[Allocation, ...]:
    """The allocations passed down to this process that the kernel confirms, in the lease
    directory this process uses (others arbitrate other GPUs' users: not ours to share)."""
    environ = os.environ if env is None else env
    text = environ.get(STEP_ENV)
    if not text:
        return ()
    # This process's own allocations (a pool exports them for the processes it starts) are not
    # inherited; without another one neither the lease directory nor the walk up the ancestors
    # (psutil: ~1.5 ms) is looked at, and a joblib pool asks at every Parallel call.
    passed_down = [a for a in _parse(text) if a.holder_pid != os.getpid() and a.slots]
    if not passed_down:
        return ()
    directory = Path(lease_dir) if lease_dir else lease_dir_path(dict(environ))
    try:
        directory = directory.resolve()
    except OSError:
        return ()
    mine = set(ancestors())
    confirmed = []
    for allocation in passed_down:
        if allocation.holder_pid not in mine:
            continue
        if Path(allocation.lease_dir).resolve() != directory:
            continue
        if all(Path(s.path).parent.resolve() == directory
               and _holds_lock(allocation.holder_pid, s) for s in allocation.slots):
            confirmed.append(allocation)
    return tuple(confirmed)


# -- serving a request from the parent's allocation -------------------------------------------

class StepGrant(Grant):
    """GPUs of an ancestor's lease, used by this process as a job step. It holds no lock:
    :meth:`release` gives nothing back (the holder does, when it releases or ends)."""

    def __init__(self, gpus: tuple[GPUSnapshot, ...], allocations: tuple[Allocation, ...],
                 request: LeaseRequest, lease_dir: Path, slurm_job: str | None = None) -> None:
        # Not Grant.__init__: a step takes no lock, writes no record.
        self.gpus = gpus
        # Shared with other steps of this Slurm job (serve_slurm_job), not an ancestor's: the
        # GPUs stay the job's (Slurm's allocation) when the holder's lease ends first.
        self.slurm_job = slurm_job
        self.allocations = allocations
        wanted = {g.uuid for g in gpus}
        self.claims = tuple(SlotClaim(s.uuid, s.index, s.slots_per_gpu, (s.slot,))
                            for a in allocations for s in a.slots if s.uuid in wanted)
        self.lease_dir = lease_dir
        self.request = request
        self.waited_s = 0.0
        self.visible_devices = ",".join(g.cuda_id for g in gpus)
        self.env = {"CUDA_VISIBLE_DEVICES": self.visible_devices, **CHILD_ORDER_ENV}
        self._owner_pid = os.getpid()
        self._released = False

    @property
    def holder_id(self) -> str:
        return "step-of-" + "+".join(a.holder_id for a in self.allocations)

    @property
    def held(self) -> bool:
        return not self._released and os.getpid() == self._owner_pid

    def release(self) -> None:
        self._released = True

    def verify(self) -> list[str]:
        if not self.held or self.slurm_job is not None:
            return []
        return [f"the lease of pid {a.holder_pid} this job step uses has ended"
                for a in self.allocations
                if not all(_holds_lock(a.holder_pid, s) for s in a.slots)]

    def _close_in_child(self) -> None:
        self._released = True

    def __del__(self) -> None:
        pass

    def __repr__(self) -> str:
        holders = ",".join(str(a.holder_pid) for a in self.allocations)
        job = f" (Slurm job {self.slurm_job})" if self.slurm_job else ""
        return f"<StepGrant {self.visible_devices!r} of pid {holders}{job}>"


def _held_gpus(request: LeaseRequest, allocations: Sequence[Allocation],
               env: Mapping[str, str] | None, visible: Sequence[GPUSnapshot] | None,
               inventory: Inventory | None) -> tuple[list[GPUSnapshot], int]:
    """The visible GPUs that ``allocations`` hold and the request may use (its include list),
    and how many it wants of them."""
    if visible is None:
        from gpuwarden.inventory import Inventory

        _host, visible = (inventory or Inventory.from_env(env)).read_visible()
    held = {u for a in allocations for u in a.uuids}
    include = set(request.constraints.include)
    mine = [g for g in visible if g.uuid in held
            and (not include or str(g.index) in include or g.uuid in include)]
    wanted = (min(len(mine), request.up_to or len(mine)) if request.every_usable
              else request.gpus)
    return mine, wanted


def serve(request: LeaseRequest, lease_dir: str | Path | None = None,
          env: Mapping[str, str] | None = None,
          visible: Sequence[GPUSnapshot] | None = None,
          inventory: Inventory | None = None) -> StepGrant | None:
    """``acquire``'s answer for a job step: GPUs of the inherited allocation, or None when
    this process is not one (then the request is served as any other)."""
    environ = os.environ if env is None else env
    if STEP_ENV not in environ:
        return None
    allocations = inherited(environ, lease_dir)
    if not allocations:
        return None
    mine, wanted = _held_gpus(request, allocations, env, visible, inventory)
    if not mine or len(mine) < wanted:
        holders = ", ".join(f"pid {a.holder_pid}" for a in allocations)
        raise LeaseUnavailableError(
            f"{request.describe()} requested by a job step of the lease of {holders}, whose "
            f"GPUs visible here are {', '.join(g.label for g in mine) or 'none'}",
            why="a process started by a lease holder uses its holder's GPUs (a job step) "
            "and cannot wait for more: the GPUs it would wait for are held by its own ancestor",
            fix=f"ask for at most {len(mine)} GPU(s), or lease more in the holder; to queue "
            f"as a separate job, start the process without {STEP_ENV} in its environment",
            evidence=[f"holder pid {a.holder_pid}: {', '.join(a.uuids)}" for a in allocations])
    chosen = tuple(mine[:wanted])
    used = {g.uuid for g in chosen}
    mine_allocations = tuple(a for a in allocations if used & set(a.uuids))
    directory = Path(lease_dir) if lease_dir else lease_dir_path(dict(environ))
    return StepGrant(chosen, mine_allocations, request, directory)


# -- Slurm: the steps of one job share the job's GPUs -------------------------------------

SLURMSTEPD_TITLE = re.compile(rb"slurmstepd: \[(\d+)")  # "slurmstepd: [1234.0]", "[1234.batch]"
MAX_ANCESTORS = 64


def slurm_job_of(pid: int) -> str | None:
    """The Slurm job ``pid`` runs in on this node, as the kernel says: the job id in the
    process title of its nearest ancestor (or itself) that is a slurmstepd running as root
    (``slurmstepd: [1234.0]``). Slurm starts every task and batch script under one; a user can
    neither run a process as root nor change a root process's title. None outside any job, or
    when /proc cannot tell (another PID namespace, a process that left its tree)."""
    from gpuwarden.lease._proc import _read_proc, process_uid

    for _ in range(MAX_ANCESTORS):
        if pid <= 1:
            return None
        title = _read_proc(f"/proc/{pid}/cmdline", 256) or b""
        found = SLURMSTEPD_TITLE.match(title)
        if found is not None and process_uid(pid) == 0:
            return found.group(1).decode()
        stat = _read_proc(f"/proc/{pid}/stat", 4096)
        try:
            pid = int(stat[stat.rindex(b")") + 2:].split()[1]) if stat else 0
        except (ValueError, IndexError):
            return None
    return None


_own_job: dict[int, str | None] = {}


def own_slurm_job() -> str | None:
    """:func:`slurm_job_of` this process, read once per process (a waiting request asks at
    every attempt; a process never moves to another job)."""
    pid = os.getpid()
    if pid not in _own_job:
        _own_job.clear()  # a forked child: its parent's answer is not its own
        _own_job[pid] = slurm_job_of(pid)
    return _own_job[pid]


def same_slurm_job(pids: Iterable[int]) -> frozenset[int]:
    """Of ``pids``, those that run in this process's own Slurm job (none outside a job)."""
    mine = own_slurm_job()
    if mine is None:
        return frozenset()
    return frozenset(p for p in pids if p != os.getpid() and slurm_job_of(p) == mine)


def _job_allocations(directory: Path, job: str) -> tuple[Allocation, ...]:
    """The leases in ``directory`` held by other processes of Slurm job ``job``, each slot
    confirmed held by its holder (F_GETLK): the holder pid of a record is the kernel's."""
    from gpuwarden.lease.records import iter_holders
    from gpuwarden.lease.scan import scan

    out = []
    for holder in iter_holders(scan(directory).records):
        if holder.pid <= 0 or holder.pid == os.getpid() or holder.legacy:
            continue
        slots = tuple(HeldSlot(c.uuid, c.index, c.slots_per_gpu, slot,
                               str(gpu_path(directory, c.uuid)))
                      for c in holder.claims for slot in c.slots)
        if slots and slurm_job_of(holder.pid) == job \
                and all(_holds_lock(holder.pid, s) for s in slots):
            out.append(Allocation(holder.pid, str(directory), holder.record_id, slots))
    return tuple(out)


def serve_slurm_job(request: LeaseRequest, lease_dir: str | Path | None = None,
                    env: Mapping[str, str] | None = None,
                    visible: Sequence[GPUSnapshot] | None = None,
                    inventory: Inventory | None = None) -> StepGrant | None:
    """``acquire``'s answer, when a lease of its own could not be had, for a process in a
    Slurm job whose other steps hold the GPUs it asks for: those GPUs, shared as a step of
    their holders (Slurm gave them to the job; its steps share them with ``--overlap``).
    None outside a Slurm job, or when the job's other processes hold too few of the GPUs
    this process may use (then the request is served, or refused, as any other)."""
    job = own_slurm_job()
    if job is None or request.memory_bytes:
        return None  # a memory lease shares GPUs by its bytes already, with every lease
    environ = os.environ if env is None else env
    directory = Path(lease_dir) if lease_dir else lease_dir_path(dict(environ))
    try:
        allocations = _job_allocations(directory.resolve(), job)
    except OSError:
        return None
    if not allocations:
        return None
    mine, wanted = _held_gpus(request, allocations, env, visible, inventory)
    if not mine or len(mine) < wanted:
        return None
    chosen = tuple(mine[:wanted])
    used = {g.uuid for g in chosen}
    return StepGrant(chosen, tuple(a for a in allocations if used & set(a.uuids)), request,
                     directory, slurm_job=job)


def blame_slurm_job(exc: Exception, lease_dir: str | Path | None = None) -> None:
    """When a refused lease's GPUs are held by another process of this Slurm job, say so in
    ``exc``: the steps of one job share the GPUs one of them holds only when it holds every
    GPU the other asks for (a lease of the free ones and a share of the held ones are not
    mixed)."""
    from gpuwarden.errors import GpuwardenError
    from gpuwarden.lease.listing import list_leases

    job = own_slurm_job()
    if job is None or not isinstance(exc, GpuwardenError):
        return
    try:
        table = list_leases(Path(lease_dir) if lease_dir else None)
    except (GpuwardenError, OSError):
        return
    theirs = [h for h in table.holders if h.pid > 0 and slurm_job_of(h.pid) == job]
    if not theirs:
        return
    note = f"held by another step of this Slurm job {job}"
    if note not in exc.what:
        exc.what = f"{exc.what} ({note}: {'; '.join(h.who() for h in theirs)})"
        exc.args = (exc.what,)
    exc.fix = ("a step of this job shares the GPUs another of its steps holds when that step "
               "holds every GPU it asks for: ask for the same GPUs (srun --overlap "
               "--gres=gpu:N in both steps) or fewer, or run the steps one after the other")


def usable(env: Mapping[str, str] | None = None, visible: Sequence[GPUSnapshot] = (),
           lease_dir: str | Path | None = None) -> int | None:
    """How many of ``visible`` a job step may use (None: this process is not a job step)."""
    allocations = inherited(env, lease_dir)
    if not allocations:
        return None
    held = {u for a in allocations for u in a.uuids}
    return sum(1 for g in visible if g.uuid in held)


def blame_ancestor(exc: Exception, lease_dir: str | Path | None = None) -> None:
    """When a refused lease's GPUs are held by an ancestor of this process, say so in ``exc``
    (a parent's lease is not a stranger's: the generic "wait in line" would wait forever)."""
    from gpuwarden.errors import GpuwardenError
    from gpuwarden.lease.listing import list_leases

    if not isinstance(exc, GpuwardenError):
        return
    try:
        table = list_leases(Path(lease_dir) if lease_dir else None)
    except (GpuwardenError, OSError):
        return
    mine = set(ancestors())
    theirs = [h for h in table.holders if h.pid in mine]
    if not theirs:
        return
    who = "; ".join(h.who() for h in theirs)
    exc.what = f"{exc.what} (held by this process's own ancestor: {who})"
    exc.args = (exc.what,)
    exc.fix = (f"the ancestor did not pass its lease down: a process it starts with its "
               f"environment (which carries {STEP_ENV} while a gpuwarden pool holds GPUs) "
               "uses its GPUs; or release them there first")
