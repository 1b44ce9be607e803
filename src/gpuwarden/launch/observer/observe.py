"""What a running job looks like from outside, for ``gpuwarden status`` and ``gpuwarden stacks``.

Three parts, each with one owner:

- :func:`build_snapshot` runs in the supervisor's loop (handed over by
  :class:`~gpuwarden.launch.observer.control.LoopCalls`), which owns the job's state: every rank's phase
  from the samples the supervisor already takes (starting, in rendezvous, running, in a
  collective and for how long, exited), its CPU use, the stall and straggler verdicts. It asks
  no rank anything.
- :class:`JobObserver` answers the control endpoint in its own thread. ``stacks`` asks each
  live rank for a fresh stack through the rank's request FIFO (a ``q`` byte: the sampling
  thread answers in a file of its own, so the supervisor's samples are untouched); a rank that
  does not answer within a second (a C extension holding the GIL) is shown with its latest
  sample and its age. On several nodes, the other nodes' ranks come through the job's own c10d
  store (``launch/multinode/_store_stacks.py``, run by each node's local rank 0).
- :func:`group_stacks` (pure) puts ranks with the same stack together, as fr_trace and py-spy
  users read them, and marks the odd ones out.
"""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuwarden.boundedio import read_json_object
from gpuwarden.launch.watch.stall import (
    IDLE_CPU_CORES,
    Frame,
    RankView,
    classify,
    current_wait,
    decide_stall,
    main_thread,
    parse_dump,
)

if TYPE_CHECKING:
    from gpuwarden.launch.outcome import PeerView
    from gpuwarden.launch.supervisor import Supervisor

# Hands a function to the supervisor's loop and returns what it returned there
# (``control.LoopCalls.call``): the loop owns the job's state.
InLoop = Callable[[Callable[[float], Any]], Any]

SNAPSHOT_SCHEMA = 1
FRESH_WAIT_S = 1.0  # a rank's sampling thread answers in milliseconds unless the GIL is held
NODE_FRESH_WAIT_S = 0.6  # answering another node: its request has less time left
REMOTE_WAIT_S = 1.5  # the whole job's answer waits this long for the other nodes
FLIGHT_RECORDER_WAIT_S = 1.0
WAIT_TAIL_LINES = 12  # a rank's last stderr lines that explain reads while it waits in init
MAX_MAIN_FRAMES = 64
MAX_OTHER_THREADS = 32
MAX_THREAD_FRAMES = 32
REQUEST_SUFFIX = ".stacks-request"  # beside local rank 0's peers file (multi-node)
ANSWER_SUFFIX = ".stacks-answer"


def source_line(path: str, lineno: int) -> str:
    return linecache.getline(path, lineno)


# ---- the snapshot (in the supervisor's loop) --------------------------------------------


@dataclass(frozen=True)
class RankProbe:
    """How to ask one live rank for a fresh stack, and what to show when it cannot answer."""

    rank: int
    pid: int
    stack_file: str
    last_dump: str  # the latest sampled dump with the script's thread in it
    last_at: float | None  # monotonic, when it was asked for


@dataclass(frozen=True)
class JobSnapshot:
    public: dict[str, Any]  # JSON-able: what status shows
    probes: tuple[RankProbe, ...]
    run_dir: str
    multinode: bool
    peers_file: str  # local rank 0's (multi-node): where the store relay looks for requests
    # The last stderr lines of each rank waiting in init_process_group: explain reads them in
    # the endpoint's thread (diagnose_waits), not in the loop
    waiting_tails: Mapping[int, tuple[str, ...]] = field(default_factory=dict)


def suspect_after_s(stall_timeout_s: float, sample_interval_s: float) -> float:
    """A stall is *suspected* halfway to its report (and never before two samples)."""
    return max(2 * sample_interval_s, stall_timeout_s / 2)


