"""One root cause and one decision for the whole job, kept in the job's store.

Every node of a multi-node job runs its own launcher, and each sees its own ranks fail: the rank
that raised on node 1, and on node 0 the echoes of it (gloo's ``Connection closed by peer``, a
watchdog timeout). Deciding per node lets the nodes disagree: node 0 restarts on the echo while
node 1 ends on "the same failure twice", and each names another cause. Here nothing is decided
per node. Through the node agent (:mod:`gpuwarden.launch.multinode.node_agent`) every launcher uses these
keys, in the store torch's rendezvous runs on (it lives as long as the job):

- ``r<round>/failure``: the round's **first failure**, compare-set, so the first writer wins.
  A node writes it as soon as one of its ranks fails of its own accord (an exception, a
  signal, a stall) or it was interrupted. An echo is never written at once: the node waits
  ECHO_WAIT_S for a real cause, then up to NODE_LOST_S for the agents' alive counters to name a
  node that went silent (its host or launcher died), and only then does its echo become the
  record. A node waiting to join (elastic membership) or a node lost is a record too. Every
  node's agent watches the key and every node stops its ranks when another's record appears.
- ``r<round>/decision``: what the job does next. The record carries everything the restart
  policy reads (the failure code, from ``explain`` over the rank's own error; the rank; the
  exception's type and innermost frame, or the signal), so every node decides from it alone,
  with the same pure :func:`~gpuwarden.launch.restart.policy.decide_restart`, without waiting for
  another; compare-set keeps the first decision stored and every node follows it: the failure
  in the words every node prints, the decision and its reason, and the job's restart history.
- ``job``: the restarts used so far and their failures (for "same failure twice"), read by
  every node when it joins a round, so a node that joined late counts like the others.

Pure helpers (records, their one-line description, decisions as data) are tested without a
store; :class:`JobRound` does the store work through the agent.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from gpuwarden.launch.multinode.node_agent import NODE_LOST_S, AgentError, NodeAgent, Round
from gpuwarden.launch.outcome import Decision, Failure, Settled, echoes
from gpuwarden.launch.restart.policy import (
    EXC_TYPE,
    EXCLUDE_GPU_CODES,
    RestartPolicy,
    decide_restart,
    innermost_frame,
)

if TYPE_CHECKING:
    from gpuwarden.launch.watch.stall import Stall

ECHO_WAIT_S = 2.0  # a node whose ranks only echoed waits this long for a real cause first
# Kinds of first-failure records
RANK, STALL, INTERRUPT, ECHO = "rank", "stall", "interrupt", "echo"
NODE_LOST, MEMBERSHIP, STORE_LOST = "node_lost", "membership", "store_lost"
LAUNCHER_ID = uuid.uuid4().hex  # who wrote a record: pids repeat across hosts


def new_record(kind: str, *, node: int, what: str, rank: int = -1, echo: bool = False,
               **more: Any) -> dict[str, Any]:
    """A first-failure record: what every node names as the job's root cause."""
    return {"kind": kind, "node": node, "host": socket.gethostname(), "rank": rank, "what": what,
            "echo": echo, "by": LAUNCHER_ID, "pid": os.getpid(), "time": time.time(), **more}


@dataclass(frozen=True)
class RankFailure:
    """What the supervisor knows of one of its ranks that failed of its own accord."""

    rank: int
    error: dict[str, Any]  # the bootstrap's error record ({} when none)
    returncode: int | None  # None: marked FAILED, not exited yet
    stderr_tail: list[str]
    fatal_dump: str
    seen_at: float  # monotonic: its exit, when its error record has no time


