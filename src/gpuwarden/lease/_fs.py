"""The lease directory and the kernel locks in it: the only module that touches them.

Every claim is an ``flock(2)`` lock on a file of the lease directory. The kernel
holds such a lock for the open file description, so whatever way the holder dies
(SIGKILL, OOM killer, segfault) the lock goes when its last descriptor closes, with
no cleanup step. ``flock`` (rather than ``fcntl``/POSIX record locks) because:

- it works on a read-only descriptor, so user B can lock a file user A (or root)
  created without anyone needing write permission on another user's file;
- two descriptors of one process conflict, so a process that holds a grant and asks
  for another one cannot be granted its own slot twice (POSIX locks would merge, and
  closing *any* descriptor of the file would silently drop them).

The directory is shared with other users, so every name in it is hostile until checked
(docs/leases.md, "Trust model"): files are opened ``O_NOFOLLOW | O_NONBLOCK`` and
``fstat``-ed before use (a symlink, a FIFO or a device is never followed, waited on or
locked), the directory and its parents are checked for owner and mode before use, no
directory is created through a link, and every wait for a lock has a deadline.

Lock files are never deleted by gpuwarden (deleting a file someone holds a lock on,
then creating it anew, would let two processes "hold" the same path); record files
(holder and ticket JSON) are deleted by their owner.

Descriptors are opened with O_CLOEXEC, so children started with exec never inherit
a claim; children made by a bare ``fork`` close theirs at once (see
:func:`forget_in_child`), so a leaked child cannot keep a GPU leased.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import pwd
import re
import stat
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpuwarden.boundedio import kind_of
from gpuwarden.errors import LeaseDirError

LEASE_DIR_ENV = "GPUWARDEN_LEASE_DIR"
# The host's shared directory, made by `gpuwarden leases init` (root-owned lock files): /run is
# local, root's, and no tmp cleaner ages it; it is emptied at boot, when every lock dies anyway.
SHARED_LEASE_DIR = "/run/gpuwarden"
DEFAULT_LEASE_DIR = SHARED_LEASE_DIR
# Without a prepared shared directory: one per user (nobody else may create or delete in it).
PRIVATE_LEASE_DIR = "/tmp/gpuwarden-leases-{uid}"
SHARED_DIR_MODE = 0o1777  # what root gets when it creates a missing directory (sticky, shared)
PRIVATE_DIR_MODE = 0o700
FILE_MODE = 0o644  # readable by every user (flock needs only a read-only descriptor)
MUTEX_NAME = "mutex.lock"
PREPARED_NAME = "prepared.json"  # written last by `gpuwarden leases init`, owned by root
# Every open of an existing name: never follow a link, never block on a FIFO.
OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
MUTEX_TIMEOUT_S = 2.0  # the mutex is held for ~0.3 ms per attempt: 2 s means a hostile holder


class UnsafeFileError(OSError):
    """A name in the lease directory that is not a file gpuwarden may lock or read: a
    symbolic link, a FIFO, a device, a directory, or a file of the wrong owner."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(errno.EINVAL, problem, str(path))
        self.path = path
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.path} {self.problem}"


class MutexBusyError(Exception):
    """The directory mutex could not be had within the deadline."""

    def __init__(self, path: Path, holders: str, waited_s: float) -> None:
        super().__init__(f"{path} held by {holders}")
        self.path = path
        self.holders = holders
        self.waited_s = waited_s


@functools.lru_cache(maxsize=256)
def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


_user = user_name


def lease_dir_choice(env: dict[str, str] | None = None) -> tuple[Path, str | None]:
    """The lease directory to use and, when it is the per-user fallback, a warning to show.

    GPUWARDEN_LEASE_DIR when set and not empty; else /run/gpuwarden when `gpuwarden leases
    init` prepared it; else /tmp/gpuwarden-leases-<uid>, which arbitrates between this
    user's jobs only.
    """
    source = os.environ if env is None else env
    given = source.get(LEASE_DIR_ENV)
    if given:
        return Path(given), None
    shared = Path(SHARED_LEASE_DIR)
    if is_prepared(shared):
        return shared, None
    private = Path(PRIVATE_LEASE_DIR.format(uid=os.geteuid()))
    return private, (
        f"{SHARED_LEASE_DIR} is not prepared, so leases go to {private}: they keep this user's "
        "jobs apart, not other users' (an admin runs `gpuwarden leases init` once to share "
        "the GPUs between users)")


