"""Holder and ticket records: who holds or waits for what, read with bounded work.

A record is a small JSON file under a fresh random name (``holder.<token>.json``,
``ticket.<token>.json``, created ``O_EXCL``: nobody can take a name before its owner does),
on which its owner holds a POSIX write lock for as long as it lives. What a record is
believed for comes from the kernel, never from the file:

- it is alive when ``F_GETLK`` finds a write lock on it, and its process is the pid the
  kernel names for that lock; its user is the file's owner;
- a ticket's place in line is the file's birth time (statx; its ctime where the filesystem
  keeps no birth time), which no user can choose;
- what a ticket asks for is only its request (how many GPUs, which ones it may use, K):
  every other request judges for itself, from GPU state, which GPUs that request could use.

Reading a directory of them, with bounded work, is ``scan.py``'s; here are the records'
fields, their parsing (bounded: :data:`MAX_RECORD_BYTES`, strings escaped) and this process's
own records.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpuwarden.lease import _fs, _locks, _proc
from gpuwarden.procs import short_command
from gpuwarden.safetext import escape_untrusted

HOLDER_PREFIX = "holder."
TICKET_PREFIX = "ticket."
RECORD_SUFFIX = ".json"
RECORD_SCHEMA = 2
MAX_RECORD_BYTES = 16 * 1024  # a holder of 16 GPUs x 8 slots writes ~3 KiB
MAX_CLAIMS = 256
MAX_BRACKETS = 4 * MAX_CLAIMS + 16  # a record's own: claims, slots, uuids and the object
LABEL_CHARS = 200
COMMAND_CHARS = 300


@dataclass(frozen=True)
class SlotClaim:
    """The slots one record holds on one GPU, or (``memory_bytes`` > 0) the memory of a memory
    lease on it. A memory claim is written with ``slots_per_gpu`` 1 and no slots: an older
    gpuwarden reads it as a lease of the GPU in another split and keeps off it."""

    uuid: str
    index: int
    slots_per_gpu: int
    slots: tuple[int, ...]
    memory_bytes: int = 0

    @property
    def is_memory(self) -> bool:
        return self.memory_bytes > 0

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"uuid": self.uuid, "index": self.index,
                                "slots_per_gpu": self.slots_per_gpu, "slots": list(self.slots)}
        if self.memory_bytes:
            data["memory_bytes"] = self.memory_bytes
        return data


@dataclass(frozen=True)
class Record:
    """A holder (``kind='holder'``) or a waiting request (``kind='ticket'``).

    ``pid``, ``uid``/``user``, ``born_ns`` and ``ino`` are the kernel's; the rest is what the
    record's owner wrote (escaped)."""

    kind: str
    record_id: str  # the random token of its file name
    pid: int  # who holds its lock, as F_GETLK says (0: a process in another PID namespace)
    user: str
    host: str
    command: str
    label: str
    born_ns: int  # the file's birth time: a ticket's place in line, a holder's start
    claims: tuple[SlotClaim, ...] = ()
    # Tickets only: the request, from which others judge what it could take.
    gpus_wanted: int = 0
    slots_per_gpu: int = 1
    slots_each: int = 1
    min_free_bytes: int = 0
    max_util_pct: int | None = None
    allow_shared: bool = False
    uuids: tuple[str, ...] = ()  # the GPUs it may use (its visible ones, include/exclude applied)
    memory_bytes: int = 0  # a memory request: the bytes it asks for on each GPU
    uid: int = -1
    ino: int = 0
    path: Path | None = field(default=None, compare=False)
    # Stopped (SIGSTOP, Ctrl-Z): set by `gpuwarden leases` from /proc (scan leaves it False).
    stopped: bool = field(default=False, compare=False)
    # Written by an older gpuwarden (a flock on the file, no record lock): its claims are kept
    # off (no two versions grant one slot); its pid is what the file says, believed only for
    # a live process of the file's owner that started before the file (older_record_problem).
    legacy: bool = False
    schema: int = field(default=RECORD_SCHEMA, compare=False)  # what the file says it is

    @property
    def started_at(self) -> float:
        """Unix time the record was made (granted, or the wait began)."""
        return self.born_ns / 1e9

    def order(self) -> tuple[int, int, str]:
        """Place in line: birth time, then inode and name for records born in one tick."""
        return (self.born_ns, self.ino, self.record_id)

    def who(self) -> str:
        """'pid 812 (alice, train.py)' in the same form select.py uses for processes."""
        parts = (self.user, self.label or self.command, "stopped" if self.stopped else "",
                 "an older gpuwarden's lease" if self.legacy else "")
        what = ", ".join(x for x in parts if x)
        # (An older gpuwarden's record is believed only for a live pid: older_record_problem.)
        pid = f"pid {self.pid}" if self.pid > 0 else "a process in another PID namespace"
        return f"{pid} ({what})" if what else pid

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "schema": RECORD_SCHEMA, "kind": self.kind, "id": self.record_id, "pid": self.pid,
            "user": self.user, "host": self.host, "command": self.command, "label": self.label,
            "started_at": self.started_at, "claims": [c.to_dict() for c in self.claims],
        }
        if self.kind == "ticket":
            data.update(gpus_wanted=self.gpus_wanted, slots_per_gpu=self.slots_per_gpu,
                        slots_each=self.slots_each, min_free_bytes=self.min_free_bytes,
                        max_util_pct=self.max_util_pct, allow_shared=self.allow_shared,
                        uuids=list(self.uuids))
            if self.memory_bytes:
                data["memory_bytes"] = self.memory_bytes
        return data

    def content(self) -> dict[str, Any]:
        """What the owner writes into the file (the kernel's facts are not written)."""
        data = self.to_dict()
        for key in ("pid", "user", "started_at", "id"):
            data.pop(key, None)
        return data


