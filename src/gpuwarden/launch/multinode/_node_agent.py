"""This node's agent in a multi-node job: torch's own c10d rendezvous, in a helper process.

The launcher never imports torch (its start-up costs tens of milliseconds, and no torch state
can leak into the ranks it starts). Multi-node jobs need torch's rendezvous, so the launcher
starts this module once per job (``python -m gpuwarden.launch.multinode._node_agent``), first thing, so
that torch's import (1-2 s) overlaps the launcher's own preflight, and talks to it over a pipe:
one JSON object per line, commands on stdin, replies and events on stdout (its stderr, torch's
own log lines, goes to a file the launcher shows when the agent fails).
:mod:`gpuwarden.launch.multinode.node_agent` is the launcher's side and documents the protocol.

What runs here is torch's: :func:`c10d_rendezvous_backend.create_backend` (the TCPStore at the
rendezvous endpoint, hosted by the node that owns the endpoint's address, for the whole job) and
:func:`dynamic_rendezvous.create_handler` (``DynamicRendezvousHandler``: join, last call,
rounds, keep-alive heartbeats, ``num_nodes_waiting`` for elastic membership, close). The static
rendezvous (``--node-rank``) runs on the same handler with MIN = MAX = N; the ranks are then
numbered by the node ranks given.

Beside torch's own keys, under ``gpuwarden/<run id>/`` in the same store:

- ``host/<participant>``: who a participant is (host name, address, --node-rank, ranks per
  node), written before it joins, so that a wait names who joined;
- ``r<round>/node/<group rank>``: the same for each node of a completed round, with the port
  of the round's workers' store when that node runs rank 0 (static);
- ``r<round>/alive/<group rank>``: a counter the agent adds 1 to every second. A node whose
  counter stops moving is lost: counters, not timestamps, because the nodes' clocks differ;
- ``r<round>/ended/<group rank>``: that node's ranks have ended (its counter may stop);
- the keys the launcher reads and compare-sets through ``get``/``cas`` (the round's first
  failure and the job's decision: :mod:`gpuwarden.launch.multinode.job_store`).

The workers meet on a store of their own (``TORCHELASTIC_USE_AGENT_STORE=True``, as under
torchrun): the agent of the node that runs rank 0 hosts a fresh one for every round, so it is up
before any rank starts and no key of a failed attempt can reach the next one (torch's own shared
store lives across rounds: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` keeps it from starting).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import IO, Any

from gpuwarden.launch.multinode.node_agent import (
    ALIVE_EVERY_S,
    NODE_LOST_S,
    WAIT_EVENT_EVERY_S,
    WATCH_EVERY_S,
    job_key,
    round_key,
)

JOIN_DETAILS_WAIT_S = 30.0  # after torch's round completed, every node publishes its details


class _Out:
    """JSON lines to the launcher; several threads write."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.lock = threading.Lock()

    def emit(self, **message: Any) -> None:
        line = json.dumps(message, default=str)
        with self.lock:
            try:
                self.stream.write(line + "\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass  # the launcher is gone: PDEATHSIG ends this process


def _error(exc: BaseException) -> dict[str, str]:
    """An exception as the launcher reports it: torch's class name, and the innermost cause's
    message (RendezvousConnectionError says "see inner exception")."""
    inner: BaseException = exc
    while inner.__cause__ is not None:
        inner = inner.__cause__
    message = str(inner).strip().splitlines()[0] if str(inner).strip() else type(inner).__name__
    return {"kind": type(exc).__name__, "message": message[:500],
            "inner": type(inner).__name__}


class Agent:
    def __init__(self, out: _Out) -> None:
        self.out = out
        self.handler: Any = None
        self.store: Any = None
        self.run_id = ""
        self.hosting = False
        self.me: dict[str, Any] = {}
        self.static_master: str | None = None
        self.round: dict[str, Any] | None = None  # the last completed round (the join reply)
        self.watch: _RoundWatch | None = None
        self.max_nodes = 1
        self.join_timeout_s = 600.0
        self.workers_store: Any = None  # this node runs rank 0: the round's workers' store
        self.retired: list[Any] = []  # the last round's workers' store, kept through a join

    # ---- commands ---------------------------------------------------------------------------

    def handle(self, msg: dict[str, Any]) -> bool:
        """Run one command; False when the agent should exit."""
        op = msg.get("op")
        rid = msg.get("id")
        try:
            if op == "connect":
                self.out.emit(reply=rid, **self.connect(msg))
            elif op == "join":
                self.out.emit(reply=rid, **self.join())
            elif op == "end_round":
                self.end_round()
                self.out.emit(reply=rid)
            elif op == "get":
                self.out.emit(reply=rid, value=self.get(str(msg["key"]),
                                                        float(msg.get("wait_s", 0))))
            elif op == "cas":
                self.out.emit(reply=rid, value=self.cas(str(msg["key"]), str(msg["expected"]),
                                                        str(msg["desired"])))
            elif op == "set":
                self.store.set(job_key(self.run_id, str(msg["key"])), str(msg["value"]))
                self.out.emit(reply=rid)
            elif op == "done":
                self.done(float(msg.get("wait_s", 0)))
                self.out.emit(reply=rid)
                return False
            else:
                self.out.emit(reply=rid, error={"kind": "UsageError",
                                                "message": f"unknown command {op!r}"})
        except Exception as exc:  # every failure goes back to the launcher, in words
            self.out.emit(reply=rid, error=_error(exc))
        return True

    def connect(self, msg: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        self.run_id = str(msg["run_id"])
        self.me = dict(msg["me"])
        self.static_master = msg.get("static_master_addr")
        self.max_nodes = int(msg["max_nodes"])
        conf = {str(k): str(v) for k, v in dict(msg.get("conf") or {}).items()}
        self.join_timeout_s = float(conf.get("join_timeout", 600))
        is_host = msg.get("is_host")
        # The launcher decides who hosts the store from its own preflight (the endpoint's
        # address on one of this host's interfaces; torch's guess compares host names only).
        # When that was a guess (the user gave no is_host) and the port turns out taken,
        # join as a client, as torch does after its own guess: another launcher of the job on
        # this host hosts it (a one-machine rehearsal).
        tries = [is_host, False] if is_host and msg.get("guessed") else [is_host]
        last: Exception | None = None
        for host_it in tries:
            if host_it is not None:
                conf["is_host"] = "true" if host_it else "false"
            params = RendezvousParameters(
                backend="c10d", endpoint=str(msg["endpoint"]), run_id=self.run_id,
                min_nodes=int(msg["min_nodes"]), max_nodes=self.max_nodes,
                local_addr=msg.get("local_addr") or None, **conf)
            try:
                backend, self.store = create_backend(params)
                self.handler = create_handler(self.store, backend, params)
            except Exception as exc:
                last = exc
                continue
            self.hosting = bool(host_it)
            return {"hosting": self.hosting}
        assert last is not None
        raise last

    def join(self) -> dict[str, Any]:
        """torch's next_rendezvous, reported every WAIT_EVENT_EVERY_S while it waits; then
        this node's details for the round, and the workers' MASTER_ADDR/MASTER_PORT."""
        self.end_round()
        # The last round's workers' store stays up through this join (a node may still be
        # stopping its ranks); the ones before are closed now.
        self.retired = [self.workers_store] if self.workers_store is not None else []
        self.workers_store = None
        node = self.handler._this_node  # torch's participant descriptor (addr_pid_localid)
        self.store.set(job_key(self.run_id, f"host/{node!r}"), json.dumps(self.me))
        reporter = _JoinReporter(self)
        reporter.start()
        try:
            info = self.handler.next_rendezvous()
        finally:
            reporter.stop.set()
            reporter.join()
        rnd = int(self.handler._state_holder.state.round)
        group_rank, world = int(info.rank), int(info.world_size)
        mine = {**self.me, "group_rank": group_rank}
        # The node that runs rank 0 hosts the round's workers' store, up before any rank starts
        # (ranks then connect at once, as torchrun's do to its agent's store), and fresh for each
        # round (no key of a failed attempt reaches the next one, unlike torchrun's).
        runs_rank0 = self.me.get("node_rank") == 0 if self.static_master is not None \
            else group_rank == 0
        if runs_rank0:
            from torch.distributed import TCPStore

            self.workers_store = TCPStore("0.0.0.0", 0, None, True, wait_for_workers=False,
                                          multi_tenant=False)
            mine["worker_port"] = int(self.workers_store.port)
        self.store.set(round_key(self.run_id, rnd, f"node/{group_rank}"), json.dumps(mine))
        keys = [round_key(self.run_id, rnd, f"node/{g}") for g in range(world)]
        self.store.wait(keys, timedelta(seconds=JOIN_DETAILS_WAIT_S))
        nodes = [json.loads(v) for v in self.store.multi_get(keys)]
        zero = next((n for n in nodes if n.get("worker_port")), None)
        master_port = int(zero["worker_port"]) if zero else 0
        master_addr = self.static_master if self.static_master is not None \
            else info.bootstrap_store_info.master_addr
        job = self.get("job", 0.0)
        self.round = {"round": rnd, "group_rank": group_rank, "group_world_size": world,
                      "nodes": nodes, "master_addr": master_addr, "master_port": master_port,
                      "job": job}
        self.watch = _RoundWatch(self, rnd, group_rank, world)
        self.watch.start()
        return self.round

    def end_round(self) -> None:
        """This node's ranks of the round have ended: say so (its counter may stop now)."""
        watch, self.watch = self.watch, None
        if watch is None:
            return
        watch.stop.set()
        watch.join()
        self.store.set(round_key(self.run_id, watch.round, f"ended/{watch.group_rank}"), "1")

    def get(self, key: str, wait_s: float) -> str | None:
        full = job_key(self.run_id, key)
        deadline = time.monotonic() + wait_s
        while True:
            # check, then get: a get of a missing key would block for the store's whole timeout
            if self.store.check([full]):
                return bytes(self.store.get(full)).decode()
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(WATCH_EVERY_S, max(0.0, deadline - time.monotonic())))

    def cas(self, key: str, expected: str, desired: str) -> str:
        return bytes(self.store.compare_set(job_key(self.run_id, key), expected, desired)).decode()

    def done(self, wait_s: float) -> None:
        """The job ended on this node. The node that hosts the store keeps it up until every
        node of the last round has ended (or went silent), at most ``wait_s``: the others
        still read the job's decision from it. Then the rendezvous is closed (torchrun's
        agents close it too: a late node learns the job is over instead of waiting)."""
        last = self.round
        self.end_round()
        if (self.hosting or self.workers_store is not None) and last is not None:
            _wait_for_ended(self, int(last["round"]), int(last["group_world_size"]),
                            int(last["group_rank"]), wait_s)
        if self.handler is not None:
            self.handler.shutdown()


class _JoinReporter(threading.Thread):
    """While torch's join waits: who is in the round, who waits for the next one. Reads the
    handler's last synced state (torch syncs it every second while it waits) and the hosts'
    own words from ``host/<participant>``; no extra traffic to the store but those reads."""

    def __init__(self, agent: Agent) -> None:
        super().__init__(name="gpuwarden-join-reporter", daemon=True)
        self.agent = agent
        self.stop = threading.Event()
        self.hosts: dict[str, dict[str, Any]] = {}

    def _who(self, desc: Any) -> dict[str, Any]:
        key = repr(desc)
        if key not in self.hosts:
            full = job_key(self.agent.run_id, f"host/{key}")
            if self.agent.store.check([full]):
                self.hosts[key] = json.loads(bytes(self.agent.store.get(full)).decode())
        return self.hosts.get(key) or {"host": str(getattr(desc, "addr", key)), "addr": ""}

    def run(self) -> None:
        start = time.monotonic()
        while not self.stop.wait(WAIT_EVENT_EVERY_S):
            try:
                state = self.agent.handler._state_holder.state  # torch's, last synced
                participants = list(dict(state.participants))
                waiting = list(set(state.wait_list))
                me = self.agent.handler._this_node
                self.agent.out.emit(
                    event="waiting", elapsed_s=round(time.monotonic() - start, 1),
                    round=int(state.round), complete=bool(state.complete),
                    closed=bool(state.closed), last_call=state.deadline is not None,
                    me_in=("round" if me in state.participants else
                           "wait_list" if me in state.wait_list else ""),
                    participants=[self._who(d) for d in sorted(participants)],
                    wait_list=[self._who(d) for d in sorted(waiting)])
            except Exception:  # a state being replaced under us: look again next time
                continue


class _RoundWatch(threading.Thread):
    """While a round runs: this node's alive counter, the others' counters (a node whose
    counter stops is reported lost), the round's first-failure key (reported once when any
    node sets it), and, when nodes may still join, torch's count of nodes waiting for the next
    round (elastic membership). A store that stops answering is reported once, then the
    watch ends."""

    def __init__(self, agent: Agent, rnd: int, group_rank: int, world: int) -> None:
        super().__init__(name="gpuwarden-round-watch", daemon=True)
        self.agent = agent
        self.round = rnd
        self.group_rank = group_rank
        self.world = world
        self.stop = threading.Event()

    def run(self) -> None:
        agent, store, out = self.agent, self.agent.store, self.agent.out
        failure = round_key(agent.run_id, self.round, "failure")
        alive = {g: round_key(agent.run_id, self.round, f"alive/{g}") for g in range(self.world)}
        ended = {g: round_key(agent.run_id, self.round, f"ended/{g}") for g in range(self.world)}
        seen: dict[int, tuple[int, float]] = {}
        lost: set[int] = set()
        told_failure = told_members = False
        next_beat = next_members = 0.0
        can_grow = self.world < agent.max_nodes
        while not self.stop.is_set():
            try:
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + ALIVE_EVERY_S
                    store.add(alive[self.group_rank], 1)
                    for g in range(self.world):
                        if g == self.group_rank or g in lost or store.check([ended[g]]):
                            continue
                        count = int(store.add(alive[g], 0))
                        if g not in seen or seen[g][0] != count:
                            seen[g] = (count, now)
                        elif now - seen[g][1] >= NODE_LOST_S:
                            lost.add(g)
                            out.emit(event="node_lost", round=self.round, group_rank=g,
                                     silent_s=round(now - seen[g][1], 1))
                if not told_failure and store.check([failure]):
                    told_failure = True
                    out.emit(event="failure", round=self.round,
                             record=bytes(store.get(failure)).decode())
                if can_grow and not told_members and now >= next_members:
                    next_members = now + 1.0
                    waiting = int(agent.handler.num_nodes_waiting())
                    if waiting:
                        told_members = True
                        out.emit(event="membership", round=self.round, waiting=waiting)
            except Exception as exc:
                if not self.stop.is_set():
                    out.emit(event="store_lost", round=self.round, **_error(exc))
                return
            self.stop.wait(WATCH_EVERY_S)


def _wait_for_ended(agent: Agent, rnd: int, world: int, me: int, wait_s: float) -> None:
    """Keep the store up until every other node of round ``rnd`` ended, or its counter stopped
    for NODE_LOST_S, or ``wait_s`` passed; tell the launcher who it waits for."""
    store = agent.store
    deadline = time.monotonic() + wait_s
    seen: dict[int, tuple[int, float]] = {}
    next_event = time.monotonic() + WAIT_EVENT_EVERY_S
    while time.monotonic() < deadline:
        now = time.monotonic()
        pending = []
        for g in range(world):
            if g == me or store.check([round_key(agent.run_id, rnd, f"ended/{g}")]):
                continue
            count = int(store.add(round_key(agent.run_id, rnd, f"alive/{g}"), 0))
            if g not in seen or seen[g][0] != count:
                seen[g] = (count, now)
            if now - seen[g][1] < NODE_LOST_S:
                pending.append(g)
        if not pending:
            return
        if now >= next_event:
            next_event = now + WAIT_EVENT_EVERY_S
            nodes = {int(n.get("group_rank", -1)): n for n in (agent.round or {}).get("nodes", [])}
            agent.out.emit(event="finishing", waiting_for=[nodes.get(g, {"group_rank": g})
                                                           for g in pending])
        time.sleep(WATCH_EVERY_S)


def main() -> int:
    # A signal sent to the launcher's whole process tree is the ranks' business: Slurm's
    # preemption notice (scancel -s USR1, --signal=USR1@T) reaches every process of the step
    # under proctrack/linuxproc or cgroup, and by default SIGUSR1/2 would end this process and
    # the job's store with it (launch/config.py's FORWARDED_SIGNALS).
    for notice in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(notice, signal.SIG_IGN)
    from gpuwarden.procs import die_with_parent

    die_with_parent(int(os.environ.get("GPUWARDEN_SUPERVISOR_PID", os.getppid())))
    # The workers' store is rank 0's, one per round (see the module docstring).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    out = _Out(sys.stdout)
    started = time.monotonic()
    try:
        import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401
        import torch.distributed.elastic.rendezvous.dynamic_rendezvous  # noqa: F401
    except Exception as exc:
        out.emit(event="fatal", **_error(exc))
        return 1
    out.emit(event="ready", import_s=round(time.monotonic() - started, 2), pid=os.getpid())
    agent = Agent(out)
    for line in sys.stdin:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict) and not agent.handle(msg):
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