def lease_dir_path(env: dict[str, str] | None = None) -> Path:
    """The lease directory :func:`lease_dir_choice` picks (without its warning)."""
    return lease_dir_choice(env)[0]


def slot_file_name(uuid: str, slots_per_gpu: int, slot: int) -> str:
    """The lock file of one slot: ``slot.<uuid>.k<slots_per_gpu>.s<slot>.lock``."""
    # Old-style MIG ids contain '/'; nothing else in a uuid needs escaping.
    return f"slot.{escape_uuid(uuid)}.k{slots_per_gpu}.s{slot}.lock"


_SLOT_RE = re.compile(r"^slot\.(?P<uuid>.+)\.k(?P<k>\d{1,4})\.s(?P<s>\d{1,4})\.lock$")


def parse_slot_name(name: str) -> tuple[str, int, int] | None:
    """(escaped uuid, slots_per_gpu, slot) of a slot lock file name; None for other names.

    The uuid is as :func:`slot_file_name` wrote it ('/' as '_'): compare with
    :func:`escape_uuid` of a GPU's uuid."""
    match = _SLOT_RE.match(name)
    if match is None:
        return None
    return match["uuid"], int(match["k"]), int(match["s"])


def escape_uuid(uuid: str) -> str:
    return uuid.replace("/", "_")


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str, limit: int = 300) -> str:
    """``text`` safe for a terminal: control characters (escape sequences, carriage returns,
    bidi overrides) written as ``\\x1b``-style escapes, and at most ``limit`` characters."""
    if len(text) > limit:
        text = text[:limit - 1] + "…"
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


# -- the directory -------------------------------------------------------------------------------

def _trusted_owner(uid: int) -> bool:
    return uid in (0, os.geteuid())


def _loose(mode: int) -> bool:
    """Writable by group or others without the sticky bit: they could delete anyone's files."""
    return bool(mode & (stat.S_IWGRP | stat.S_IWOTH)) and not mode & stat.S_ISVTX


def _check_links(path: Path, where: str, fix_env: str) -> None:
    """Each component of ``path`` that is a symbolic link must belong to root or to us (as
    fs.protected_symlinks asks in sticky directories): a link another user planted decides
    where we would create and lock files."""
    prefix = Path(path.anchor)
    for part in path.parts[1:]:
        prefix = prefix / part
        try:
            st = os.lstat(prefix)
        except OSError:
            return  # missing: the resolution below says so
        if stat.S_ISLNK(st.st_mode) and not _trusted_owner(st.st_uid):
            raise LeaseDirError(
                f"{where}: {str(prefix)!r} is a symbolic link owned by {_user(st.st_uid)}",
                why="a link another user made decides where gpuwarden would create and lock "
                "files",
                fix=f"remove the link (as its owner or root), or {fix_env}")


def _check_parents(real: Path, where: str, fix_env: str) -> None:
    """Every parent of the directory belongs to root or us and lets no one else rename
    entries (not writable by others, or sticky): else the directory could be swapped."""
    for parent in real.parents:
        try:
            st = os.lstat(parent)
        except OSError as exc:
            raise LeaseDirError(f"{where}: its parent {str(parent)!r} cannot be read",
                                why=exc.strerror, fix=fix_env) from exc
        if not _trusted_owner(st.st_uid) or _loose(st.st_mode):
            raise LeaseDirError(
                f"{where}: its parent {str(parent)!r} is owned by {_user(st.st_uid)} with mode "
                f"{stat.S_IMODE(st.st_mode):04o}",
                why="another user could rename the lease directory and put their own in its "
                "place, and two jobs would then lock different files for the same GPU",
                fix=f"use a directory whose parents only root or you can change, or {fix_env}")


def prepare_dir(path: Path, *, create: bool = True, write: bool = True) -> Path:
    """:func:`check_dir`'s real path."""
    return check_dir(path, create=create, write=write)[0]


@dataclass
class _Checked:
    """A directory that passed :func:`check_dir`, with a descriptor kept open on it."""

    real: Path
    prepared: bool
    fd: int
    identity: tuple[int, int, int, int]  # device, inode, owner, mode
    at: float
    held: bool = False  # the shared flock of hold_dir taken


