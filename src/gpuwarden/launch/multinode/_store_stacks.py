"""Rank side, multi-node: ``gpuwarden stacks`` across nodes, through the job's own c10d store.

The launcher of each node answers for its own ranks (``launch/observer/observe.py``); it has no store
client (it never imports torch). The node's local rank 0 has one: its store watch
(``launch/multinode/_store_watch.py``) polls the store every 0.5 s for the job's abort key, and calls
:meth:`StackRelay.poll` there too. Keys, beside the watch's own under ``gpuwarden/``:

- ``gpuwarden/stacks/seq``: a counter; a node that wants every node's stacks adds 1;
- ``gpuwarden/stacks/<seq>/open``: set by the asking node while it waits for answers;
- ``gpuwarden/stacks/<seq>/node/<n>``: node n's answer (its launcher's, JSON, bounded).

Asking: the launcher writes ``<peers file>.stacks-request`` (an id and a deadline); at its next
poll the relay opens a request in the store, waits for the other nodes' answers until the
deadline (answering other nodes' requests meanwhile), writes them to
``<peers file>.stacks-answer`` and deletes the keys. Answering: a relay that sees the counter
move asks its own node's launcher (the endpoint linked as ``control.sock`` in the job's
directory) for the node's stacks and sets them under the request. While nobody asks, a poll
costs one ``add(key, 0)`` round trip and one ``stat``, in local rank 0 only. Nothing here
prints; errors other than the store's are swallowed (the store's go to the watch, which reports
a lost store).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from typing import Any

PREFIX = "gpuwarden/stacks/"
SEQ_KEY = PREFIX + "seq"
MAX_ANSWER_BYTES = 1 << 20
ASK_LAUNCHER_TIMEOUT_S = 1.2
ANSWER_POLL_S = 0.02
MAX_BACKLOG = 4  # requests answered per poll at most (older ones have timed out anyway)


def open_key(seq: int) -> str:
    return f"{PREFIX}{seq}/open"


def answer_key(seq: int, node: int) -> str:
    return f"{PREFIX}{seq}/node/{node}"


def ask_launcher(control: str, timeout_s: float = ASK_LAUNCHER_TIMEOUT_S) -> bytes:
    """This node's ranks, as its launcher answers ``{"op": "stacks", "scope": "node"}``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + timeout_s
    try:
        sock.settimeout(timeout_s)
        sock.connect(control)
        sock.sendall(b'{"op": "stacks", "scope": "node", "all_threads": true}\n')
        chunks, size = [], 0
        while size <= MAX_ANSWER_BYTES:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        return json.dumps({"ok": False, "error": f"its launcher did not answer: {exc}"}).encode()
    finally:
        sock.close()
    if size > MAX_ANSWER_BYTES:
        return json.dumps({"ok": False, "error": "its answer was too large"}).encode()
    return b"".join(chunks)


class StackRelay:
    def __init__(self, peers_file: str, node: int, nnodes: int) -> None:
        self.node = node
        self.nnodes = nnodes
        self.request_file = peers_file + ".stacks-request"
        self.answer_file = peers_file + ".stacks-answer"
        self.control = os.path.join(os.path.dirname(peers_file), "control.sock")
        self.seen: int | None = None  # the counter at the last poll
        self.own: set[int] = set()
        self._request_stamp: tuple[int, int] | None = self._stamp()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.request_file)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns)

    def poll(self, store: Any) -> None:
        """One look (from the store watch's loop): answer other nodes, then ask for ours."""
        self._answer_others(store)
        stamp = self._stamp()
        if stamp is not None and stamp != self._request_stamp:
            self._request_stamp = stamp
            request = _read_json(self.request_file)
            if request is not None and isinstance(request.get("id"), str):
                self._ask_others(store, request)

    def _answer_others(self, store: Any) -> None:
        now = int(store.add(SEQ_KEY, 0))
        if self.seen is None:
            self.seen = now  # requests from before this watch started have been given up
            return
        for seq in range(max(self.seen + 1, now - MAX_BACKLOG + 1), now + 1):
            if seq in self.own or not store.check([open_key(seq)]):
                continue
            answer = ask_launcher(self.control)
            if store.check([open_key(seq)]):  # still wanted: the asker has not given up
                store.set(answer_key(seq, self.node), answer)
        self.seen = max(self.seen, now)

    def _ask_others(self, store: Any, request: dict[str, Any]) -> None:
        deadline = float(request.get("deadline") or 0) if isinstance(
            request.get("deadline"), (int, float)) else time.time() + 1.0
        seq = int(store.add(SEQ_KEY, 1))
        self.own.add(seq)
        store.set(open_key(seq), b"1")
        others = [n for n in range(self.nnodes) if n != self.node]
        got: dict[str, Any] = {}
        try:
            while others and time.time() < deadline:
                for n in list(others):
                    if store.check([answer_key(seq, n)]):
                        got[str(n)] = _parse(store.get(answer_key(seq, n)))
                        others.remove(n)
                if others:
                    self._answer_others(store)  # another node may be asking at the same time
                    time.sleep(ANSWER_POLL_S)
        finally:
            store.delete_key(open_key(seq))
            for n in range(self.nnodes):
                if n != self.node:
                    store.delete_key(answer_key(seq, n))
        with contextlib.suppress(OSError):
            tmp = f"{self.answer_file}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"id": request["id"], "seq": seq, "nodes": got}, f)
            os.replace(tmp, self.answer_file)


def _parse(raw: Any) -> Any:
    data = bytes(raw) if isinstance(raw, (bytes, bytearray)) else str(raw).encode()
    if len(data) > MAX_ANSWER_BYTES:
        return {"ok": False, "error": "its answer was too large"}
    try:
        return json.loads(data)
    except ValueError:
        return {"ok": False, "error": "its answer was not JSON"}


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.loads(f.read(4096))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