OWN_NAME_FORM = re.compile(r"(?:holder|ticket)\.[0-9a-f]{32}\.json")  # what OwnedRecord names


def new_token() -> str:
    return secrets.token_hex(16)


def this_process(kind: str, label: str | None, **fields: Any) -> Record:
    """A record describing the calling process."""
    host, command = _identity(tuple(sys.argv))
    return Record(kind=kind, record_id="", pid=os.getpid(), user=_proc.user_name(os.geteuid()),
                  host=host, command=command, label=escape_untrusted(label or "", LABEL_CHARS),
                  born_ns=time.time_ns(), uid=os.geteuid(), **fields)


@functools.lru_cache(maxsize=8)
def _identity(argv: tuple[str, ...]) -> tuple[str, str]:
    words = [os.path.basename(argv[0]), *argv[1:]] if argv and argv[0] else []
    command = short_command(words, width=COMMAND_CHARS) if words else sys.executable
    return (escape_untrusted(socket.gethostname(), 120),
            escape_untrusted(command, COMMAND_CHARS))


def record_name(kind: str, token: str) -> str:
    return f"{HOLDER_PREFIX if kind == 'holder' else TICKET_PREFIX}{token}{RECORD_SUFFIX}"


# -- this process's own records -------------------------------------------------------------------

_own_lock = threading.Lock()
_own: dict[str, dict[str, Record]] = {}  # directory -> file name -> record
# Names this process is creating (from before the file exists until it is in _own): a scan in
# another thread of this process must not open one either (see Scanner._check_unless_ours).
_creating: dict[str, set[str]] = {}


@contextlib.contextmanager
def _being_made(directory: str, name: str) -> Iterator[None]:
    """The name is known as ours from before its file exists until the block ends (by then it
    is in _own, or gone)."""
    with _own_lock:
        _creating.setdefault(directory, set()).add(name)
    try:
        yield
    finally:
        with _own_lock:
            _creating.get(directory, set()).discard(name)


class OwnedRecord:
    """A record file this process made and holds the write lock on.

    The name is fresh and random, created ``O_EXCL`` (retried on the improbable collision),
    so no other user can occupy it first; the file is locked before anything is written. A
    scan in this process never opens it (closing any descriptor of a file would drop this
    process's lock on it): it is known here, and while it is being made its name is too.
    """

    def __init__(self, directory: Path, record: Record) -> None:
        self.directory = directory
        self.fd: int | None = None
        for _ in range(16):
            token = new_token()
            path = directory / record_name(record.kind, token)
            with _being_made(str(directory), path.name):
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                                 | os.O_NOFOLLOW, _fs.RECORD_MODE)
                except FileExistsError:
                    continue
                self._fill(fd, path, token, record)
                return
        raise OSError(errno.EEXIST, "no free record name after 16 tries", str(directory))

    def _fill(self, fd: int, path: Path, token: str, record: Record) -> None:
        """Lock the new file, write the record, and make it known as ours; on any failure the
        file is deleted and closed."""
        try:
            os.fchmod(fd, _fs.RECORD_MODE)  # readable by `gpuwarden leases` of every user
            if not _locks._set_lock(fd, fcntl.F_WRLCK, 0, 0):  # a fresh file: nobody holds it
                raise OSError(errno.EAGAIN, "cannot lock a new record", str(path))
            # And a flock, with the fields an older gpuwarden reads (id, pid, user, start):
            # a version that checks flocks sees this lease live and keeps off its slots, and
            # does not delete the record as stale. This version believes none of those fields.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            legacy = {"id": token, "pid": os.getpid(), "user": record.user,
                      "started_at": time.time()}
            os.write(fd, json.dumps({**record.content(), **legacy}).encode())
            st = os.fstat(fd)
            # A ticket's place in line is its birth time; a holder's start, for display, its
            # ctime.
            born = _fs.birth_ns(fd, st) if record.kind == "ticket" else st.st_ctime_ns
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)
            raise
        self.fd = fd
        self.path = path
        self.record = replace(record, record_id=token, born_ns=born, ino=st.st_ino, path=path)
        with _own_lock:
            _own.setdefault(str(self.directory), {})[path.name] = self.record
        _fs.track(self)

    def remove(self) -> None:
        """Delete the file, then drop the lock (a reader never sees it unlocked but present)."""
        if self.fd is None:
            return
        # A random name of ours, in a directory where only its owner (and root) may delete or
        # replace it: the name is ours to delete.
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with _own_lock:
            _own.get(str(self.directory), {}).pop(self.path.name, None)
        with contextlib.suppress(OSError):
            os.close(self.fd)  # drops the lock; a watcher sees IN_DELETE, then the close
        self.fd = None
        _fs.untrack(self)

    def _close_in_child(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)  # the child holds no POSIX lock: closing drops nothing
            self.fd = None