RECHECK_S = 2.0  # a process re-runs the full checks of a directory it uses this often
_checked: dict[tuple[str, bool, int], _Checked] = {}
_checked_lock = threading.Lock()


def check_dir(path: Path, *, create: bool = True, write: bool = True) -> tuple[Path, bool]:
    """:func:`_check_dir`, remembered for :data:`RECHECK_S` while the directory is the same
    inode with the same owner and mode (a lease in a loop pays for the checks once)."""
    key = (str(path), write, os.geteuid())  # a forked child may switch users
    with _checked_lock:
        known = _checked.get(key)
    if known is not None and time.monotonic() - known.at < RECHECK_S:
        try:
            if _identity(os.stat(known.real, follow_symlinks=False)) == known.identity:
                return known.real, known.prepared
        except OSError:
            pass
    real, prepared = _check_dir(path, create=create, write=write)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(fd)
    except OSError:
        return real, prepared
    with _checked_lock:
        old = _checked.get(key)
        entry = _Checked(real, prepared, fd, _identity(st), time.monotonic())
        if old is not None and same_file(old.fd, real):
            entry.fd, entry.held = old.fd, old.held  # keep the descriptor (and its flock)
            os.close(fd)
        elif old is not None:
            os.close(old.fd)
        _checked[key] = entry
    return real, prepared


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_uid, st.st_mode


def _check_dir(path: Path, *, create: bool = True, write: bool = True) -> tuple[Path, bool]:
    """Check that ``path`` is a lease directory this user can trust (and, with ``write``, use);
    create it when missing (with ``create``). Returns its real path (links resolved), and
    whether `gpuwarden leases init` prepared it (see :func:`is_prepared`).

    Raises LeaseDirError (exit 2) when the path is relative, a link loop, a link to nothing, a
    link or a parent another user controls, not a directory, owned by another user (who could
    delete every lock file in it), writable by others without the sticky bit, on a read-only
    file system, or (``write``) not writable for this user.
    """
    where = f"lease directory {str(path)!r}"
    fix_env = f"set {LEASE_DIR_ENV} to an absolute path of a directory on a local filesystem"
    if not path.is_absolute():
        raise LeaseDirError(f"{where} is a relative path",
                            why="every process that shares the GPUs must name the same "
                            "directory, whatever its working directory", fix=fix_env)
    _check_links(path, where, fix_env)
    for _ in range(3):  # a name that appears between our check and our mkdir: check again
        try:
            real = Path(os.path.realpath(path, strict=True))
        except FileNotFoundError:
            if os.path.islink(path):
                raise LeaseDirError(
                    f"{where} is a symbolic link to {os.readlink(path)!r}, which does not exist",
                    why="gpuwarden never creates a directory through a link: a link another "
                    "user made would choose where it writes",
                    fix=f"create the target directory yourself, or {fix_env}") from None
            if not create:
                raise
            created = _create_dir(path, where, fix_env)
            if created is None:
                continue
            real = created
        except OSError as exc:
            raise _path_error(where, fix_env, exc) from exc
        break
    else:
        raise LeaseDirError(f"{where} keeps changing while gpuwarden checks it", fix=fix_env)
    _check_parents(real, where, fix_env)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            raise LeaseDirError(f"{where} is not a directory",
                                fix=f"remove it, or {fix_env}") from None
        raise _path_error(where, fix_env, exc) from exc
    try:
        st = os.fstat(fd)
        readonly = bool(os.fstatvfs(fd).f_flag & os.ST_RDONLY)
        prepared = st.st_uid == 0 and _has_marker(fd)
    finally:
        os.close(fd)
    mode = stat.S_IMODE(st.st_mode)
    if not _trusted_owner(st.st_uid) and write:
        raise LeaseDirError(
            f"{where} is owned by user {_user(st.st_uid)} (mode {mode:04o})",
            why=f"{_user(st.st_uid)} could delete or replace any lock file in it, and two jobs "
            "would then hold the same GPU",
            fix="ask an admin to run `gpuwarden leases init` (a root-owned /run/gpuwarden), or "
            f"{fix_env}")
    if _loose(mode):
        raise LeaseDirError(
            f"{where} is writable by other users without the sticky bit (mode {mode:04o})",
            why="any user could delete a lock file that another job holds, and two jobs "
            "would then hold the same GPU",
            fix=f"chmod +t {real} (as its owner {_user(st.st_uid)} or root)")
    if readonly and write:
        raise LeaseDirError(f"{where} is on a read-only file system",
                            why="leases need to create lock and record files",
                            fix=f"{fix_env} (e.g. under /run or /tmp)")
    if write and not os.access(real, os.W_OK | os.X_OK):
        raise LeaseDirError(
            f"{where} is not writable by user {_user(os.geteuid())} "
            f"(owner {_user(st.st_uid)}, mode {mode:04o})",
            why="every user that leases GPUs must be able to create its record files",
            fix=f"ask an admin to run `gpuwarden leases init --dir {real}` (or chmod 1777 "
            f"{real} as {_user(st.st_uid)} or root), or {fix_env}")
    return real, prepared


