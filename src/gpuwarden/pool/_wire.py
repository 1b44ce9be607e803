"""Frames on a pool worker's socket, and the non-blocking buffers the pool's manager keeps.

A frame is a fixed header — payload length, task id, kind — then the payload. The header
stays outside any pickle, so the manager knows which task a frame belongs to even when its
payload cannot be unpickled there.

The worker side blocks (one task at a time, nothing else to do). The manager side never
does: it reads and writes every worker's socket without blocking, keeping what is not yet
written or not yet complete in per-worker buffers, so one worker that does not read (stuck
in an initializer, stopped) cannot hold up the others — neither a large payload sent to it
nor its half-sent result.
"""

from __future__ import annotations

import collections
import errno
import itertools
import socket
import struct
from enum import IntEnum

HEADER = struct.Struct("<QqB")  # payload bytes, task id (-1: none), kind
# A TASK_BEHIND's payload and a SKIPPED's begin with the send's claim (_worker.py).
CLAIM = struct.Struct("<Q")
# Below this the header and payload go out in one send; above, in two (no copy of the payload).
COALESCE_BYTES = 1 << 16
# One read call per worker and wake-up takes at most this much: a worker sending a large
# result cannot starve the others' short messages.
READ_CHUNK = 1 << 20
# The manager's read buffer per worker: frames up to this size are read many to a call.
BUFFER_BYTES = 1 << 16
# At most this many pieces go in one sendmsg (far below any system's IOV_MAX).
SEND_PIECES = 64
# What a read or write on a worker's socket fails with when the worker is gone. Anything else
# (ENOBUFS, ENOMEM under memory pressure) is tried again later, never taken for a death.
GONE = {errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF, errno.ESHUTDOWN}


class Kind(IntEnum):
    # parent -> worker
    BOOT = 1
    TASK = 2
    STOP = 3
    # A task sent to a worker still running another (pipelined); payload: the send's claim,
    # then the task. The worker runs it only if it takes the claim first (a byte of the pool's
    # claim file, _worker.py); the pool takes it back by taking the claim itself. Without the
    # claim, taking it back could run it twice.
    TASK_BEHIND = 4
    # worker -> parent
    READY = 10       # preload, memory cap and initializer done; payload: notes (pickled list)
    INIT_ERROR = 11  # payload: the pickled exception (with the worker's traceback)
    STARTED = 12     # the worker has read task `task id` and is about to load and run it
    RESULT = 13      # payload: pickled return value
    ERROR = 14       # payload: pickled exception (with the worker's traceback)
    # Sent before a task's RESULT or ERROR when loading the task imported modules; payload:
    # (seconds loading took, their names) pickled. The pool's next workers import them before
    # they are READY; the import's time is not counted as the task's.
    IMPORTED = 15
    SKIPPED = 16     # a TASK_BEHIND whose claim the worker could not take: not run; payload: the claim


def frame(kind: Kind, task_id: int, payload: bytes | memoryview = b"") -> list[bytes | memoryview]:
    """The pieces to send for one frame (one piece when small)."""
    header = HEADER.pack(len(payload), task_id, kind)
    if len(payload) <= COALESCE_BYTES:
        return [header + bytes(payload)]
    return [header, payload]


# -- the blocking side (worker, server) ----------------------------------------------------

def send_frame(sock: socket.socket, kind: Kind, task_id: int,
               payload: bytes | memoryview = b"") -> None:
    for piece in frame(kind, task_id, payload):
        sock.sendall(piece)


