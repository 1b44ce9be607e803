"""NCCL's flight recorder, read into the stall report (GPU jobs only).

torch's ProcessGroupNCCL keeps the last N collectives of each rank in a ring buffer when
``TORCH_NCCL_TRACE_BUFFER_SIZE`` (``TORCH_FR_BUFFER_SIZE`` in newer releases) is set, and writes it
when its watchdog times out (``TORCH_NCCL_DUMP_ON_TIMEOUT``) to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``
+ the rank (``TORCH_FR_DUMP_TEMP_FILE``), or when a byte is written to the named pipe it makes
at ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` + rank + ``.pipe`` (``TORCH_FR_DEBUG_INFO_PIPE_FILE``).
gpuwarden turns this on for GPU ranks, into the job's own directory, unless the user set these
variables, and asks for a dump through the pipes when it sees a stall (long before NCCL's
watchdog timeout). A dump is a pickle of plain containers
(``{"version", "pg_config", "entries": [{"collective_seq_id", "profiling_name", "state",
"process_group": (name, desc), ...}]}``); it is read here with an unpickler that refuses every
global, so a planted file cannot run code in the launcher.

The summary says, per process group, the last collective every rank recorded and the ranks that
never reached collective N: the ranks that did not join.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Mapping
from typing import Any

DUMP_PREFIX = "nccl_trace_rank_"
TRACE_ENTRIES = "2000"
MAX_DUMP_BYTES = 64 << 20


def recorder_env(run_dir: str, base_env: Mapping[str, str]) -> dict[str, str]:
    """The variables that turn the recorder on for a GPU rank (the user's own settings win)."""
    prefix = os.path.join(run_dir, DUMP_PREFIX)
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": TRACE_ENTRIES,
        "TORCH_FR_BUFFER_SIZE": TRACE_ENTRIES,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": prefix,
        "TORCH_FR_DEBUG_INFO_PIPE_FILE": prefix,
    }
    user_set = any(k in base_env for k in wanted)
    return {} if user_set else wanted


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
