"""A simulated host read from a scenario JSON file (every field: docs/scenarios.md).

It produces the same :class:`HostSnapshot` the NVML backend does, so everything
above the boundary runs unchanged on a machine without a GPU. Validation names
the offending field (``gpus[1].memory_total_mib: expected an integer, got 'x'``).
Scenarios ship with the package (``gpuwarden/inventory/scenarios``): GPUWARDEN_SIMULATE
and ``--simulate`` take one's name (``two-idle``) as well as a path.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Collection
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from gpuwarden.boundedio import InputRefused, decode_utf8, read_regular
from gpuwarden.errors import ScenarioError
from gpuwarden.inventory.snapshot import (
    FABRIC_COMPLETED,
    FABRIC_STATES,
    THROTTLE_REASONS,
    ComputeMode,
    GPUHealth,
    GPUProcess,
    GPUSnapshot,
    HostSnapshot,
)
from gpuwarden.safetext import escape_untrusted
from gpuwarden.units import MIB

_FIX = ("correct the scenario file (every field is described in docs/scenarios.md; "
        "`gpuwarden ls --simulate example` shows a valid one)")

SHIPPED_DIR = Path(__file__).parent / "scenarios"


def shipped_scenarios() -> tuple[str, ...]:
    """Names of the scenarios that ship with gpuwarden (``two-idle``, ``example`` ...)."""
    return tuple(sorted(p.stem for p in SHIPPED_DIR.glob("*.json")))


def resolve_scenario(value: str | Path) -> Path:
    """The file a scenario value names: a shipped scenario's name, else a path.

    A bare word that is neither a shipped scenario nor an existing file is refused with the
    list of shipped names (a path that does not exist is refused when it is read).
    """
    text = str(value)
    if text and os.sep not in text and not text.endswith(".json"):
        shipped = SHIPPED_DIR / f"{text}.json"
        if shipped.is_file():
            return shipped
        if not os.path.exists(text):
            raise ScenarioError(f"no scenario named {escape_untrusted(text, 60)!r}",
                                fix=f"one of {', '.join(shipped_scenarios())}, or the path of "
                                "a scenario file (docs/scenarios.md)")
    return Path(text)


class SimulatedBackend:
    """Reads the scenario on every :meth:`read_host`, so a test may rewrite it between reads;
    processes with a ``timeline`` are read at the moment of each read (docs/scenarios.md)."""

    name = "simulated"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def read_host(self) -> HostSnapshot:
        path = resolve_scenario(self.path)
        shown = self.path.name if path.parent == SHIPPED_DIR else self.path
        try:
            written_at = path.stat().st_mtime
        except OSError:
            written_at = time.time()
        return parse_scenario(load_scenario(path), source=f"simulated:{shown}",
                              live=Live(path.parent, written_at))

    def read_memory(self, uuids: Collection[str] | None = None) -> tuple[GPUSnapshot, ...]:
        """The guard's read: memory and processes of the devices ``uuids`` (every device, MIG
        instances too, when None). The same scenario, timelines and all, as read_host."""
        return memory_view(self.read_host(), uuids)


def memory_view(host: HostSnapshot, uuids: Collection[str] | None) -> tuple[GPUSnapshot, ...]:
    """The devices ``uuids`` of ``host`` (GPUs and MIG instances alike), in host order."""
    devices = [d for g in host.gpus for d in (g, *g.mig_devices)]
    return tuple(d for d in devices if uuids is None or d.uuid in uuids)


class Live:
    """What a scenario's moving parts are read against: the time now, when a process started
    (the kernel's), and which pid a pid file names. One per read of the scenario."""

    def __init__(self, base_dir: Path, written_at: float, now: float | None = None) -> None:
        self.base_dir = base_dir
        self.written_at = written_at
        self.now = time.time() if now is None else now

    def pid_in_file(self, name: str) -> int | None:
        path = Path(name) if os.path.isabs(name) else self.base_dir / name
        try:
            raw = read_regular(path, max_bytes=64)
            pid = int(raw.strip())
        except (OSError, InputRefused, ValueError):
            return None
        return pid if pid > 0 else None

    def started_at(self, pid: int) -> float | None:
        """When ``pid`` started, when it runs on this host (a zombie does not), else None."""
        import psutil

        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return float(proc.create_time())
        except (psutil.Error, OSError):
            return None

    def who(self, pid: int) -> tuple[str | None, str | None]:
        """(user, command line) of a live process on this host, as ``ls`` would show it."""
        import psutil

        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                return proc.username(), " ".join(proc.cmdline()) or proc.name()
        except (psutil.Error, OSError):
            return None, None


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


def parse_scenario(data: Any, *, source: str = "simulated", live: Live | None = None
                   ) -> HostSnapshot:
    """Validate a decoded scenario and build the snapshot; raise ScenarioError naming the field.

    ``live``: what timelines and pid files are read against (default: now, this directory,
    the scenario written now)."""
    live = live or Live(Path.cwd(), time.time())
    root = _Fields(data, "scenario")
    gpus_raw = root.get("gpus", list)
    gpus = tuple(_parse_gpu(g, f"gpus[{i}]", live) for i, g in enumerate(gpus_raw))
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
        cuda_init=_cuda_init(root.get("cuda_init", str, default=None)),
    )


