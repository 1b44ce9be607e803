"""GPU selection: a pure function from snapshots and constraints to a decision.

Every GPU gets a verdict with a reason a person can act on, e.g.
``GPU 2: refused: exclusive_process mode, held by pid 5151 (carol, python eval.py)``.
Order among the acceptable GPUs: most free memory first, then lowest
utilization, then lowest index — deterministic for equal snapshots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from gpuwarden.errors import ConstraintError, UsageError
from gpuwarden.inventory.snapshot import ComputeMode, GPUSnapshot
from gpuwarden.units import format_bytes


@dataclass(frozen=True)
class Constraints:
    """What the caller needs. ``include``/``exclude`` hold indices or (prefixes of) UUIDs."""

    count: int = 1
    min_free_bytes: int = 0
    max_util_pct: int | None = None
    allow_shared: bool = False  # accept GPUs that already run processes (DEFAULT mode only)
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    # Processes to not count as foreign (the caller's own, or the holders of its leases).
    own_pids: frozenset[int] = frozenset()
    # GPUs unavailable for reasons outside NVML, by uuid (e.g. "leased by pid 812 (alice) for 3m").
    unavailable: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for what, ids in (("include", self.include), ("exclude", self.exclude)):
            for ident in ids:
                check_gpu_id(ident, what=what, listed=",".join(ids))


_ID_FORM = "an index (0), a GPU-... UUID or its prefix, or a MIG-... UUID"


def check_gpu_id(ident: str, *, what: str, listed: str | None = None) -> str:
    """``ident`` when it names a GPU the way CUDA_VISIBLE_DEVICES does; UsageError otherwise.

    A bare word would match nothing (or, as a UUID prefix, everything): refused, not guessed.
    """
    shown = ident if listed is None else listed
    if not isinstance(ident, str) or not ident:
        raise UsageError(f"{what} {shown!r}: an empty GPU id", fix=f"give {_ID_FORM}, "
                         "separated by commas without empty entries")
    ok = ident.isascii() and (ident.isdigit() or (
        ident[:4] in ("GPU-", "MIG-") and len(ident) > 4
        and all(c.isalnum() or c in "-/" for c in ident[4:])))
    if not ok or len(ident) > 128:
        raise UsageError(f"{what} {shown[:140]!r}: {ident[:60]!r} is not a GPU id",
                         fix=f"give {_ID_FORM}")
    return ident


def parse_gpu_ids(text: str, *, what: str) -> tuple[str, ...]:
    """'0,2,GPU-1f0e' → ('0', '2', 'GPU-1f0e'); UsageError for '0,,x' (an empty entry, a bare
    word). An empty ``text`` is no list at all."""
    if not text.strip():
        return ()
    return tuple(check_gpu_id(part.strip(), what=what, listed=text) for part in text.split(","))


class Refusal(str, Enum):
    """Why a GPU was refused, as data: fix hints and callers decide by this, not by the prose."""

    NOT_INCLUDED = "not_included"
    EXCLUDED = "excluded"
    UNAVAILABLE = "unavailable"  # a caller's reason (a lease)
    PROHIBITED = "prohibited"
    MIG = "mig"
    EXCLUSIVE_HELD = "exclusive_held"
    IN_USE = "in_use"
    MEMORY = "memory"
    UTILIZATION = "utilization"
    UNREADABLE = "unreadable"  # NVML failed on it: GPU is lost, needs a reset
    FABRIC = "fabric"  # its NVLink fabric is not registered: CUDA cannot start on it


@dataclass(frozen=True)
class Verdict:
    gpu: GPUSnapshot
    accepted: bool
    reason: str
    refusal: Refusal | None = None  # set exactly when not accepted

    def line(self) -> str:
        return f"{self.gpu.label}: {'ok' if self.accepted else 'refused'}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.gpu.index, "uuid": self.gpu.uuid, "id": self.gpu.cuda_id,
                "accepted": self.accepted, "reason": self.reason,
                "refusal": None if self.refusal is None else self.refusal.value}


@dataclass(frozen=True)
class Selection:
    """``selected`` holds ``count`` GPUs when the request is met, and is empty otherwise;
    ``verdicts`` covers every candidate, in the order of preference."""

    constraints: Constraints
    verdicts: tuple[Verdict, ...]
    selected: tuple[GPUSnapshot, ...]

    @property
    def satisfied(self) -> bool:
        return len(self.selected) == self.constraints.count

    @property
    def acceptable(self) -> tuple[GPUSnapshot, ...]:
        return tuple(v.gpu for v in self.verdicts if v.accepted)

    @property
    def rejected(self) -> tuple[Verdict, ...]:
        return tuple(v for v in self.verdicts if not v.accepted)

    def error(self) -> ConstraintError:
        """Why the request is not met: a ConstraintError (exit 4) with every GPU's verdict."""
        c = self.constraints
        return ConstraintError(
            f"{c.count} GPU(s) requested, {len(self.acceptable)} of {len(self.verdicts)} usable",
            why=None if self.verdicts else "no GPU is visible to this process",
            fix=_fix_hint(self),
            evidence=[v.line() for v in self.verdicts],
        )

    def require(self) -> tuple[GPUSnapshot, ...]:
        """The selected GPUs, or raise :meth:`error`."""
        if self.satisfied:
            return self.selected
        raise self.error()


