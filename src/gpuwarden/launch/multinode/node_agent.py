"""The launcher's side of the node agent (:mod:`gpuwarden.launch.multinode._node_agent`): standard library
only, so the launcher still never imports torch.

Every multi-node launch starts one agent process, first thing (torch's import then overlaps the
preflight), and talks to it over its stdin/stdout, one JSON object per line:

- commands, each with an ``id`` the reply carries back: ``connect`` (create torch's c10d
  backend and DynamicRendezvousHandler), ``join`` (torch's ``next_rendezvous``; the reply is
  the :class:`Round`), ``end_round``, ``get`` / ``cas`` / ``set`` (keys of the job under
  ``gpuwarden/<run id>/``), ``done`` (keep the store up for the others, close the rendezvous,
  exit). A failed command replies ``{"error": {"kind", "message", "inner"}}``;
- events, unasked: ``ready`` (torch imported), ``waiting`` (every second while a join waits:
  the round's participants and the nodes waiting for the next round), ``failure`` (some node
  set the round's first-failure key), ``node_lost`` (a node's alive counter stopped),
  ``membership`` (nodes wait to join: elastic re-rendezvous), ``store_lost``, ``finishing``
  (the store host waits for the others to end), ``fatal``.

:class:`NodeAgent` is the process; the supervisor registers :meth:`NodeAgent.fileno` in its
selector and reads events with :meth:`NodeAgent.read_events` while ranks run.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuwarden.errors import LaunchError

ALIVE_EVERY_S = 1.0  # an agent adds 1 to its alive counter this often
NODE_LOST_S = 5.0  # a counter that has not moved for this long: the node is lost
WATCH_EVERY_S = 0.2  # the round's failure key is looked at this often
WAIT_EVENT_EVERY_S = 1.0  # a waiting join reports this often
READY_WAIT_S = 60.0  # torch's import in the agent: seconds, more on a loaded host
REPLY_WAIT_S = 60.0  # a store operation (torch's read_timeout is 60 s)


def job_key(run_id: str, key: str) -> str:
    """Where gpuwarden's key ``key`` of job ``run_id`` lives in the job's store."""
    return f"gpuwarden/{run_id}/{key}"


def round_key(run_id: str, rnd: int, key: str) -> str:
    return job_key(run_id, f"r{rnd}/{key}")


@dataclass(frozen=True)
class NodeInfo:
    """One node of a round, in its own words."""

    group_rank: int  # torch's node rank for the round (assigned on arrival)
    host: str  # its host name
    addr: str  # the address it advertises ('' when its host name is used)
    node_rank: int | None  # --node-rank (static), None when assigned
    local_world_size: int

    @property
    def label(self) -> str:
        return self.host + (f" ({self.addr})" if self.addr and self.addr != self.host else "")

    @classmethod
    def of(cls, data: dict[str, Any]) -> NodeInfo:
        """A node's own words, through the network: typed, and its strings escaped."""
        from gpuwarden.safetext import escape_untrusted

        node_rank = data.get("node_rank")
        return cls(_int(data.get("group_rank"), -1), escape_untrusted(str(data.get("host", "?"))),
                   escape_untrusted(str(data.get("addr") or "")),
                   None if node_rank is None else _int(node_rank, -1),
                   _int(data.get("local_world_size"), 0))


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


@dataclass(frozen=True)
class Round:
    """A completed rendezvous round: this node's place in it and the workers' store."""

    round: int
    group_rank: int  # this node's index: static, its --node-rank; c10d, torch's
    group_world_size: int
    master_addr: str  # rank 0's host, where the workers' store runs
    master_port: int
    nodes: tuple[NodeInfo, ...]  # by group rank
    job: dict[str, Any] | None  # the job's restart record (job_store.py), None before any

    def node(self, group_rank: int) -> NodeInfo | None:
        return next((n for n in self.nodes if n.group_rank == group_rank), None)


class AgentError(LaunchError):
    """The node agent failed a command; ``kind`` is torch's exception class name."""

    def __init__(self, kind: str, message: str, inner: str = "") -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.inner = kind, message, inner