def rank_row(view: RankView, *, now: float, failing: bool = False) -> dict[str, Any]:
    """One rank's phase, from what the supervisor knows (its samples, its exit)."""
    row: dict[str, Any] = {"phase": "starting", "op": None, "site": None, "for_s": None,
                           "where": "", "cpu_cores": None, "returncode": None}
    if view.state == "exited":
        row["phase"] = "finished" if view.returncode == 0 else "exited"
        row["returncode"] = view.returncode
        return row
    if view.state == "finished":
        row["phase"] = "finished"
        return row
    if view.state != "running":
        return row
    row["cpu_cores"] = _recent_cpu(view)
    wait = current_wait(view.samples, source_line)
    frames = next((s.frames for s in reversed(view.samples) if s.frames), ())
    if wait is not None and not (wait.wait.kind == "backward" and
                                 (wait.cpu_cores is None or wait.cpu_cores >= IDLE_CPU_CORES)):
        row["phase"] = "rendezvous" if wait.wait.kind == "init" else "collective"
        row["op"], row["site"] = wait.wait.op, wait.wait.site
        row["for_s"] = round(max(0.0, now - wait.since), 1)
        row["where"] = f"{wait.wait.describe()} at {wait.wait.site}"
    elif frames:
        row["phase"] = "running"
        top = next((f for f in frames if not f.in_torch), frames[0])
        row["where"] = f"{top.func} at {top.site}"
    if failing:
        row["phase"] = "failing"
    return row


def _recent_cpu(view: RankView, span_s: float = 6.0) -> float | None:
    timed = [s for s in view.samples if s.cpu_s is not None]
    if len(timed) < 2:
        return None
    last = timed[-1]
    first = next((s for s in timed if s.at >= last.at - span_s and s is not last), None)
    if first is None or last.at <= first.at:
        return None
    return round((last.cpu_s - first.cpu_s) / (last.at - first.at), 3)  # type: ignore[operator]


def build_snapshot(sup: Supervisor, now: float) -> JobSnapshot:
    """In the supervisor's loop: the job as it is now (nothing is asked of any rank)."""
    from gpuwarden.launch.watch.status import Phase

    plan, config = sup.plan, sup.plan.config
    views = sup.views()
    rows, probes = [], []
    tails: dict[int, tuple[str, ...]] = {}
    for r in sup.ranks:
        view = views[r.spec.rank]
        phase = None
        with contextlib.suppress(OSError, ValueError):
            phase = r.status.read().phase
        row = {"rank": r.spec.rank, "local_rank": r.spec.local_rank, "node": plan.node_rank,
               "pid": r.proc.pid, "gpu": r.spec.gpu.label if r.spec.gpu is not None else None,
               **rank_row(view, now=now, failing=phase is Phase.FAILED and r.exit is None)}
        rows.append(row)
        if row["phase"] == "rendezvous" and r.relay.stderr_tail:
            tails[r.spec.rank] = tuple(list(r.relay.stderr_tail)[-WAIT_TAIL_LINES:])
        if r.exit is None and r.sampler is not None:
            last_at = next((s.at for s in reversed(r.sampler.samples) if s.frames), None)
            probes.append(RankProbe(r.spec.rank, r.proc.pid, r.spec.files.stacks,
                                    r.sampler.last_dump, last_at))
    stall: dict[str, Any] | None = None
    outcome = sup.outcome(now)
    reported = outcome.stall
    if reported is not None:
        stall = {"reported": True, "suspected": True, "waiting": reported.waiting,
                 "elsewhere": reported.elsewhere, "point": reported.point, "kind": reported.kind}
    else:
        suspect = decide_stall(views, now, suspect_after_s(config.stall_timeout_s,
                                                           sup.sample_interval_s), source_line)
        if suspect is not None:
            stall = {"reported": False, "suspected": True, "waiting": suspect.waiting,
                     "elsewhere": suspect.elsewhere, "point": suspect.point, "kind": suspect.kind}
    straggler = sup.straggler.to_dict() if sup.straggler is not None else None
    public: dict[str, Any] = {
        "run_id": next((s.env.get("TORCHELASTIC_RUN_ID") for s in plan.ranks), None),
        "node_rank": plan.node_rank, "nnodes": plan.nnodes, "world_size": plan.world_size,
        "host": socket.gethostname(), "attempt": plan.attempt,
        "max_restarts": config.max_restarts, "target": config.target,
        "stall_timeout_s": config.stall_timeout_s,
        "sample_interval_s": sup.sample_interval_s,
        "uptime_s": round(now - outcome.started_at, 1),
        "ranks": rows, "stall": stall, "straggler": straggler,
    }
    peers_file = ""
    if sup.peers is not None:
        public["peers"] = {"store_connected": sup.peers.reader_connected,
                           "arrived": sorted(sup.peers.arrived),
                           "store_lost": sup.peers.store_lost}
        peers_file = next((s.files.peers for s in plan.ranks if s.local_rank == 0), "")
    return JobSnapshot(public, tuple(probes), plan.run_dir, plan.nnodes > 1, peers_file, tails)


