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

Reading is bounded per scan (:class:`Scanner`): at most :data:`MAX_NAMES` directory entries,
:data:`CHECKS_PER_USER` record files opened per user (the oldest first) of which at most
:data:`RECORDS_PER_USER` are kept, :data:`MAX_RECORD_BYTES` per record (parsed once per
inode and remembered), and :data:`SCAN_BUDGET_S` of time. What one user plants costs that
user's records their place, not anyone else's. Strings are escaped when parsed.
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
MAX_NAMES = 200_000  # directory entries looked at in one scan
CHECKS_PER_USER = 128  # record files of one user opened in one scan (oldest first)
RECORDS_PER_USER = 64  # live records of one user kept in one scan
MAX_CHECKS = 4096  # record files opened in one scan, every user together
SCAN_BUDGET_S = 0.25  # a scan stops here and says it saw only part of the directory
# ...but not before it looked at (lstat) and opened this many records: a small directory is
# always read whole, so a pause of the scanning process (a loaded box, a GC) never hides an
# earlier request from it.
MIN_CHECKS = 64
NEW_NAMES_PER_SCAN = 2048  # record names seen for the first time that one scan looks at
STALE_AGE_S = 0.0  # our own unlocked record this old is deleted by a scan (under the mutex)
MAX_CORRUPT = 64  # unreadable records listed by one scan
# The format before issue 25 (schema 1: a flock, no record lock, the pid only what the file
# says) is honoured by gpuwarden 0.1.x, during an upgrade, and only while the process it
# names is verifiably the one that wrote it (:func:`older_record_problem`); 0.2.0 drops it
# (docs/leases.md, "Upgrading"; tests/test_lease.py holds the version to that).
OLDER_FORMAT_DROPPED_IN = (0, 2)
# A process's start (10 ms ticks) and a file's birth come from two clocks: a process that
# started up to this long after the record it wrote is still its writer.
START_SLACK_NS = 1_000_000_000


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


_OWN_FORM = re.compile(r"(?:holder|ticket)\.[0-9a-f]{32}\.json")  # what OwnedRecord names


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


def _reset_own_in_child() -> None:
    global _own_lock
    _own_lock = threading.Lock()
    _own.clear()
    _creating.clear()


os.register_at_fork(after_in_child=_reset_own_in_child)


# -- reading the directory --------------------------------------------------------------------------

@dataclass(frozen=True)
class Corrupt:
    """A record file that is not believed (shown by `gpuwarden leases`, else ignored)."""

    path: Path
    problem: str


@dataclass
class ScanResult:
    records: list[Record]
    corrupt: list[Corrupt]
    gpu_files: list[str]  # names of GPU lock files seen (listing only)
    complete: bool = True  # False: the name or time budget ended the scan early
    left_out: dict[int, int] = field(default_factory=dict)  # uid -> records not read (caps)

    def holders(self) -> list[Record]:
        return [r for r in self.records if r.kind == "holder"]

    def tickets(self) -> list[Record]:
        return sorted((r for r in self.records if r.kind == "ticket"), key=Record.order)


@dataclass
class _Known:
    """What one scan learnt of a record file, kept while its name names the same inode."""

    ino: int
    uid: int
    mtime_ns: int  # lstat's: order among a user's files before one is opened
    size: int = -1
    born_ns: int = 0
    parsed: Record | None = None
    problem: str = ""


_known_lock = threading.Lock()
_known_by_dir: dict[str, dict[str, _Known]] = {}  # what this process learnt, per directory
_entries_by_dir: dict[str, int] = {}  # how many names the last scan of a directory saw


def entries_seen(directory: Path) -> int:
    """How many names the last scan of ``directory`` in this process saw (0: none yet)."""
    return _entries_by_dir.get(str(directory), 0)


