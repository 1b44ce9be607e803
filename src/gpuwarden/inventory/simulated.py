"""A simulated host read from a scenario JSON file (format: tests/scenarios/example.json).

It produces the same :class:`HostSnapshot` the NVML backend does, so everything
above the boundary runs unchanged on a machine without a GPU. Validation names
the offending field (``gpus[1].memory_total_mib: expected an integer, got 'x'``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gpuwarden.boundedio import InputRefused, decode_utf8, read_regular
from gpuwarden.errors import ScenarioError
from gpuwarden.inventory.snapshot import ComputeMode, GPUProcess, GPUSnapshot, HostSnapshot
from gpuwarden.units import MIB

_FIX = ("correct the file named by GPUWARDEN_SIMULATE (format: tests/scenarios/example.json "
        "in gpuwarden's repository)")


class SimulatedBackend:
    """Reads the scenario on every :meth:`read_host`, so a test may rewrite it between reads."""

    name = "simulated"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def read_host(self) -> HostSnapshot:
        return parse_scenario(load_scenario(self.path), source=f"simulated:{self.path}")


def load_scenario(path: str | Path) -> Any:
    """The decoded JSON of a scenario file, read bounded (boundedio.read_regular): a FIFO, a
    device, a file over 4 MiB, invalid UTF-8, an integer of more than 18 digits, a float that
    is not finite, or nesting deeper than the parser allows is a ScenarioError, never a hang,
    a MemoryError or a traceback."""
    name = str(path)
    try:
        text = decode_utf8(read_regular(path))
    except FileNotFoundError as exc:
        raise ScenarioError(
            f"scenario file {name!r} does not exist",
            fix="point GPUWARDEN_SIMULATE at an existing scenario file, or unset it to use NVML",
        ) from exc
    except OSError as exc:
        raise ScenarioError(
            f"scenario file {name!r} cannot be read", why=exc.strerror or str(exc), fix=_FIX,
        ) from exc
    except InputRefused as exc:
        raise ScenarioError(f"scenario file {name!r} {exc.problem}", fix=exc.fix) from exc
    try:
        return json.loads(text, parse_int=_bounded_int, parse_float=_finite_float,
                          parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ScenarioError(
            f"scenario file {name!r} is not valid JSON",
            why=f"line {exc.lineno}, column {exc.colno}: {exc.msg}",
            fix=_FIX,
        ) from exc
    except _BadNumber as exc:
        raise ScenarioError(f"scenario file {name!r}: {exc}", fix=_FIX) from exc
    except RecursionError as exc:
        # The C decoder guards its own recursion; a scenario is three levels deep.
        raise ScenarioError(f"scenario file {name!r} is nested too deeply to be a scenario",
                            fix=_FIX) from exc


class _BadNumber(ValueError):
    pass


# Every integer of a scenario (MiB, pids, percentages, indices) fits in 18 digits; refusing
# longer ones before int() keeps a 10**400 (or a 100000-digit) literal from ever being
# converted or multiplied.
_MAX_INT_DIGITS = 18


def _bounded_int(text: str) -> int:
    digits = text.lstrip("-")
    if len(digits) > _MAX_INT_DIGITS:
        raise _BadNumber(f"an integer of {len(digits)} digits ({text[:12]}...) is out of range")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BadNumber(f"the number {text[:20]} is out of range")
    return value


def _no_constant(text: str) -> float:
    raise _BadNumber(f"{text} is not a JSON number")


def parse_scenario(data: Any, *, source: str = "simulated") -> HostSnapshot:
    """Validate a decoded scenario and build the snapshot; raise ScenarioError naming the field."""
    root = _Fields(data, "scenario")
    gpus_raw = root.get("gpus", list)
    gpus = tuple(_parse_gpu(g, f"gpus[{i}]") for i, g in enumerate(gpus_raw))
    seen: dict[int, str] = {}
    for gpu in gpus:
        if gpu.index in seen:
            raise ScenarioError(
                f"scenario: two GPUs have index {gpu.index}", fix="give every GPU its own index"
            )
        seen[gpu.index] = gpu.uuid
    return HostSnapshot(
        hostname=root.get("hostname", str, default="simulated-host"),
        driver_version=root.get("driver_version", str, default=None),
        cuda_driver_version=root.get("cuda_driver_version", str, default=None),
        gpus=tuple(sorted(gpus, key=lambda g: g.index)),
        source=source,
    )


def _parse_gpu(raw: Any, where: str) -> GPUSnapshot:
    f = _Fields(raw, where)
    index = f.get("index", int)
    uuid = f.get("uuid", str)
    total = f.get("memory_total_mib", int) * MIB
    used = f.get("memory_used_mib", int) * MIB
    if used > total:
        raise ScenarioError(
            f"{where}.memory_used_mib is larger than memory_total_mib", fix=_FIX
        )
    mode_text = f.get("compute_mode", str, default="default")
    try:
        mode = ComputeMode(mode_text)
    except ValueError:
        allowed = ", ".join(m.value for m in ComputeMode)
        raise ScenarioError(
            f"{where}.compute_mode: {_short(mode_text)} is not a compute mode",
            fix=f"use one of {allowed}",
        ) from None
    mig_enabled = f.get("mig_enabled", bool, default=False)
    processes = _parse_processes(f.get("processes", list, default=[]), f"{where}.processes")
    migs = tuple(
        _parse_mig(m, f"{where}.mig_devices[{i}]", index=index, parent=uuid)
        for i, m in enumerate(f.get("mig_devices", list, default=[]))
    )
    if migs and not mig_enabled:
        raise ScenarioError(f"{where} lists mig_devices but mig_enabled is false", fix=_FIX)
    return GPUSnapshot(
        index=index,
        uuid=uuid,
        name=f.get("name", str, default="Simulated GPU"),
        pci_bus_id=f.get("pci_bus_id", str, default=f"00000000:{index:02x}:00.0"),
        memory_total_bytes=total,
        memory_used_bytes=used,
        utilization_gpu_pct=f.get("utilization_gpu_pct", int, default=None),
        compute_mode=mode,
        mig_enabled=mig_enabled,
        processes=processes,
        mig_devices=migs,
        error=f.get("error", str, default=None),
    )


def _parse_mig(raw: Any, where: str, *, index: int, parent: str) -> GPUSnapshot:
    f = _Fields(raw, where)
    uuid = f.get("uuid", str)
    if not uuid.startswith("MIG-"):
        raise ScenarioError(f"{where}.uuid: {_short(uuid)} must start with 'MIG-'", fix=_FIX)
    return GPUSnapshot(
        index=index,
        uuid=uuid,
        name=f.get("name", str, default="MIG instance"),
        pci_bus_id="",
        memory_total_bytes=f.get("memory_total_mib", int) * MIB,
        memory_used_bytes=f.get("memory_used_mib", int, default=0) * MIB,
        utilization_gpu_pct=None,
        compute_mode=ComputeMode.DEFAULT,
        mig_enabled=False,
        processes=_parse_processes(f.get("processes", list, default=[]), f"{where}.processes"),
        mig_parent_uuid=parent,
    )


def _parse_processes(raw: list[Any], where: str) -> tuple[GPUProcess, ...]:
    out = []
    for i, item in enumerate(raw):
        f = _Fields(item, f"{where}[{i}]")
        mib = f.get("used_memory_mib", int, default=None)
        context = f.get("context", str, default="compute")
        if context not in _CONTEXTS:
            raise ScenarioError(f"{where}[{i}].context: {_short(context)} is not a context",
                                fix=f"use one of {', '.join(_CONTEXTS)}")
        out.append(
            GPUProcess(
                pid=f.get("pid", int),
                user=f.get("user", str, default=None),
                command=f.get("command", str, default=None),
                used_memory_bytes=None if mib is None else mib * MIB,
                context=context,
                note=f.get("note", str, default=None),
            )
        )
    return tuple(out)


_CONTEXTS = ("compute", "graphics", "compute+graphics")
_MISSING = object()


class _Fields:
    """Typed field access on a JSON object, with errors that name the field path."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ScenarioError(
                f"{where}: expected an object, got {type(data).__name__}", fix=_FIX
            )
        self.data = data
        self.where = where

    def get(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        if key not in self.data or (self.data[key] is None and default is not _MISSING):
            if default is _MISSING:
                raise ScenarioError(f"{self.where}.{key}: missing", fix=_FIX)
            return default
        value = self.data[key]
        # bool is an int in Python; a scenario saying "index": true is still wrong.
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not ok:
            raise ScenarioError(
                f"{self.where}.{key}: expected {_KIND_NAMES.get(kind, kind.__name__)}, "
                f"got {_short(value)}",
                fix=_FIX,
            )
        if kind is int and value < 0:
            raise ScenarioError(f"{self.where}.{key}: must not be negative, got {value}", fix=_FIX)
        return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_KIND_NAMES = {int: "an integer", str: "a string", bool: "true or false", list: "a list"}