def _fix_hint(sel: Selection) -> str:
    kinds = {v.refusal for v in sel.rejected}
    hints = []
    if Refusal.IN_USE in kinds:
        hints.append("--allow-shared to share GPUs in the default compute mode")
    if Refusal.MEMORY in kinds:
        hints.append("a lower --min-free")
    if Refusal.UTILIZATION in kinds:
        hints.append("a higher --max-util")
    hints.append("fewer GPUs, or wait for GPUs to free (gpuwarden run --wait)")
    fix = "ask for " + ", or ".join(hints)
    if Refusal.FABRIC in kinds:
        fix += ("; GPUs whose NVLink fabric is not ready wait for an admin: `systemctl status "
                "nvidia-fabricmanager` (the fabricmanager of the driver's exact version)")
    return fix


def _matches(gpu: GPUSnapshot, ids: Sequence[str]) -> bool:
    for ident in ids:
        if ident.isdigit() and int(ident) == gpu.index and not gpu.is_mig_instance:
            return True
        if not ident.isdigit() and gpu.uuid.startswith(ident):
            return True
    return False


def judge(gpu: GPUSnapshot, c: Constraints) -> Verdict:
    """The verdict on one GPU; the first refusal found is the reason given."""
    # Only compute contexts stand in a CUDA job's way (exclusive modes count only them); a
    # graphics context (a display server) just holds memory, already in memory_used_bytes.
    foreign = [p for p in gpu.processes if p.pid not in c.own_pids and p.has_compute]
    free = format_bytes(gpu.memory_free_bytes)

    def no(kind: Refusal, reason: str) -> Verdict:
        return Verdict(gpu, False, reason, kind)

    if c.include and not _matches(gpu, c.include):
        return no(Refusal.NOT_INCLUDED, "not in the requested list")
    if c.exclude and _matches(gpu, c.exclude):
        return no(Refusal.EXCLUDED, "excluded on request")
    if gpu.error is not None:
        return no(Refusal.UNREADABLE,
                  f"unusable: {gpu.error} (GPU_HARDWARE_FAULT when it is lost: an admin must "
                  "reset it; leave it out meanwhile)")
    if gpu.health.fabric_ready is False:  # every CUDA call on it fails with error 802
        return no(Refusal.FABRIC,
                  f"its NVLink fabric is {gpu.health.fabric_state}"
                  + (f" ({gpu.health.fabric_error})" if gpu.health.fabric_error else "")
                  + ": CUDA cannot start on it (CUDA_SYSTEM_NOT_READY); an admin must get "
                  "nvidia-fabricmanager running (`gpuwarden doctor` says more)")
    if gpu.uuid in c.unavailable:
        return no(Refusal.UNAVAILABLE, c.unavailable[gpu.uuid])
    if gpu.compute_mode is ComputeMode.PROHIBITED:
        return no(Refusal.PROHIBITED,
                  "prohibited compute mode: no process may create a CUDA context on it")
    if gpu.mig_enabled and not gpu.is_mig_instance:
        ids = ", ".join(m.uuid for m in gpu.mig_devices) or "none configured"
        return no(Refusal.MIG,
                  f"MIG enabled: name one of its instances in CUDA_VISIBLE_DEVICES ({ids})")
    if gpu.compute_mode.is_exclusive and foreign:
        return no(Refusal.EXCLUSIVE_HELD,
                  f"{gpu.compute_mode.value} mode, held by {foreign[0].describe()}")
    if foreign and not c.allow_shared:
        who = "; ".join(p.describe() for p in foreign[:3])
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        return no(Refusal.IN_USE, f"in use by {len(foreign)} other process(es): {who}{more}")
    if gpu.memory_free_bytes < c.min_free_bytes:
        return no(Refusal.MEMORY, f"{free} free, {format_bytes(c.min_free_bytes)} required")
    util = gpu.utilization_gpu_pct
    if c.max_util_pct is not None and util is not None and util > c.max_util_pct:
        return no(Refusal.UTILIZATION, f"utilization {util}% > {c.max_util_pct}%")
    detail = [f"{free} free"]
    if util is not None:
        detail.append(f"{util}% utilization")
    if gpu.compute_mode is not ComputeMode.DEFAULT:
        detail.append(f"{gpu.compute_mode.value} mode, idle")
    if foreign:
        detail.append(f"shared with {len(foreign)} process(es)")
    return Verdict(gpu, True, ", ".join(detail))


