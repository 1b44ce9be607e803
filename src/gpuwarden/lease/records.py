"""Holder and ticket records: who holds or waits for what, for display and for the queue.

A record is a small JSON file its owner keeps an exclusive flock on for as long as it
lives. It is written to a temporary name, locked, then renamed into place, so a
record is never visible unlocked while its owner lives. A record whose lock nobody
holds belongs to a dead process: it is ignored, and deleted when we may (our own).

Records never decide who holds a slot — the slot locks do. A corrupt, truncated or
foreign-format record is reported by ``gpuwarden leases`` and otherwise ignored: it
can neither block a GPU nor crash anything.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwarden.boundedio import read_regular
from gpuwarden.lease import _fs
from gpuwarden.procs import short_command

HOLDER_PREFIX = "holder."
TICKET_PREFIX = "ticket."
RECORD_SUFFIX = ".json"
RECORD_SCHEMA = 1


@dataclass(frozen=True)
class SlotClaim:
    """The slots one record holds (or, for a ticket, wants) on one GPU."""

    uuid: str
    index: int
    slots_per_gpu: int
    slots: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "index": self.index, "slots_per_gpu": self.slots_per_gpu,
                "slots": list(self.slots)}


@dataclass(frozen=True)
class Record:
    """A holder (``kind='holder'``) or a waiting request (``kind='ticket'``)."""

    kind: str
    record_id: str
    pid: int
    user: str
    host: str
    command: str
    label: str
    started_at: float  # unix time: when the lease was granted / the wait began
    claims: tuple[SlotClaim, ...] = ()
    # Tickets only: arrival order (CLOCK_MONOTONIC, system-wide on Linux), the request,
    # and the GPUs it would take if their leases went (it holds them back from later requests).
    arrival_ns: int = 0
    gpus_wanted: int = 0
    slots_per_gpu: int = 1
    slots_each: int = 1
    eligible: tuple[str, ...] = ()
    path: Path | None = field(default=None, compare=False)

    def who(self) -> str:
        """'pid 812 (alice, train.py)' in the same form select.py uses for processes."""
        what = ", ".join(x for x in (self.user, self.label or self.command) if x)
        return f"pid {self.pid} ({what})" if what else f"pid {self.pid}"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "schema": RECORD_SCHEMA, "kind": self.kind, "id": self.record_id, "pid": self.pid,
            "user": self.user, "host": self.host, "command": self.command, "label": self.label,
            "started_at": self.started_at, "claims": [c.to_dict() for c in self.claims],
        }
        if self.kind == "ticket":
            data.update(arrival_ns=self.arrival_ns, gpus_wanted=self.gpus_wanted,
                        slots_per_gpu=self.slots_per_gpu, slots_each=self.slots_each,
                        eligible=list(self.eligible))
        return data


def new_record_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def this_process(kind: str, record_id: str, label: str | None, **fields: Any) -> Record:
    """A record describing the calling process."""
    argv = [os.path.basename(sys.argv[0]), *sys.argv[1:]] if sys.argv and sys.argv[0] else []
    command = short_command(argv, width=300) if argv else sys.executable
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    return Record(kind=kind, record_id=record_id, pid=os.getpid(), user=user,
                  host=socket.gethostname(), command=command,
                  label=label or "", started_at=time.time(), **fields)


def record_path(directory: Path, kind: str, record_id: str) -> Path:
    prefix = HOLDER_PREFIX if kind == "holder" else TICKET_PREFIX
    return directory / f"{prefix}{record_id}{RECORD_SUFFIX}"


class OwnedRecord:
    """A record file this process owns and holds the flock on."""

    def __init__(self, directory: Path, record: Record) -> None:
        self.directory = directory
        self.record = record
        self.path = record_path(directory, record.kind, record.record_id)
        self.fd: int | None = None
        self.write(record)
        _fs.track(self)

    def write(self, record: Record) -> None:
        """Replace the record atomically; the new file is locked before it becomes visible."""
        tmp = self.directory / f".{self.path.name}.{secrets.token_hex(3)}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     _fs.FILE_MODE)
        try:
            os.fchmod(fd, _fs.FILE_MODE)
            if not _fs.try_lock(fd):  # a fresh file of ours: nobody else can hold it
                raise OSError(f"cannot lock new record {tmp}")
            os.write(fd, json.dumps(record.to_dict()).encode())
            os.rename(tmp, self.path)
        except BaseException:
            _fs.unlock_close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        old, self.fd, self.record = self.fd, fd, record
        if old is not None:
            _fs.unlock_close(old)

    def remove(self) -> None:
        """Delete the file, then drop the lock (a reader never sees it unlocked but present)."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if _fs.same_file(self.fd, self.path):
                os.unlink(self.path)
        _fs.unlock_close(self.fd)
        self.fd = None
        _fs.untrack(self)

    def _close_in_child(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


@dataclass(frozen=True)
class Corrupt:
    """A record file that could not be understood (shown by `gpuwarden leases`, else ignored)."""

    path: Path
    problem: str


def scan(directory: Path, *, cleanup: bool = True
         ) -> tuple[list[Record], list[Corrupt], list[str]]:
    """The live records of ``directory``, the unreadable ones, and every name the directory
    held (callers look for lock files in it without listing it again); stale records are
    skipped.

    With ``cleanup``, stale records (nobody holds their lock) and leftover temporary
    files that belong to this user are deleted; other users' are left alone (the
    sticky bit forbids it, and they are harmless).
    """
    live: list[Record] = []
    corrupt: list[Corrupt] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return live, corrupt, []
    for name in names:
        if not name.endswith(RECORD_SUFFIX) or not name.startswith((HOLDER_PREFIX, TICKET_PREFIX)):
            if cleanup and name.startswith(".") and name.endswith(".tmp"):
                _remove_if_stale(directory / name, min_age_s=60.0)
            continue
        path = directory / name
        alive = _fs.probe_record_alive(path)
        if alive is None:
            continue
        if not alive:
            if cleanup:
                _remove_if_stale(path)
            continue
        try:
            live.append(parse_record(path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            corrupt.append(Corrupt(path, f"{type(exc).__name__}: {exc}"))
    return live, corrupt, names


def _remove_if_stale(path: Path, min_age_s: float = 0.0) -> None:
    """Delete our own record whose lock nobody holds. Called under the directory mutex,
    which every record write also holds, so the file cannot be replaced meanwhile."""
    try:
        # O_NONBLOCK: a FIFO planted under a record's name must not block the open.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or time.time() - st.st_mtime < min_age_s:
            return
        if _fs.try_lock(fd, shared=True) and _fs.same_file(fd, path):
            with contextlib.suppress(OSError):
                os.unlink(path)
    finally:
        _fs.unlock_close(fd)


def parse_record(path: Path) -> Record:
    """Read one record; ValueError/KeyError/TypeError when it is not a valid record."""
    # Bounded: any user can plant a FIFO, a symlink to /dev/zero or a deep JSON in the shared
    # directory (InputRefused is a ValueError: the record is reported as corrupt).
    raw = read_regular(path, max_bytes=1 << 20, nofollow=True)
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply to be a record") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    kind = data["kind"]
    if kind not in ("holder", "ticket"):
        raise ValueError(f"unknown kind {kind!r}")
    claims = tuple(
        SlotClaim(uuid=str(c["uuid"]), index=int(c["index"]),
                  slots_per_gpu=int(c["slots_per_gpu"]),
                  slots=tuple(int(s) for s in c["slots"]))
        for c in data.get("claims", [])
    )
    return Record(
        kind=kind, record_id=str(data["id"]), pid=int(data["pid"]), user=str(data["user"]),
        host=str(data["host"]), command=str(data["command"]), label=str(data.get("label", "")),
        started_at=float(data["started_at"]), claims=claims,
        arrival_ns=int(data.get("arrival_ns", 0)), gpus_wanted=int(data.get("gpus_wanted", 0)),
        slots_per_gpu=int(data.get("slots_per_gpu", 1)),
        slots_each=int(data.get("slots_each", 1)),
        eligible=tuple(str(u) for u in data.get("eligible", [])), path=path,
    )


def iter_holders(records: list[Record]) -> Iterator[Record]:
    """The holder records among ``records``."""
    return (r for r in records if r.kind == "holder")
