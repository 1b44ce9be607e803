"""NCCL's flight recorder, read into the stall report (GPU jobs only).

torch's ProcessGroupNCCL keeps the last N collectives of each rank in a ring buffer when
``TORCH_FR_BUFFER_SIZE`` (``TORCH_NCCL_TRACE_BUFFER_SIZE`` before torch 2.8) is set, and writes
it when its watchdog times out (``TORCH_NCCL_DUMP_ON_TIMEOUT``) to ``TORCH_FR_DUMP_TEMP_FILE``
(``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``) + the rank, or when a byte is written to the named pipe it
makes at ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` + rank + ``.pipe``. gpuwarden turns this on for GPU
ranks, into the job's own directory, unless the user set one of these variables, and asks for a
dump through the pipes when it sees a stall (long before NCCL's watchdog timeout). It sets each
variable under the one name the installed torch reads (:func:`installed_recorder_names`): torch
2.8 and later still read the old names but print a deprecation warning in every rank for them. A dump is a pickle of plain containers
(``{"version", "pg_config", "entries": [{"collective_seq_id", "profiling_name", "state",
"process_group": (name, desc), ...}]}``); it is read here with an unpickler that refuses every
global, so a planted file cannot run code in the launcher.

The summary says, per process group, the last collective every rank recorded and the ranks that
never reached collective N: the ranks that did not join.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DUMP_PREFIX = "nccl_trace_rank_"
TRACE_ENTRIES = "2000"
MAX_DUMP_BYTES = 64 << 20


# Every spelling torch has read for the recorder's settings: one the user set means the user
# configured the recorder, and gpuwarden sets none.
RECORDER_VARIABLES = (
    "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_FR_DEBUG_INFO_PIPE_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
)
_C10D_HEADERS = ("include", "torch", "csrc", "distributed", "c10d")


@dataclass(frozen=True)
class RecorderNames:
    """The variable names the installed torch reads for the recorder (one spelling each: torch
    prints ``... is deprecated; use ...`` in every rank for a deprecated one it still reads)."""

    buffer_size: str
    dump_file: str
    pipe_file: str
    dump_on_timeout: str = "TORCH_NCCL_DUMP_ON_TIMEOUT"


def recorder_env(run_dir: str, base_env: Mapping[str, str],
                 names: RecorderNames | None = None) -> dict[str, str]:
    """The variables that turn the recorder on for a GPU rank (the user's own settings win),
    spelled as the installed torch reads them (:func:`installed_recorder_names`)."""
    if any(k in base_env for k in RECORDER_VARIABLES):
        return {}
    names = names or installed_recorder_names()
    prefix = os.path.join(run_dir, DUMP_PREFIX)
    return {names.buffer_size: TRACE_ENTRIES, names.dump_on_timeout: "1",
            names.dump_file: prefix, names.pipe_file: prefix}


def names_for(fr_names: bool, fr_pipe: bool = False) -> RecorderNames:
    if fr_names:  # the backend-neutral FlightRecorder (pytorch#152563, 2025): TORCH_FR_*
        return RecorderNames("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
                             "TORCH_FR_DEBUG_INFO_PIPE_FILE" if fr_pipe
                             else "TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
    return RecorderNames("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                         "TORCH_NCCL_DEBUG_INFO_PIPE_FILE")


@functools.lru_cache(maxsize=1)
def installed_recorder_names() -> RecorderNames:
    """Asked of the installed torch without importing it (the supervisor imports no torch): its
    own C++ headers, shipped in every wheel, name what ``FlightRecorder`` and
    ``ProcessGroupNCCL`` read; without them, the version in the package metadata decides (the
    ``TORCH_FR_*`` names came with torch 2.8)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return recorder_names_in(roots) or names_for(_torch_version() >= (2, 8))


def recorder_names_in(torch_roots: list[str]) -> RecorderNames | None:
    """The names a torch installed at one of ``torch_roots`` reads, from its headers (None
    when it has none: a stripped install)."""
    for root in torch_roots:
        c10d = os.path.join(root, *_C10D_HEADERS)
        recorder = _header(os.path.join(c10d, "FlightRecorder.hpp"))
        nccl = _header(os.path.join(c10d, "ProcessGroupNCCL.hpp"))
        if recorder is not None or nccl is not None:
            return names_for('"TORCH_FR_BUFFER_SIZE"' in (recorder or ""),
                             '"TORCH_FR_DEBUG_INFO_PIPE_FILE"' in (nccl or ""))
    return None


def _header(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(1 << 20)
    except OSError:
        return None


def _torch_version() -> tuple[int, int]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("torch")
    except PackageNotFoundError:
        return (0, 0)
    parts = re.findall(r"\d+", text)[:2]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, 0)


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused global {module}.{name} in a flight-recorder dump")


def read_dump(path: str) -> dict[str, Any] | None:
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > MAX_DUMP_BYTES:
            return None
        with open(path, "rb") as f:
            data = _PlainUnpickler(io.BytesIO(f.read())).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, MemoryError):
        return None
    return data if isinstance(data, dict) else None


