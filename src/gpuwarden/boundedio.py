"""Bounded reads of the files gpuwarden parses: no input can hang it or fill its memory.

Every file gpuwarden *parses* (a scenario named by GPUWARDEN_SIMULATE, an explain knowledge
base, a lease record in the shared lease directory) is read with :func:`read_regular`: a
regular file only, at most ``max_bytes``. The file is opened non-blocking and checked with
``fstat`` on the opened descriptor, so a FIFO without a writer, ``/dev/zero``, a terminal or a
directory is refused at once (no hang, no unbounded read), and a file swapped between a check
and the open cannot slip through.

A log that is *streamed* (``gpuwarden explain``) may be any size and may come from a pipe:
:func:`open_stream` accepts regular files and FIFOs (``explain <(zcat x.log.gz)``), and waits
for a FIFO's writer at most :data:`FIFO_OPEN_TIMEOUT_S` instead of forever.

Errors: :class:`InputRefused` (a ``ValueError``) says why a file is not read; ``OSError``
(missing file, no permission) passes through. Callers map both to their own
:class:`~gpuwarden.errors.UsageError` (exit 2) with a code.
"""

from __future__ import annotations

import json
import os
import select
import stat
import threading
import time
from typing import Any, BinaryIO

from gpuwarden.units import format_bytes

# A config-like file gpuwarden parses whole: a scenario of a 64-GPU host is ~50 KiB.
MAX_PARSED_BYTES = 4 * 1024 * 1024
# How long `explain FIFO` waits for a writer to open the FIFO. A producer started first
# (`producer > fifo &`) is already blocked in its open and connects at once; a pipe from
# process substitution (`<(cmd)`) has its writer from the start.
FIFO_OPEN_TIMEOUT_S = 0.5


class InputRefused(ValueError):
    """A file that is not read: not a regular file, too large, or a FIFO with no writer."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix


def kind_of(mode: int) -> str:
    """'a directory', 'a FIFO', ... for a ``st_mode``."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def _open_nonblocking(path: str | os.PathLike[str], *, nofollow: bool = False) -> int:
    # O_NONBLOCK: opening a FIFO for reading returns at once even with no writer; O_NOCTTY: a
    # terminal named as the file never becomes our controlling terminal.
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    return os.open(path, flags | (os.O_NOFOLLOW if nofollow else 0))


def read_regular(path: str | os.PathLike[str], *, max_bytes: int = MAX_PARSED_BYTES,
                 nofollow: bool = False) -> bytes:
    """The content of the regular file ``path``, at most ``max_bytes``.

    Raises InputRefused for anything else than a regular file, or a larger one; OSError when
    it cannot be opened (``nofollow``: a symlink is refused with ELOOP).
    """
    fd = _open_nonblocking(path, nofollow=nofollow)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InputRefused(f"is {kind_of(mode)}, not a regular file",
                               "name a regular file (copy the content into one)")
        chunks: list[bytes] = []
        size = 0
        # Read to one byte past the cap: st_size is not trusted (a file may grow, /proc and
        # sysfs files report 0).
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise InputRefused(f"is larger than {format_bytes(max_bytes)}",
                               f"give a file of at most {format_bytes(max_bytes)}")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_json_object(path: str | os.PathLike[str], *, max_bytes: int = MAX_PARSED_BYTES,
                     nofollow: bool = False) -> dict[str, Any] | None:
    """The JSON object in the regular file ``path``, read as :func:`read_regular` does; None
    when there is none: missing, unreadable, refused, not JSON, or not an object. For the
    files gpuwarden's own processes leave for each other (a rank's error record, a store
    watch's peers file, a launcher's registry record), where "nothing usable" is an answer."""
    try:
        data = json.loads(read_regular(path, max_bytes=max_bytes, nofollow=nofollow))
    except (OSError, ValueError, RecursionError):  # InputRefused is a ValueError
        return None
    return data if isinstance(data, dict) else None


def decode_utf8(data: bytes) -> str:
    """``data`` as UTF-8 text; InputRefused naming the first invalid byte otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputRefused(
            f"is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}, line {line})",
            "save the file as UTF-8") from None


def open_stream(path: str | os.PathLike[str], *,
                fifo_open_timeout_s: float = FIFO_OPEN_TIMEOUT_S) -> BinaryIO:
    """Open a log to stream: a regular file, or a FIFO whose writer connects in time.

    Raises InputRefused for a directory, a device, a socket, or a FIFO nobody opened for
    writing within ``fifo_open_timeout_s``; OSError when it cannot be opened.
    """
    fd = _open_nonblocking(path)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            os.set_blocking(fd, True)
            stream = os.fdopen(fd, "rb")
            fd = -1
            return stream
        if not stat.S_ISFIFO(mode):
            raise InputRefused(f"is {kind_of(mode)}, not a log file",
                               "name a log file, or pipe the output into gpuwarden (cmd | "
                               "gpuwarden explain)")
        fifo_fd, fd = fd, -1  # closed by _fifo_with_writer on every path
        return _fifo_with_writer(fifo_fd, fifo_open_timeout_s)
    finally:
        if fd >= 0:
            os.close(fd)


def _fifo_with_writer(nonblocking_fd: int, timeout_s: float) -> BinaryIO:
    """A FIFO opened non-blocking, once a writer has shown up: returned blocking, for streaming.

    Two signs of a writer, whichever comes first: data (or a writer that came and went) on
    our descriptor, seen by poll(); or a blocking open of the same FIFO returning, which
    happens as soon as a writer has it open, before any data (poll cannot tell that on
    Linux). The blocking open goes through our descriptor (/proc/self/fd), not the path,
    which another user could swap meanwhile; it runs in a thread so it can be abandoned.
    """
    fifo = f"/proc/self/fd/{nonblocking_fd}"
    opened: list[int | OSError] = []

    def opener() -> None:
        try:
            opened.append(os.open(fifo, os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            opened.append(exc)

    thread = threading.Thread(target=opener, name="gpuwarden-fifo-open", daemon=True)
    thread.start()
    poller = select.poll()
    poller.register(nonblocking_fd, select.POLLIN | select.POLLHUP)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if opened:
                first = opened[0]
                if isinstance(first, int):
                    opened.clear()
                    os.close(nonblocking_fd)
                    return os.fdopen(first, "rb")
                break
            if poller.poll(20):  # data, or a writer that already finished
                _abandon(thread, fifo, opened)
                os.set_blocking(nonblocking_fd, True)
                return os.fdopen(nonblocking_fd, "rb")
            if time.monotonic() >= deadline:
                break
    except BaseException:
        _abandon(thread, fifo, opened)
        os.close(nonblocking_fd)
        raise
    failure = opened[0] if opened and isinstance(opened[0], OSError) else None
    _abandon(thread, fifo, opened)
    os.close(nonblocking_fd)
    if failure is not None:
        raise failure
    raise InputRefused(
        f"is a FIFO (named pipe) that no process opened for writing within {timeout_s:g} s",
        "start the program that writes into it first, or pipe its output into gpuwarden "
        "(cmd | gpuwarden explain)")


def _abandon(thread: threading.Thread, fifo: str, opened: list[int | OSError]) -> None:
    """Stop the thread waiting in a blocking open of ``fifo`` and close what it opened."""
    if thread.is_alive():
        # A writer end opened by us (non-blocking: it succeeds, a reader is waiting) lets the
        # waiting open return; both ends are closed at once.
        try:
            unblock = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            unblock = -1
        thread.join(1.0)
        if unblock >= 0:
            os.close(unblock)
    for item in opened:
        if isinstance(item, int):
            os.close(item)
    opened.clear()