def local_record(node: int, failed: list[RankFailure], *, interrupt: str | None,
                 stall: Stall | None, stall_timeout_s: float) -> dict[str, Any]:
    """This node's first failure as a record: an interrupt, a stall, or the first rank to fail
    of its own accord (an echo only when every failure here is one). It carries what the
    restart policy reads (the code, from explain over the rank's own error text; the rank; the
    exception type and innermost frame, or the signal), so every node decides alike from it."""
    from gpuwarden.procs import describe_exit, signal_name

    if interrupt is not None:
        return new_record(INTERRUPT, node=node, what=f"gpuwarden received {interrupt}")
    if stall is not None:
        return new_record(STALL, node=node, rank=stall.waiting[0] if stall.waiting else -1,
                          what=f"rank(s) {', '.join(map(str, stall.waiting))} waited in "
                          f"{stall.point} for more than {stall_timeout_s:g} s",
                          code="RDZV_WORKERS_MISSING" if stall.kind == "init" else "RANK_STALL")

    def order(f: RankFailure) -> tuple[bool, float, int]:
        text = " ".join([str(f.error.get("message", "")), *f.stderr_tail[-5:]])
        echo = (f.returncode is None or f.returncode > 0 or bool(f.error)) \
            and echoes(text)
        when = f.error.get("monotonic")
        return echo, float(when) if isinstance(when, (int, float)) else f.seen_at, f.rank

    if not failed:
        return new_record(ECHO, node=node, echo=True, what="this node's ranks were stopped")
    first = min(failed, key=order)
    echo = order(first)[0]
    err, code = first.error, first.returncode
    more: dict[str, Any] = {"code": _failure_code(
        "\n".join([str(err.get("traceback", "")), *first.stderr_tail, first.fatal_dump]))}
    if err.get("type"):
        what = f"{err.get('type')}: {err.get('message')}"
        more.update(exc_type=str(err["type"]), where=innermost_frame(str(err.get("traceback", ""))))
    elif code is not None and code < 0:
        what = f"killed by {describe_exit(code)}"
        more["signal"] = signal_name(-code)
    else:
        what = describe_exit(code)
    return new_record(ECHO if echo else RANK, node=node, rank=first.rank, what=what.strip()[:300],
                      echo=echo, **more)


def _failure_code(text: str) -> str:
    """The failure code the report gives this text (explain's primary code, else RANK_FAILED)."""
    try:
        from gpuwarden.explain import explain_text

        code = explain_text(text).primary.code
    except Exception:  # a record must not fail because a diagnosis did
        return "RANK_FAILED"
    return "RANK_FAILED" if code == "NONE" else str(code)


