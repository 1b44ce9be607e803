"""The kernel locks of a lease directory: POSIX byte-range locks, which name their holder.

Every claim is an ``fcntl`` record lock (``F_SETLK``), never a ``flock``:

- the kernel tells anyone who asks who holds one: ``F_GETLK`` answers with the lock's type
  (read or write) and the pid that holds it, translated into the asker's PID namespace. So a
  lease, the directory mutex, or a lock some other tool took on our files is named by pid and
  user without reading ``/proc/locks`` (which a user holding 100k locks of their own makes
  slow to read, and which a reader must cut short);
- byte ranges: one lock file per GPU holds every slot of every split of it. Slot ``s`` of a
  GPU split in ``K`` is byte ``K(K-1)/2 + s``; "is this GPU split some other way" is two
  ``F_GETLK`` calls over the bytes of every other K, with no file name involved;
- read and write locks: a whole GPU is a write lock on byte 0 (slot 0 of K=1); every memory
  lease on the GPU holds a *read* lock on that same byte, so the kernel itself keeps a whole-GPU
  lease and memory leases apart (readers share, a writer excludes them all), while how many
  bytes of memory each takes is in its holder record, summed under the directory mutex;
- a process's POSIX locks are not inherited by ``fork`` and go when it exits, however it
  exits: the claim lives exactly as long as the process that took it.

What POSIX locks cost, and how this module pays it:

- *closing any descriptor of a file drops every lock the process holds on it*. So a lock
  file is opened once per process and inode (:class:`_Inode`), and its descriptors are kept
  until the process holds no lock on it; nothing else in gpuwarden opens a lock file
  (probes go through the same descriptor);
- *a process never conflicts with itself* (two grants of one process, or two threads): the
  bytes this process holds are recorded here and count as taken, and the directory mutex
  is also a thread lock within the process;
- a write lock needs a descriptor open for writing: lock files are mode 0666 (0660 with
  ``leases init --group``), in a directory where nobody can delete or replace them.

Open-file-description locks (``F_OFD_SETLK``), which another user may take on our files,
conflict with ours and are reported with pid -1: the kernel does not say whose they are,
and neither can we. ``flock`` locks do not interact with record locks at all: a ``flock``
on a lease file blocks nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import stat
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpuwarden.boundedio import kind_of
from gpuwarden.lease._proc import process_facts, user_name

# struct flock on Linux (every architecture gpuwarden runs on): short l_type, short l_whence,
# off_t l_start, off_t l_len, pid_t l_pid, padded to 32 bytes.
_FLOCK = struct.Struct("hhqqi4x")
# Every open of an existing lock file: never follow a link, never block on a FIFO.
LOCK_OPEN_FLAGS = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
LOCK_FILE_MODE = 0o666


class UnsafeFileError(OSError):
    """A name in the lease directory that is not a file gpuwarden may lock or read: a
    symbolic link, a FIFO, a device, a directory, or a file of the wrong owner."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(errno.EINVAL, problem, str(path))
        self.path = path
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.path} {self.problem}"


@dataclass(frozen=True)
class LockOwner:
    """What ``F_GETLK`` says about one lock that stands in the way."""

    pid: int  # > 0: a POSIX lock's process; 0: another PID namespace; -1: an OFD lock
    write: bool
    start: int
    length: int  # 0: to the end of the file (and beyond)


def describe_owner(owner: LockOwner | None) -> str:
    """'pid 4242 (mallory, sleep 1000, stopped), a read lock' for the holder F_GETLK named."""
    if owner is None:
        return "nobody (it was just released)"
    kind = "" if owner.write else ", a read lock"
    if owner.pid > 0:
        return process_facts(owner.pid).describe() + kind
    if owner.pid == 0:
        return "a process in another PID namespace (the kernel gives no pid here)" + kind
    return ("an open file description lock (F_OFD_SETLK), which the kernel attributes to no "
            "process" + kind)


def slot_offset(slots_per_gpu: int, slot: int) -> int:
    """The byte of slot ``slot`` of a GPU split in ``slots_per_gpu``: every split has its own
    bytes, so holders of different splits are told apart by the byte they lock."""
    return slots_per_gpu * (slots_per_gpu - 1) // 2 + slot