class NodeAgent:
    """The agent process and its pipe. Not thread-safe: the launcher's main thread owns it."""

    def __init__(self, proc: subprocess.Popen[bytes], stderr_path: str) -> None:
        self.proc = proc
        self.stderr_path = stderr_path
        self._buf = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []  # unasked events not consumed yet
        self._replies: dict[int, dict[str, Any]] = {}
        self._pending: set[int] = set()  # commands sent, not answered yet
        self.ready = False
        self.eof = False  # the agent's stdout closed: it exited
        self.import_s: float | None = None
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)

    @classmethod
    def start(cls, env: dict[str, str] | None = None) -> NodeAgent:
        """Start the agent now (its torch import takes 1-2 s: start it before anything else).
        Its stderr (torch's own log lines) goes to a private file, removed by :meth:`close`."""
        import tempfile

        fd, stderr_path = tempfile.mkstemp(prefix="gpuwarden-node-agent-", suffix=".stderr")
        child_env = dict(env if env is not None else os.environ)
        child_env["GPUWARDEN_SUPERVISOR_PID"] = str(os.getpid())
        # The agent imports torch for its rendezvous and nothing else: no GPU is its business.
        child_env["CUDA_VISIBLE_DEVICES"] = ""
        with os.fdopen(fd, "wb") as errf:
            # Its own session: a Ctrl-C is the launcher's to handle (it tells the agent). It
            # arms PDEATHSIG itself, first thing, and exits if the launcher is already gone.
            proc = subprocess.Popen(
                [sys.executable, "-m", "gpuwarden.launch.multinode._node_agent"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errf, env=child_env,
                close_fds=True, start_new_session=True)
        return cls(proc, stderr_path)

    # ---- pipe --------------------------------------------------------------------------------

    def fileno(self) -> int:
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> bool:
        """Read what is there; False at EOF (the agent exited)."""
        assert self.proc.stdout is not None
        while True:
            try:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
            except BlockingIOError:
                return True
            except OSError:
                chunk = b""
            if not chunk:
                self._parse()
                self.eof = True
                return False
            self._buf += chunk
            self._parse()

    def _parse(self) -> None:
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if not isinstance(msg, dict):
                continue
            if "reply" in msg and msg["reply"] is not None:
                self._replies[int(msg["reply"])] = msg
            elif msg.get("event") == "ready":
                self.ready = True
                self.import_s = msg.get("import_s")
            else:
                self.events.append(msg)

    def read_events(self) -> list[dict[str, Any]]:
        """Events that arrived (non-blocking); each is returned once."""
        self._read()
        out, self.events = self.events, []
        return out

    def send(self, op: str, **fields: Any) -> int:
        self._next_id += 1
        assert self.proc.stdin is not None
        line = json.dumps({"op": op, "id": self._next_id, **fields}) + "\n"
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died() from None
        self._pending.add(self._next_id)
        return self._next_id

    def wait_reply(self, rid: int, timeout_s: float,
                   on_event: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """The reply to command ``rid``; events that arrive meanwhile go to ``on_event`` (else
        they are kept for :meth:`read_events`). Raises AgentError for a failed command."""
        deadline = time.monotonic() + timeout_s
        while True:
            eof = not self._read()
            if on_event is not None:
                for event in self.read_events_buffered():
                    on_event(event)
            if rid in self._replies:
                reply = self._replies.pop(rid)
                self._pending.discard(rid)
                err = reply.get("error")
                if isinstance(err, dict):
                    raise AgentError(str(err.get("kind", "Error")), str(err.get("message", "")),
                                     str(err.get("inner", "")))
                return reply
            if eof:
                raise self._died()
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentError("TimeoutError", f"the node agent did not answer within "
                                 f"{timeout_s:g} s")
            with contextlib.suppress(OSError, ValueError):
                select.select([self.fileno()], [], [], min(left, 0.5))

    @property
    def busy(self) -> bool:
        """A command the launcher waited for is still running in the agent (a join cut short
        by Ctrl-C): the agent reads no other command until it ends."""
        self._read()
        for rid in list(self._pending):
            if rid in self._replies:
                self._pending.discard(rid)
                self._replies.pop(rid)
        return bool(self._pending)

    def forget(self, rid: int) -> None:
        """A command sent without waiting for its answer (fire and forget)."""
        self._pending.discard(rid)

    def read_events_buffered(self) -> list[dict[str, Any]]:
        out, self.events = self.events, []
        return out

    def call(self, op: str, timeout_s: float = REPLY_WAIT_S,
             on_event: Callable[[dict[str, Any]], None] | None = None,
             **fields: Any) -> dict[str, Any]:
        return self.wait_reply(self.send(op, **fields), timeout_s, on_event)

    def wait_ready(self, timeout_s: float = READY_WAIT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            alive = self._read()
            # Ready once the line is read, not after another wait: the rendezvous (the store,
            # on the node that hosts it, which the other nodes wait for) starts from here.
            if self.ready:
                return
            if not alive:
                raise self._died()
            fatal = next((e for e in self.events if e.get("event") == "fatal"), None)
            if fatal is not None:
                raise AgentError(str(fatal.get("kind")), str(fatal.get("message")))
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentError("TimeoutError", f"the node agent did not start within "
                                 f"{timeout_s:g} s (importing torch)")
            with contextlib.suppress(OSError, ValueError):
                select.select([self.fileno()], [], [], min(left, 0.5))

    def _died(self) -> AgentError:
        code = self.proc.poll()
        tail = self.stderr_tail()
        return AgentError("AgentDied", f"the node agent exited ({code})"
                          + (f": {tail[-1]}" if tail else ""))

    def stderr_tail(self, lines: int = 8) -> list[str]:
        from gpuwarden.safetext import escape_untrusted

        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return []
        return [escape_untrusted(line) for line in text.strip().splitlines()[-lines:]]

    # ---- the end -----------------------------------------------------------------------------

    def close(self) -> None:
        """End the agent at once. Whatever the job's store needed was done before (``done``:
        the node that hosts it waited for the others); an agent still importing torch, or
        still in a join cut short, would not read its stdin anyway."""
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        with contextlib.suppress(OSError):
            os.unlink(self.stderr_path)
        if self.proc.stdout is not None:
            with contextlib.suppress(OSError):
                self.proc.stdout.close()
