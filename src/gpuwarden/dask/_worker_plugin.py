"""What runs inside each Dask worker process that ``gpuwarden worker`` starts.

Three things: the optional PyTorch memory cap (as the local pool does), a record of the
tasks this worker is executing, kept in a file that outlives the process, and Dask's log lines
about lost connections kept to one line each (``_logs.py``). A worker killed by
SIGKILL (the OOM killer) leaves nothing else behind; its nanny reads the file after the death
to tell the scheduler which task the worker was running when it died (the scheduler itself only
knows which tasks it had *sent* to the worker, and with a queue of two per thread that is not
the same thing).

The record costs one ``pwrite`` of a few bytes when a task starts and one when it ends
(microseconds, against Dask's ~1 ms per task).
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

log = logging.getLogger("gpuwarden.dask")

_LENGTH = struct.Struct("<I")


def write_executing(fd: int, keys: list[Any]) -> None:
    """Replace the record in ``fd`` by ``keys``: a length, then a pickle; one write."""
    payload = pickle.dumps(keys, protocol=pickle.HIGHEST_PROTOCOL)
    os.pwrite(fd, _LENGTH.pack(len(payload)) + payload, 0)


def read_executing(path: str) -> list[Any]:
    """The keys a (dead) worker was executing, from its record; [] when there is none.

    The file is the nanny's own (created in its private directory), so unpickling it trusts
    nothing more than the nanny's own process did.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    if len(data) < _LENGTH.size:
        return []
    (length,) = _LENGTH.unpack_from(data)
    try:
        keys = pickle.loads(data[_LENGTH.size:_LENGTH.size + length])
    except Exception:  # noqa: BLE001 - a torn record names no task, it must not break the report
        return []
    return list(keys) if isinstance(keys, list) else []


class GPUWorkerPlugin(WorkerPlugin):
    """Installed in every worker of ``gpuwarden worker`` (``Worker(plugins=...)``)."""

    name = "gpuwarden-worker"

    def __init__(self, record_path: str, memory_fraction: float | None = None) -> None:
        self.record_path = record_path
        self.memory_fraction = memory_fraction
        self._fd: int | None = None
        self._executing: list[Any] = []

    def setup(self, worker: Any) -> None:
        from gpuwarden.dask._logs import shorten_connection_errors

        shorten_connection_errors()
        self._fd = os.open(self.record_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        write_executing(self._fd, [])
        if self.memory_fraction is not None:
            from gpuwarden.pool._worker import _cap_memory

            for note in _cap_memory(self.memory_fraction):
                log.warning("%s: %s", worker.name, note)

    def teardown(self, worker: Any) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish == "executing":
            self._executing.append(key)
        elif start == "executing" and key in self._executing:
            self._executing.remove(key)
        else:
            return
        if self._fd is not None:
            write_executing(self._fd, self._executing)