def _cuda_init(value: str | None) -> str | None:
    """The scenario's cuInit answer: a CUresult name as cuGetErrorName gives it."""
    if value is not None and not re.fullmatch(r"CUDA_SUCCESS|CUDA_ERROR_[A-Z0-9_]+", value):
        raise ScenarioError(f"scenario.cuda_init: {_short(value)} is not a CUDA driver result",
                            fix="use a CUresult name such as CUDA_SUCCESS or "
                            "CUDA_ERROR_SYSTEM_NOT_READY")
    return value


def _parse_gpu(raw: Any, where: str, live: Live) -> GPUSnapshot:
    f = _Fields(raw, where)
    index = f.get("index", int)
    uuid = f.get("uuid", str)
    total = _memory(f, "memory_total")
    used = _memory(f, "memory_used")
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
    processes, moving = _parse_processes(f.get("processes", list, default=[]),
                                         f"{where}.processes", live)
    used = min(total, used + moving)
    migs = tuple(
        _parse_mig(m, f"{where}.mig_devices[{i}]", index=index, parent=uuid, live=live)
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
        health=_parse_health(f.get("health", dict, default={}), f"{where}.health"),
    )


_REASON_NAMES = tuple(name for _bit, name in THROTTLE_REASONS)


def _parse_health(raw: dict[str, Any], where: str) -> GPUHealth:
    f = _Fields(raw, where)
    unknown = sorted(set(raw) - {x.name for x in fields(GPUHealth)})
    if unknown:
        raise ScenarioError(f"{where}.{unknown[0]}: not a health field",
                            fix=f"use {', '.join(x.name for x in fields(GPUHealth))}")
    reasons = f.get("throttle_reasons", list, default=None)
    if reasons is not None:
        for i, reason in enumerate(reasons):
            if reason not in _REASON_NAMES:
                raise ScenarioError(f"{where}.throttle_reasons[{i}]: {_short(reason)} is not a "
                                    "clock event reason", fix=f"use {', '.join(_REASON_NAMES)}")
        reasons = tuple(reasons)
    fabric_state = f.get("fabric_state", str, default=None)
    if fabric_state is not None and fabric_state not in FABRIC_STATES:
        raise ScenarioError(f"{where}.fabric_state: {_short(fabric_state)} is not a fabric state",
                            fix=f"use one of {', '.join(FABRIC_STATES)} (or leave it out: no fabric)")
    fabric_error = f.get("fabric_error", str, default=None)
    if fabric_error is not None and fabric_state != FABRIC_COMPLETED:
        raise ScenarioError(f"{where}.fabric_error: only a completed registration has a result",
                            fix=f'set fabric_state to "{FABRIC_COMPLETED}", or drop fabric_error')
    return GPUHealth(
        temperature_c=f.get("temperature_c", int, default=None),
        fan_speed_pct=f.get("fan_speed_pct", int, default=None),
        power_draw_w=f.get("power_draw_w", float, default=None),
        power_limit_w=f.get("power_limit_w", float, default=None),
        performance_state=f.get("performance_state", int, default=None),
        sm_clock_mhz=f.get("sm_clock_mhz", int, default=None),
        sm_clock_max_mhz=f.get("sm_clock_max_mhz", int, default=None),
        memory_clock_mhz=f.get("memory_clock_mhz", int, default=None),
        throttle_reasons=reasons,
        ecc_errors_uncorrected=f.get("ecc_errors_uncorrected", int, default=None),
        retired_pages=f.get("retired_pages", int, default=None),
        memory_repair_pending=f.get("memory_repair_pending", bool, default=None),
        nvlinks_active=f.get("nvlinks_active", int, default=None),
        nvlinks_total=f.get("nvlinks_total", int, default=None),
        fabric_state=fabric_state,
        fabric_error=fabric_error,
    )


