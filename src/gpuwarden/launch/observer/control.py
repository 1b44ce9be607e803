"""The running launcher's control endpoint, and the per-user registry where it is found.

``gpuwarden status`` and ``gpuwarden stacks`` ask a running ``gpuwarden launch`` what its ranks
are doing. No signal is sent to anyone: the launcher serves a unix stream socket,
``<runtime dir>/<launcher pid>.sock``, beside ``<pid>.json`` (what the job is: its command,
run id, node, ranks; written once). One request per connection: a line of JSON in, a JSON
document out.

Who may ask is the kernel's decision, not this module's: the runtime directory is the user's
own, mode 0700 (``$XDG_RUNTIME_DIR/gpuwarden`` when the session has one, else
``/tmp/gpuwarden-run-<uid>``; ``GPUWARDEN_RUNTIME_DIR`` names another), so another user's
``connect()`` fails with EACCES before any byte reaches the launcher, and so does their
``ls`` of the directory. Nothing in the directory is world-readable. Root passes, as root
passes everywhere (it can ptrace the ranks anyway). What every user may know of another user's
job comes from what the system already shows them: the process table (pid, owner, command, as
``ps``) and the lease directory (GPUs, as ``gpuwarden leases``): see :mod:`gpuwarden.jobs`.

A directory at the /tmp path that is not this user's own 0700 directory (another user made it
first, a symbolic link, loose permissions) is never used: a fresh private one is made beside
it (``/tmp/gpuwarden-run-<uid>-XXXXXX``), which the readers look at too.

The endpoint's work happens in its own threads, never in the supervisor's loop: a request that
needs the supervisor's state hands a function to the loop (:class:`LoopCalls`), which runs it
between two polls and hands the result back. The endpoint costs nothing while nobody asks (its
thread sleeps in ``select``; the answers, ``observe.py``, are imported at the first request),
and a slow or silent client cannot delay the job (bounded reads, timeouts, at most
:data:`MAX_CLIENTS` at once). The supervisor hosts it without knowing it (``serve`` is handed
to it by the runner): it sees a :class:`ControlServer` only as its ``Endpoint``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwarden.boundedio import read_json_object

if TYPE_CHECKING:
    from gpuwarden.launch.supervisor import Supervisor

RUNTIME_ENV = "GPUWARDEN_RUNTIME_DIR"
RECORD_SCHEMA = 1
REQUEST_MAX_BYTES = 4096
RECORD_MAX_BYTES = 64 * 1024
ANSWER_MAX_BYTES = 64 * 1024 * 1024
MAX_CLIENTS = 8
CLIENT_IO_TIMEOUT_S = 5.0  # a client that neither sends its request nor reads its answer
MAX_FALLBACK_DIRS = 16
CONTROL_LINK = "control.sock"  # in the job's private directory: how its ranks find the endpoint


class EndpointError(OSError):
    """The endpoint could not be reached or did not answer properly (errno kept when known)."""


# ---- the runtime directory ---------------------------------------------------------------


def _private_dir(path: Path, uid: int) -> bool:
    """A directory (not a link) owned by ``uid`` that nobody else may enter."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and st.st_mode & 0o077 == 0


def _xdg_dir(env: dict[str, str] | os._Environ[str], uid: int) -> Path | None:
    base = env.get("XDG_RUNTIME_DIR")
    if base and os.path.isabs(base) and _private_dir(Path(base), uid):
        return Path(base) / "gpuwarden"
    return None


def tmp_dir_for(uid: int) -> Path:
    """The conventional place, the same for every user (so root and the user's own other
    sessions find it; $TMPDIR differs between sessions)."""
    return Path("/tmp") / f"gpuwarden-run-{uid}"