class FrameSource:
    """Frames from a blocking socket (the worker's). A small frame's header and payload come
    in one call, with whatever follows them; a large payload is read straight into its own
    buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()

    def _fill(self, n: int) -> bool:
        while len(self._buf) < n:
            chunk = self._sock.recv(BUFFER_BYTES)
            if not chunk:
                return False
            self._buf += chunk
        return True

    def next(self) -> tuple[Kind, int, bytearray] | None:
        """The next frame, or None at end of input (the other side is gone)."""
        if not self._fill(HEADER.size):
            return None
        length, task_id, kind = HEADER.unpack_from(self._buf)
        end = HEADER.size + length
        if end <= BUFFER_BYTES:
            if not self._fill(end):
                return None
            payload = self._buf[HEADER.size:end]
            del self._buf[:end]
            return Kind(kind), task_id, payload
        payload = bytearray(length)
        got = min(len(self._buf) - HEADER.size, length)
        payload[:got] = self._buf[HEADER.size:HEADER.size + got]
        del self._buf[:HEADER.size + got]
        view = memoryview(payload)
        while got < length:
            k = self._sock.recv_into(view[got:])
            if k == 0:
                return None
            got += k
        return Kind(kind), task_id, payload


# -- the non-blocking side (the pool's manager thread) -------------------------------------

class FrameReader:
    """Collects frames from a non-blocking socket across partial reads.

    Small frames are read through one buffer, as many as the socket holds in one call (a
    worker's STARTED and RESULT often arrive together); a frame too large for the buffer is
    read straight into its own. A read that returns less than it asked for has emptied the
    socket (a stream socket gives all it holds), so no call is spent to hear EAGAIN."""

    def __init__(self) -> None:
        self._buf = bytearray(BUFFER_BYTES)
        self._start = 0  # unparsed bytes: _buf[_start:_end]
        self._end = 0
        self._body: bytearray | None = None  # a large frame's payload, being filled
        self._got = 0
        self._kind = 0
        self._task_id = 0
        self.eof = False
        self.error: OSError | None = None
        self.more = False  # the last read stopped at its budget: the socket may hold more

    @property
    def partial(self) -> bool:
        """A frame has begun and not ended (a worker that died while sending it)."""
        return self._end > self._start or self._body is not None

    def read(self, sock: socket.socket) -> list[tuple[Kind, int, bytearray]]:
        """Every frame completed by what the socket has now (sets :attr:`eof` at its end)."""
        frames: list[tuple[Kind, int, bytearray]] = []
        budget = READ_CHUNK
        while budget > 0 and not self.eof:
            try:
                if self._body is not None:
                    view = memoryview(self._body)[self._got:self._got + budget]
                    k = sock.recv_into(view)
                    if k == 0:
                        self.eof = True
                        break
                    self._got += k
                    budget -= k
                    if self._got == len(self._body):
                        frames.append((Kind(self._kind), self._task_id, self._body))
                        self._body = None
                    elif k < len(view):
                        break  # the socket is empty
                    continue
                if self._start:  # what is left (part of a frame) to the buffer's front
                    left = self._end - self._start
                    self._buf[:left] = self._buf[self._start:self._end]
                    self._start, self._end = 0, left
                asked = min(len(self._buf) - self._end, budget)
                k = sock.recv_into(memoryview(self._buf)[self._end:self._end + asked])
                if k == 0:
                    self.eof = True
                    break
                self._end += k
                budget -= k
                self._parse(frames)
                if k < asked:
                    break  # the socket is empty
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.eof = exc.errno in GONE  # ECONNRESET and the like: the worker is gone
                self.error = exc
                break
        self.more = budget <= 0 and not self.eof
        return frames

    def _parse(self, frames: list[tuple[Kind, int, bytearray]]) -> None:
        """Take the buffer's whole frames; a large frame's start moves to its own buffer."""
        buf = self._buf
        while self._end - self._start >= HEADER.size:
            length, task_id, kind = HEADER.unpack_from(buf, self._start)
            begin = self._start + HEADER.size
            if self._end - begin >= length:
                frames.append((Kind(kind), task_id, buf[begin:begin + length]))
                self._start = begin + length
            elif length > len(buf) - HEADER.size:
                have = self._end - begin
                self._body = bytearray(length)
                self._body[:have] = buf[begin:self._end]
                self._got, self._kind, self._task_id = have, kind, task_id
                self._start = self._end = 0
                return
            else:
                return  # the rest of this frame is still to come
        if self._start == self._end:
            self._start = self._end = 0


class FrameWriter:
    """Frames waiting to be written to a non-blocking socket, written as it accepts them."""

    def __init__(self) -> None:
        self._pieces: collections.deque[memoryview] = collections.deque()
        self.broken = False
        self.error: OSError | None = None

    def __bool__(self) -> bool:
        return bool(self._pieces)

    def put(self, kind: Kind, task_id: int, payload: bytes | memoryview = b"") -> None:
        self._pieces.extend(memoryview(p) for p in frame(kind, task_id, payload))

    def flush(self, sock: socket.socket) -> None:
        """Write what the socket takes now; sets :attr:`broken` when it takes nothing more."""
        pieces = self._pieces
        while pieces and not self.broken:
            try:
                # Every waiting frame in one call (a task pipelined behind another, a STOP)
                sent = (sock.send(pieces[0]) if len(pieces) == 1
                        else sock.sendmsg(list(itertools.islice(pieces, SEND_PIECES))))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in GONE:
                    return  # tried again when the socket is writable
                self.broken = True  # EPIPE: the worker is gone; its exit report follows
                self.error = exc
                pieces.clear()
                return
            while sent:
                if sent >= len(pieces[0]):
                    sent -= len(pieces.popleft())
                else:
                    pieces[0] = pieces[0][sent:]
                    return  # the socket took part: it is full