def parse_record(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        rec = json.loads(text)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def is_mine(rec: dict[str, Any] | None) -> bool:
    return rec is not None and rec.get("by") == LAUNCHER_ID


def describe(rec: dict[str, Any]) -> str:
    """The root cause in one line, the same on every node: 'rank 3 on node 1 (host-b):
    RuntimeError: boom', 'node 1 (host-b) was lost: ...'. Another node's words are escaped
    (they come through the network)."""
    from gpuwarden.safetext import escape_untrusted

    where = f"node {rec.get('node')} ({escape_untrusted(str(rec.get('host', '?')))})"
    what = escape_untrusted(str(rec.get("what", "")))
    kind = rec.get("kind")
    if kind in (RANK, ECHO) and int(rec.get("rank", -1)) >= 0:
        return f"rank {rec.get('rank')} on {where}: {what}"
    return f"{where}: {what}"


def failure_to_dict(f: Failure) -> dict[str, Any]:
    return asdict(f)


def failure_from_dict(data: dict[str, Any]) -> Failure:
    """A Failure another node wrote (through the network: typed and escaped here)."""
    from gpuwarden.safetext import escape_untrusted

    def text(key: str) -> str | None:
        value = data.get(key)
        return None if value is None else escape_untrusted(str(value))[:300]

    rank = data.get("rank")
    return Failure(text("code") or "RANK_FAILED", rank if isinstance(rank, int) else None,
                   text("exc_type"), text("where"), text("signal"), text("gpu"),
                   text("gpu_label"), text("what") or "", bool(data.get("echo")))


def failure_of_record(rec: dict[str, Any]) -> Failure:
    """The Failure a node decides from when only the record is known (its writer is gone)."""
    kind = rec.get("kind")
    what = str(rec.get("what", ""))
    if kind == MEMBERSHIP:
        return Failure("MEMBERSHIP_CHANGE", what=what)
    if kind == NODE_LOST:
        return Failure("NODE_LOST", what=describe(rec))
    if kind == STORE_LOST:
        return Failure("RDZV_STORE_LOST", what=describe(rec))
    if kind == INTERRUPT:
        return Failure("LAUNCH_INTERRUPTED", what=describe(rec))
    typed = EXC_TYPE.match(what)
    rank = rec.get("rank")
    return failure_from_dict({
        "code": rec.get("code") or ("RANK_STALL" if kind == STALL else "RANK_FAILED"),
        "rank": rank if isinstance(rank, int) and rank >= 0 else None,
        "exc_type": rec.get("exc_type") or (typed.group(1) if typed else None),
        "where": rec.get("where") or (f"node {rec.get('node')}" if typed else None),
        "signal": rec.get("signal"), "what": what, "echo": bool(rec.get("echo"))})


def job_history(rnd: Round) -> tuple[int, list[Failure]]:
    job = rnd.job or {}
    history = [failure_from_dict(d) for d in job.get("history", []) if isinstance(d, dict)]
    return int(job.get("restarts_used", 0)), history


class JobRound:
    """The store side of one round for this node's launcher."""

    def __init__(self, agent: NodeAgent, rnd: Round) -> None:
        self.agent = agent
        self.round = rnd
        self.failure_key = f"r{rnd.round}/failure"
        self.decision_key = f"r{rnd.round}/decision"

    def publish(self, rec: dict[str, Any]) -> None:
        """Offer ``rec`` as the round's first failure, without waiting for the answer (the
        supervisor's loop must not block); the agent's watch reports whichever record won."""
        try:
            self.agent.forget(self.agent.send("cas", key=self.failure_key, expected="",
                                              desired=json.dumps(rec)))
        except AgentError:
            pass  # the agent is gone: the others notice this node's silence

    def first_failure(self, own: dict[str, Any] | None, seen: dict[str, Any] | None
                      ) -> tuple[dict[str, Any] | None, bool]:
        """The round's first failure once this node's attempt ended, and whether the store is
        gone. ``own``: this node's record (None when its ranks did not fail of their own
        accord); ``seen``: the record the agent already reported (whoever won)."""
        if seen is not None:
            return seen, False
        lost: list[dict[str, Any]] = []

        def on_event(event: dict[str, Any]) -> None:
            if event.get("event") == "node_lost" and event.get("round") == self.round.round:
                lost.append(event)

        try:
            if own is not None and not own.get("echo"):
                return self._cas(self.failure_key, own), False
            # Only echoes here, or nothing: a real cause elsewhere has ECHO_WAIT_S to arrive,
            # then a silent node NODE_LOST_S to be noticed, before this echo is the record.
            rec = self._get(self.failure_key, ECHO_WAIT_S, on_event)
            if rec is None and own is not None:
                if not lost:
                    rec = self._get(self.failure_key, NODE_LOST_S + 1.0, on_event)
                if rec is None:
                    rec = self._cas(self.failure_key, self.lost_record(lost[0]) if lost else own)
            return rec, False
        except AgentError:
            return None, True

    def _get(self, key: str, wait_s: float,
             on_event: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any] | None:
        reply = self.agent.call("get", key=key, wait_s=wait_s, on_event=on_event,
                                timeout_s=wait_s + 30)
        return parse_record(reply.get("value"))

    def _cas(self, key: str, rec: dict[str, Any]) -> dict[str, Any] | None:
        value = self.agent.call("cas", key=key, expected="", desired=json.dumps(rec))["value"]
        return parse_record(value)

    def poll(self) -> list[tuple[str | None, dict[str, Any] | None]]:
        """The agent's new events of this round, as (why this node's ranks must stop, the
        round's first-failure record): another node's record ("abort"), a node waiting to join
        ("membership": every node re-rendezvous, whoever wrote it), a node lost (its record is
        offered), the store or the agent gone ("store_lost"). Never blocks."""
        events = self.agent.read_events()
        if self.agent.eof:
            events.append({"event": "store_lost", "round": self.round.round})
        out: list[tuple[str | None, dict[str, Any] | None]] = []
        for event in events:
            if event.get("round") != self.round.round:
                continue  # a late word about an earlier round
            kind = event.get("event")
            if kind == "failure":
                rec = parse_record(event.get("record"))
                if rec is not None:
                    stop = "membership" if rec.get("kind") == MEMBERSHIP else \
                        None if is_mine(rec) else "abort"
                    out.append((stop, rec))
            elif kind == "node_lost":
                self.publish(self.lost_record(event))
                out.append(("abort", None))
            elif kind == "membership":
                self.publish(new_record(MEMBERSHIP, node=self.round.group_rank,
                                        what=f"{event.get('waiting')} node(s) waiting to join "
                                        "the job"))
                out.append(("membership", None))
            elif kind == "store_lost":
                out.append(("store_lost", None))
        return out

    def lost_record(self, event: dict[str, Any]) -> dict[str, Any]:
        g = int(event.get("group_rank", -1))
        node = self.round.node(g)
        host = node.label if node is not None else "?"
        rec = new_record(NODE_LOST, node=g, what=f"went silent (no word from its launcher for "
                         f"{float(event.get('silent_s', NODE_LOST_S)):.0f} s): its host, network "
                         "or launcher died", lost_host=host)
        rec["host"] = node.host if node is not None else "?"
        return rec

    def settle(self, rec: dict[str, Any] | None, local: Callable[[], Failure],
               policy: RestartPolicy, restarts_used: int, history: list[Failure]) -> Settled:
        """The job's decision after this round's first failure ``rec``. Every node decides
        from the record alone (its code, rank, exception type and frame, or signal), so every
        node reaches the same decision without waiting for another; compare-set keeps the
        first one stored, which every node follows. ``local()`` (this node's own Failure)
        serves only when nothing was recorded, and to name the GPU to exchange when the
        record is this node's."""
        if rec is None:
            failure = local()
            decision = decide_restart(history, failure, policy)
            return Settled(None, decision, failure, restarts_used, history)
        stored: dict[str, Any] | None = None
        try:
            failure = failure_of_record(rec)
            decision = decide_restart(history, failure, policy)
            counted = decision.restart and decision.counts
            used = restarts_used + (1 if counted else 0)
            hist = [*history, failure] if counted else history
            proposal = {"restart": decision.restart, "counts": decision.counts,
                        "reason": decision.reason, "failure": failure_to_dict(failure),
                        "restarts_used": used, "history": [failure_to_dict(f) for f in hist],
                        "by": LAUNCHER_ID}
            stored = self._cas(self.decision_key, proposal) or proposal
            if stored.get("by") == LAUNCHER_ID and decision.restart:
                self.agent.call("set", key="job", value=json.dumps(
                    {"restarts_used": used, "history": proposal["history"]}))
        except AgentError:
            return Settled(rec, Decision(False, "the job's store is gone (its host, network "
                                         "or launcher died): no rendezvous to restart on, "
                                         "not restarting"), failure_of_record(rec),
                           restarts_used, history, store_lost=True)
        assert stored is not None
        raw_failure = stored.get("failure")
        failure = failure_from_dict(raw_failure if isinstance(raw_failure, dict)
                                    else {"code": "RANK_FAILED"})
        restart = bool(stored.get("restart"))
        exclude: tuple[str, ...] = ()
        if restart and is_mine(rec) and failure.code in EXCLUDE_GPU_CODES:
            gpu = local().gpu  # this node's GPU failed: only this node can exchange it
            exclude = (gpu,) if gpu else ()
        decision = Decision(restart, str(stored.get("reason", "")), exclude,
                            counts=bool(stored.get("counts", True)))
        raw_history = stored.get("history")
        hist = [failure_from_dict(d) for d in (raw_history if isinstance(raw_history, list) else [])
                if isinstance(d, dict)]
        stored_used = stored.get("restarts_used")
        return Settled(rec, decision, failure,
                       stored_used if isinstance(stored_used, int) else restarts_used, hist)