def diagnose_waits(rows: Sequence[dict[str, Any]], tails: Mapping[int, tuple[str, ...]]) -> None:
    """A rank in init_process_group whose own output names why it cannot get through (torch
    retries an unknown MASTER_ADDR or a refused connection silently, printing a warning now and
    then): its row gets explain's code and words (``diagnosis``), so `status` says more than
    "in rendezvous". Runs explain, in the endpoint's thread."""
    if not tails:
        return
    from gpuwarden.explain import explain_text
    from gpuwarden.safetext import escape_untrusted

    for row in rows:
        tail = tails.get(row.get("rank", -1))
        if not tail:
            continue
        try:
            primary = explain_text("\n".join(tail)).primary
        except Exception:  # a diagnosis must not cost the answer
            continue
        if primary.code in ("NONE", "RANK_FAILED"):
            continue
        line = escape_untrusted(primary.evidence[-1].text.strip(), 300) if primary.evidence \
            else ""
        row["diagnosis"] = {"code": primary.code, "what": primary.what, "line": line}


# ---- fresh stacks (in the endpoint's threads) -------------------------------------------


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns)


def _ask(fifo: str, byte: bytes) -> bool:
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # ENXIO: no reader (the rank is not sampling, or gone)
        return False
    try:
        os.write(fd, byte)
        return True
    except OSError:  # EAGAIN: the FIFO is full, the rank has not read for a while
        return False
    finally:
        os.close(fd)


def fresh_dumps(probes: Iterable[RankProbe], wait_s: float) -> dict[int, tuple[str, bool]]:
    """rank -> (dump, fresh): taken now by each rank's sampling thread, else its latest sample."""
    from gpuwarden.launch.watch.sampler import read_dump
    from gpuwarden.launch.watch.status import query_path, sample_paths

    probes = list(probes)
    pending: dict[int, tuple[str, tuple[int, int] | None]] = {}
    for p in probes:
        answer = query_path(p.stack_file)
        before = _stamp(answer)
        if _ask(sample_paths(p.stack_file)[0], b"q"):
            pending[p.rank] = (answer, before)
    out: dict[int, tuple[str, bool]] = {}
    deadline = time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:
        time.sleep(0.005)
        for rank, (answer, before) in list(pending.items()):
            stamp = _stamp(answer)
            if stamp is not None and stamp != before:
                dump = read_dump(answer)
                if dump:
                    out[rank] = (dump, True)
                    del pending[rank]
    for p in probes:
        if p.rank not in out:
            out[p.rank] = (p.last_dump, False)
    return out