def _create_dir(path: Path, where: str, fix_env: str) -> Path | None:
    """mkdir the last component (never through a link); None when a name appeared meanwhile."""
    try:
        parent = Path(os.path.realpath(path.parent, strict=True))
    except FileNotFoundError:
        raise LeaseDirError(
            f"{where} cannot be created: its parent {str(path.parent)!r} does not exist",
            fix=f"create the parent directory, or {fix_env}") from None
    except OSError as exc:
        raise _path_error(where, fix_env, exc) from exc
    _check_parents(parent / path.name, where, fix_env)
    # Root's directory is shared (sticky, like /tmp); a user's is private: nobody else may
    # trust a directory a user owns (that user could delete its lock files).
    mode = SHARED_DIR_MODE if os.geteuid() == 0 else PRIVATE_DIR_MODE
    target = parent / path.name
    try:
        os.mkdir(target, 0o700)
    except FileExistsError:
        return None
    except OSError as exc:
        raise _path_error(where, fix_env, exc, creating=True) from exc
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, mode)  # on the directory we just made, by descriptor: never another one
    finally:
        os.close(fd)
    return target


def _path_error(where: str, fix_env: str, exc: OSError, *, creating: bool = False
                ) -> LeaseDirError:
    if exc.errno == errno.ELOOP:
        return LeaseDirError(f"{where} is a symbolic link loop ({exc.filename or 'a link'} "
                             "points back to itself)", fix=f"remove the loop, or {fix_env}")
    if exc.errno == errno.EROFS:
        return LeaseDirError(f"{where} is on a read-only file system",
                             why="leases need to create lock and record files",
                             fix=f"{fix_env} (e.g. under /run or /tmp)")
    verb = "created" if creating else "read"
    return LeaseDirError(f"{where} cannot be {verb}", why=exc.strerror or str(exc), fix=fix_env)


def is_prepared(path: Path) -> bool:
    """Whether ``path`` is a directory `gpuwarden leases init` prepared: owned by root, with
    its root-owned marker file (no other user can make either)."""
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.fstat(dfd).st_uid == 0 and _has_marker(dfd)
    except OSError:
        return False
    finally:
        os.close(dfd)


def _has_marker(dfd: int) -> bool:
    try:
        fd = os.open(PREPARED_NAME, OPEN_FLAGS, dir_fd=dfd)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return stat.S_ISREG(st.st_mode) and st.st_uid == 0


def hold_dir(directory: Path) -> int:
    """A descriptor of the checked ``directory`` with a shared flock on it, or -1; not to be
    closed by the caller. Lease holders hold it because systemd-tmpfiles skips a directory
    locked that way when it ages /tmp; the process keeps it for its lifetime (one per
    directory), which costs a descriptor and keeps the cleaner away a little longer."""
    with _checked_lock:
        entry = next((e for e in _checked.values() if e.real == directory), None)
        if entry is None:
            return -1
        if not entry.held:
            try_lock(entry.fd, shared=True)  # never waits: an exclusive holder gains nothing
            entry.held = True
        return entry.fd


def same_dir(fd: int, directory: Path) -> bool:
    return fd < 0 or same_file(fd, directory)


# -- files in it ---------------------------------------------------------------------------------