def read_dumps(run_dir: str) -> dict[int, dict[str, Any]]:
    """rank -> its dump, for every dump in the job's directory."""
    out: dict[int, dict[str, Any]] = {}
    try:
        names = os.listdir(run_dir)
    except OSError:
        return out
    for name in names:
        m = re.fullmatch(re.escape(DUMP_PREFIX) + r"(\d+)", name)
        if m:
            dump = read_dump(os.path.join(run_dir, name))
            if dump is not None:
                out[int(m[1])] = dump
    return out


def last_collectives(dumps: Mapping[int, Mapping[str, Any]]
                     ) -> dict[str, dict[int, tuple[int, str, str]]]:
    """process group -> rank -> (sequence number, name, state) of the rank's last collective."""
    last: dict[str, dict[int, tuple[int, str, str]]] = {}
    for rank, dump in dumps.items():
        entries = dump.get("entries")
        if not isinstance(entries, list):
            continue
        for e in entries:
            if not isinstance(e, dict):
                continue
            seq = e.get("collective_seq_id")
            if not isinstance(seq, int) or seq <= 0:
                continue  # point-to-point or malformed
            pg = e.get("process_group")
            group = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else "default"
            seen = last.setdefault(group, {}).get(rank)
            if seen is None or seq >= seen[0]:
                last[group][rank] = (seq, str(e.get("profiling_name", "?")), str(e.get("state", "?")))
    return last


def summarize(dumps: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """Per process group: each rank's last collective, and who did not join the furthest one."""
    last = last_collectives(dumps)
    lines: list[str] = []
    for group, ranks in sorted(last.items()):
        top = max(seq for seq, _, _ in ranks.values())
        behind = sorted(r for r, (seq, _, _) in ranks.items() if seq < top)
        name = next(n for seq, n, _ in ranks.values() if seq == top)
        head = f"process group {group}: collective #{top} ({name})"
        if behind:
            lines.append(f"{head}: rank(s) {', '.join(map(str, behind))} never joined it")
        else:
            lines.append(f"{head}: every rank with a dump joined it")
        for r, (seq, n, state) in sorted(ranks.items()):
            lines.append(f"  rank {r}: last collective #{seq} {n} ({state})")
    return lines


def request_dumps(run_dir: str) -> int:
    """Write to every rank's dump pipe; returns how many were asked."""
    asked = 0
    try:
        names = os.listdir(run_dir)
    except OSError:
        return 0
    for name in names:
        if name.startswith(DUMP_PREFIX) and name.endswith(".pipe"):
            try:
                fd = os.open(os.path.join(run_dir, name), os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader (the rank is gone)
                continue
            try:
                os.write(fd, b"1")
                asked += 1
            except OSError:
                pass
            finally:
                os.close(fd)
    return asked


def summary(run_dir: str, wait_s: float = 5.0) -> list[str]:
    """Ask the ranks for dumps (GPU jobs: NCCL's monitor thread polls its pipe about once a
    second), wait for them a bounded time, and summarize what came."""
    import time

    asked = request_dumps(run_dir)
    if asked:
        deadline = time.monotonic() + wait_s
        while len(read_dumps(run_dir)) < asked and time.monotonic() < deadline:
            time.sleep(0.1)
    return summarize(read_dumps(run_dir))