class Scanner:
    """Reads one lease directory's records, remembering (for the process) what does not
    change: a record file's owner and content, per inode."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._key = str(directory)

    @property
    def _known(self) -> dict[str, _Known]:
        with _known_lock:
            return _known_by_dir.get(self._key, {})

    @_known.setter
    def _known(self, value: dict[str, _Known]) -> None:
        with _known_lock:
            _known_by_dir[self._key] = value

    def scan(self, *, cleanup: bool = False, budget_s: float = SCAN_BUDGET_S,
             want_gpu_files: bool = False) -> ScanResult:
        started = time.monotonic()
        deadline = started + budget_s
        result = ScanResult([], [], [])
        with _own_lock:
            own = dict(_own.get(str(self.directory), {}))
        candidates: list[tuple[str, int, os.DirEntry[str]]] = []
        seen = 0
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    seen += 1
                    if seen > MAX_NAMES:
                        result.complete = False
                        break
                    name = entry.name
                    if name.endswith(RECORD_SUFFIX) and name.startswith((HOLDER_PREFIX,
                                                                         TICKET_PREFIX)):
                        if name in own:
                            result.records.append(own[name])
                        else:
                            candidates.append((name, entry.inode(), entry))
                    elif want_gpu_files and name.startswith("gpu.") and name.endswith(".lock") \
                            and len(result.gpu_files) < 4096:
                        result.gpu_files.append(name)
                    if not seen & 1023 and time.monotonic() > deadline:
                        result.complete = False
                        break
        except OSError:
            return result
        _entries_by_dir[self._key] = seen
        # What we know of each candidate (uid, age) without opening it: lstat, once per inode,
        # at most NEW_NAMES_PER_SCAN new ones per scan (the rest in the next scans). Names of
        # the form this version writes come first: a flood of other names waits behind them.
        candidates.sort(key=lambda c: _OWN_FORM.fullmatch(c[0]) is None)
        known_now: dict[str, _Known] = {}
        previous = self._known
        new_left = NEW_NAMES_PER_SCAN
        for name, ino, entry in candidates:
            known = previous.get(name)
            if known is None or known.ino != ino:
                looked = NEW_NAMES_PER_SCAN - new_left  # the clock is read every 64, from 64 on
                if new_left <= 0 or (looked >= MIN_CHECKS and not looked % MIN_CHECKS
                                     and time.monotonic() > deadline):
                    result.complete = False
                    continue
                new_left -= 1
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                known = _Known(st.st_ino, st.st_uid, st.st_mtime_ns)
            known_now[name] = known
        self._known = known_now  # names gone from the directory are forgotten
        # Per user, oldest first, the users taken in turn (every user's oldest record, then
        # every user's second...): a user's flood of records costs that user's places only,
        # and a scan cut short by its budget has still seen each user's earliest requests.
        by_user = sorted(known_now.items(), key=lambda kv: (kv[1].uid, kv[1].born_ns
                                                            or kv[1].mtime_ns, kv[0]))
        turn: dict[int, int] = {}
        places = []
        for name, known in by_user:
            turn[known.uid] = turn.get(known.uid, -1) + 1
            places.append((turn[known.uid], known.born_ns or known.mtime_ns, name, known))
        order = [(name, known) for _i, _born, name, known in sorted(places, key=lambda p: p[:3])]
        checks: dict[int, int] = {}
        kept: dict[int, int] = {}
        opened = 0
        for name, known in order:
            uid = known.uid
            out_of_time = opened >= MIN_CHECKS and time.monotonic() > deadline
            if checks.get(uid, 0) >= CHECKS_PER_USER or kept.get(uid, 0) >= RECORDS_PER_USER \
                    or opened >= MAX_CHECKS or out_of_time:
                result.left_out[uid] = result.left_out.get(uid, 0) + 1
                if opened >= MAX_CHECKS or out_of_time:
                    result.complete = False
                continue
            checks[uid] = checks.get(uid, 0) + 1
            opened += 1
            record = self._check_unless_ours(name, known, result, cleanup)
            if record is not None:
                kept[uid] = kept.get(uid, 0) + 1
                result.records.append(record)
        return result

    def _check_unless_ours(self, name: str, known: _Known, result: ScanResult, cleanup: bool
                           ) -> Record | None:
        """:meth:`_check`, unless another thread of this process made (or is making) the
        record since the scan began: opening it here, then closing, would drop that thread's
        lock, and every other process would take its live request or lease for a dead one.
        Held across the check, the lock keeps such a record from being born meanwhile."""
        with _own_lock:
            directory = str(self.directory)
            ours = _own.get(directory, {}).get(name)
            if ours is not None:
                return ours
            if name in _creating.get(directory, ()):
                return None
            return self._check(name, known, result, cleanup)

    def _check(self, name: str, known: _Known, result: ScanResult, cleanup: bool
               ) -> Record | None:
        """Open one record file: its lock (alive, and whose), and its content (parsed once)."""
        path = self.directory / name
        try:
            fd = _fs.open_regular(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._corrupt(result, path, getattr(exc, "problem", None) or exc.strerror or str(exc))
            return None
        try:
            st = os.fstat(fd)
            if st.st_ino != known.ino:  # replaced since it was listed: next scan
                return None
            owner = _locks.test_lock(fd, 0, 0)
            legacy = owner is None and _flocked(fd)
            if owner is None and not legacy:  # nobody holds it: its owner is gone
                if cleanup and st.st_uid == os.geteuid() \
                        and time.time() - st.st_mtime > STALE_AGE_S:
                    _remove_if_stale(path, fd)
                return None
            if legacy:  # an older gpuwarden's live record: only its claims matter
                owner = _locks.LockOwner(-1, True, 0, 0)
            assert owner is not None
            if not legacy and (not owner.write or owner.pid < 0 or owner.start != 0
                               or owner.length != 0):
                self._corrupt(result, path, "locked, but not the way a record's owner locks it "
                              f"(held by {_locks.describe_owner(owner)})")
                return None
            if (known.size, known.mtime_ns) != (st.st_size, st.st_mtime_ns):
                known.parsed, known.problem = None, ""  # rewritten in place: read it again
            if known.parsed is None and not known.problem:
                if not known.born_ns:
                    known.born_ns = _fs.birth_ns(fd, st)
                try:
                    known.parsed = parse_record_bytes(os.pread(fd, MAX_RECORD_BYTES + 1, 0),
                                                      name)
                    known.size, known.mtime_ns = st.st_size, st.st_mtime_ns
                except (ValueError, KeyError, TypeError, RecursionError) as exc:
                    problem = escape_untrusted(f"{type(exc).__name__}: {exc}", 200)
                    # Records are written under the mutex: a scan under it (cleanup) never sees
                    # one half written; another may, for a moment after its birth.
                    if cleanup or time.time() - st.st_mtime > 1.0:
                        known.problem = problem  # settled: remembered for this inode
                        known.size, known.mtime_ns = st.st_size, st.st_mtime_ns
                    else:  # perhaps being written: shown now, read again next scan
                        self._corrupt(result, path, problem)
                        return None
        except OSError:
            return None
        finally:
            os.close(fd)  # our own records are never opened here: closing drops nothing of ours
        if known.problem:
            self._corrupt(result, path, known.problem)
            return None
        assert known.parsed is not None
        if legacy:
            # Only a record an older version wrote is kept alive by a flock: any user who can
            # read a dead record of this version can flock it, and must not revive it.
            if known.parsed.kind != "holder" or known.parsed.schema >= RECORD_SCHEMA:
                return None  # a dead record, or an older version's waiting request (unordered)
            # Nor does a flock make an older record's pid true: anyone can write one and
            # flock it. Believed only when the kernel agrees the process could be its writer.
            problem = older_record_problem(known.parsed.pid, st.st_uid, known.born_ns)
            if problem:
                self._corrupt(result, path, problem)
                return None
            return replace(known.parsed, pid=known.parsed.pid, uid=st.st_uid, legacy=True,
                           user=_proc.user_name(st.st_uid), born_ns=st.st_mtime_ns,
                           ino=st.st_ino, path=path)
        return replace(known.parsed, pid=owner.pid, uid=st.st_uid,
                       user=_proc.user_name(st.st_uid), born_ns=known.born_ns, ino=st.st_ino,
                       path=path)

    @staticmethod
    def _corrupt(result: ScanResult, path: Path, problem: str) -> None:
        if len(result.corrupt) < MAX_CORRUPT:
            result.corrupt.append(Corrupt(path, problem))


def older_record_problem(pid: int, owner_uid: int, born_ns: int) -> str:
    """Why a flock-held record of the older format is not an older gpuwarden's lease, or ''.

    That version kept a flock on its record and wrote its own pid into it: so the pid must
    name a live process of the record file's owner (the kernel's word, from /proc), started
    no later than the file was born (a pid reused since names another process). Anything
    else is forged, or a dead writer's record kept alive by someone else's flock."""
    owner = _proc.user_name(owner_uid)
    if pid <= 0:
        return f"forged: an older gpuwarden's record of {owner} that names no pid"
    uid = _proc.process_uid(pid)
    started = _proc.process_start_ns(pid)
    if uid is None or started is None:
        return (f"forged or stale: an older gpuwarden's record of {owner} claims pid {pid}, "
                "which is not running (someone else holds its flock)")
    if uid != owner_uid:
        return (f"forged: an older gpuwarden's record of {owner} claims pid {pid}, a process "
                f"of {_proc.user_name(uid)}, not of the record's owner")
    if born_ns and started > born_ns + START_SLACK_NS:
        return (f"forged or stale: an older gpuwarden's record of {owner} claims pid {pid}, "
                "which started after the record was written (its writer is gone)")
    return ""


def _flocked(fd: int) -> bool:
    """Whether some process holds an exclusive flock on the file (an older gpuwarden)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _remove_if_stale(path: Path, fd: int) -> None:
    """Delete our own record whose lock nobody holds (its process died)."""
    if _fs.same_file(fd, path) and _locks.test_lock(fd, 0, 0) is None and not _flocked(fd):
        with contextlib.suppress(OSError):
            os.unlink(path)


def scan(directory: Path, *, cleanup: bool = False) -> ScanResult:
    """One bounded scan of ``directory`` (see :class:`Scanner`)."""
    return Scanner(directory).scan(cleanup=cleanup, want_gpu_files=True)


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

