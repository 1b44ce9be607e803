"""Reading a lease directory's records with bounded work (:class:`Scanner`), believing the
kernel only: alive when ``F_GETLK`` finds the owner's write lock, the user is the file's owner,
a ticket's place its birth time.

Bounded per scan: at most :data:`MAX_NAMES` directory entries, :data:`CHECKS_PER_USER` record
files opened per user (the oldest first) of which at most :data:`RECORDS_PER_USER` are kept,
:data:`~.records.MAX_RECORD_BYTES` per record (parsed once per inode and remembered), and
:data:`SCAN_BUDGET_S` of time. What one user plants costs that user's records their place, not
anyone else's. The records themselves (their fields, this process's own) are ``records.py``'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpuwarden.lease import _fs, _locks, _proc
from gpuwarden.lease.records import (
    HOLDER_PREFIX,
    MAX_RECORD_BYTES,
    OWN_NAME_FORM,
    RECORD_SCHEMA,
    RECORD_SUFFIX,
    TICKET_PREFIX,
    Record,
    own_names,
    parse_record_bytes,
)
from gpuwarden.safetext import escape_untrusted

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
        with own_names(str(self.directory)) as (mine, _making):
            own = dict(mine)
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
        candidates.sort(key=lambda c: OWN_NAME_FORM.fullmatch(c[0]) is None)
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
        with own_names(str(self.directory)) as (mine, making):
            ours = mine.get(name)
            if ours is not None:
                return ours
            if name in making:
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