def _parse_mig(raw: Any, where: str, *, index: int, parent: str, live: Live) -> GPUSnapshot:
    f = _Fields(raw, where)
    uuid = f.get("uuid", str)
    if not uuid.startswith("MIG-"):
        raise ScenarioError(f"{where}.uuid: {_short(uuid)} must start with 'MIG-'", fix=_FIX)
    total = _memory(f, "memory_total")
    processes, moving = _parse_processes(f.get("processes", list, default=[]),
                                         f"{where}.processes", live)
    return GPUSnapshot(
        index=index,
        uuid=uuid,
        name=f.get("name", str, default="MIG instance"),
        pci_bus_id="",
        memory_total_bytes=total,
        memory_used_bytes=min(total, _memory(f, "memory_used", default=0) + moving),
        utilization_gpu_pct=None,
        compute_mode=ComputeMode.DEFAULT,
        mig_enabled=False,
        processes=processes,
        mig_parent_uuid=parent,
    )


def _parse_processes(raw: list[Any], where: str, live: Live
                     ) -> tuple[tuple[GPUProcess, ...], int]:
    """The processes now, and the memory the moving ones (a ``timeline`` or a ``pid_file``)
    use now: the GPU's used memory is its ``memory_used`` plus that."""
    out = []
    moving = 0
    for i, item in enumerate(raw):
        here = f"{where}[{i}]"
        f = _Fields(item, here)
        used = _memory(f, "used_memory", default=None)
        rss = _memory(f, "host_memory_rss", default=None)
        context = f.get("context", str, default="compute")
        if context not in _CONTEXTS:
            raise ScenarioError(f"{here}.context: {_short(context)} is not a context",
                                fix=f"use one of {', '.join(_CONTEXTS)}")
        timeline = _parse_timeline(f.get("timeline", list, default=None), f"{here}.timeline")
        pid_file = f.get("pid_file", str, default=None)
        if pid_file is not None and "pid" in f.data:
            raise ScenarioError(f"{here}: give pid or pid_file, not both", fix=_FIX)
        if pid_file is not None:
            found = live.pid_in_file(pid_file)
            started = None if found is None else live.started_at(found)
            if found is None or started is None:
                continue  # not started yet, or ended: NVML lists only live processes
            pid = found
        else:
            pid = f.get("pid", int)
            started = None  # a process of the scenario's own: its timeline runs from the file
        user = f.get("user", str, default=None)
        command = f.get("command", str, default=None)
        if pid_file is not None and user is None and command is None:
            user, command = live.who(pid)
        if timeline is not None:
            elapsed = live.now - (started if started is not None else live.written_at)
            current = _at(timeline, elapsed, used)
            if current is _EXITED:
                continue
            used = current
        if (timeline is not None or pid_file is not None) and used:
            moving += used
        out.append(
            GPUProcess(
                pid=pid,
                user=user,
                command=command,
                used_memory_bytes=used,
                context=context,
                note=f.get("note", str, default=None),
                host_memory_rss_bytes=rss,
                cpu_time_s=f.get("cpu_time_s", float, default=None),
                elapsed_s=f.get("elapsed_s", float, default=None),
            )
        )
    return tuple(out), moving


_EXITED: Any = object()


def _parse_timeline(raw: list[Any] | None, where: str) -> list[tuple[float, Any]] | None:
    """``[{"at_s": 0, "used_memory_mib": 1024}, {"at_s": 3, "used_memory_mib": 25600},
    {"at_s": 9, "exited": true}]`` as (at_s, bytes or _EXITED), in time order."""
    if raw is None:
        return None
    points: list[tuple[float, Any]] = []
    for i, item in enumerate(raw):
        f = _Fields(item, f"{where}[{i}]")
        at_s = f.get("at_s", float)
        if f.get("exited", bool, default=False):
            points.append((at_s, _EXITED))
            continue
        points.append((at_s, _memory(f, "used_memory")))
    if any(b[0] < a[0] for a, b in zip(points, points[1:], strict=False)):
        raise ScenarioError(f"{where}: at_s must not decrease from one point to the next",
                            fix=_FIX)
    return points


