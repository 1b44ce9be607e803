"""The lease directory: where it is, whether it can be trusted, and the birth time of the
files in it. The locks themselves are in ``_locks.py``, the records in ``records.py`` (read by ``scan.py``), what
the kernel says about the processes named in them in ``_proc.py``.

The directory is shared with other users, so every name in it is hostile until checked
(docs/leases.md, "Trust model"): files are opened ``O_NOFOLLOW | O_NONBLOCK`` and
``fstat``-ed before use (a symlink, a FIFO or a device is never followed, waited on or
locked), the directory and its parents are checked for owner and mode before use, and no
directory is created through a link. A directory gpuwarden creates is private (0700) to
the user who creates it, root included; a shared one is made by `gpuwarden leases init`.

Every string taken from another process (a command line, a record) passes through
:func:`gpuwarden.safetext.escape_untrusted` before it is shown.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import json
import os
import stat
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpuwarden.errors import LeaseDirError
from gpuwarden.lease._locks import (
    UnsafeFileError,
    check_regular,
    open_no_link,
)
from gpuwarden.lease._locks import _names as _same_inode
from gpuwarden.lease._proc import user_name
from gpuwarden.safetext import escape_untrusted

__all__ = ["UnsafeFileError"]

LEASE_DIR_ENV = "GPUWARDEN_LEASE_DIR"
# The host's shared directory, made by `gpuwarden leases init` (root-owned lock files): /run is
# local, root's, and no tmp cleaner ages it; it is emptied at boot, when every lock dies anyway.
SHARED_LEASE_DIR = "/run/gpuwarden"
DEFAULT_LEASE_DIR = SHARED_LEASE_DIR
# Without a prepared shared directory: one per user (nobody else may create or delete in it).
PRIVATE_LEASE_DIR = "/tmp/gpuwarden-leases-{uid}"
# When another user planted the name first: the next of these that is ours (or free) instead.
PRIVATE_DIR_ALTERNATES = 8
PRIVATE_DIR_MODE = 0o700
RECORD_MODE = 0o644  # records are readable by every user of the directory (for `leases`)
MUTEX_NAME = "mutex.lock"
PREPARED_NAME = "prepared.json"  # written last by `gpuwarden leases init`, owned by root
# The layout `leases init` writes: 2 = one lock file per GPU, a byte per slot (record locks).
PREPARED_SCHEMA = 2
MAX_PREPARED_BYTES = 1 << 20
# Every open of an existing name we only read: never follow a link, never block on a FIFO.
OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
# A request without --wait: how long it waits for the directory mutex, which an attempt holds
# for under a millisecond (a longer hold is a stopped or hostile holder, named in the answer).
MUTEX_TIMEOUT_S = 0.5




def lease_dir_choice(env: dict[str, str] | None = None) -> tuple[Path, str | None]:
    """The lease directory to use and, when it is the per-user fallback, a warning to show.

    GPUWARDEN_LEASE_DIR when set and not empty; else /run/gpuwarden when `gpuwarden leases
    init` prepared it; else this user's private directory (see :func:`private_dir`), which
    arbitrates between this user's jobs only.
    """
    source = os.environ if env is None else env
    given = source.get(LEASE_DIR_ENV)
    if given:
        return Path(given), None
    shared = Path(SHARED_LEASE_DIR)
    if is_prepared(shared):
        return shared, None
    private = private_dir()
    return private, (
        f"{SHARED_LEASE_DIR} is not prepared, so leases go to {private}: they keep this user's "
        "jobs apart, not other users' (an admin runs `gpuwarden leases init` once to share "
        "the GPUs between users)")


def private_dir(uid: int | None = None) -> Path:
    """This user's own fallback directory: ``/tmp/gpuwarden-leases-<uid>``, or, when another
    user planted that name first, the first of ``...-<uid>.1`` .. ``.7`` that is ours, else the
    first that is free. Every process of the user makes the same choice: one of ours is
    preferred to a free one, and another user can neither delete nor rename ours.

    A directory of ours with another mode (an older gpuwarden made root's 1777) is made
    private again here.
    """
    uid = os.geteuid() if uid is None else uid
    base = PRIVATE_LEASE_DIR.format(uid=uid)
    names = [Path(base)] + [Path(f"{base}.{n}") for n in range(1, PRIVATE_DIR_ALTERNATES)]
    free = None
    for path in names:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            free = free or path
            continue
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
            if stat.S_IMODE(st.st_mode) != PRIVATE_DIR_MODE and uid == os.geteuid():
                _make_private(path, st)
            return path
    return free or names[0]  # all planted: the checks of check_dir name the planter


def _make_private(path: Path, seen: os.stat_result) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino, st.st_uid) == (seen.st_dev, seen.st_ino, seen.st_uid):
            os.fchmod(fd, PRIVATE_DIR_MODE)  # by descriptor: never another directory
    except OSError:
        pass
    finally:
        os.close(fd)


def lease_dir_path(env: dict[str, str] | None = None) -> Path:
    """The lease directory :func:`lease_dir_choice` picks (without its warning)."""
    return lease_dir_choice(env)[0]


def gpu_file_name(uuid: str) -> str:
    """The lock file of one GPU (every slot of every split is a byte of it)."""
    # Old-style MIG ids contain '/'; nothing else in a uuid needs escaping.
    return f"gpu.{escape_uuid(uuid)}.lock"


@functools.lru_cache(maxsize=1024)
def gpu_path(directory: Path, uuid: str) -> Path:
    return directory / gpu_file_name(uuid)


def escape_uuid(uuid: str) -> str:
    return uuid.replace("/", "_")


def printable(text: str, limit: int = 300) -> str:
    """``text`` safe for a terminal, at most ``limit`` characters (see safetext)."""
    return escape_untrusted(text, limit)


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
                f"{where}: {str(prefix)!r} is a symbolic link owned by {user_name(st.st_uid)}",
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
                f"{where}: its parent {str(parent)!r} is owned by {user_name(st.st_uid)} with mode "
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


def is_private(real: Path) -> bool:
    """Whether the checked directory ``real`` is this user's own, writable by nobody else (from
    what :func:`check_dir` saw: no system call)."""
    with _checked_lock:
        entry = next((e for e in _checked.values() if e.real == real), None)
    if entry is None:
        return False
    _dev, _ino, uid, mode = entry.identity
    return uid == os.geteuid() and not mode & (stat.S_IWGRP | stat.S_IWOTH)


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
            f"{where} is owned by user {user_name(st.st_uid)} (mode {mode:04o})",
            why=f"{user_name(st.st_uid)} could delete or replace any lock file in it, and two jobs "
            "would then hold the same GPU",
            fix="ask an admin to run `gpuwarden leases init` (a root-owned /run/gpuwarden), or "
            f"{fix_env}")
    if _loose(mode):
        raise LeaseDirError(
            f"{where} is writable by other users without the sticky bit (mode {mode:04o})",
            why="any user could delete a lock file that another job holds, and two jobs "
            "would then hold the same GPU",
            fix=f"chmod +t {real} (as its owner {user_name(st.st_uid)} or root)")
    if readonly and write:
        raise LeaseDirError(f"{where} is on a read-only file system",
                            why="leases need to create lock and record files",
                            fix=f"{fix_env} (e.g. under /run or /tmp)")
    if write and not os.access(real, os.W_OK | os.X_OK):
        raise LeaseDirError(
            f"{where} is not writable by user {user_name(os.geteuid())} "
            f"(owner {user_name(st.st_uid)}, mode {mode:04o})",
            why="every user that leases GPUs must be able to create its record files",
            fix=f"ask an admin to run `gpuwarden leases init --dir {real}` (or chmod 1777 "
            f"{real} as {user_name(st.st_uid)} or root), or {fix_env}")
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
    # Private, root's included: a directory other users share is made by `leases init`, which
    # knows it is making one (a world-writable directory root made on the side was one any
    # user could plant names in).
    mode = PRIVATE_DIR_MODE
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


@dataclass(frozen=True)
class PreparedConfig:
    """What `gpuwarden leases init` wrote in ``prepared.json`` (root's file: trusted)."""

    schema: int
    max_slots_per_gpu: int
    gpus: tuple[str, ...]
    group: str | None
    # What each GPU keeps out of memory leases (`leases init --mem-reserve`); None: the default.
    memory_reserve_bytes: int | None = None


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


def prepared_config(directory: Path) -> PreparedConfig | None:
    """The configuration of a prepared ``directory`` (None: not prepared, or unreadable).

    Read from root's marker only: the K a request may use and the GPUs that have lock files
    come from here, never from the names of files in the directory."""
    with _checked_lock:
        cached = _configs.get(str(directory))
    if cached is not None and time.monotonic() - cached[0] < RECHECK_S:
        return cached[1]
    config = None
    try:
        fd = os.open(Path(directory) / PREPARED_NAME, OPEN_FLAGS)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == 0:
                data = json.loads(os.pread(fd, MAX_PREPARED_BYTES, 0))
                gpus = data.get("gpus", [])
                config = PreparedConfig(
                    schema=int(data.get("schema", 1)),
                    max_slots_per_gpu=int(data.get("max_slots_per_gpu", 8)),
                    gpus=tuple(str(g) for g in gpus) if isinstance(gpus, list) else (),
                    group=data.get("group") if isinstance(data.get("group"), str) else None,
                    memory_reserve_bytes=_reserve(data.get("memory_reserve_bytes")))
        except (OSError, ValueError, TypeError, AttributeError):
            config = None
        finally:
            os.close(fd)
    with _checked_lock:
        _configs[str(directory)] = (time.monotonic(), config)
    return config


_configs: dict[str, tuple[float, PreparedConfig | None]] = {}


def _reserve(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 50:
        return None
    return value


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
            with contextlib.suppress(OSError):
                # Never waits: an exclusive holder gains nothing.
                fcntl.flock(entry.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            entry.held = True
        return entry.fd


def same_dir(fd: int, directory: Path) -> bool:
    return fd < 0 or same_file(fd, directory)


def same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (it was not deleted or replaced)."""
    return _same_inode(fd, path)


def open_regular(path: Path, *, owner: int | None = None) -> int:
    """A read-only descriptor of the existing regular file ``path``; never follows a link and
    never blocks (on a FIFO). Raises FileNotFoundError, or UnsafeFileError for anything that
    is not a regular file (owned by ``owner``, when given)."""
    fd = open_no_link(path, OPEN_FLAGS)
    check_regular(fd, path, owner)
    return fd


# -- the birth time of a file: the kernel's arrival order -------------------------------------

_STATX_BTIME = 0x800
_AT_EMPTY_PATH = 0x1000
_STATX_BUF = 256  # struct statx is 256 bytes
_STATX_MASK_AT = 0
_STATX_BTIME_AT = 80  # stx_btime: struct statx_timestamp {__s64 tv_sec; __u32 tv_nsec; ...}


def _resolve_statx() -> object | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_statx = _resolve_statx()
_statx_local = threading.local()


def birth_ns(fd: int, st: os.stat_result) -> int:
    """When the file open as ``fd`` was created, in ns: the kernel's birth time where the
    filesystem keeps one (statx), else its ctime. Nobody can set either to a chosen value,
    and the birth time does not move later (a hard link, a chmod or a write moves ctime)."""
    if _statx is not None:
        buf = getattr(_statx_local, "buf", None)
        if buf is None:
            buf = _statx_local.buf = ctypes.create_string_buffer(_STATX_BUF)
        if _statx(fd, b"", _AT_EMPTY_PATH, _STATX_BTIME, buf) == 0:  # type: ignore[operator]
            mask = struct.unpack_from("I", buf, _STATX_MASK_AT)[0]
            if mask & _STATX_BTIME:
                sec, nsec = struct.unpack_from("qI", buf, _STATX_BTIME_AT)
                return sec * 1_000_000_000 + nsec
    return st.st_ctime_ns


# -- claims of this process across fork ---------------------------------------------------------

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
    """After a bare fork: the child holds none of the parent's record locks (POSIX locks are
    not inherited); close its copies of the records' descriptors so that nothing in the child
    believes it holds a lease. The claim lives exactly as long as the process that took it.
    """
    global _checked_lock, _live_lock
    for holder in list(_live):
        holder._close_in_child()
    _live.clear()
    _live_lock = threading.Lock()
    _checked_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=forget_in_child)
