"""The rank side of multi-node diagnosis, on the TCPStore torch.distributed already runs.

No second server: rank 0's ``init_process_group`` (env://) hosts a c10d TCPStore at
MASTER_ADDR:MASTER_PORT, and every rank connects to it. Nothing of torch is wrapped to learn
when a rank gets there: the bootstrap (:mod:`gpuwarden.launch.ranks._bootstrap`) starts a daemon
thread that looks at the main thread's frames (``sys._current_frames``, 10 times a second,
multi-node only) and, once ``init_process_group`` is among them (torch is imported by then),
starts :class:`StoreWatch` in that thread: one more *client* of that store, opened with ``world_size=None`` and
``wait_for_workers=False``. In torch's TCPStore.cpp such a client never touches the store's
worker counter (``waitForWorkers`` returns at once without ``numWorkers`` and is only called
with ``waitWorkers``), so rank 0's "N/M clients joined" count and its wait are untouched; the
thread's keys live under ``gpuwarden/``, beside the process group's own prefixed keys.

- every rank writes ``gpuwarden/rank/<r>`` = {host, pid, node} and adds 1 to
  ``gpuwarden/arrived``: the store then knows *who* arrived, not only how many;
- the node's local rank 0 keeps polling (0.5 s): the arrivals (until all are in), and
  ``gpuwarden/abort``, which a node whose rank failed sets (first writer wins, compare_set);
  a lost connection (node 0 gone) is reported too;
- what it sees goes to ``GPUWARDEN_PEERS_FILE`` (JSON, replaced atomically), which the node's
  supervisor reads with its progress records. The supervisor never imports torch;
- the same poll relays ``gpuwarden stacks`` between nodes (``launch/multinode/_store_stacks.py``).

The job-wide first failure and the restart decision live in the node agent's store, which
outlives the attempts (``job_store.py``); this abort key in the workers' store is the fast path
a failing rank takes itself, within milliseconds of its exception.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

PREFIX = "gpuwarden/"
ARRIVED_KEY = PREFIX + "arrived"
ABORT_KEY = PREFIX + "abort"
POLL_S = 0.5


def rank_key(rank: int) -> str:
    return f"{PREFIX}rank/{rank}"


def _client(host: str, port: int, timeout_s: float) -> Any:
    from torch.distributed import TCPStore

    # world_size=None + wait_for_workers=False: not counted as a worker (see module docstring).
    return TCPStore(host, port, None, False, timedelta(seconds=timeout_s), wait_for_workers=False)


def set_abort(store: Any, record: dict[str, Any]) -> dict[str, Any] | None:
    """Set the abort key unless another node already did: the first failure is the root cause.
    Returns the record the key holds now when it is another's (the rank then failed on an echo
    of it, and --max-restarts decides from that node's failure)."""
    now = store.compare_set(ABORT_KEY, "", json.dumps(record))
    try:
        held = json.loads(now)
    except (TypeError, ValueError):
        return None
    return held if isinstance(held, dict) and held != record else None


class StoreWatch(threading.Thread):
    def __init__(self, env: dict[str, str] | os._Environ[str]) -> None:
        super().__init__(name="gpuwarden-store-watch", daemon=True)
        self.host = env["MASTER_ADDR"]
        self.port = int(env["MASTER_PORT"])
        self.rank = int(env["RANK"])
        self.world = int(env["WORLD_SIZE"])
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.node = int(env.get("GPUWARDEN_NODE_RANK", "0"))
        self.nnodes = int(env.get("GPUWARDEN_NNODES", "1"))
        self.peers_file = env["GPUWARDEN_PEERS_FILE"]
        self.timeout_s = float(env.get("GPUWARDEN_RDZV_TIMEOUT", "300"))
        self.store: Any = None
        self.stopping = threading.Event()
        self.state: dict[str, Any] = {"rank": self.rank, "connected": False, "arrived": {}}
        self._lock = threading.Lock()

    def _publish(self, **changes: Any) -> None:
        with self._lock:
            self.state.update(changes)
            self.state["updated"] = time.time()
            tmp = f"{self.peers_file}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.state, f)
            os.replace(tmp, self.peers_file)

    def run(self) -> None:
        try:
            self.store = _client(self.host, self.port, self.timeout_s)
            me = {"host": socket.gethostname(), "pid": os.getpid(), "node": self.node,
                  "time": time.time()}
            self.store.set(rank_key(self.rank), json.dumps(me))
            self.store.add(ARRIVED_KEY, 1)
        except Exception as exc:  # the rank's own init reports the same failure, with its words
            self._publish(store_error=f"{type(exc).__name__}: {exc}")
            return
        self._publish(connected=True)
        if self.local_rank != 0:
            return  # one watcher per node is enough; keep the client for set_abort
        self._watch()

    def _watch(self) -> None:
        from gpuwarden.launch.multinode._store_stacks import StackRelay

        arrived: dict[str, Any] = {}
        count = 0
        relay = StackRelay(self.peers_file, self.node, self.nnodes)
        while True:
            try:
                if self.store.check([ABORT_KEY]):
                    record = json.loads(self.store.get(ABORT_KEY).decode() or "{}")
                    self._publish(abort=record)
                    return
                if count < self.world:
                    now = int(self.store.add(ARRIVED_KEY, 0))
                    if now != count:
                        count = now
                        for r in range(self.world):
                            if str(r) not in arrived and self.store.check([rank_key(r)]):
                                arrived[str(r)] = json.loads(self.store.get(rank_key(r)).decode())
                        self._publish(arrived=dict(arrived))
                relay.poll(self.store)
            except Exception as exc:  # DistNetworkError: the store (rank 0's process) is gone
                if not self.stopping.is_set():
                    self._publish(store_lost=f"{type(exc).__name__}: {str(exc).splitlines()[0]}",
                                  store_lost_at=time.time())
                return
            if self.stopping.wait(POLL_S):
                return

    def abort(self, record: dict[str, Any]) -> bool:
        """Tell every node this job failed (called by the failing rank itself). True when sent."""
        if self.store is None:
            return False
        try:
            first = set_abort(self.store, record)
        except Exception:
            return False
        if first is not None and first.get("node") != self.node:
            self._publish(abort_sent=True, abort=first)
        else:
            self._publish(abort_sent=True)
        return True