def _at(points: list[tuple[float, Any]], elapsed_s: float, before: Any) -> Any:
    """The timeline's value ``elapsed_s`` after its start; ``before`` until its first point."""
    value = before
    for at_s, point in points:
        if at_s > elapsed_s:
            break
        value = point
    return value


_CONTEXTS = ("compute", "graphics", "compute+graphics")
_MISSING = object()


def _memory(f: _Fields, name: str, default: Any = _MISSING) -> Any:
    """``NAME_mib`` (whole MiB, what a person writes) or ``NAME_bytes`` (exact, what a host
    captured from NVML needs: a real GPU's used memory is rarely whole MiB), in bytes."""
    if f"{name}_mib" in f.data and f"{name}_bytes" in f.data:
        raise ScenarioError(f"{f.where}: give {name}_mib or {name}_bytes, not both", fix=_FIX)
    if f"{name}_bytes" in f.data:
        return f.get(f"{name}_bytes", int, default=default)
    mib = f.get(f"{name}_mib", int, default=default)
    return mib * MIB if isinstance(mib, int) and mib is not default else mib


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
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # 300 W is as good as 300.0 W
        # bool is an int in Python; a scenario saying "index": true is still wrong.
        ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
        if not ok:
            raise ScenarioError(
                f"{self.where}.{key}: expected {_KIND_NAMES.get(kind, kind.__name__)}, "
                f"got {_short(value)}",
                fix=_FIX,
            )
        if kind in (int, float) and value < 0:
            raise ScenarioError(f"{self.where}.{key}: must not be negative, got {value}", fix=_FIX)
        return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               list: "a list", dict: "an object"}


def scenario_from_snapshot(host: HostSnapshot) -> dict[str, Any]:
    """A host as a scenario (the inverse of :func:`parse_scenario`), so a real host read
    through NVML can be replayed exactly on a machine without a GPU (scripts/verify-gpu
    captures the card it runs on this way). Memory is written in MiB where it is whole MiB,
    else in bytes; fields NVML could not answer are left out."""
    return {
        "comment": f"captured from {host.source} on {host.hostname} by gpuwarden",
        "hostname": host.hostname,
        "driver_version": host.driver_version,
        "cuda_driver_version": host.cuda_driver_version,
        "gpus": [_gpu_entry(gpu) for gpu in host.gpus],
    }


def _memory_entry(name: str, value: int | None) -> dict[str, int]:
    if value is None:
        return {}
    return {f"{name}_mib": value // MIB} if value % MIB == 0 else {f"{name}_bytes": value}


def _gpu_entry(gpu: GPUSnapshot) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        **_memory_entry("memory_total", gpu.memory_total_bytes),
        **_memory_entry("memory_used", gpu.memory_used_bytes),
        "processes": [_process_entry(p) for p in gpu.processes],
    }
    if gpu.mig_parent_uuid is None:
        entry.update(pci_bus_id=gpu.pci_bus_id, utilization_gpu_pct=gpu.utilization_gpu_pct,
                     compute_mode=gpu.compute_mode.value, mig_enabled=gpu.mig_enabled,
                     error=gpu.error)
        health = {k: (list(v) if isinstance(v, tuple) else v)
                  for k, v in asdict(gpu.health).items() if v is not None}
        if health:
            entry["health"] = health
        if gpu.mig_devices:
            entry["mig_devices"] = [_gpu_entry(m) for m in gpu.mig_devices]
    return {k: v for k, v in entry.items() if v is not None}


def _process_entry(proc: GPUProcess) -> dict[str, Any]:
    entry = {
        "pid": proc.pid, "user": proc.user, "command": proc.command,
        **_memory_entry("used_memory", proc.used_memory_bytes),
        "context": proc.context, "note": proc.note,
        **_memory_entry("host_memory_rss", proc.host_memory_rss_bytes),
        "cpu_time_s": proc.cpu_time_s, "elapsed_s": proc.elapsed_s,
    }
    return {k: v for k, v in entry.items() if v is not None}