def open_regular(path: Path, *, owner: int | None = None) -> int:
    """A read-only descriptor of the existing regular file ``path``; never follows a link and
    never blocks (on a FIFO). Raises FileNotFoundError, or UnsafeFileError for anything that
    is not a regular file (owned by ``owner``, when given)."""
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(path, "is a symbolic link, not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode) or (owner is not None and st.st_uid != owner):
        os.close(fd)
        if stat.S_ISREG(st.st_mode):
            problem = (f"is owned by {_user(st.st_uid)}, not by {_user(owner or 0)} who prepared "
                       "the directory")
        else:
            problem = f"is {kind_of(st.st_mode)} owned by {_user(st.st_uid)}, not a regular file"
        raise UnsafeFileError(path, problem)
    return fd


def open_lock_file(path: Path, *, create: bool = True, owner: int | None = None) -> int:
    """A read-only O_CLOEXEC descriptor of the lock file ``path``, created when missing
    (with ``create``). UnsafeFileError when the name is a link, a FIFO, or another non-file.

    An existing file is opened without O_CREAT: with fs.protected_regular (systemd's
    default) an O_CREAT open of another user's file in a sticky directory fails with
    EACCES even though the file is readable.
    """
    for _ in range(100):
        try:
            return open_regular(path, owner=owner)
        except FileNotFoundError:
            if not create:
                raise
        try:
            fd = os.open(path, OPEN_FLAGS | os.O_CREAT | os.O_EXCL, FILE_MODE)
        except FileExistsError:
            continue  # someone created it between our two opens: open theirs
        with contextlib.suppress(OSError):
            os.fchmod(fd, FILE_MODE)  # the umask may have removed read bits others need
        return fd
    raise OSError(errno.EAGAIN, f"cannot open or create {path}")


def try_lock(fd: int, *, shared: bool = False) -> bool:
    """Take the flock on ``fd`` without waiting; False when someone else holds it."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_within(fd: int, timeout_s: float) -> bool:
    """Take the exclusive flock on ``fd`` within ``timeout_s``; False when it stayed held.

    Polls (from 50 us up to 2 ms apart) rather than blocking: a blocked flock(2) cannot be
    given a deadline, and a process that holds it forever must not hang everyone."""
    if try_lock(fd):
        return True
    deadline = time.monotonic() + timeout_s
    pause = 0.00005
    while time.monotonic() < deadline:
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        if try_lock(fd):
            return True
        pause = min(pause * 2, 0.002)
    return False


def unlock_close(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    with contextlib.suppress(OSError):
        os.close(fd)


def same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (it was not deleted or replaced)."""
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


@contextlib.contextmanager
def dir_mutex(directory: Path, timeout_s: float = MUTEX_TIMEOUT_S, *,
              owner: int | None = None, create: bool = True) -> Iterator[None]:
    """The lease directory's mutex: held for the fraction of a millisecond of one attempt.

    Every decision that reads lock state and then takes locks runs under it, which
    makes "pick the GPUs and claim them" one atomic step across processes. A holder
    that dies inside it releases it like any other flock. Raises MutexBusyError, naming
    who holds it, when it cannot be had within ``timeout_s``.
    """
    path = directory / MUTEX_NAME
    deadline = time.monotonic() + timeout_s
    for _ in range(3):
        fd = open_lock_file(path, owner=owner, create=create)
        if not lock_within(fd, max(0.0, deadline - time.monotonic())):
            holders = describe_holders(fd)
            unlock_close(fd)
            raise MutexBusyError(path, holders, timeout_s)
        if same_file(fd, path):
            break
        unlock_close(fd)  # deleted and replaced (an unprepared directory): lock the new one
    try:
        yield
    finally:
        unlock_close(fd)


def probe_record_alive(path: Path) -> bool | None:
    """Whether the process that wrote the record ``path`` still holds its flock.

    True: its owner holds it (alive). False: nobody does (the owner died or released), or
    the name is not a regular file. None: the file is gone. The probe takes a shared lock
    for microseconds; owners hold an exclusive one, so a probe never disturbs a live owner.
    """
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    try:
        got = try_lock(fd, shared=True)
    finally:
        unlock_close(fd)
    return not got


# -- who holds a lock: the kernel's table ---------------------------------------------------------

def flock_table() -> dict[int, set[int]] | None:
    """inode number -> pids holding an exclusive flock on it, from /proc/locks; None when it
    cannot be read (no procfs).

    The kernel writes the pid of the process that took each lock, translated to our PID
    namespace. Inode numbers only, not devices: overlayfs reports other device numbers to
    stat(2) than /proc/locks shows; a match must also agree on the pid, so a stray inode
    collision cannot make a forged record pass.
    """
    data = _read_proc("/proc/locks")
    if data is None:
        return None
    table: dict[int, set[int]] = {}
    for line in data.splitlines():
        parts = line.split()
        # "12: FLOCK  ADVISORY  WRITE 4242 00:1f:123456 0 EOF"; "12: -> FLOCK ..." is a waiter.
        if len(parts) < 6 or parts[1] != b"FLOCK" or parts[3] != b"WRITE":
            continue
        try:
            table.setdefault(int(parts[5].rsplit(b":", 1)[1]), set()).add(int(parts[4]))
        except (ValueError, IndexError):
            continue
    return table


def _read_proc(path: str, limit: int = 1 << 24) -> bytes | None:
    """A /proc file (size 0 to stat) in 64 KiB reads: reading it whole at once makes Python
    allocate a large buffer per call, which costs more than the kernel's work."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    chunks: list[bytes] = []
    size = 0
    try:
        while size < limit:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks)


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` from /proc (``T``/``t``: stopped), None when unknown."""
    data = _read_proc(f"/proc/{pid}/stat", limit=1)
    try:
        return None if data is None else data[data.rindex(b")") + 2:][:1].decode()
    except ValueError:
        return None


_states: dict[int, tuple[float, bool]] = {}


def is_stopped(pid: int, max_age_s: float = 0.0) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, Ctrl-Z, a debugger); with ``max_age_s``, an answer
    read that recently may be reused (for display: a waiter retries many times a second)."""
    if max_age_s:
        known = _states.get(pid)
        if known is not None and time.monotonic() - known[0] < max_age_s:
            return known[1]
    stopped = process_state(pid) in ("T", "t")
    if len(_states) > 4096:
        _states.clear()
    _states[pid] = (time.monotonic(), stopped)
    return stopped


@dataclass(frozen=True)
class ProcessFacts:
    """What the kernel says about a process (never what a record claims)."""

    pid: int
    user: str
    command: str
    stopped: bool

    def describe(self) -> str:
        what = ", ".join(x for x in (self.user, self.command, "stopped" if self.stopped else "")
                         if x)
        return f"pid {self.pid} ({what})" if what else f"pid {self.pid}"


def process_facts(pid: int) -> ProcessFacts:
    user = command = ""
    with contextlib.suppress(OSError):
        user = _user(os.stat(f"/proc/{pid}").st_uid)
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(4096).split(b"\0")
        command = printable(" ".join(a.decode(errors="replace") for a in argv if a), 80)
    return ProcessFacts(pid, user, command, is_stopped(pid))


def describe_holders(fd: int) -> str:
    """'pid 4242 (mallory, sleep 1000, stopped)' for whoever holds the flock on ``fd``."""
    table = flock_table()
    try:
        ino = os.fstat(fd).st_ino
    except OSError:
        ino = -1
    pids = sorted((table or {}).get(ino, ()))
    if not pids:
        return "a process /proc/locks does not show (another PID namespace?)" if table is not None \
            else "an unknown process (/proc/locks cannot be read)"
    return "; ".join(process_facts(pid).describe() for pid in pids)


class _Closable(Protocol):
    def _close_in_child(self) -> None: ...


_live: weakref.WeakSet[_Closable] = weakref.WeakSet()
_live_lock = threading.Lock()


def track(holder: _Closable) -> None:
    with _live_lock:
        _live.add(holder)


def untrack(holder: _Closable) -> None:
    with _live_lock:
        _live.discard(holder)


def forget_in_child() -> None:
    """After a bare fork: close the child's copies of every claim's descriptors.

    Closing (never unlocking: LOCK_UN would release the parent's lock too) drops the
    child's reference, so the claim lives exactly as long as the process that took it.
    """
    global _checked_lock
    for holder in list(_live):
        holder._close_in_child()
    _live.clear()
    _checked_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=forget_in_child)
