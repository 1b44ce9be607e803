"""gpuwarden's fork server: imports the preload modules once, then forks pool workers.

Why not ``multiprocessing``'s forkserver: its children re-run the caller's ``__main__``
before their target (that import could touch CUDA before the worker's
CUDA_VISIBLE_DEVICES is in place), and it is one server per interpreter whose preload
list is fixed by whoever starts it first. This one belongs to one pool.

The server is a fresh interpreter (``python -m gpuwarden.pool._forkserver FD PPID``)
that must never initialize CUDA: it imports ``torch`` (which does not initialize CUDA)
and nothing calls into ``torch.cuda`` here. A forked worker sets its own
CUDA_VISIBLE_DEVICES before any task runs; CUDA reads the variable when it initializes.

Protocol, one SOCK_SEQPACKET message each (pickled):
parent -> server: the boot dict, then ``("fork", token)`` carrying the worker's socket as
an SCM_RIGHTS fd, or ``("stop",)``;
server -> parent: ``("ready", pid, notes)``, ``("forked", token, pid)``, and
``("exit", pid, returncode)`` when a worker ends (the server reaps its children).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import select
import signal
import socket
import sys
import traceback
from multiprocessing.connection import Connection

from gpuwarden.procs import die_with_parent, status_to_returncode

MAX_MESSAGE_BYTES = 1 << 16


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        sock.send(pickle.dumps(("exit", pid, status_to_returncode(status))))


def _child(sock: socket.socket, wake: tuple[int, int], fd: int, server_pid: int) -> None:
    code = 1
    try:
        sock.close()
        os.close(wake[0])
        os.close(wake[1])
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        die_with_parent(server_pid)
        from gpuwarden.pool._worker import serve

        conn = Connection(fd)
        boot = pickle.loads(conn.recv_bytes())
        code = serve(conn, boot)
    except BaseException:  # noqa: BLE001 - a child must never return into the server loop
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str]) -> int:
    fd, ppid = int(argv[0]), int(argv[1])
    die_with_parent(ppid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    boot = pickle.loads(sock.recv(MAX_MESSAGE_BYTES))
    for entry in reversed(boot["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    notes = []
    for module in ("gpuwarden.pool._worker", *boot["preload"]):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            notes.append(f"preload {module!r} not importable: {exc}")
    server_pid = os.getpid()
    wake = os.pipe()
    os.set_blocking(wake[1], False)
    signal.set_wakeup_fd(wake[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
    children: set[int] = set()
    sock.send(pickle.dumps(("ready", os.getpid(), notes)))
    try:
        while True:
            readable, _, _ = select.select([sock.fileno(), wake[0]], [], [])
            if wake[0] in readable:
                os.read(wake[0], 4096)
                _reap(sock, children)
            if sock.fileno() not in readable:
                continue
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 1)
            if not data:
                return 0  # the pool's process is gone
            message = pickle.loads(data)
            if message[0] == "stop":
                return 0
            pid = os.fork()
            if pid == 0:
                _child(sock, wake, fds[0], server_pid)
            os.close(fds[0])
            children.add(pid)
            sock.send(pickle.dumps(("forked", message[1], pid)))
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