def slot_of_offset(offset: int) -> tuple[int, int]:
    """(slots_per_gpu, slot) of a byte :func:`slot_offset` gave (any byte: O(1), so a lock
    someone took far out in a lock file costs nothing to name)."""
    k = (1 + math.isqrt(1 + 8 * max(0, offset))) // 2  # the largest k with k(k-1)/2 <= offset
    while slot_offset(k, 0) > offset:
        k -= 1
    while slot_offset(k + 1, 0) <= offset:
        k += 1
    return k, offset - slot_offset(k, 0)


def test_lock(fd: int, start: int, length: int, *, write: bool = True) -> LockOwner | None:
    """Who holds a lock that would keep us from taking ``[start, start+length)`` (length 0:
    to infinity), as the kernel says; None when nobody (else) does. Our own process's locks
    never show here: see :func:`held_here`."""
    req = _FLOCK.pack(fcntl.F_WRLCK if write else fcntl.F_RDLCK, os.SEEK_SET, start, length, 0)
    l_type, _whence, l_start, l_len, l_pid = _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_GETLK, req))
    if l_type == fcntl.F_UNLCK:
        return None
    return LockOwner(l_pid, l_type == fcntl.F_WRLCK, l_start, l_len)


def _set_lock(fd: int, kind: int, start: int, length: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


# -- one open file description per lock-file inode, per process ---------------------------------

@dataclass
class _Inode:
    """Every descriptor this process has of one lock file, and the bytes it holds in it."""

    dev: int
    ino: int
    fds: list[int]
    held: dict[int, int]  # byte -> how many claims of this process hold it (1): write locks
    # byte -> how many claims of this process share a read lock on it (memory leases: one
    # POSIX read lock per process and byte, however many grants of the process use it)
    shared: dict[int, int] = field(default_factory=dict)

    @property
    def fd(self) -> int:
        return self.fds[0]


_registry_lock = threading.RLock()
_inodes: dict[tuple[int, int], _Inode] = {}
_by_path: dict[str, tuple[int, int]] = {}


def open_lock_file(path: Path, *, create: bool, owner: int | None = None,
                   create_mode: int = LOCK_FILE_MODE, replace_planted: bool = False,
                   recheck: bool = True) -> _Inode:
    """This process's handle of the lock file ``path`` (created when missing, with
    ``create``). Raises FileNotFoundError, UnsafeFileError (a link, a FIFO, a device, a
    file of the wrong ``owner``), or PermissionError (not writable for this user).

    A descriptor is never closed while this process holds a lock on its inode (closing any
    descriptor of a file would drop them all), so a second open of the same inode (the path
    was replaced and replaced back) is kept beside the first.
    """
    key = str(path)
    with _registry_lock:
        known = _by_path.get(key)
        if known is not None:
            entry = _inodes.get(known)
            if entry is not None and (not recheck or _names(entry.fd, path)):
                return entry
        try:
            fd = _open_locked_path(path, create=create, owner=owner, create_mode=create_mode)
        except (UnsafeFileError, PermissionError):
            if not replace_planted:
                raise
            os.unlink(path)  # our own directory: nobody else can put a name back meanwhile
            fd = _open_locked_path(path, create=True, owner=os.geteuid(),
                                   create_mode=create_mode)
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        entry = _inodes.get(ident)
        if entry is None:
            entry = _new_inode(ident, fd)
        else:
            entry.fds.append(fd)  # never close: it would drop this process's locks
        _by_path[key] = ident
        _forget_unused(keep=ident)
        return entry


def _new_inode(ident: tuple[int, int], fd: int) -> _Inode:
    entry = _Inode(ident[0], ident[1], [fd], {})
    _inodes[ident] = entry
    return entry


def _forget_unused(keep: tuple[int, int]) -> None:
    """Close inodes no path names any more and no claim holds (a replaced file's)."""
    named = set(_by_path.values())
    for ident, entry in list(_inodes.items()):
        if ident != keep and ident not in named and not entry.held and not entry.shared:
            for fd in entry.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            del _inodes[ident]


def _names(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (it was not deleted or replaced)."""
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def open_no_link(path: Path, flags: int) -> int:
    """``os.open`` of a name that must not be a symbolic link (flags include O_NOFOLLOW) or a
    socket: those are UnsafeFileError, other errors pass through."""
    try:
        return os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(path, "is a symbolic link, not a regular file") from None
        if exc.errno == errno.ENXIO:  # a socket
            raise UnsafeFileError(path, "is a socket, not a regular file") from None
        raise


def _open_locked_path(path: Path, *, create: bool, owner: int | None, create_mode: int) -> int:
    for _ in range(100):
        try:
            fd = open_no_link(path, LOCK_OPEN_FLAGS)
        except FileNotFoundError:
            if not create:
                raise
        else:
            check_regular(fd, path, owner)
            return fd
        try:
            # O_CREAT only for a missing name: with fs.protected_regular, O_CREAT on another
            # user's file in a sticky directory fails even when it could be opened.
            fd = os.open(path, LOCK_OPEN_FLAGS | os.O_CREAT | os.O_EXCL, create_mode)
        except FileExistsError:
            continue
        with contextlib.suppress(OSError):
            os.fchmod(fd, create_mode)  # the umask may have taken bits others need
        return fd
    raise OSError(errno.EAGAIN, f"cannot open or create {path}")


def check_regular(fd: int, path: Path, owner: int | None) -> os.stat_result:
    """``fstat`` of ``fd``; closes it and raises UnsafeFileError unless it is a regular file
    (of ``owner``, when given)."""
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if stat.S_ISREG(st.st_mode) and (owner is None or st.st_uid == owner):
        return st
    os.close(fd)
    if stat.S_ISREG(st.st_mode):
        problem = (f"is owned by {user_name(st.st_uid)}, not by {user_name(owner or 0)} who "
                   "prepared the directory")
    else:
        problem = f"is {kind_of(st.st_mode)} owned by {user_name(st.st_uid)}, not a regular file"
    raise UnsafeFileError(path, problem)


def held_here(entry: _Inode, start: int, length: int) -> bool:
    """Whether this process holds a byte of ``[start, start+length)`` (length 0: to infinity),
    a write or a shared (read) lock."""
    with _registry_lock:
        end = start + length if length else None
        return any(b >= start and (end is None or b < end) for b in (*entry.held, *entry.shared))


def written_here(entry: _Inode, byte: int) -> bool:
    """Whether this process holds the write lock on ``byte``."""
    with _registry_lock:
        return byte in entry.held


def shared_here(entry: _Inode, byte: int) -> int:
    """How many claims of this process share the read lock on ``byte``."""
    with _registry_lock:
        return entry.shared.get(byte, 0)


def try_take(entry: _Inode, byte: int) -> bool:
    """Take a write lock on ``byte`` without waiting; False when someone (this process
    included, with a write or a read lock) holds it."""
    with _registry_lock:
        # A write lock over our own read lock would convert it, not fail: refused here.
        if byte in entry.held or byte in entry.shared:
            return False
        if not _set_lock(entry.fd, fcntl.F_WRLCK, byte, 1):
            return False
        entry.held[byte] = 1
        return True


def give_back(entry: _Inode, byte: int) -> None:
    with _registry_lock:
        if entry.held.pop(byte, None) is None:
            return
        with contextlib.suppress(OSError):
            _set_lock(entry.fd, fcntl.F_UNLCK, byte, 1)


def try_share(entry: _Inode, byte: int) -> bool:
    """Take (or share) a read lock on ``byte`` without waiting; False when a write lock is on
    it (another process's, or this process's own: a read lock would downgrade it). Counted per
    claim: the process's one POSIX read lock goes with the last :func:`give_back_shared`."""
    with _registry_lock:
        if byte in entry.held:
            return False
        count = entry.shared.get(byte, 0)
        if not count and not _set_lock(entry.fd, fcntl.F_RDLCK, byte, 1):
            return False
        entry.shared[byte] = count + 1
        return True


def give_back_shared(entry: _Inode, byte: int) -> None:
    with _registry_lock:
        count = entry.shared.get(byte, 0)
        if count <= 0:
            return
        if count > 1:
            entry.shared[byte] = count - 1
            return
        del entry.shared[byte]
        with contextlib.suppress(OSError):
            _set_lock(entry.fd, fcntl.F_UNLCK, byte, 1)


def names_inode(entry: _Inode, path: Path) -> bool:
    """Whether ``path`` still names the lock file this handle locks."""
    return _names(entry.fd, path)


def forget_in_child() -> None:
    """After a bare fork: the child holds none of the parent's POSIX locks (the kernel does not
    copy them); close its copies of the descriptors (which cannot drop the parent's locks) and
    start afresh."""
    global _registry_lock
    _registry_lock = threading.RLock()
    for entry in _inodes.values():
        for fd in entry.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    _inodes.clear()
    _by_path.clear()


# -- the directory mutex ---------------------------------------------------------------------------

class MutexBusyError(Exception):
    """The directory mutex could not be had within the deadline."""

    def __init__(self, path: Path, holder: LockOwner | None, waited_s: float) -> None:
        super().__init__(f"{path} held")
        self.path = path
        self.holder = holder
        self.waited_s = waited_s


_thread_mutexes: dict[str, threading.Lock] = {}
MUTEX_BYTE = 0


@contextlib.contextmanager
def dir_mutex(path: Path, timeout_s: float, *, owner: int | None, create: bool,
              replace_planted: bool = False, recheck: bool = True) -> Iterator[None]:
    """Hold the write lock of the mutex file ``path`` (and this process's thread lock for it)
    for the block. Raises MutexBusyError, with what the kernel says of its holder, when it
    stays held ``timeout_s``.

    Polled (50 us, doubling to 2 ms): a blocking F_SETLKW cannot be given a deadline, and a
    process that holds the mutex forever must not hang anyone.
    """
    deadline = time.monotonic() + timeout_s
    with _registry_lock:
        thread_lock = _thread_mutexes.setdefault(str(path), threading.Lock())
    if not thread_lock.acquire(timeout=max(0.0, timeout_s)):
        raise MutexBusyError(path, LockOwner(os.getpid(), True, 0, 1), timeout_s)
    try:
        entry = open_lock_file(path, create=create, owner=owner,
                               replace_planted=replace_planted, recheck=recheck)
        pause = 0.00005
        while not try_take(entry, MUTEX_BYTE):
            left = deadline - time.monotonic()
            if left <= 0:
                raise MutexBusyError(path, test_lock(entry.fd, MUTEX_BYTE, 1), timeout_s)
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.002)
        try:
            yield
        finally:
            give_back(entry, MUTEX_BYTE)
    finally:
        thread_lock.release()


def _reset_thread_mutexes() -> None:
    _thread_mutexes.clear()


def _after_fork_in_child() -> None:
    forget_in_child()
    _reset_thread_mutexes()


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def peek(path: Path) -> Iterator[int | None]:
    """A descriptor to ask ``F_GETLK`` about the lock file ``path`` (None: it cannot be
    opened), for a reader that may not write it (`gpuwarden leases`).

    This process's own descriptor when it has one; else a read-only one, closed at the end,
    all under the registry lock, so that no thread of this process takes a lock on the file
    through another descriptor before this one is closed (which would drop it)."""
    with _registry_lock:
        known = _by_path.get(str(path))
        entry = _inodes.get(known) if known is not None else None
        if entry is not None and _names(entry.fd, path):
            yield entry.fd
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_NOCTTY)
            st = check_regular(fd, path, None)
        except OSError:
            yield None
            return
        entry = _inodes.get((st.st_dev, st.st_ino))
        if entry is not None:
            entry.fds.append(fd)  # an inode this process locks: never close a descriptor of it
            yield entry.fd
            return
        try:
            yield fd
        finally:
            os.close(fd)


def held_ranges(fd: int, limit: int = 4096) -> list[LockOwner]:
    """Every lock range of the file that another process holds, as ``F_GETLK`` finds them one
    by one (each answer splits what is left to ask); at most ``limit`` questions."""
    found: list[LockOwner] = []
    todo = [(0, 0)]
    asked = 0
    while todo and asked < limit:
        start, length = todo.pop()
        asked += 1
        owner = test_lock(fd, start, length)
        if owner is None:
            continue
        found.append(owner)
        if owner.start > start:
            todo.append((start, owner.start - start))
        if owner.length:
            after = owner.start + owner.length
            if not length:
                todo.append((after, 0))
            elif after < start + length:
                todo.append((after, start + length - after))
    return sorted(found, key=lambda o: o.start)