@contextlib.contextmanager
def own_names(directory: str) -> Iterator[tuple[dict[str, Record], set[str]]]:
    """This process's own records in ``directory`` (file name -> record) and the names it is
    making there, held still for the block: no thread of this process makes a record in it
    meanwhile (a scan that opened and closed one would drop that thread's lock)."""
    with _own_lock:
        yield _own.get(directory, {}), _creating.get(directory, set())


def _reset_own_in_child() -> None:
    global _own_lock
    _own_lock = threading.Lock()
    _own.clear()
    _creating.clear()


os.register_at_fork(after_in_child=_reset_own_in_child)



def parse_record_bytes(raw: bytes, name: str) -> Record:
    """A record from its file's bytes: bounded, every field checked, unknown fields ignored,
    strings escaped. ValueError/KeyError/TypeError/RecursionError when it is not a record."""
    if len(raw) > MAX_RECORD_BYTES:
        raise ValueError(f"more than a record's {MAX_RECORD_BYTES} bytes")
    if not raw:
        raise ValueError("empty")
    # More brackets than any record has: refused before the parser sees it (two C counts).
    if raw.count(b"[") + raw.count(b"{") > MAX_BRACKETS:
        raise ValueError("JSON nested too deeply for a record (or too many brackets)")
    try:
        data = json.loads(raw)  # the C parser: no loop over bytes here, nesting bounded by it
    except RecursionError:
        raise ValueError("JSON nested too deeply for a record") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    kind = "holder" if name.startswith(HOLDER_PREFIX) else "ticket"
    if data.get("kind") != kind:
        raise ValueError(f"kind {escape_untrusted(str(data.get('kind')), 40)!r} under a "
                         f"{kind} name")
    raw_claims = data.get("claims", [])
    if not isinstance(raw_claims, list) or len(raw_claims) > MAX_CLAIMS:
        raise ValueError(f"claims: not a list of at most {MAX_CLAIMS} entries")
    claims = tuple(
        SlotClaim(uuid=_text(c["uuid"], 120), index=_int(c["index"], 0, 1 << 16),
                  slots_per_gpu=_int(c["slots_per_gpu"], 1, 1 << 16),
                  slots=tuple(_int(s, 0, 1 << 16) for s in _list(c["slots"])),
                  memory_bytes=_int(c.get("memory_bytes", 0), 0, 1 << 62))
        for c in raw_claims
    )
    util = data.get("max_util_pct")
    token = name[len(HOLDER_PREFIX if kind == "holder" else TICKET_PREFIX):-len(RECORD_SUFFIX)]
    claimed_pid = data.get("pid")
    return Record(
        kind=kind, record_id=escape_untrusted(token, 64),
        # What the file says: shown only for an older gpuwarden's record, never believed.
        pid=claimed_pid if isinstance(claimed_pid, int) and 0 < claimed_pid < 1 << 31 else -1,
        user="",
        host=_text(data.get("host", ""), 120), command=_text(data.get("command", ""),
                                                             COMMAND_CHARS),
        label=_text(data.get("label", ""), LABEL_CHARS), born_ns=0, claims=claims,
        gpus_wanted=_int(data.get("gpus_wanted", 0), 0, 1 << 16),
        slots_per_gpu=_int(data.get("slots_per_gpu", 1), 1, 1 << 16),
        slots_each=_int(data.get("slots_each", 1), 1, 1 << 16),
        min_free_bytes=_int(data.get("min_free_bytes", 0), 0, 1 << 62),
        max_util_pct=None if util is None else _int(util, 0, 101),
        allow_shared=data.get("allow_shared") is True,
        uuids=tuple(_text(u, 120) for u in _list(data.get("uuids", []))),
        memory_bytes=_int(data.get("memory_bytes", 0), 0, 1 << 62),
        schema=_int(data.get("schema", 1), 0, 1 << 16),
    )


def _int(value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise ValueError(f"{escape_untrusted(repr(value), 40)} is not an integer in "
                         f"[{low}, {high})")
    return value


def _text(value: Any, limit: int) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{escape_untrusted(repr(value), 40)} is not a string")
    return escape_untrusted(value, limit)


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list) or len(value) > MAX_CLAIMS:
        raise ValueError(f"not a list of at most {MAX_CLAIMS} entries")
    return value


def iter_holders(records: list[Record]) -> Iterator[Record]:
    """The holder records among ``records``."""
    return (r for r in records if r.kind == "holder")