def preference_key(gpu: GPUSnapshot) -> tuple[int, int, int, str]:
    util = gpu.utilization_gpu_pct if gpu.utilization_gpu_pct is not None else 0
    return (-gpu.memory_free_bytes, util, gpu.index, gpu.uuid)


def unmatched_ids(gpus: Sequence[GPUSnapshot], ids: Sequence[str]) -> tuple[str, ...]:
    """The entries of ``ids`` (an --include list) that name none of ``gpus``."""
    return tuple(i for i in ids if not any(_matches(g, (i,)) for g in gpus))


def check_include(gpus: Sequence[GPUSnapshot], constraints: Constraints, *,
                  flag: str = "--include") -> None:
    """UsageError when --include names a GPU that is not among ``gpus`` (the visible ones):
    a typo or another host's index, which no amount of waiting would ever turn up."""
    missing = unmatched_ids(gpus, constraints.include)
    if missing:
        shown = ", ".join(g.cuda_id for g in gpus) or "none"
        raise UsageError(f"{flag} {','.join(constraints.include)}: no visible GPU is "
                         f"{missing[0]!r}", why=f"the GPUs this process may use are: {shown}",
                         fix=f"name GPUs that `gpuwarden ls` shows as visible, or leave {flag} out")


# Refusals that waiting does not lift: the request's own lists, a mode or MIG setting only an
# admin changes, a GPU lost until it is reset.
_LASTING = frozenset({Refusal.NOT_INCLUDED, Refusal.EXCLUDED, Refusal.PROHIBITED, Refusal.MIG,
                      Refusal.UNREADABLE})


def never_satisfiable(selection: Selection) -> ConstraintError | None:
    """Why waiting could never serve ``selection``'s request, or None when it could.

    A GPU counts as never usable when its refusal lasts (see ``_LASTING``) or when its total
    memory is below ``min_free_bytes``; a GPU refused for who uses it now may free up.
    """
    c = selection.constraints
    lasting = [v for v in selection.verdicts if v.refusal in _LASTING]
    small = [v for v in selection.verdicts
             if v.refusal not in _LASTING and v.gpu.memory_total_bytes < c.min_free_bytes]
    could = len(selection.verdicts) - len(lasting) - len(small)
    if could >= c.count:
        return None
    parts = []
    if lasting:
        kinds = sorted({_LASTING_WORDS[v.refusal] for v in lasting if v.refusal is not None})
        parts.append(f"{len(lasting)} refused for good ({', '.join(kinds)})")
    if small:
        largest = max(v.gpu.memory_total_bytes for v in small)
        parts.append(f"{len(small)} too small for --min-free {format_bytes(c.min_free_bytes)} "
                     f"(the largest has {format_bytes(largest)} in all)")
    return ConstraintError(
        f"{c.count} GPU(s) requested, at most {could} of {len(selection.verdicts)} could ever "
        "be usable: no wait can serve this request",
        why="; ".join(parts) or "no GPU is visible to this process",
        fix="ask for fewer GPUs, a lower --min-free, or other GPUs (--include/--exclude)",
        evidence=[v.line() for v in selection.verdicts])


_LASTING_WORDS = {Refusal.NOT_INCLUDED: "not in --include", Refusal.EXCLUDED: "--exclude",
                  Refusal.PROHIBITED: "prohibited mode", Refusal.MIG: "MIG-enabled",
                  Refusal.UNREADABLE: "lost or unreadable"}


def select(gpus: Sequence[GPUSnapshot], constraints: Constraints) -> Selection:
    """Judge every GPU and pick ``constraints.count`` of the acceptable ones."""
    if constraints.count < 0:
        raise ValueError("count must be >= 0")
    # Acceptable GPUs in order of preference, then the refused ones by index.
    verdicts = sorted((judge(g, constraints) for g in gpus),
                      key=lambda v: (0, *preference_key(v.gpu)) if v.accepted
                      else (1, 0, 0, v.gpu.index, v.gpu.uuid))
    accepted = [v.gpu for v in verdicts if v.accepted]
    chosen = tuple(accepted[: constraints.count]) if len(accepted) >= constraints.count else ()
    return Selection(constraints, tuple(verdicts), chosen)