def runtime_dir(env: dict[str, str] | os._Environ[str] | None = None) -> Path:
    """This user's runtime directory, created 0700 if needed (never one another user made)."""
    env = os.environ if env is None else env
    uid = os.getuid()
    named = env.get(RUNTIME_ENV)
    candidates = [Path(named)] if named else [p for p in (_xdg_dir(env, uid), tmp_dir_for(uid))
                                               if p is not None]
    for path in candidates:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        if _private_dir(path, uid):
            return path
    if named:
        raise EndpointError(f"{RUNTIME_ENV}={named} is not a directory of this user's with "
                            "mode 0700")
    # Taken by another user, a link, or loose permissions: a fresh private one beside it.
    return Path(tempfile.mkdtemp(prefix=f"{tmp_dir_for(uid).name}-", dir=tmp_dir_for(uid).parent))


def runtime_dirs(uid: int | None = None,
                 env: dict[str, str] | os._Environ[str] | None = None) -> list[Path]:
    """Where ``uid``'s (default: this user's) launchers register, for readers. Another user's
    directories are found by their conventional names and owner only (what is inside them
    is for the kernel to refuse)."""
    env = os.environ if env is None else env
    me = os.getuid()
    uid = me if uid is None else uid
    if env.get(RUNTIME_ENV):
        return [Path(env[RUNTIME_ENV])]
    out: list[Path] = []
    xdg = _xdg_dir(env, uid) if uid == me else Path(f"/run/user/{uid}/gpuwarden")
    if xdg is not None:
        out.append(xdg)
    base = tmp_dir_for(uid)
    out.append(base)
    with contextlib.suppress(OSError):
        extra = sorted(e.path for e in os.scandir(base.parent)
                       if e.name.startswith(f"{base.name}-"))[:MAX_FALLBACK_DIRS]
        out += [Path(p) for p in extra if _private_dir(Path(p), uid)]
    return out


# ---- processes ---------------------------------------------------------------------------


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the
    pid, it names one process for good (a pid alone is reused)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


# ---- the supervisor's loop -----------------------------------------------------------------


