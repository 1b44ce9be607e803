"""Wake a waiting request the moment something it waits on ends: inotify on the lease directory.

A holder keeps its record (and its GPU lock files) open for writing while it lives, and
deletes the record when it releases. So the kernel reports the end of every holder or ticket
however it ends: ``IN_DELETE`` for a release, ``IN_CLOSE_WRITE`` for a process that died
(its descriptors are closed at exit, SIGKILL included). A waiter blocks on one inotify
descriptor in its own thread (no thread per record, no polling) and is woken only by events
for the names it waits on; any other name's events are read and dropped.

Bounded against a flood of events (another user opening and closing their files in a loop):
at most :data:`MAX_EVENT_BYTES` are read per wait, after which the wait falls back to
retrying every :data:`POLL_S`; a full kernel queue (``IN_Q_OVERFLOW``) counts as a change.
Without inotify (a filesystem without it, or the per-user instance limit reached) a waiter
retries every :data:`POLL_S`.

Instances are kept for the next wait of the process, not closed: closing an inotify
descriptor waits for the kernel's SRCU grace period (milliseconds to tens of milliseconds on a
busy host), and a grant must not wait for that.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import struct
import threading
import time
from pathlib import Path

IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_MASK = IN_CLOSE_WRITE | IN_MOVED_FROM | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
MAX_EVENT_BYTES = 1 << 20  # per wait; a flood beyond this is not parsed, the wait polls
POLL_S = 0.05


def _resolve() -> tuple[object, object, object] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        init, add, rm = libc.inotify_init1, libc.inotify_add_watch, libc.inotify_rm_watch
    except (OSError, AttributeError):
        return None
    init.argtypes, init.restype = [ctypes.c_int], ctypes.c_int
    add.argtypes, add.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32], ctypes.c_int
    rm.argtypes, rm.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return init, add, rm


_calls = _resolve()
_pool_lock = threading.Lock()
_pool: list[int] = []  # inotify descriptors without a watch, for the next waiter
POOL_SIZE = 4


class DirWatch:
    """The changes of one directory, for one waiter. ``wait(names, timeout)`` returns True when
    one of ``names`` was closed after writing, deleted or renamed (or the kernel lost events),
    False when the timeout passed quietly."""

    def __init__(self, directory: Path) -> None:
        self.fd = -1
        self._wd = -1
        if _calls is None:
            return
        init, add, _rm = _calls
        with _pool_lock:
            fd = _pool.pop() if _pool else -1
        if fd < 0:
            fd = init(IN_NONBLOCK | IN_CLOEXEC)  # type: ignore[operator]
        if fd < 0:
            return  # EMFILE: the user's inotify instances are used up; poll instead
        wd = add(fd, os.fsencode(directory), _MASK)  # type: ignore[operator]
        if wd < 0:
            _give_back(fd)
            return
        self.fd, self._wd = fd, wd

    @property
    def polling(self) -> bool:
        return self.fd < 0

    def wait(self, names: set[str], timeout_s: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout_s)
        if self.fd < 0:
            return self._poll(deadline)
        wanted = {os.fsencode(n) for n in names}
        budget = MAX_EVENT_BYTES
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                ready, _, _ = select.select([self.fd], [], [], left)
            except InterruptedError:
                continue
            if not ready:
                return False
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                return True
            if _relevant(data, wanted):
                return True
            budget -= len(data)
            if budget <= 0:  # someone floods the directory with events: stop reading them
                self._drain()
                return self._poll(deadline)

    def _drain(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self.fd, 65536):
                pass

    @staticmethod
    def _poll(deadline: float) -> bool:
        left = deadline - time.monotonic()
        if left < POLL_S:
            time.sleep(max(0.0, left))
            return False
        time.sleep(POLL_S)
        return True

    def close(self) -> None:
        if self.fd >= 0 and _calls is not None:
            _calls[2](self.fd, self._wd)  # type: ignore[operator]
            self._drain()  # what came meanwhile, and the IN_IGNORED of the removed watch
            _give_back(self.fd)
        self.fd = -1

    def __enter__(self) -> DirWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _give_back(fd: int) -> None:
    with _pool_lock:
        if len(_pool) < POOL_SIZE:
            _pool.append(fd)
            return
    # Closing waits for an SRCU grace period: not on the caller's time.
    threading.Thread(target=os.close, args=(fd,), daemon=True).start()


def _forget_in_child() -> None:
    # The parent's instances are shared with it (one open file description): never read here.
    global _pool_lock
    _pool_lock = threading.Lock()
    for fd in _pool:
        with contextlib.suppress(OSError):
            os.close(fd)
    _pool.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _relevant(data: bytes, wanted: set[bytes]) -> bool:
    """Whether the events in ``data`` concern a wanted name (one struct per event, no per-byte
    work)."""
    offset = 0
    size = _EVENT.size
    while offset + size <= len(data):
        _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
        if mask & (IN_Q_OVERFLOW | IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED):
            return True
        name = data[offset + size:offset + size + length].rstrip(b"\0")
        if name in wanted:
            return True
        offset += size + length
    return False
