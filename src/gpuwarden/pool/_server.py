"""The pool's process server: one small single-threaded process per pool that starts, watches
and stops every worker. ``python -m gpuwarden.pool._server FD OWNER_PID``.

Why a server for both start methods: a process started from a thread of the caller's process
races the caller's own ``fork()`` in another thread (the child of that fork inherits the
starter's pipes; ``subprocess`` then waits on its error pipe for as long as that child
lives). The server is started once, with ``posix_spawn`` (no pipe to wait on), and being
single-threaded it forks or spawns the workers without any such race.

- ``forkserver``: the server imports the preload modules (``torch``: importing it does not
  initialize CUDA, and nothing here calls into ``torch.cuda``) with the workers' thread caps
  already in its environment, then forks each worker in milliseconds. A forked worker puts
  its slot's variables into its environment first; CUDA reads CUDA_VISIBLE_DEVICES when it
  initializes, later, in a task. Unlike the standard library's forkserver it is private to
  the pool (its own preload list) and never imports the caller's ``__main__``.
- ``spawn``: the server ``posix_spawn`` s ``python -m gpuwarden.pool._worker`` with the slot's
  environment: nothing in the new interpreter runs before it is in place.

Every worker is in its own process group and dies with the server (PR_SET_PDEATHSIG). The
server is a child subreaper: what a task starts stays under it even when the worker dies.
When a worker exits, the server kills the rest of the worker's process group (while the
worker is still a zombie, so the group id cannot have been reused), reaps it and reports
``("exit", pid, returncode)``. It never signals a pid it has reaped. When the pool's process
dies (watched through a pidfd, or by polling the parent pid), or on ``("stop",)``, it kills
everything under it, reaps it, and exits.

Protocol on the control socket (SOCK_SEQPACKET, one pickle per message; both ends are the
same user's processes; the pool's end is :class:`ServerLink`, in the pool's process):
pool -> server: the boot dict; ``("spawn", key, env)`` with the worker's socket as an
SCM_RIGHTS fd; ``("kill", pid)``; ``("stop",)``.
server -> pool: ``("ready", pid, notes)``, ``("forked", key, pid)``,
``("spawn_failed", key, text)``, ``("exit", pid, returncode)``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import importlib
import os
import pickle
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from gpuwarden.procs import die_with_parent, status_to_returncode

MAX_MESSAGE_BYTES = 1 << 20
KILL_ALL_WITHIN_S = 5.0
_PR_SET_CHILD_SUBREAPER = 36
# Signals a child of a Python process should get back at their defaults (as subprocess does).
RESET_SIGNALS = tuple(getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ", "SIGXFZ")
                      if hasattr(signal, name))


# ---- the pool's end (in the pool's process) ----------------------------------------------


class ServerLink:
    """The pool's end of the control socket (the manager thread's): starts the server with
    ``posix_spawn``, sends it messages (and the workers' sockets), reads what it reports,
    reaps it, and kills its whole tree when it does not stop."""

    def __init__(self, boot: dict[str, Any], env: Mapping[str, str]) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.pid = os.posix_spawn(
                sys.executable,
                [sys.executable, "-m", "gpuwarden.pool._server", "3", str(os.getpid())],
                dict(env),
                file_actions=[(os.POSIX_SPAWN_DUP2, child.fileno(), 3),
                              (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)],
                setsigdef=RESET_SIGNALS, setsigmask=(),
            )
        finally:
            child.close()
        self.sock = parent
        self.sock.setblocking(False)
        self.outbox: collections.deque[tuple[bytes, list[int]]] = collections.deque()
        self.returncode: int | None = None
        self.gone = False
        self.send(boot)

    def send(self, message: Any, fds: Sequence[int] = ()) -> None:
        self.outbox.append((pickle.dumps(message), list(fds)))
        self.flush()

    def flush(self) -> None:
        while self.outbox and not self.gone:
            data, fds = self.outbox[0]
            try:
                if fds:
                    socket.send_fds(self.sock, [data], fds)
                else:
                    self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.gone = True
            self.outbox.popleft()
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self.gone:
            while self.outbox:
                for fd in self.outbox.popleft()[1]:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def receive(self) -> list[tuple[Any, ...]] | None:
        """Messages the server sent; None when it is gone (end of input)."""
        out: list[tuple[Any, ...]] = []
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError:
                data = b""
            if not data:
                self.gone = True
                return out or None
            out.append(pickle.loads(data))

    def reap(self, timeout_s: float) -> int | None:
        """Wait (bounded) for the server to exit; kill it if it does not; its returncode."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else (SIGCHLD ignored, a reaper)
                return None
            if pid:
                self.returncode = status_to_returncode(status)
                return self.returncode
            if time.monotonic() >= deadline:
                self.kill_tree()
                deadline = time.monotonic() + timeout_s
            time.sleep(0.005)

    def kill_tree(self) -> None:
        """SIGKILL the server and everything under it. Its pid is ours until we reap it; its
        descendants are not reaped by anyone while it is stopped or stuck."""
        import psutil

        try:
            tree = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)

    def close(self) -> None:
        self.gone = True
        self.flush()  # closes the descriptors of what was never sent
        self.sock.close()


# ---- the server (in its own process) ---------------------------------------------------