_watch: StoreWatch | None = None
# Held while the watch is started and while stop() ends the joining thread: no watch may start
# (and open a store connection) after the script has ended and the interpreter finalizes.
_start_lock = threading.Lock()
_LOOK_S = 0.1  # how often the joining thread looks at the main thread's frames


def _calls(frame: Any, name: str) -> bool:
    """Whether ``frame`` or one of its callers is torch's function ``name``."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == name and "torch" in code.co_filename:
            return True
        frame = frame.f_back
    return False


class _Joining(threading.Thread):
    """Waits (without touching torch) until the main thread is inside init_process_group, then
    runs the store watch; stops it when the script leaves the process group."""

    def __init__(self, env: dict[str, str] | os._Environ[str]) -> None:
        super().__init__(name="gpuwarden-store-join", daemon=True)
        self.env = dict(env)
        self.main_ident = threading.main_thread().ident
        self.quit = threading.Event()

    def run(self) -> None:
        global _watch
        # Entering init_process_group is seen by sampling, so a rank whose init took less than
        # one look (the last node to arrive joins at once) is recognised by its process group.
        if not self._until("init_process_group", or_done=_joined):
            return
        with _start_lock:
            if self.quit.is_set():
                return
            watch = StoreWatch(self.env)
            _watch = watch
            watch.start()
        # The script leaving the process group: rank 0's store is about to go away on purpose.
        if self._until("destroy_process_group"):
            watch.stopping.set()

    def _until(self, name: str, or_done: Callable[[], bool] | None = None) -> bool:
        """Wait until the main thread is inside torch's ``name`` (or ``or_done()``, the call's
        effect, is seen); False when told to quit."""
        while not self.quit.wait(_LOOK_S):
            if _main_calls(self.main_ident or 0, name) or (or_done is not None and or_done()):
                return True
        return False


def _joined() -> bool:
    """Whether the script's default process group exists. Reads torch's module global without
    importing or calling anything of torch, and keeps no reference to the group."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    member = getattr(c10d, "GroupMember", None)
    return getattr(member, "WORLD", None) is not None


def _main_calls(main_ident: int, name: str) -> bool:
    """A function of its own so that no reference to the main thread's frames outlives the look:
    a frame kept by this thread keeps its locals (a process group, a store) alive into the
    interpreter's finalization, where their C++ destructors abort ('terminate called without an
    active exception')."""
    frame = sys._current_frames().get(main_ident)
    try:
        return frame is not None and _calls(frame, name)
    finally:
        del frame


_joining: _Joining | None = None


def start_when_joining(env: dict[str, str] | os._Environ[str]) -> None:
    """Multi-node: start the store watch once the script enters init_process_group."""
    global _joining
    if _joining is None and env.get("GPUWARDEN_PEERS_FILE"):
        _joining = _Joining(env)
        _joining.start()


def connected(wait_s: float = 0.0) -> bool:
    """Whether this rank holds a store client; a rank that fails right after init may wait up
    to ``wait_s`` for its watch to finish connecting (it is failing anyway)."""
    deadline = time.monotonic() + wait_s
    while True:
        if _watch is not None and _watch.store is not None:
            return True
        # The joining thread may not have seen a quick init yet: the group exists, the watch
        # is a look away.
        starting = (_watch is None and _joining is not None and _joining.is_alive()
                    and _joined())
        if (not starting and (_watch is None or not _watch.is_alive())) \
                or time.monotonic() >= deadline:
            return False  # never reached init, or the connection failed, or too late
        time.sleep(0.02)


def stop() -> None:
    """The script ends: stop polling first, so that rank 0's store going away on purpose is
    not mistaken for node 0 dying."""
    if _joining is not None:
        with _start_lock:
            _joining.quit.set()
    if _watch is not None:
        _watch.stopping.set()
        if _watch is not threading.current_thread():
            _watch.join(timeout=2 * POLL_S)
            if not _watch.is_alive():
                # Close the store client now, in the main thread: left to the interpreter's
                # finalization, its C++ destructor may run with a thread still joinable
                # ('terminate called without an active exception', SIGABRT after a good run).
                _watch.store = None


def abort_from_rank(record: dict[str, Any]) -> bool:
    if _watch is None:
        return False
    return _watch.abort(record)
