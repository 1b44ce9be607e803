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


def _recv_exactly(sock: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return buf


def recv_frame(sock: socket.socket) -> tuple[Kind, int, bytearray] | None:
    """The next frame, or None at end of input (the other side is gone)."""
    header = _recv_exactly(sock, HEADER.size)
    if header is None:
        return None
    length, task_id, kind = HEADER.unpack(header)
    payload = _recv_exactly(sock, length) if length else bytearray()
    if payload is None:
        return None
    return Kind(kind), task_id, payload


# -- the non-blocking side (the pool's manager thread) -------------------------------------

class FrameReader:
    """Collects frames from a non-blocking socket across partial reads."""

    def __init__(self) -> None:
        self._header = bytearray()
        self._body: bytearray | None = None
        self._got = 0
        self._kind = 0
        self._task_id = 0
        self.eof = False
        self.error: OSError | None = None
        self.more = False  # the last read stopped at its budget: the socket may hold more

    @property
    def partial(self) -> bool:
        """A frame has begun and not ended (a worker that died while sending it)."""
        return bool(self._header) or self._body is not None

    def read(self, sock: socket.socket) -> list[tuple[Kind, int, bytearray]]:
        """Every frame completed by what the socket has now (sets :attr:`eof` at its end)."""
        frames: list[tuple[Kind, int, bytearray]] = []
        budget = READ_CHUNK
        while budget > 0 and not self.eof:
            try:
                if self._body is None:
                    chunk = sock.recv(HEADER.size - len(self._header))
                    if not chunk:
                        self.eof = True
                        break
                    self._header += chunk
                    budget -= len(chunk)
                    if len(self._header) < HEADER.size:
                        continue
                    length, self._task_id, self._kind = HEADER.unpack(self._header)
                    self._header.clear()
                    self._body, self._got = bytearray(length), 0
                else:
                    view = memoryview(self._body)[self._got:self._got + budget]
                    k = sock.recv_into(view) if len(view) else 0
                    if len(view) and k == 0:
                        self.eof = True
                        break
                    self._got += k
                    budget -= k
                if self._body is not None and self._got == len(self._body):
                    frames.append((Kind(self._kind), self._task_id, self._body))
                    self._body = None
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.eof = exc.errno in GONE  # ECONNRESET and the like: the worker is gone
                self.error = exc
                break
        self.more = budget <= 0 and not self.eof
        return frames


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
        while self._pieces and not self.broken:
            piece = self._pieces[0]
            try:
                sent = sock.send(piece)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in GONE:
                    return  # tried again when the socket is writable
                self.broken = True  # EPIPE: the worker is gone; its exit report follows
                self.error = exc
                self._pieces.clear()
                return
            if sent == len(piece):
                self._pieces.popleft()
            else:
                self._pieces[0] = piece[sent:]