def frames_of(frames: Sequence[Frame], limit: int) -> list[dict[str, Any]]:
    """Frames as data (innermost first), at most ``limit``: the innermost ones and the
    outermost few (where the script called in from)."""
    kept = list(frames)
    if len(kept) > limit:
        kept = kept[: limit - 4] + [Frame("...", 0, f"({len(frames) - limit} frames left out)")] \
            + kept[-3:]
    return [{"file": f.file, "line": f.line, "func": f.func} for f in kept]


def stack_record(rank: int, dump: str, fresh: bool, all_threads: bool) -> dict[str, Any]:
    """One rank's answer: its script's thread (and the others on request), what it waits in."""
    threads = parse_dump(dump)
    main = main_thread(threads)
    wait = classify(main, source_line) if main else None
    record: dict[str, Any] = {
        "rank": rank, "fresh": fresh, "main": frames_of(main, MAX_MAIN_FRAMES),
        "wait": None if wait is None else {"kind": wait.kind, "op": wait.op, "site": wait.site,
                                           "what": wait.describe()},
    }
    if all_threads:
        others = [t for t in threads if t and not any(f.func == "_sampling_loop" for f in t)
                  and not any("gpuwarden/launch/ranks/_bootstrap.py" in f.file for f in t)]
        record["threads"] = [frames_of(t, MAX_THREAD_FRAMES) for t in others[:MAX_OTHER_THREADS]]
    return record


def _flight_records(run_dir: str, wait_s: float) -> dict[int, list[dict[str, Any]]]:
    """rank -> its last collective per process group, from NCCL's flight recorder (GPU jobs
    whose ranks made dump pipes); {} elsewhere."""
    from gpuwarden.launch.watch import flight_recorder

    with contextlib.suppress(OSError):  # an earlier answer must not pass for this one
        for name in os.listdir(run_dir):
            if name.startswith(flight_recorder.DUMP_PREFIX) and not name.endswith(".pipe"):
                os.unlink(os.path.join(run_dir, name))
    asked = flight_recorder.request_dumps(run_dir)
    if not asked:
        return {}
    deadline = time.monotonic() + wait_s
    while len(flight_recorder.read_dumps(run_dir)) < asked and time.monotonic() < deadline:
        time.sleep(0.05)
    out: dict[int, list[dict[str, Any]]] = {}
    for group, ranks in flight_recorder.last_collectives(flight_recorder.read_dumps(run_dir)).items():
        for rank, (seq, name, state) in ranks.items():
            out.setdefault(rank, []).append({"group": group, "seq": seq, "op": name,
                                             "state": state})
    return out


# ---- the endpoint's handler ---------------------------------------------------------------