class LoopCalls:
    """Functions handed from the endpoint's threads to the supervisor's loop, which owns all of
    the job's state: the loop runs them between two polls (it selects on :attr:`fileno` to
    wake at once) and the caller waits a bounded time for the result."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        for s in (self._r, self._w):
            s.setblocking(False)
        self._pending: queue.SimpleQueue[tuple[Callable[[float], Any], queue.SimpleQueue[Any]]] \
            = queue.SimpleQueue()
        self._closed = False

    def fileno(self) -> int:
        return self._r.fileno()

    def clear_wakeups(self) -> None:
        with contextlib.suppress(OSError):
            self._r.recv(4096)

    def call(self, fn: Callable[[float], Any], timeout_s: float = 2.0) -> Any:
        """Run ``fn(now)`` in the loop; its result, or EndpointError when the loop is gone."""
        if self._closed:
            raise EndpointError("the job is ending")
        box: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending.put((fn, box))
        with contextlib.suppress(OSError):
            self._w.send(b"x")
        try:
            ok, value = box.get(timeout=timeout_s)
        except queue.Empty:
            raise EndpointError("the launcher's loop did not answer in time") from None
        if not ok:
            raise EndpointError(f"the launcher could not answer: {value}")
        return value

    def run_pending(self) -> None:
        """In the loop: run what was handed over (a failure is the caller's, never the job's)."""
        while True:
            try:
                fn, box = self._pending.get_nowait()
            except queue.Empty:
                return
            try:
                box.put((True, fn(time.monotonic())))
            except Exception as exc:  # noqa: BLE001 - an endpoint bug must not stop the job
                box.put((False, f"{type(exc).__name__}: {exc}"))

    def close(self) -> None:
        self._closed = True
        self.run_pending()  # a caller waiting now gets its answer (or a clean refusal)
        for s in (self._r, self._w):
            s.close()


# ---- the endpoint ------------------------------------------------------------------------


Handler = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Endpoint:
    directory: Path
    pid: int

    @property
    def socket_path(self) -> Path:
        return self.directory / f"{self.pid}.sock"

    @property
    def record_path(self) -> Path:
        return self.directory / f"{self.pid}.json"


class ControlServer:
    """The endpoint of one launcher process: bound by :meth:`start`, gone after :meth:`close`.
    ``calls``: how its handler reaches the loop that hosts it (``fileno``, ``clear_wakeups``
    and ``run_pending`` are that loop's side)."""

    def __init__(self, record: dict[str, Any], handler: Handler, *,
                 directory: Path | None = None, calls: LoopCalls | None = None) -> None:
        self.calls = calls or LoopCalls()
        self.endpoint = Endpoint(directory or runtime_dir(), os.getpid())
        self.record = {"schema": RECORD_SCHEMA, "pid": os.getpid(), "uid": os.getuid(),
                       "start_ticks": process_start_ticks(os.getpid()), "started_at": time.time(),
                       **record}
        self.handler = handler
        self._sock: socket.socket | None = None
        self._stop_r, self._stop_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._clients = threading.BoundedSemaphore(MAX_CLIENTS)
        self._links: list[str] = []

    def start(self) -> ControlServer:
        path = self.endpoint.socket_path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # this pid's own leftover: a former process with our pid died
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            os.chmod(path, 0o600)  # the directory already keeps others out; this is for show
            sock.listen(16)
            _write_private(self.endpoint.record_path, json.dumps(self.record).encode())
        except BaseException:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="gpuwarden-control",
                                        daemon=True)
        self._thread.start()
        return self

    def link_into(self, directory: str) -> None:
        """A link to the endpoint in the job's private directory, where its ranks look for it
        (multi-node: a node answers another node's ``stacks`` through its own launcher)."""
        link = os.path.join(directory, CONTROL_LINK)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(link)
        with contextlib.suppress(OSError):
            os.symlink(self.endpoint.socket_path, link)
            self._links.append(link)

    def fileno(self) -> int:
        return self.calls.fileno()

    def clear_wakeups(self) -> None:
        self.calls.clear_wakeups()

    def run_pending(self) -> None:
        self.calls.run_pending()

    def _serve(self) -> None:
        assert self._sock is not None
        while True:
            try:
                ready, _, _ = select.select([self._sock.fileno(), self._stop_r], [], [])
            except (OSError, ValueError):
                return
            if self._stop_r in ready:
                return
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            if not self._clients.acquire(blocking=False):
                with contextlib.suppress(OSError):
                    conn.sendall(_encode({"ok": False, "error": "busy: too many requests at once"}))
                conn.close()
                continue
            threading.Thread(target=self._one, args=(conn,), name="gpuwarden-control-client",
                             daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(CLIENT_IO_TIMEOUT_S)
            request = _read_request(conn)
            try:
                answer = self.handler(request) if request is not None else \
                    {"ok": False, "error": "malformed request"}
            except Exception as exc:  # noqa: BLE001 - a failed answer must not touch the job
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            conn.sendall(_encode(answer))
        except OSError:
            pass
        finally:
            conn.close()
            self._clients.release()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        if self._sock is not None:
            self._sock.close()
        paths: list[str | Path] = [self.endpoint.socket_path, self.endpoint.record_path,
                                   *self._links]
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.calls.close()  # a request still waiting for the loop gets a clean refusal


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _encode(answer: dict[str, Any]) -> bytes:
    return json.dumps(answer, separators=(",", ":")).encode() + b"\n"


def _read_request(conn: socket.socket) -> dict[str, Any] | None:
    data = b""
    while b"\n" not in data and len(data) < REQUEST_MAX_BYTES:
        chunk = conn.recv(REQUEST_MAX_BYTES)
        if not chunk:
            break
        data += chunk
    line = data.split(b"\n", 1)[0]
    try:
        request = json.loads(line)
    except ValueError:
        return None
    return request if isinstance(request, dict) else None


# ---- the client --------------------------------------------------------------------------


def ask(path: str | os.PathLike[str], request: dict[str, Any], *,
        timeout_s: float = 3.0) -> dict[str, Any]:
    """Send one request to the endpoint at ``path`` and return its answer. EndpointError with
    the kernel's errno (EACCES: not this user's; ECONNREFUSED/ENOENT: no launcher there)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + timeout_s
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect(os.fspath(path))
        except OSError as exc:
            raise EndpointError(exc.errno, exc.strerror or str(exc), os.fspath(path)) from exc
        sock.sendall(json.dumps(request).encode() + b"\n")
        chunks: list[bytes] = []
        size = 0
        while True:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                raise EndpointError(f"no answer within {timeout_s:g} s") from None
            if not chunk:
                break
            size += len(chunk)
            if size > ANSWER_MAX_BYTES:
                raise EndpointError(f"answer larger than {ANSWER_MAX_BYTES} bytes")
            chunks.append(chunk)
    except OSError as exc:
        if isinstance(exc, EndpointError):
            raise
        raise EndpointError(exc.errno, exc.strerror or str(exc)) from exc
    finally:
        sock.close()
    try:
        answer = json.loads(b"".join(chunks))
    except ValueError:
        raise EndpointError("the endpoint's answer is not JSON") from None
    if not isinstance(answer, dict):
        raise EndpointError("the endpoint's answer is not a JSON object")
    return answer


@dataclass(frozen=True)
class Registered:
    """One launcher of this user's, as its registry record says."""

    endpoint: Endpoint
    record: dict[str, Any]

    @property
    def pid(self) -> int:
        return self.endpoint.pid


def registered_jobs(directories: list[Path] | None = None) -> list[Registered]:
    """This user's live launchers. A record whose process is gone (or whose pid now names
    another process) is removed with its socket: the directory is this user's own."""
    out: list[Registered] = []
    for directory in directories if directories is not None else runtime_dirs():
        try:
            names = sorted(e.name for e in os.scandir(directory) if e.name.endswith(".json"))
        except OSError:
            continue
        for name in names:
            stem = name[:-5]
            if not stem.isdigit():
                continue
            endpoint = Endpoint(directory, int(stem))
            record = _read_record(endpoint.record_path)
            if record is None:
                continue
            if process_start_ticks(endpoint.pid) != record.get("start_ticks"):
                for path in (endpoint.record_path, endpoint.socket_path):
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                continue
            out.append(Registered(endpoint, record))
    return out


def _read_record(path: Path) -> dict[str, Any] | None:
    return read_json_object(path, max_bytes=RECORD_MAX_BYTES, nofollow=True)


def command_line() -> str:
    """This process's command line, as the registry record shows it."""
    from gpuwarden.procs import short_command

    argv = [os.path.basename(sys.argv[0]), *sys.argv[1:]] if sys.argv and sys.argv[0] else []
    return short_command(argv, width=300) if argv else sys.executable


def serve(sup: Supervisor) -> ControlServer | None:
    """The endpoint of a supervisor (``launch/supervisor.py``), or None when it cannot be made
    (no usable runtime directory, no room for a socket): the job runs the same without it."""
    plan = sup.plan
    record = {
        "kind": "spawn" if any("--call" in spec.argv for spec in plan.ranks) else "launch",
        "command": command_line(), "target": plan.config.target,
        "run_id": next((s.env.get("TORCHELASTIC_RUN_ID") for s in plan.ranks), None),
        "node_rank": plan.node_rank, "nnodes": plan.nnodes, "world_size": plan.world_size,
        "nproc": len(plan.ranks), "attempt": plan.attempt,
        "gpus": [s.gpu.label for s in plan.ranks if s.gpu is not None],
    }
    calls = LoopCalls()
    try:
        server = ControlServer(record, _answers(sup, calls), calls=calls).start()
    except OSError:
        calls.close()
        return None
    server.link_into(plan.run_dir)
    return server


def _answers(sup: Supervisor, calls: LoopCalls) -> Handler:
    """The handler of ``sup``'s endpoint: ``observe.py``'s JobObserver, imported and made at
    the first request (most jobs are never asked)."""
    made: list[Handler] = []
    lock = threading.Lock()

    def handle(request: dict[str, Any]) -> dict[str, Any]:
        with lock:
            if not made:
                from gpuwarden.launch.observer.observe import JobObserver

                made.append(JobObserver(sup, calls.call).handle)
        return made[0](request)

    return handle
