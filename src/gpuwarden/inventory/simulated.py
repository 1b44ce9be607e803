"""A simulated host read from a scenario JSON file (format: tests/scenarios/example.json).

It produces the same :class:`HostSnapshot` the NVML backend does, so everything
above the boundary runs unchanged on a machine without a GPU. Validation names
the offending field (``gpus[1].memory_total_mib: expected an integer, got 'x'``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise ScenarioError(
                f"scenario file {str(self.path)!r} does not exist",
                fix="point GPUWARDEN_SIMULATE at an existing scenario file, or unset it to use NVML",
            ) from exc
        except OSError as exc:
            raise ScenarioError(
                f"scenario file {str(self.path)!r} cannot be read",
                why=exc.strerror or str(exc),
                fix=_FIX,
            ) from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScenarioError(
                f"scenario file {str(self.path)!r} is not valid JSON",
                why=f"line {exc.lineno}, column {exc.colno}: {exc.msg}",
                fix=_FIX,
            ) from exc
        return parse_scenario(data, source=f"simulated:{self.path}")


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
            f"{where}.compute_mode: {mode_text!r} is not a compute mode",
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
    )


def _parse_mig(raw: Any, where: str, *, index: int, parent: str) -> GPUSnapshot:
    f = _Fields(raw, where)
    uuid = f.get("uuid", str)
    if not uuid.startswith("MIG-"):
        raise ScenarioError(f"{where}.uuid: {uuid!r} must start with 'MIG-'", fix=_FIX)
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
        out.append(
            GPUProcess(
                pid=f.get("pid", int),
                user=f.get("user", str, default=None),
                command=f.get("command", str, default=None),
                used_memory_bytes=None if mib is None else mib * MIB,
            )
        )
    return tuple(out)


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
                f"got {value!r}",
                fix=_FIX,
            )
        if kind is int and value < 0:
            raise ScenarioError(f"{self.where}.{key}: must not be negative, got {value}", fix=_FIX)
        return value


_KIND_NAMES = {int: "an integer", str: "a string", bool: "true or false", list: "a list"}
