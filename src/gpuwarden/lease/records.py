"""Holder and ticket records: who holds or waits for what, for display and for the queue.

A record is a small JSON file its owner keeps an exclusive flock on for as long as it
lives. It is written to a temporary name, locked, then renamed into place, so a
record is never visible unlocked while its owner lives. A record whose lock nobody
holds belongs to a dead process: it is ignored, and deleted when we may (our own).

A live holder record keeps other requests off the slots it names, besides the slot locks
themselves: in a directory that `gpuwarden leases init` did not prepare, another user can
delete a lock file and create a new one at its path, and the record is what still says the
slot is taken. So a record is only believed under the kernel's word: the pid that holds
its lock in /proc/locks must be the pid it names, and its user is the file's owner, never
the name it claims. Reading is bounded (size cap, nesting cap, validated fields, control
characters escaped): a hostile record is listed by ``gpuwarden leases`` and otherwise
ignored; it cannot crash anything or block a GPU under someone else's name.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import math
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpuwarden.lease import _fs
from gpuwarden.procs import short_command

HOLDER_PREFIX = "holder."
TICKET_PREFIX = "ticket."
RECORD_SUFFIX = ".json"
RECORD_SCHEMA = 1
MAX_RECORD_BYTES = 64 * 1024
MAX_NESTING = 8  # a record is 4 levels deep: {claims: [{slots: [..]}]}
MAX_CLAIMS = 256
LABEL_CHARS = 200
COMMAND_CHARS = 300


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
    # Stopped (SIGSTOP, Ctrl-Z): set by `gpuwarden leases` from /proc (scan leaves it False).
    stopped: bool = field(default=False, compare=False)

    def who(self) -> str:
        """'pid 812 (alice, train.py)' in the same form select.py uses for processes."""
        parts = (self.user, self.label or self.command, "stopped" if self.stopped else "")
        what = ", ".join(x for x in parts if x)
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
                  host=socket.gethostname(), command=command[:COMMAND_CHARS],
                  label=(label or "")[:LABEL_CHARS], started_at=time.time(), **fields)


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
    """The live records of ``directory``, the unreadable or forged ones, and every name the
    directory held (callers look for lock files in it without listing it again); stale
    records are skipped.

    A record is live when someone holds its lock; it is believed when /proc/locks says that
    someone is the pid it names (a record naming another pid goes to the forged list). Its
    user is the file's owner. With ``cleanup``, stale records (nobody holds their lock) and
    leftover temporary files that belong to this user are deleted; other users' are left
    alone (the sticky bit forbids it, and they are harmless).
    """
    live: list[Record] = []
    corrupt: list[Corrupt] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return live, corrupt, []
    table: dict[int, set[int]] | None | bool = False  # read at the first live record
    for name in names:
        if not name.endswith(RECORD_SUFFIX) or not name.startswith((HOLDER_PREFIX, TICKET_PREFIX)):
            if cleanup and name.startswith(".") and name.endswith(".tmp"):
                _remove_if_stale(directory / name, min_age_s=60.0)
            continue
        path = directory / name
        try:
            fd = _fs.open_regular(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            corrupt.append(Corrupt(path, _fs.printable(getattr(exc, "problem", None)
                                                       or exc.strerror or str(exc))))
            continue
        try:
            if _fs.try_lock(fd, shared=True):  # nobody holds it: its owner is gone
                if cleanup:
                    _remove_if_stale(path)
                continue
            st = os.fstat(fd)
            record = parse_record_fd(fd, path, st.st_size)
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            corrupt.append(Corrupt(path, _fs.printable(f"{type(exc).__name__}: {exc}")))
            continue
        finally:
            _fs.unlock_close(fd)
        if table is False:
            table = _fs.flock_table()
        if table is not None and record.pid not in table.get(st.st_ino, ()):  # type: ignore[union-attr]
            holders = sorted(table.get(st.st_ino, ()))  # type: ignore[union-attr]
            corrupt.append(Corrupt(path, f"forged: claims pid {record.pid}, but its lock is held "
                                   f"by {', '.join(f'pid {p}' for p in holders) or 'nobody we can see'} "
                                   f"(owner {_fs.user_name(st.st_uid)})"))
            continue
        live.append(replace(record, user=_fs.user_name(st.st_uid)))
    return live, corrupt, names


def _remove_if_stale(path: Path, min_age_s: float = 0.0) -> None:
    """Delete our own record whose lock nobody holds. Called under the directory mutex,
    which every record write also holds, so the file cannot be replaced meanwhile."""
    try:
        fd = _fs.open_regular(path)
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
    fd = _fs.open_regular(path)
    try:
        return parse_record_fd(fd, path, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def parse_record_fd(fd: int, path: Path, size: int) -> Record:
    """Parse the record open as ``fd``: bounded in size and nesting, every field checked,
    unknown fields ignored, strings made printable."""
    if size > MAX_RECORD_BYTES:
        raise ValueError(f"{size} bytes, more than a record's {MAX_RECORD_BYTES}")
    raw = os.pread(fd, MAX_RECORD_BYTES + 1, 0)
    if len(raw) > MAX_RECORD_BYTES:
        raise ValueError(f"more than a record's {MAX_RECORD_BYTES} bytes")
    _check_nesting(raw)
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    kind = data["kind"]
    if kind not in ("holder", "ticket"):
        raise ValueError(f"unknown kind {_fs.printable(str(kind), 40)!r}")
    raw_claims = data.get("claims", [])
    if not isinstance(raw_claims, list) or len(raw_claims) > MAX_CLAIMS:
        raise ValueError("claims: not a list of at most 256 entries")
    claims = tuple(
        SlotClaim(uuid=_text(c["uuid"], 120), index=_int(c["index"], 0, 1 << 16),
                  slots_per_gpu=_int(c["slots_per_gpu"], 1, 1 << 12),
                  slots=tuple(_int(s, 0, 1 << 12) for s in _list(c["slots"])))
        for c in raw_claims
    )
    return Record(
        kind=kind, record_id=_text(data["id"], 120), pid=_int(data["pid"], 1, 1 << 31),
        user=_text(data["user"], 64), host=_text(data["host"], 120),
        command=_text(data["command"], COMMAND_CHARS),
        label=_text(data.get("label", ""), LABEL_CHARS),
        started_at=_float(data["started_at"]), claims=claims,
        arrival_ns=_int(data.get("arrival_ns", 0), 0, 1 << 63),
        gpus_wanted=_int(data.get("gpus_wanted", 0), 0, 1 << 16),
        slots_per_gpu=_int(data.get("slots_per_gpu", 1), 1, 1 << 12),
        slots_each=_int(data.get("slots_each", 1), 1, 1 << 12),
        eligible=tuple(_text(u, 120) for u in _list(data.get("eligible", []))), path=path,
    )


def _check_nesting(raw: bytes) -> None:
    """Refuse JSON nested deeper than a record can be, before json.loads recurses into it.

    Fast path: fewer brackets than the limit cannot nest deeper than it. Else count depth,
    skipping strings."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_NESTING:
        return
    depth = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > MAX_NESTING:
                raise ValueError(f"JSON nested deeper than {MAX_NESTING} levels")
        elif byte in (0x5D, 0x7D):
            depth -= 1


def _int(value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise ValueError(f"{_fs.printable(repr(value), 40)} is not an integer in [{low}, {high})")
    return value


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise ValueError(f"{_fs.printable(repr(value), 40)} is not a finite number")
    return float(value)


def _text(value: Any, limit: int) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{_fs.printable(repr(value), 40)} is not a string")
    return _fs.printable(value, limit)


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list) or len(value) > MAX_CLAIMS:
        raise ValueError("not a list of at most 256 entries")
    return value


def iter_holders(records: list[Record]) -> Iterator[Record]:
    """The holder records among ``records``."""
    return (r for r in records if r.kind == "holder")
