"""The lease directory and the kernel locks in it: the only module that touches them.

Every claim is an ``flock(2)`` lock on a file of the lease directory. The kernel
holds such a lock for the open file description, so whatever way the holder dies
(SIGKILL, OOM killer, segfault) the lock goes when its last descriptor closes, with
no cleanup step. ``flock`` (rather than ``fcntl``/POSIX record locks) because:

- it works on a read-only descriptor, so user B can lock a file user A created
  without anyone needing write permission on another user's file;
- two descriptors of one process conflict, so a process that holds a grant and asks
  for another one cannot be granted its own slot twice (POSIX locks would merge, and
  closing *any* descriptor of the file would silently drop them).

Lock files are never deleted (deleting a file someone holds a lock on, then creating
it anew, would let two processes "hold" the same path); record files (holder and
ticket JSON) are deleted by their owner.

Descriptors are opened with O_CLOEXEC, so children started with exec never inherit
a claim; children made by a bare ``fork`` close theirs at once (see
:func:`forget_in_child`), so a leaked child cannot keep a GPU leased.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import re
import stat
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from gpuwarden.errors import LeaseDirError

LEASE_DIR_ENV = "GPUWARDEN_LEASE_DIR"
# /tmp is local to the host, present everywhere, and 1777 like the directory we make in it.
DEFAULT_LEASE_DIR = "/tmp/gpuwarden-leases"
DIR_MODE = 0o1777  # every user may create files; only a file's owner may delete or rename it
FILE_MODE = 0o644  # readable by every user (flock needs only a read-only descriptor)
MUTEX_NAME = "mutex.lock"


def lease_dir_path(env: dict[str, str] | None = None) -> Path:
    """GPUWARDEN_LEASE_DIR when set and not empty, else :data:`DEFAULT_LEASE_DIR`."""
    source = os.environ if env is None else env
    return Path(source.get(LEASE_DIR_ENV) or DEFAULT_LEASE_DIR)


def slot_file_name(uuid: str, slots_per_gpu: int, slot: int) -> str:
    """The lock file of one slot: ``slot.<uuid>.k<slots_per_gpu>.s<slot>.lock``."""
    # Old-style MIG ids contain '/'; nothing else in a uuid needs escaping.
    return f"slot.{escape_uuid(uuid)}.k{slots_per_gpu}.s{slot}.lock"


_SLOT_RE = re.compile(r"^slot\.(?P<uuid>.+)\.k(?P<k>\d+)\.s(?P<s>\d+)\.lock$")


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


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def prepare_dir(path: Path) -> Path:
    """Make sure ``path`` is a lease directory this user can use; create it when missing.

    Raises LeaseDirError when the parent does not exist, the directory is not writable
    for this user, is world-writable without the sticky bit, or is not a directory.
    """
    where = f"lease directory {str(path)!r}"
    fix_env = f"set {LEASE_DIR_ENV} to a directory on a local filesystem"
    try:
        # mkdir only when missing: on an existing directory in a parent we may not write,
        # mkdir fails with EACCES rather than EEXIST.
        if not os.path.lexists(path):
            os.mkdir(path, 0o700)
            # mkdir's mode passes through the umask; chmod sets what other users need.
            with contextlib.suppress(OSError):
                os.chmod(path, DIR_MODE)
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise LeaseDirError(
            f"{where} cannot be created: its parent {str(path.parent)!r} does not exist",
            fix=f"create the parent directory, or {fix_env}",
        ) from None
    except OSError as exc:
        raise LeaseDirError(f"{where} cannot be created", why=exc.strerror or str(exc),
                            fix=fix_env) from exc
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise LeaseDirError(f"{where} cannot be read", why=exc.strerror or str(exc),
                            fix=fix_env) from exc
    if stat.S_ISLNK(st.st_mode):
        # Resolve a link once: /tmp names are a classic place for link tricks, so the
        # target must pass the same checks.
        target = path.resolve()
        if target == path:
            raise LeaseDirError(f"{where} is a symbolic link loop", fix=fix_env)
        return prepare_dir(target)
    if not stat.S_ISDIR(st.st_mode):
        raise LeaseDirError(f"{where} is not a directory", fix=f"remove it, or {fix_env}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise LeaseDirError(
            f"{where} is world-writable without the sticky bit (mode {mode:04o})",
            why="any user could delete a lock file that another job holds, and two jobs "
            "would then hold the same GPU",
            fix=f"chmod 1777 {path} (as its owner {_user(st.st_uid)} or root)",
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise LeaseDirError(
            f"{where} is not writable by user {_user(os.getuid())} "
            f"(owner {_user(st.st_uid)}, mode {mode:04o})",
            why="every user that leases GPUs must be able to create its lock and record files",
            fix=f"chmod 1777 {path} (as {_user(st.st_uid)} or root), or {fix_env}",
        )
    return path


def open_lock_file(path: Path) -> int:
    """A read-only O_CLOEXEC descriptor of the lock file ``path``, created when missing.

    An existing file is opened without O_CREAT: with fs.protected_regular (systemd's
    default) an O_CREAT open of another user's file in a sticky directory fails with
    EACCES even though the file is readable.
    """
    # O_NONBLOCK: only flock()ed, never read; a FIFO planted at the path must not block.
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    for _ in range(100):
        try:
            return os.open(path, flags)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, FILE_MODE)
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
def dir_mutex(directory: Path) -> Iterator[None]:
    """The lease directory's mutex: held for the few milliseconds of one attempt.

    Every decision that reads lock state and then takes locks runs under it, which
    makes "pick the GPUs and claim them" one atomic step across processes. A holder
    that dies inside it releases it like any other flock.
    """
    fd = open_lock_file(directory / MUTEX_NAME)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        unlock_close(fd)


def probe_record_alive(path: Path) -> bool | None:
    """Whether the process that wrote the record ``path`` still holds its flock.

    True: its owner holds it (alive). False: nobody does (the owner died or released).
    None: the file is gone. The probe takes a shared lock for microseconds; owners hold
    an exclusive one, so a probe never disturbs a live owner.
    """
    try:
        # O_NONBLOCK: a FIFO planted under a record's name must not block the open.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    try:
        got = try_lock(fd, shared=True)
    finally:
        unlock_close(fd)
    return not got


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
    for holder in list(_live):
        holder._close_in_child()
    _live.clear()


os.register_at_fork(after_in_child=forget_in_child)