def _subreaper() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _watch_owner(owner_pid: int) -> int | None:
    """A pidfd that becomes readable when the pool's process exits (None: poll instead)."""
    try:
        fd = os.pidfd_open(owner_pid)
    except (AttributeError, OSError):
        return None
    if os.getppid() != owner_pid:  # it died before the pidfd was opened
        os.close(fd)
        sys.exit(0)
    return fd


class Server:
    def __init__(self, sock: socket.socket, owner_pid: int, boot: dict[str, Any]) -> None:
        self.sock = sock
        self.owner_pid = owner_pid
        self.method: str = boot["method"]
        self.workers: set[int] = set()
        self.pid = os.getpid()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written

    def send(self, message: tuple[Any, ...]) -> None:
        try:
            self.sock.send(pickle.dumps(message))
        except OSError:
            self.stop_everything()
            os._exit(0)  # the pool is gone

    # -- workers -------------------------------------------------------------------------

    def spawn(self, key: int, env: dict[str, str], fd: int) -> None:
        try:
            pid = self._fork_worker(env, fd) if self.method == "forkserver" \
                else self._spawn_worker(env, fd)
        except OSError as exc:
            self.send(("spawn_failed", key, f"{type(exc).__name__}: {exc}"))
            return
        finally:
            os.close(fd)
        self.workers.add(pid)
        self.send(("forked", key, pid))

    def _spawn_worker(self, env: dict[str, str], fd: int) -> int:
        return os.posix_spawn(
            sys.executable, [sys.executable, "-m", "gpuwarden.pool._worker", "3", str(self.pid)],
            {**os.environ, **env},
            file_actions=[(os.POSIX_SPAWN_DUP2, fd, 3)],
            setpgroup=0, setsigdef=RESET_SIGNALS, setsigmask=(),
        )

    def _fork_worker(self, env: dict[str, str], fd: int) -> int:
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            os.setpgid(0, 0)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for extra in (self.wake_r, self.wake_w):
                os.close(extra)
            self.sock.close()
            die_with_parent(self.pid)
            os.environ.update(env)
            from gpuwarden.pool._worker import serve

            code = serve(socket.socket(fileno=fd))
        except BaseException:  # noqa: BLE001 - a child must never return into the server loop
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
        raise AssertionError("unreachable")

    def kill(self, pid: int) -> None:
        # Only a child not yet reaped: its pid cannot belong to anyone else.
        if pid in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def reap(self) -> None:
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid == 0:
                return
            pid = info.si_pid
            if pid in self.workers:
                # What the worker started in its group goes with it; the zombie keeps the
                # group id from being reused until it is reaped just below.
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
            try:
                _, status = os.waitpid(pid, 0)
            except ChildProcessError:
                continue
            if pid in self.workers:
                self.workers.discard(pid)
                self.send(("exit", pid, status_to_returncode(status)))

    def stop_everything(self) -> None:
        """SIGKILL every process under the server (workers, and what they left behind, which
        came to the server as their subreaper), reap them all, within a bound."""
        import psutil

        deadline = time.monotonic() + KILL_ALL_WITHIN_S
        for pid in list(self.workers):
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        while time.monotonic() < deadline:
            try:
                children = psutil.Process(self.pid).children()
            except psutil.Error:
                children = []
            for child in children:
                with contextlib.suppress(psutil.Error):
                    child.send_signal(signal.SIGKILL)
            try:
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                return
            time.sleep(0.01)

    # -- the loop ------------------------------------------------------------------------

    def run(self, owner_fd: int | None) -> None:
        watched = [self.sock.fileno(), self.wake_r, *([owner_fd] if owner_fd is not None else [])]
        while True:
            readable, _, _ = select.select(watched, [], [], 1.0 if owner_fd is None else None)
            if (owner_fd is not None and owner_fd in readable) or os.getppid() != self.owner_pid:
                return  # the pool's process is gone
            if self.wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
                self.reap()
            if self.sock.fileno() not in readable:
                continue
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE_BYTES, 1)
            except OSError:
                return
            if not data:
                return  # the pool closed its end
            message = pickle.loads(data)
            if message[0] == "spawn":
                if fds:
                    self.spawn(message[1], message[2], fds[0])
            elif message[0] == "kill":
                self.kill(message[1])
            elif message[0] == "stop":
                return
            for extra in fds[1:] if message[0] == "spawn" else fds:
                os.close(extra)


def _preload(boot: dict[str, Any]) -> list[str]:
    from gpuwarden.pool import _worker

    # Started with the first slot's thread caps: what it loads now reads them, and a worker
    # forked with the same caps need not set them again.
    _worker.record_thread_env()
    notes = []
    for module in boot["preload"]:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            notes.append(f"preload {module!r} not importable: {exc}")
    return notes


def main(argv: list[str]) -> int:
    fd, owner_pid = int(argv[0]), int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
    _subreaper()
    owner_fd = _watch_owner(owner_pid)
    if os.getppid() != owner_pid:
        return 0
    sock = socket.socket(fileno=fd)
    boot = pickle.loads(sock.recv(MAX_MESSAGE_BYTES))
    for entry in reversed(boot["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    notes = _preload(boot) if boot["method"] == "forkserver" else []
    server = Server(sock, owner_pid, boot)
    server.send(("ready", server.pid, notes))
    try:
        server.run(owner_fd)
    finally:
        server.stop_everything()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