class JobObserver:
    """Answers ``status`` and ``stacks`` for one supervisor (in the endpoint's threads)."""

    def __init__(self, sup: Supervisor, in_loop: InLoop) -> None:
        self.sup = sup
        self.in_loop = in_loop
        self._asking = threading.Lock()  # one round of FIFO questions at a time

    def snapshot(self) -> JobSnapshot:
        snap: JobSnapshot = self.in_loop(lambda now: build_snapshot(self.sup, now))
        return snap

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "status":
            snap = self.snapshot()
            diagnose_waits(snap.public["ranks"], snap.waiting_tails)
            return {"ok": True, "schema": SNAPSHOT_SCHEMA, "job": snap.public}
        if op == "stacks":
            return self.stacks(request.get("scope") == "node", bool(request.get("all_threads")))
        return {"ok": False, "error": f"unknown request {str(op)[:40]!r}"}

    def stacks(self, node_only: bool, all_threads: bool) -> dict[str, Any]:
        started = time.monotonic()
        snap = self.snapshot()
        request_id = ""
        if snap.multinode and not node_only and snap.peers_file:
            request_id = _ask_other_nodes(snap.peers_file, started + REMOTE_WAIT_S)
        with self._asking:
            dumps = fresh_dumps(snap.probes, NODE_FRESH_WAIT_S if node_only else FRESH_WAIT_S)
        by_rank = {row["rank"]: row for row in snap.public["ranks"]}
        ages = {p.rank: p.last_at for p in snap.probes}
        ranks = []
        for rank, (dump, fresh) in sorted(dumps.items()):
            rec = stack_record(rank, dump, fresh, all_threads)
            if not fresh:
                at = ages.get(rank)
                rec["age_s"] = None if at is None else round(time.monotonic() - at, 1)
            ranks.append({**by_rank.get(rank, {}), **rec})
        for rank, row in by_rank.items():  # ranks with nothing to ask: ended, not started
            if rank not in dumps:
                ranks.append({**row, "fresh": False, "main": [], "wait": None})
        fr = _flight_records(snap.run_dir, FLIGHT_RECORDER_WAIT_S) if not node_only else {}
        for rec in ranks:
            if rec["rank"] in fr:
                rec["flight_recorder"] = fr[rec["rank"]]
        job = {k: v for k, v in snap.public.items() if k != "ranks"}
        node = {"node": snap.public["node_rank"], "host": snap.public["host"], "answered": True,
                "after_s": round(time.monotonic() - started, 3), "error": None}
        answer: dict[str, Any] = {"ok": True, "schema": SNAPSHOT_SCHEMA, "job": job,
                                  "nodes": [node], "ranks": ranks}
        if request_id:
            _merge_other_nodes(answer, snap, request_id, started + REMOTE_WAIT_S, all_threads,
                               started, self.sup.peers)
        answer["ranks"].sort(key=lambda r: r.get("rank", -1))
        answer["nodes"].sort(key=lambda n: n.get("node", -1))
        answer["after_s"] = round(time.monotonic() - started, 3)
        return answer


def _ask_other_nodes(peers_file: str, deadline_mono: float) -> str:
    """Ask local rank 0's store relay for the other nodes' stacks; the request's id."""
    request_id = uuid.uuid4().hex
    body = {"id": request_id, "deadline": time.time() + (deadline_mono - time.monotonic())}
    tmp = f"{peers_file}{REQUEST_SUFFIX}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(body, f)
        os.replace(tmp, peers_file + REQUEST_SUFFIX)
    except OSError:
        return ""
    return request_id


def _merge_other_nodes(answer: dict[str, Any], snap: JobSnapshot, request_id: str,
                       deadline: float, all_threads: bool, started: float,
                       peers: PeerView | None) -> None:
    nnodes = int(snap.public["nnodes"])
    me = int(snap.public["node_rank"])
    # Waited for even while the watch is not connected yet: right after init_process_group the
    # script runs ahead of the watch's own connection (and of the supervisor's next look at it),
    # and a request written before the relay starts is still answered at its first poll.
    got: dict[str, Any] = {}
    path = snap.peers_file + ANSWER_SUFFIX
    while time.monotonic() < deadline:
        data = read_json_object(path)
        if data is not None and data.get("id") == request_id:
            nodes = data.get("nodes")
            got = nodes if isinstance(nodes, dict) else {}
            break
        time.sleep(0.02)
    # ``peers`` is the supervisor's live view: the watch may have connected while we waited.
    connected = bool(got) or (peers is not None and peers.reader_connected)
    for node in range(nnodes):
        if node == me:
            continue
        remote = got.get(str(node)) if isinstance(got, dict) else None
        entry: dict[str, Any] = {"node": node, "host": None, "answered": False, "error": None,
                                 "after_s": round(time.monotonic() - started, 3)}
        if not connected:
            entry["error"] = ("this node's local rank 0 holds no connection to the job's store "
                              "yet (before init_process_group), so other nodes cannot be asked")
        elif not isinstance(remote, dict):
            entry["error"] = f"no answer within {REMOTE_WAIT_S:g} s"
        elif not remote.get("ok"):
            entry["error"] = str(remote.get("error") or "no answer")[:300]
        else:
            entry.update(answered=True, host=_text(remote.get("job", {}).get("host")))
            for rec in _remote_ranks(remote, node, all_threads):
                answer["ranks"].append(rec)
        answer["nodes"].append(entry)


