"""Wake a waiter the moment a lease record it waits on ends — by blocking on its lock.

Every live record (holder or ticket) is exclusively flock'd by its owner. A thread that
asks for a shared lock on it blocks in the kernel until the owner releases it or dies
(however it dies), so a waiter learns of a release without polling. One thread per
watched record per process, shared by every wait in the process; it ends with the record.

The thread lets go of the shared lock at once (LOCK_UN releases it for the open file
description, so a copy of the descriptor in a forked child cannot keep it either).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterable
from pathlib import Path

_lock = threading.Lock()
_waiters: dict[Path, set[threading.Event]] = {}


def watch(paths: Iterable[Path], event: threading.Event) -> None:
    """Set ``event`` when any of ``paths`` ends (released, its owner died, or gone)."""
    for path in paths:
        with _lock:
            if path in _waiters:
                _waiters[path].add(event)
                continue
            _waiters[path] = {event}
        threading.Thread(target=_block_on, args=(path,), daemon=True,
                         name=f"gpuwarden-watch-{path.name}").start()


def unwatch(event: threading.Event) -> None:
    with _lock:
        for events in _waiters.values():
            events.discard(event)


def _block_on(path: Path) -> None:
    try:
        # Never a FIFO or a link (open_regular): only a regular file's lock is waited on. A
        # record whose owner never lets go keeps this daemon thread blocked, nothing else.
        from gpuwarden.lease._fs import open_regular

        fd = open_regular(path)
    except OSError:
        fd = -1  # already gone (or not a record): that is the news
    if fd >= 0:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # returns when the owner's exclusive lock goes
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    with _lock:
        events = _waiters.pop(path, set())
    for event in events:
        event.set()


def _reset_in_child() -> None:
    # The watcher threads do not exist in a forked child; the lock may be held by one.
    global _lock
    _lock = threading.Lock()
    _waiters.clear()


os.register_at_fork(after_in_child=_reset_in_child)
