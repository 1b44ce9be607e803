"""``gpuwarden leases init``: prepare a lease directory that no user can break.

Run once by an admin (root). The directory and every lock file in it (the mutex, and one
file per GPU whose bytes are its slots) belong to root, in a sticky directory: users open
the lock files to lock byte ranges, create only their own record files, and can delete or
replace neither the lock files nor each other's records. Without this, a user who created a
lock file first could delete it while another user holds its lock (see docs/leases.md,
"Trust model").

Root writes only what it created: a managed name that already exists is used only when it
is a regular file of root's with one link and a mode init itself gives (a hard link to a
file elsewhere, or an unexpected mode, is left alone and reported); a user's file, FIFO or
link in its place is unlinked (never followed) and made afresh, unless a process holds a
lock on it right now.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import json
import os
import secrets
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuwarden.boundedio import kind_of
from gpuwarden.errors import LeaseDirError, UsageError
from gpuwarden.lease import _fs, _locks, _proc

DEFAULT_MAX_SLOTS = 8


@dataclass
class InitReport:
    """What `leases init` did, file by file."""

    directory: Path
    mode: int
    group: str
    created: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)  # a user's file (or a FIFO, a link) before
    held: list[str] = field(default_factory=list)  # a user's file under a live lock: left
    refused: list[str] = field(default_factory=list)  # root's, but not as init makes it: left

    def to_dict(self) -> dict[str, object]:
        return {"lease_dir": str(self.directory), "mode": f"{self.mode:04o}", "group": self.group,
                "created": len(self.created), "kept": len(self.kept), "replaced": self.replaced,
                "held": self.held, "refused": self.refused}


def init_shared_dir(path: Path, uuids: Sequence[str], *, group: str | None = None,
                    max_slots: int = DEFAULT_MAX_SLOTS,
                    memory_reserve_bytes: int | None = None) -> InitReport:
    """Create (or repair) the shared lease directory ``path`` for the GPUs ``uuids``.

    ``memory_reserve_bytes``: what each GPU keeps out of memory leases (None: the default,
    1 GiB). Idempotent: run it again after adding GPUs or to allow more slots per GPU. A lock file
    some process holds right now is left as it is and reported (run again when it is free),
    and so is a root-owned name init would not have made (another link count or mode).

    Raises LeaseDirError when not run as root, when ``path`` is a link or belongs to another
    user (gpuwarden never chmods a directory that is not root's), or its parents are unsafe;
    UsageError for an unknown group or a bad ``max_slots``.
    """
    where = f"lease directory {str(path)!r}"
    if os.geteuid() != 0:
        raise LeaseDirError("`gpuwarden leases init` must run as root",
                            why="the lock files must belong to root, so that no user can "
                            "delete or replace one that another user holds",
                            fix="sudo gpuwarden leases init")
    if not path.is_absolute():
        raise LeaseDirError(f"{where} is a relative path", fix="give an absolute path (--dir)")
    if not 1 <= max_slots <= 64:
        raise UsageError(f"--slots-per-gpu {max_slots}: must be between 1 and 64",
                         fix="the largest K any job will use (K slots per GPU)")
    gid = 0
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise UsageError(f"no group {group!r} on this host",
                             fix="create it (groupadd) or name an existing one") from None
    # With a group: only its members may enter, create records or lock; else every user.
    dir_mode = 0o1770 if group else 0o1777
    # Lock files are writable (a record lock for writing needs it); records stay 0644.
    file_mode = 0o660 if group else 0o666
    marker_mode = 0o640 if group else 0o644
    dfd = _open_or_make(path, where)
    try:
        os.fchown(dfd, 0, gid)
        os.fchmod(dfd, dir_mode)
        report = InitReport(path, dir_mode, group or "root")
        names = [_fs.MUTEX_NAME] + [_fs.gpu_file_name(u) for u in uuids]
        for name in dict.fromkeys(names):
            getattr(report, _ensure_root_file(dfd, name, gid, file_mode)).append(name)
        marker = {"schema": _fs.PREPARED_SCHEMA, "created_at": time.time(), "group": group,
                  "max_slots_per_gpu": max_slots, "gpus": list(uuids)}
        if memory_reserve_bytes is not None:
            marker["memory_reserve_bytes"] = memory_reserve_bytes
        _write_root_file(dfd, _fs.PREPARED_NAME, json.dumps(marker).encode(), gid, marker_mode)
    finally:
        os.close(dfd)
    return report


def _open_or_make(path: Path, where: str) -> int:
    """A descriptor of the directory ``path``: root's, never reached through a link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        try:
            parent = Path(os.path.realpath(path.parent, strict=True))
        except OSError as exc:
            raise LeaseDirError(f"{where} cannot be created: its parent "
                                f"{str(path.parent)!r} cannot be used", why=exc.strerror,
                                fix="create the parent, or choose another --dir") from None
        _fs._check_parents(parent / path.name, where, "choose another --dir")
        try:
            os.mkdir(parent / path.name, 0o700)
        except OSError as exc:
            raise LeaseDirError(f"{where} cannot be created", why=exc.strerror,
                                fix="choose another --dir") from exc
        st = os.lstat(parent / path.name)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise LeaseDirError(f"{where} is {kind_of(st.st_mode)}, not a directory",
                            why="init prepares a real directory, never one reached through a "
                            "link", fix=f"remove {path} (as root), or choose another --dir")
    if st.st_uid != 0:
        raise LeaseDirError(
            f"{where} belongs to {_proc.user_name(st.st_uid)}",
            why="gpuwarden never takes over a directory that is not root's: its owner could "
            "still delete every file in it",
            fix=f"move it away (mv {path} {path}.old) and run init again")
    _fs._check_parents(Path(os.path.realpath(path)), where, "choose another --dir")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    if os.fstat(fd).st_ino != st.st_ino:  # swapped between lstat and open
        os.close(fd)
        raise LeaseDirError(f"{where} changed while init checked it", fix="run init again")
    return fd


# Modes init gives its lock files now (0666/0660) and gave them before record locks (0644/0640).
_MODES_OF_INIT = (0o666, 0o660, 0o644, 0o640)


def _ensure_root_file(dfd: int, name: str, gid: int, mode: int) -> str:
    """Make ``name`` a root-owned regular lock file; which InitReport list it goes to.

    An existing root-owned file is changed (owner, mode) only when it is one init made: a
    regular file with a single link and one of init's modes. Anything else of root's there
    (a hard link to a file elsewhere, which fs.protected_hardlinks=0 lets any user make;
    a file with another mode) is left untouched and reported."""
    outcome = "created"
    try:
        fd = os.open(name, _fs.OPEN_FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        fd = -1
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENXIO):
            raise
        os.unlink(name, dir_fd=dfd)  # a symbolic link or a socket: unlink never follows it
        fd, outcome = -1, "replaced"
    if fd >= 0:
        try:
            st = os.fstat(fd)
            if st.st_uid == 0:
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 \
                        or stat.S_IMODE(st.st_mode) not in _MODES_OF_INIT:
                    return "refused"
                os.fchown(fd, 0, gid)
                os.fchmod(fd, mode)
                return "kept"
            if stat.S_ISREG(st.st_mode) and _is_locked(fd):
                return "held"  # a user's lock file under a live lease: replace it later
            # A user's file, FIFO, socket...: unlinked (its content is never touched).
            os.unlink(name, dir_fd=dfd)
            outcome = "replaced"
        finally:
            os.close(fd)
    fd = os.open(name, _fs.OPEN_FLAGS | os.O_CREAT | os.O_EXCL, mode, dir_fd=dfd)
    try:
        os.fchown(fd, 0, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return outcome


def _is_locked(fd: int) -> bool:
    """Whether some process holds a lock on the file: a record lock (this gpuwarden's), or a
    flock (an older gpuwarden's lease)."""
    if _locks.test_lock(fd, 0, 0) is not None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _write_root_file(dfd: int, name: str, data: bytes, gid: int, mode: int) -> None:
    tmp = f".{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode, dir_fd=dfd)
    try:
        os.fchown(fd, 0, gid)
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