def _text(value: Any, limit: int = 200) -> str | None:
    return None if value is None else str(value)[:limit]


def _remote_ranks(remote: Mapping[str, Any], node: int, all_threads: bool) -> list[dict[str, Any]]:
    """Another node's ranks, as it answered through the store: checked (the store takes keys
    from anyone who reaches its port), bounded, and never trusted for more than display."""
    out = []
    ranks = remote.get("ranks")
    for rec in ranks[:4096] if isinstance(ranks, list) else []:
        if not isinstance(rec, dict) or not isinstance(rec.get("rank"), int):
            continue
        clean: dict[str, Any] = {"rank": rec["rank"], "node": node}
        for key in ("local_rank", "pid", "returncode"):
            clean[key] = rec.get(key) if isinstance(rec.get(key), int) else None
        for key in ("gpu", "phase", "op", "site", "where"):
            clean[key] = _text(rec.get(key))
        for key in ("for_s", "cpu_cores", "age_s"):
            clean[key] = rec.get(key) if isinstance(rec.get(key), (int, float)) else None
        clean["fresh"] = bool(rec.get("fresh"))
        clean["main"] = _frames(rec.get("main"), MAX_MAIN_FRAMES)
        wait = rec.get("wait")
        clean["wait"] = {k: _text(wait.get(k)) for k in ("kind", "op", "site", "what")} \
            if isinstance(wait, dict) else None
        if all_threads and isinstance(rec.get("threads"), list):
            clean["threads"] = [_frames(t, MAX_THREAD_FRAMES)
                                for t in rec["threads"][:MAX_OTHER_THREADS]]
        out.append(clean)
    return out


def _frames(value: Any, limit: int) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        return []
    out = []
    for f in value[:limit]:
        if isinstance(f, dict):
            out.append({"file": _text(f.get("file"), 500) or "?",
                        "line": f.get("line") if isinstance(f.get("line"), int) else 0,
                        "func": _text(f.get("func")) or "?"})
    return out


# ---- grouping (pure) ----------------------------------------------------------------------


def _key(rec: Mapping[str, Any], all_threads: bool) -> tuple[Any, ...]:
    main = tuple((f["file"], f["line"], f["func"]) for f in rec.get("main") or ())
    if not all_threads:
        return main
    others = sorted(tuple((f["file"], f["line"], f["func"]) for f in t)
                    for t in rec.get("threads") or ())
    return (main, tuple(others))


def group_stacks(ranks: Sequence[Mapping[str, Any]], *, all_threads: bool = False
                 ) -> list[dict[str, Any]]:
    """Ranks with the same stack together, largest group first; ``odd`` marks the ranks out of
    step: every group but the largest when one group is larger than all others; on a tie, the
    groups not waiting in a collective when the tied ones differ in that."""
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for rec in ranks:
        if not rec.get("main"):
            continue
        groups.setdefault(_key(rec, all_threads), []).append(rec)
    ordered = sorted(groups.values(), key=lambda g: (-len(g), min(r["rank"] for r in g)))
    out: list[dict[str, Any]] = []
    for members in ordered:
        first = members[0]
        out.append({"ranks": sorted(r["rank"] for r in members),
                    "nodes": sorted({int(r["node"]) for r in members
                                     if isinstance(r.get("node"), int)}),
                    "main": first.get("main") or [], "threads": first.get("threads") or [],
                    "wait": first.get("wait"), "odd": False})
    if len(out) > 1:
        sizes = [len(g["ranks"]) for g in out]
        if sizes[0] > sizes[1]:
            for g in out[1:]:
                g["odd"] = True
        else:
            top = [g for g in out if len(g["ranks"]) == sizes[0]]
            waiting = [g for g in top if g["wait"]]
            if len(waiting) == 1:
                for g in out:
                    g["odd"] = g is not waiting[0]
    return out
