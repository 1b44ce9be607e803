"""Which GPUs this process may use: CUDA_VISIBLE_DEVICES as CUDA reads it, and Slurm.

CUDA's rules, mirrored here (PyTorch's ``torch.cuda._parse_visible_devices``
follows the same ones):

- unset: every device; empty or ``-1``: none.
- a list of one form, decided by the first entry: indices (``0,2``), GPU UUIDs
  or unique prefixes of them (``GPU-1f0e8c52``), or MIG instance UUIDs (``MIG-...``).
- enumeration stops at the first invalid entry (a negative number, an index
  past the last GPU, a UUID prefix matching nothing or several, an entry of
  another form); everything before it is still visible.
- a repeated device makes CUDA see none at all. gpuwarden reports that as an
  error rather than silently running with no GPU.

Indices are NVML's (PCI bus order). CUDA numbers devices fastest-first unless
``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which is why everything gpuwarden starts gets
that variable (:data:`CHILD_ORDER_ENV`).

Slurm: inside an allocation, ``SLURM_STEP_GPUS`` (or ``SLURM_JOB_GPUS``) names
the physical GPUs the job owns. When NVML sees more GPUs than that, the host
view is narrowed to the allocation; when the job runs in a device cgroup NVML
already sees only the allocated GPUs, renumbered from 0, and they are used as
they are. ``CUDA_VISIBLE_DEVICES``, as Slurm or the user set it, then applies.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from gpuwarden.errors import VisibilityError

if TYPE_CHECKING:  # only named here: a launch's plan imports this module for CHILD_ORDER_ENV
    from gpuwarden.inventory.snapshot import GPUSnapshot

CHILD_ORDER_ENV = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

_FIX_CVD = (
    "set CUDA_VISIBLE_DEVICES to distinct indices or UUIDs that `gpuwarden ls` shows, "
    "or unset it"
)


@dataclass(frozen=True)
class Visibility:
    """The devices this process may use, in CUDA order, and notes on what was dropped."""

    gpus: tuple[GPUSnapshot, ...]
    notes: tuple[str, ...] = ()
    # The CUDA_VISIBLE_DEVICES entry at which CUDA stops enumerating (an invalid one:
    # not an index, past the last GPU, no such UUID); None when every entry is used.
    # Its explanation is the last of ``notes``.
    stopped_at_entry: str | None = None


def resolve_visible(host_gpus: Sequence[GPUSnapshot], env: Mapping[str, str] | None = None
                    ) -> tuple[GPUSnapshot, ...]:
    """The GPUs of ``host_gpus`` this process may use; see :func:`parse_visibility`."""
    return parse_visibility(host_gpus, env).gpus


def parse_visibility(host_gpus: Sequence[GPUSnapshot], env: Mapping[str, str] | None = None
                     ) -> Visibility:
    """Apply Slurm's allocation and CUDA_VISIBLE_DEVICES to the host's GPUs.

    Raises VisibilityError (code CUDA_NO_DEVICE, exit 2) when the variables leave
    no GPU although the host has some, or repeat a device.
    """
    env = os.environ if env is None else env
    notes: list[str] = []
    candidates = tuple(host_gpus)
    allocation = _slurm_allocation(env)
    if allocation is not None:
        candidates = _apply_slurm(candidates, allocation, notes)

    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return Visibility(candidates, tuple(notes))
    gpus, stopped_at = _apply_cvd(raw, tuple(host_gpus), notes)
    if allocation is not None:
        outside = [g for g in gpus if g not in candidates and not g.is_mig_instance]
        if outside:
            raise VisibilityError(
                f"CUDA_VISIBLE_DEVICES={raw!r} names {outside[0].label}, which is outside this "
                f"Slurm job's allocation ({allocation[0]}={allocation[1]})",
                fix="name only the GPUs Slurm gave the job, or unset CUDA_VISIBLE_DEVICES",
            )
    if not gpus and host_gpus:
        raise VisibilityError(
            f"CUDA_VISIBLE_DEVICES={raw!r} leaves no GPU visible",
            why=notes[-1] if notes else "an empty value or -1 hides every GPU",
            fix=_FIX_CVD,
        )
    return Visibility(gpus, tuple(notes), stopped_at)


_Chosen: TypeAlias = "tuple[tuple[GPUSnapshot, ...], str | None]"  # the devices, the entry CUDA stopped at


def _apply_cvd(raw: str, host: tuple[GPUSnapshot, ...], notes: list[str]) -> _Chosen:
    value = raw.strip()
    if value == "":
        notes.append("CUDA_VISIBLE_DEVICES is empty: no GPU is visible")
        return (), None
    entries = [e.strip() for e in value.split(",")]
    first = entries[0]
    if first.startswith("MIG-"):
        pool = tuple(m for g in host for m in g.mig_devices)
        return _match_uuids(raw, entries, "MIG-", pool, notes)
    if first.startswith("GPU-"):
        return _match_uuids(raw, entries, "GPU-", host, notes)

    chosen: list[GPUSnapshot] = []
    for pos, entry in enumerate(entries):
        ordinal = _strtoul(entry)
        if ordinal is None or ordinal < 0:
            notes.append(_stop_note(raw, pos, entry, "is not a device index" if ordinal is None
                                    else "is negative"))
            return tuple(chosen), entry
        if ordinal >= len(host):
            notes.append(_stop_note(raw, pos, entry, f"is past the last GPU (the host has {len(host)})"))
            return tuple(chosen), entry
        gpu = host[ordinal]
        if gpu in chosen:
            raise _duplicate(raw, entry)
        chosen.append(gpu)
    return tuple(chosen), None


def _match_uuids(raw: str, entries: list[str], prefix: str, pool: tuple[GPUSnapshot, ...],
                 notes: list[str]) -> _Chosen:
    chosen: list[GPUSnapshot] = []
    for pos, entry in enumerate(entries):
        if not entry.startswith(prefix):
            notes.append(_stop_note(raw, pos, entry, f"does not start with {prefix} like the first entry"))
            return tuple(chosen), entry
        matches = [g for g in pool if g.uuid.startswith(entry)]
        if len(matches) != 1:
            why = "matches no device" if not matches else f"matches {len(matches)} devices"
            notes.append(_stop_note(raw, pos, entry, why))
            return tuple(chosen), entry
        if matches[0] in chosen:
            raise _duplicate(raw, entry)
        chosen.append(matches[0])
    return tuple(chosen), None


def _strtoul(entry: str) -> int | None:
    """The leading integer of an entry, as CUDA's strtoul-like parse reads it ('1gpu' → 1)."""
    match = re.match(r"[+-]?\d+", entry)
    return int(match.group(0)) if match else None


