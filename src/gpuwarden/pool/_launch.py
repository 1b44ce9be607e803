"""Starting pool workers: a fresh interpreter each (spawn) or a fork of gpuwarden's fork server.

Both give each worker its own environment before any of its code runs; see docs/pool.md.
Only the pool's manager thread calls these: PR_SET_PDEATHSIG fires when the *thread* that
forked a child ends, so every process is started from the one thread that lives as long
as the pool.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol

from gpuwarden.errors import PoolBrokenError
from gpuwarden.pool import _forkserver

EXIT_WAIT_S = 5.0

# The manager thread starts processes while the caller's own threads may fork (joblib's own
# tests start a multiprocessing Manager next to a running pool). A fork inside Popen's window
# copies Popen's error pipe into the forked child, which keeps its write end open for as long
# as it lives, and Popen then waits for that pipe's end forever (seen in the joblib suite on a
# loaded machine). So a fork waits for a start in flight, and a start for a fork in flight.
# Popen without preexec_fn does not run these at-fork hooks itself.
_START_LOCK = threading.Lock()
os.register_at_fork(before=_START_LOCK.acquire, after_in_parent=_START_LOCK.release,
                    after_in_child=_START_LOCK.release)


class Launcher(Protocol):
    control: Any  # something multiprocessing.connection.wait accepts, or None

    def start(self) -> list[str]: ...
    def launch(self, env: Mapping[str, str]) -> tuple[Connection, int]: ...
    def on_control(self) -> None: ...
    def wait_exit(self, pid: int) -> int | None: ...
    def pids(self) -> list[int]: ...
    def stop(self) -> None: ...


def _socketpair() -> tuple[socket.socket, socket.socket]:
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return parent, child


def _connection(sock: socket.socket) -> Connection:
    return Connection(sock.detach())


class SpawnLauncher:
    """``python -m gpuwarden.pool._worker``: the worker's environment is fixed at exec."""

    control = None

    def __init__(self) -> None:
        self._popens: dict[int, subprocess.Popen[bytes]] = {}

    def start(self) -> list[str]:
        return []

    def launch(self, env: Mapping[str, str]) -> tuple[Connection, int]:
        parent, child = _socketpair()
        full_env = {**os.environ, **env}
        try:
            with _START_LOCK:
                popen = subprocess.Popen(
                    [sys.executable, "-m", "gpuwarden.pool._worker", str(child.fileno()),
                     str(os.getpid())],
                    env=full_env, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
                )
        finally:
            child.close()
        self._popens[popen.pid] = popen
        return _connection(parent), popen.pid

    def on_control(self) -> None:
        pass

    def wait_exit(self, pid: int) -> int | None:
        popen = self._popens.pop(pid, None)
        if popen is None:
            return None
        try:
            return popen.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            return None

    def pids(self) -> list[int]:
        return list(self._popens)

    def stop(self) -> None:
        for pid in list(self._popens):
            self.wait_exit(pid)


class ForkServerLauncher:
    """One fork server per pool: preload once, fork each worker in milliseconds."""

    def __init__(self, sys_path: Sequence[str], preload: Sequence[str]) -> None:
        self._boot = {"sys_path": list(sys_path), "preload": list(preload)}
        self._sock: socket.socket | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self._exits: dict[int, int] = {}
        self._live: set[int] = set()
        self.control: Any = None

    def start(self) -> list[str]:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        # The server must not pick a GPU for anyone: each worker sets its own.
        env.pop("CUDA_VISIBLE_DEVICES", None)
        try:
            with _START_LOCK:
                self._popen = subprocess.Popen(
                    [sys.executable, "-m", "gpuwarden.pool._forkserver", str(child.fileno()),
                     str(os.getpid())],
                    env=env, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
                )
        finally:
            child.close()
        self._sock = parent
        self.control = parent
        parent.send(pickle.dumps(self._boot))
        message = self._receive()
        if message is None or message[0] != "ready":
            raise PoolBrokenError(
                "gpuwarden's fork server did not start",
                why=f"it exited with code {self._popen.wait()}" if message is None else None,
                fix="look at its output above; try start_method='spawn'",
            )
        return list(message[2])

    def _receive(self, timeout_s: float | None = None) -> tuple[Any, ...] | None:
        assert self._sock is not None
        self._sock.settimeout(timeout_s)
        try:
            data = self._sock.recv(_forkserver.MAX_MESSAGE_BYTES)
        except (TimeoutError, OSError):
            return None
        finally:
            self._sock.settimeout(None)
        if not data:
            return None
        message: tuple[Any, ...] = pickle.loads(data)
        if message[0] == "exit":
            self._exits[message[1]] = message[2]
            self._live.discard(message[1])
        return message

    def launch(self, env: Mapping[str, str]) -> tuple[Connection, int]:
        assert self._sock is not None
        parent, child = _socketpair()
        try:
            socket.send_fds(self._sock, [pickle.dumps(("fork", 0))], [child.fileno()])
        finally:
            child.close()
        while True:
            message = self._receive()
            if message is None:
                raise PoolBrokenError("gpuwarden's fork server is gone",
                                      fix="try start_method='spawn'")
            if message[0] == "forked":
                self._live.add(message[2])
                return _connection(parent), int(message[2])

    def on_control(self) -> None:
        if self._receive(timeout_s=0) is None and self._popen is not None \
                and self._popen.poll() is not None:
            self.control = None

    def wait_exit(self, pid: int) -> int | None:
        deadline = time.monotonic() + EXIT_WAIT_S
        while pid not in self._exits:
            left = deadline - time.monotonic()
            if left <= 0 or self._sock is None:
                return None
            if self._receive(timeout_s=left) is None and self._popen is not None \
                    and self._popen.poll() is not None:
                return None
        return self._exits.pop(pid)

    def pids(self) -> list[int]:
        return [*self._live, *([self._popen.pid] if self._popen else [])]

    def stop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.send(pickle.dumps(("stop",)))
        if self._popen is not None:
            try:
                self._popen.wait(timeout=EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self.control = None
