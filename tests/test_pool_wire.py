"""The pool's wire (_wire.py) and mailbox on real sockets and pipes: frames arrive whole
however the stream is cut, and the per-task system calls stay few (a burst of submit() calls
wakes the manager once; two small frames waiting in a socket are one read)."""
from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
from typing import Any

import pytest

from gpuwarden.pool._manager import Mailbox
from gpuwarden.pool._wire import (
    BUFFER_BYTES,
    HEADER,
    FrameReader,
    FrameSource,
    FrameWriter,
    Kind,
    frame,
)

# Frames of every size class: empty (STARTED), small, around the read buffer's size, and
# larger than it (read straight into their own buffer).
PAYLOADS = [b"", b"x" * 7, bytes(range(256)) * 3, b"a" * (BUFFER_BYTES - 17),
            b"b" * (BUFFER_BYTES - 16), b"c" * BUFFER_BYTES, os.urandom(3 * BUFFER_BYTES + 5), b"z"]


def _stream() -> tuple[bytes, list[tuple[Kind, int, bytes]]]:
    sent = [(Kind.RESULT if i % 2 else Kind.STARTED, i - 1, p) for i, p in enumerate(PAYLOADS)]
    data = b"".join(bytes(piece) for kind, tid, p in sent for piece in frame(kind, tid, p))
    return data, sent


class CountingSocket:
    """A real socket whose receive calls are counted."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.calls = 0

    def recv_into(self, buf: Any) -> int:
        self.calls += 1
        return self.sock.recv_into(buf)


@pytest.mark.parametrize("seed", range(4))
def test_the_managers_reader_gets_every_frame_whole_however_the_stream_is_cut(seed: int) -> None:
    data, sent = _stream()
    rng = random.Random(seed)
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        reader, got = FrameReader(), []
        pos = 0
        while pos < len(data):
            # cuts inside headers, inside payloads, and several frames at once
            step = rng.choice([1, 3, 16, 17, 100, BUFFER_BYTES - 1, BUFFER_BYTES + 9, 200_000])
            a.sendall(data[pos:pos + step])
            pos = min(pos + step, len(data))
            while True:
                got.extend(reader.read(b))
                if not reader.more:
                    break
            taken = sum(HEADER.size + len(p) for _k, _t, p in got)
            assert reader.partial == (taken < pos)
        assert [(k, t, bytes(p)) for k, t, p in got] == sent
        assert not reader.partial and not reader.eof
        a.close()
        assert reader.read(b) == [] and reader.eof


def test_a_frame_cut_by_the_senders_death_is_partial_then_eof() -> None:
    a, b = socket.socketpair()
    with b:
        b.setblocking(False)
        data = b"".join(bytes(x) for x in frame(Kind.RESULT, 5, b"q" * 1000))
        a.sendall(data[:500])
        a.close()
        reader = FrameReader()
        assert reader.read(b) == []
        # all there was came in one read (a short read: the socket is empty); its end with
        # the next, as the manager's next wake-up (the end of input keeps the socket readable)
        assert reader.partial and reader.read(b) == []
        assert reader.eof and reader.partial


def test_two_small_frames_waiting_in_the_socket_take_one_read() -> None:
    """A worker's STARTED and RESULT of a tiny task: one call, not a header and a payload
    read each plus a last one that hears EAGAIN (five before)."""
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        for kind, payload in ((Kind.STARTED, b""), (Kind.RESULT, b"\x80\x05K\x01.")):
            for piece in frame(kind, 9, payload):
                a.sendall(piece)
        counted = CountingSocket(b)
        frames = FrameReader().read(counted)  # type: ignore[arg-type]
        assert [(k, t) for k, t, _ in frames] == [(Kind.STARTED, 9), (Kind.RESULT, 9)]
        assert counted.calls == 1


@pytest.mark.parametrize("seed", range(3))
def test_the_workers_source_gets_every_frame_whole_however_the_stream_is_cut(seed: int) -> None:
    data, sent = _stream()
    rng = random.Random(seed)
    a, b = socket.socketpair()

    def feed() -> None:
        pos = 0
        while pos < len(data):
            step = rng.choice([1, 5, 17, 4096, BUFFER_BYTES + 3, 300_000])
            a.sendall(data[pos:pos + step])
            pos += step
        a.close()

    writer = threading.Thread(target=feed)
    writer.start()
    with b:
        source, got = FrameSource(b), []
        while (item := source.next()) is not None:
            got.append((item[0], item[1], bytes(item[2])))
    writer.join()
    assert got == sent


def test_the_writer_sends_queued_frames_in_order_through_a_full_socket() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        data, sent = _stream()
        writer = FrameWriter()
        for kind, tid, payload in sent * 3:
            writer.put(kind, tid, payload)
        received = bytearray()
        b.setblocking(False)
        while writer or len(received) < 3 * len(data):
            writer.flush(a)
            assert not writer.broken
            with contextlib.suppress(BlockingIOError):
                while chunk := b.recv(1 << 16):
                    received += chunk
        assert bytes(received) == data * 3


def test_a_burst_of_puts_writes_one_wake_byte_until_the_manager_takes_them() -> None:
    box = Mailbox()
    try:
        with box.lock:
            for i in range(100):
                box.put_locked("task", i)
        assert os.read(box.wake_r, 1024) == b"x"  # one byte for the burst, not 100
        with box.lock:
            assert [e[1] for e in box.take_locked()] == list(range(100))
            box.put_locked("task", 100)  # after a take: the manager must wake again
        assert os.read(box.wake_r, 1024) == b"x"
    finally:
        os.close(box.wake_r)
        os.close(box.wake_w)