def _stop_note(raw: str, pos: int, entry: str, why: str) -> str:
    kept = "no GPU" if pos == 0 else f"only the first {pos} entr{'y' if pos == 1 else 'ies'}"
    return (f"CUDA_VISIBLE_DEVICES={raw!r}: entry {entry!r} {why}; CUDA stops at the first "
            f"invalid entry, so {kept} of the list {'is' if pos == 1 else 'are'} visible")


def _duplicate(raw: str, entry: str) -> VisibilityError:
    return VisibilityError(
        f"CUDA_VISIBLE_DEVICES={raw!r} names the same device twice ({entry!r})",
        why="CUDA sees no device at all when an entry repeats",
        fix=_FIX_CVD,
    )


def _slurm_allocation(env: Mapping[str, str]) -> tuple[str, str] | None:
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def parse_int_list(text: str, *, what: str) -> list[int]:
    """'0,2-4' → [0, 2, 3, 4]; the form Slurm uses for GPU ids."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise VisibilityError(
                f"{what}={text!r}: {part!r} is not a GPU index or range",
                fix=f"{what} should look like 0,1 or 0-3",
            )
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) else lo
        out.extend(range(lo, hi + 1))
    return out


def _apply_slurm(host: tuple[GPUSnapshot, ...], allocation: tuple[str, str],
                 notes: list[str]) -> tuple[GPUSnapshot, ...]:
    name, value = allocation
    wanted = parse_int_list(value, what=name)
    by_index = {g.index: g for g in host}
    if all(i in by_index for i in wanted):
        if len(wanted) < len(host):
            notes.append(f"Slurm allocation {name}={value}: using GPUs {','.join(map(str, wanted))}")
        return tuple(by_index[i] for i in wanted)
    if len(host) == len(wanted):
        # A device cgroup: NVML shows just the allocated GPUs, renumbered from 0.
        notes.append(f"Slurm allocation {name}={value}: the host shows only the allocated GPUs")
        return host
    raise VisibilityError(
        f"{name}={value} names GPUs this host does not have (it has {len(host)})",
        why="the variable does not belong to this node, or was copied from another job",
        fix=f"run inside the Slurm step that set it, or unset {name}",
    )
