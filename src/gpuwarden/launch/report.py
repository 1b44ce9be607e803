"""The one report of a launch: which rank failed first, how, where it ran, and the failure code.

Built from the supervisor's :class:`~.outcome.RunOutcome` by pure functions, as a
:class:`~.outcome.LaunchReport`. The root cause is the rank
that failed first in time, but an echo (a peer's socket closed under a collective, a watchdog
or collective timeout) is never the cause while a real one exists: a rank that failed of its
own accord, or a rank that left (any exit code, 0 included) or died before the others started
failing. The failure code
comes from ``gpuwarden.explain`` when it recognises the rank's error text, else
RANK_NATIVE_CRASH for a rank ended by SIGSEGV, SIGBUS or SIGABRT, else RANK_FAILED: the report
is complete without it (exception, traceback tail, exit code or signal, pid, GPU).
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

from gpuwarden.launch.outcome import LaunchReport, RankExit, RunOutcome, is_echo
from gpuwarden.launch.watch.stall import Stall, main_thread_frames
from gpuwarden.procs import describe_exit, shell_exit_code, signal_name
from gpuwarden.safetext import escape_untrusted

if TYPE_CHECKING:  # explain (and its knowledge base) loads only when a rank failed
    from gpuwarden.explain.diagnosis import Finding as Diagnosed

TRACEBACK_TAIL_LINES = 12
EXIT_NODE_ABORTED = 1
ECHO_WINDOW_S = 2.0

_SIGNAL_WHY = {
    "SIGKILL": ("SIGKILL cannot be caught: most often the kernel's out-of-memory killer (host RAM, "
                "not GPU memory), else something outside the job (a scheduler, a person) killed it",
                "look for the OOM killer: `dmesg -T | grep -i -E 'killed process|out of memory'`; "
                "use less host memory per rank (batch size, DataLoader workers, pinned memory)"),
    "SIGSEGV": ("a crash in native code (a C/C++/CUDA extension, mismatched library builds)",
                "the Python stack at the crash is shown below; rebuild or update the extension in it"),
    "SIGABRT": ("native code called abort(): a failed C++ check in torch, NCCL or an extension",
                "the lines the rank printed before it died name the check that failed"),
    "SIGBUS": ("a bus error, usually shared memory (/dev/shm) running out under DataLoader or NCCL",
               "give the container more /dev/shm (--shm-size, --ipc=host) or use fewer workers"),
    "SIGFPE": ("an arithmetic fault in native code: an integer division by zero or overflow in "
               "a C/C++/CUDA extension (a float division by zero gives inf, not a signal)",
               "the Python stack at the crash is shown below: look for an index or size that "
               "can be 0 in the call into the extension"),
    "SIGILL": ("an illegal instruction: a library built for a newer CPU than this one (AVX2, "
               "AVX-512, a -march=native build), or a corrupted binary",
               "install a build for this CPU (`lscpu` lists its flags), or rebuild the extension "
               "without -march=native"),
}


# Signals of a rank's own native code (RANK_NATIVE_CRASH), unless explain names the error the
# rank aborted on; SIGKILL comes from outside (HOST_OOM_KILL, the scheduler).
_NATIVE_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE", "SIGILL"})


def exit_words(returncode: int) -> str:
    """'exit code 3' or 'signal SIGKILL(-9)'."""
    return f"signal {describe_exit(returncode)}" if returncode < 0 else describe_exit(returncode)


def root_cause(exits: list[RankExit]) -> RankExit | None:
    """The rank to blame, or None when nothing failed.

    The first failure in time, unless it is an echo: then a real failure (one of the rank's own
    making) seen within ECHO_WINDOW_S of it wins, else the rank that left (exit 0 included,
    e.g. ``os._exit(0)``) before it: the others failed because that rank was gone. The window
    absorbs the supervisor's view of an exit, a poll later than the peer's own error record.
    Past the window the echo stays the first failure: a failure recorded later (its own
    exception's time, not when it was reaped) cannot be what the echo heard.
    """
    failures = sorted((e for e in exits if e.failed and not e.stopped_by_launcher),
                      key=lambda e: (e.failed_at, e.rank))
    if not failures:
        return None
    first = failures[0]
    if not is_echo(first):
        return first
    for other in failures[1:]:
        if other.failed_at - first.failed_at > ECHO_WINDOW_S:
            break
        if not is_echo(other):
            return other
    left = sorted((e for e in exits if not e.failed and not e.stopped_by_launcher
                   and e.ended_at <= first.failed_at + ECHO_WINDOW_S),
                  key=lambda e: (e.ended_at, e.rank))
    return left[0] if left else first


def build_report(outcome: RunOutcome) -> LaunchReport:
    plan = outcome.plan
    failures = [e for e in outcome.exits.values() if e.failed and not e.stopped_by_launcher]
    job = outcome.job_failure
    if job is not None and job.get("by") != _job_by() and job.get("kind") != "membership":
        return _node_aborted_report(outcome)  # the job's first failure is another node's
    if outcome.stopped_for == "memory" and outcome.memory_stop is not None:
        return _memory_report(outcome, outcome.memory_stop)
    if outcome.stopped_for is not None and all(is_echo(e) for e in failures):
        return _node_aborted_report(outcome)  # another node failed first: say which
    root = root_cause(list(outcome.exits.values()))
    if root is not None and not root.failed:
        return _left_early_report(outcome, root, failures)
    if root is not None:
        return _failure_report(outcome, root)
    if outcome.stall is not None and not plan.config.keep_waiting:
        return stall_report(outcome, outcome.stall)
    if outcome.interrupted_by is not None:
        return _interrupted_report(outcome)
    elapsed = outcome.ended_at - outcome.started_at
    return LaunchReport(0, None, f"{plan.world_size} rank(s) finished in {elapsed:.1f} s")


def _interrupted_report(outcome: RunOutcome) -> LaunchReport:
    """gpuwarden was asked to stop. When the ranks' own output says why they were stuck (a
    rendezvous that retries an unknown MASTER_ADDR, a refused connection), the report says it:
    an interrupt is often the user giving up on a job that waited silently."""
    plan = outcome.plan
    signum = int(getattr(signal, str(outcome.interrupted_by), signal.SIGTERM))
    what = (f"gpuwarden received {outcome.interrupted_by} and stopped all {plan.world_size} "
            "rank(s)" if len(outcome.pids) >= plan.world_size else
            f"gpuwarden received {outcome.interrupted_by} while starting ranks and stopped the "
            f"{len(outcome.pids)} of {plan.world_size} it had started")
    evidence = [_rank_line(outcome, e) for e in sorted(outcome.exits.values(), key=_by_rank)]
    stuck = _stuck_before_interrupt(outcome)
    if stuck is None:
        return LaunchReport(128 + signum, "LAUNCH_INTERRUPTED", what, evidence=evidence)
    diag, ranks = stuck
    who = _ranks_by_node(outcome, ranks)
    why = (f"before the interrupt, rank(s) {who} were stuck: {diag.what} ({diag.code}); "
           f"{diag.why}")
    if diag.evidence:
        line = escape_untrusted(diag.evidence[-1].text.strip(), 500)
        evidence.append(f"matched in rank {ranks[0]}'s output: {line}")
    fields: dict[str, Any] = {"stuck": {"code": diag.code, "ranks": ranks,
                                        "explain": dict(diag.fields)}}
    return LaunchReport(128 + signum, "LAUNCH_INTERRUPTED", what, why, diag.fix, evidence,
                        fields=fields)


def _stuck_before_interrupt(outcome: RunOutcome) -> tuple[Diagnosed, list[int]] | None:
    """explain's diagnosis of the first rank whose last stderr lines name a known failure
    (RANK_FAILED, a launcher's wrapping, is not one), and every rank whose lines say the same."""
    found: Diagnosed | None = None
    ranks: list[int] = []
    for e in sorted(outcome.exits.values(), key=_by_rank):
        tail = e.stderr_before_stop or e.stderr_tail
        if not tail:
            continue
        diag = _explain("\n".join(tail))
        if diag is None or diag.code == "RANK_FAILED":
            continue
        if found is None:
            found = diag
        if diag.code == found.code:
            ranks.append(e.rank)
    return None if found is None else (found, ranks)


def _memory_report(outcome: RunOutcome, finding: dict[str, Any]) -> LaunchReport:
    """--mem-enforce stop: the job was stopped because a rank used more than its lease."""
    evidence = [str(e) for e in finding.get("evidence", [])]
    evidence += [_rank_line(outcome, e) for e in sorted(outcome.exits.values(), key=_by_rank)]
    return LaunchReport(1, "LEASE_MEMORY_EXCEEDED", f"stopped: {finding.get('what')}",
                        why=finding.get("why"), fix=finding.get("fix"), evidence=evidence,
                        fields=dict(finding.get("fields") or {}))


def _job_by() -> str:
    from gpuwarden.launch.multinode.job_store import LAUNCHER_ID

    return LAUNCHER_ID


def _by_rank(e: RankExit) -> int:
    return e.rank


def _device(outcome: RunOutcome, rank: int) -> str:
    spec = outcome.plan.spec(rank)
    if spec is None:
        return f"node {outcome.plan.node_of(rank)}"
    return spec.device_label if outcome.plan.nnodes == 1 else \
        f"{spec.device_label}, node {outcome.plan.node_rank}"


def _ranks_by_node(outcome: RunOutcome, ranks: list[int]) -> str:
    """'2, 3' on one node; '2, 3 (node 1)' for ranks of another node in a multi-node job."""
    plan = outcome.plan
    if plan.nnodes == 1:
        return ", ".join(map(str, ranks))
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(plan.node_of(r), []).append(r)
    return "; ".join(f"{', '.join(map(str, rs))} (node {node})" for node, rs in sorted(groups.items()))


def _node_aborted_report(outcome: RunOutcome) -> LaunchReport:
    plan, peers = outcome.plan, outcome.peers
    job = outcome.job_failure
    if job is not None:
        return _job_failure_report(outcome, job)
    stopped = [_rank_line(outcome, e) for e in sorted(outcome.exits.values(), key=_by_rank)]
    if outcome.stopped_for == "abort" and peers is not None and peers.abort is not None:
        rec = peers.abort
        host = f" on {rec['host']}" if rec.get("host") else ""
        what = (f"rank {rec.get('rank')} (node {rec.get('node')}{host}) failed: "
                f"{rec.get('what', 'no detail')}; this node (node {plan.node_rank}) stopped its "
                f"{len(plan.ranks)} rank(s)")
        why = ("the failing node set the job's abort key in the rendezvous store "
               "(gpuwarden/abort); without it this node would wait for NCCL's watchdog "
               "(10 min) or gloo's timeout (30 min)")
        fix = f"the root cause is in node {rec.get('node')}'s report"
    else:
        lost = peers.store_lost if peers is not None else None
        what = (f"the rendezvous store at {plan.master_addr}:{plan.master_port} went away while "
                f"this node's ranks waited for the others; node {plan.node_rank} stopped its ranks")
        why = (f"rank 0's process (node 0) hosts the store: node 0 failed, was stopped, or "
               f"lost the network ({lost})")
        fix = "the root cause is in node 0's report"
    return LaunchReport(EXIT_NODE_ABORTED, "NODE_ABORTED", what, why, fix, stopped, [], None)


def _job_failure_report(outcome: RunOutcome, rec: dict[str, Any]) -> LaunchReport:
    """Another node's failure is the job's first (job_store.py): named as every node names it;
    this node's own failures are listed as its echoes, or as failures that came after it."""
    from gpuwarden.launch.multinode import job_store

    plan = outcome.plan
    kind = rec.get("kind")
    node = rec.get("node")
    what = (f"{job_store.describe(rec)}; this node (node {plan.node_rank}) stopped its "
            f"{len(plan.ranks)} rank(s)")
    if kind == job_store.NODE_LOST:
        why = (f"node {node} stopped answering in the job's store: its host, its network or its "
               "launcher died; its ranks' peers here would have waited for NCCL's watchdog "
               "(10 min) or gloo's timeout (30 min)")
        fix = f"look at node {node}'s host (its launcher's output, dmesg, the scheduler's log)"
    else:
        why = ("the first failure anywhere in the job is the root cause: its node wrote it to "
               "the job's store, and every node stopped its ranks when it appeared")
        fix = f"the root cause, its traceback and its fix are in node {node}'s report"
    evidence = []
    for e in sorted(outcome.exits.values(), key=_by_rank):
        line = _rank_line(outcome, e)
        if e.failed and not e.stopped_by_launcher:
            err = e.error or {}
            words = f"{err.get('type')}: {err.get('message')}" if err.get("type") else ""
            line += (f" (an echo of the job's first failure{': ' + words if words else ''})"
                     if is_echo(e) else f" (failed after the job's first failure: {words or 'see above'})")
        evidence.append(line)
    fields = {"node": node, "host": rec.get("host"), "rank": rec.get("rank"), "kind": kind}
    return LaunchReport(EXIT_NODE_ABORTED, "NODE_ABORTED", what, why, fix, evidence, [], None,
                        fields)


def _rank_line(outcome: RunOutcome, e: RankExit) -> str:
    how = exit_words(e.returncode)
    if e.stopped_by_launcher:
        how = f"stopped by gpuwarden ({how})"
    return f"rank {e.rank}: pid {e.pid}, {_device(outcome, e.rank)}, {how}"


def _explain(text: str) -> Diagnosed | None:
    """explain's primary diagnosis when it knows the text, else None."""
    from gpuwarden.explain import explain_text

    try:
        primary = explain_text(text).primary
    except Exception:  # the report must not fail because a diagnosis did
        return None
    return None if primary.code == "NONE" else primary


def _left_early_report(outcome: RunOutcome, root: RankExit, failures: list[RankExit]) -> LaunchReport:
    """A rank ended (exit code 0) while the others still needed it: their errors are echoes."""
    first = min(failures, key=lambda e: (e.failed_at, e.rank))
    after = root.ended_at - outcome.started_at
    what = (f"rank {root.rank} exited with code 0 after {after:.1f} s while the other ranks still "
            f"needed it; rank(s) {', '.join(str(e.rank) for e in sorted(failures, key=_by_rank))} "
            "then failed waiting for it")
    why = ("a collective completes only when every rank calls it: a rank that returns early, calls "
           "sys.exit(0) or os._exit(0) in the middle of training leaves its peers with a closed "
           "connection (gloo) or a watchdog timeout (NCCL); their errors are echoes of it")
    fix = (f"find why rank {root.rank} ended early (a rank-dependent return, break or exit in the "
           "script); every rank must run the same collectives")
    evidence = [f"rank {root.rank}: pid {root.pid}, {_device(outcome, root.rank)}, exit code 0 "
                f"after {after:.1f} s"]
    for e in sorted(outcome.exits.values(), key=_by_rank):
        if e.rank != root.rank:
            line = _rank_line(outcome, e)
            if e.failed and not e.stopped_by_launcher:
                line += f" (failed after rank {root.rank} left, an echo of it)"
            evidence.append(line)
    err = first.error or {}
    details: list[tuple[str, list[str]]] = []
    if err:
        tb = str(err.get("traceback", "")).rstrip().splitlines()
        details.append((f"traceback of rank {first.rank} (the echo, last lines)",
                        tb[-TRACEBACK_TAIL_LINES:]))
    # The job failed (the echo's code, at least 1), though the rank that caused it exited 0.
    exit_code = 1 if first.killed_by_launcher else max(1, shell_exit_code(first.returncode))
    fields: dict[str, Any] = {"rank": root.rank, "pid": root.pid,
                              "device": _device(outcome, root.rank), "returncode": 0,
                              "after_s": round(after, 3), "echo_rank": first.rank}
    return LaunchReport(exit_code, "RANK_EXITED_EARLY", what, why, fix, evidence, details,
                        root.rank, fields)


def _exception_words(err: dict[str, Any]) -> str:
    """'KeyError: 'lr'', or 'KeyboardInterrupt' for an exception without a message."""
    message = str(err.get("message", ""))
    return f"{err.get('type')}: {message}" if message else str(err.get("type"))


def _failure_report(outcome: RunOutcome, root: RankExit) -> LaunchReport:
    after = root.failed_at - outcome.started_at
    err = root.error or {}
    recorded = root.torch_error  # torch's @record / record_exception, in its error file
    details: list[tuple[str, list[str]]] = []
    if err:
        what = f"rank {root.rank} failed first: {_exception_words(err)}"
        tb = str(err.get("traceback", "")).rstrip().splitlines()
        details.append((f"traceback of rank {root.rank} (last lines)", tb[-TRACEBACK_TAIL_LINES:]))
    elif recorded is not None and recorded.message:
        # The script recorded its exception with torch's error handler, then left on its own
        # (sys.exit(7)): what torchrun's ChildFailedError shows for it.
        what = f"rank {root.rank} failed first: {escape_untrusted(recorded.message, 500)}"
        tb = (recorded.traceback or "").rstrip().splitlines()
        details.append((f"traceback rank {root.rank} recorded in torch's error file (last lines)",
                        [escape_untrusted(line, 2000) for line in tb[-TRACEBACK_TAIL_LINES:]]))
    elif root.returncode < 0 and root.finished_script:
        what = (f"rank {root.rank} finished its script, then was killed by "
                f"{describe_exit(root.returncode)} as its interpreter exited")
    elif root.returncode < 0:
        what = f"rank {root.rank} was killed by {describe_exit(root.returncode)}"
    else:
        what = f"rank {root.rank} failed first: {exit_words(root.returncode)}"
    crash_frames = main_thread_frames(root.fatal_dump, TRACEBACK_TAIL_LINES) \
        if root.fatal_dump.strip() else []
    if crash_frames:
        first = root.fatal_dump.strip().splitlines()[0]
        details.append((f"Python stack of rank {root.rank} at the crash ({first})", crash_frames))
    elif not err and recorded is None and root.stderr_tail:
        details.append((f"last lines rank {root.rank} wrote to stderr", root.stderr_tail[-8:]))

    text = "\n".join([str(err.get("traceback", "")), *root.stderr_tail, root.fatal_dump,
                      recorded.traceback or recorded.message if recorded is not None else ""])
    diag = _explain(text)
    code, why, fix = "RANK_FAILED", None, None
    # A rank that raised and then outlived --grace in its teardown was SIGKILLed by gpuwarden:
    # its exception is the failure, not the signal.
    raised_then_killed = bool(err) and root.killed_by_launcher
    name = signal_name(-root.returncode) if root.returncode < 0 else None
    # The script had ended, by an uncaught exception (the bootstrap recorded it) or by
    # returning (its FINISHED phase), then a native signal: the rank died while the
    # interpreter went down (a gloo or NCCL thread of a process group or DDP model still alive
    # calls std::terminate: "terminate called without an active exception"). After an
    # exception, the exception is the failure; after a return, the crash at exit is, named so.
    at_exit = name in _NATIVE_SIGNALS and not raised_then_killed \
        and (bool(err) or root.finished_script)
    raised_then_crashed = at_exit and bool(err)
    if raised_then_crashed and diag is not None and diag.code == "RANK_NATIVE_CRASH":
        diag = None  # what explain read is the abort at exit ("Fatal Python error: Aborted")
    if diag is not None and not (name in _NATIVE_SIGNALS and diag.code == "RANK_FAILED"
                                 and not raised_then_crashed):
        code, why, fix = diag.code, diag.why, diag.fix
    elif name in _NATIVE_SIGNALS and not raised_then_killed and not raised_then_crashed:
        code = "RANK_NATIVE_CRASH"  # its own native code ended it; the Python stack is below
    if at_exit and not err and (diag is None or diag.code == "RANK_NATIVE_CRASH"):
        why = ("the script had returned: native threads still running while the "
               "interpreter shut down crashed it (torch's gloo or NCCL threads of a process "
               "group that was not freed: never destroyed, or still held, as "
               "torch.distributed.nn holds the default group when it is imported after "
               "init_process_group, which DDP's first use does)")
        fix = ("call torch.distributed.destroy_process_group() before the script returns, "
               "and `import torch.distributed.nn` before init_process_group (or use "
               "gpuwarden.distributed.init(), which does); the rank's work itself had finished")
    if name is not None and not raised_then_killed and not raised_then_crashed:
        sig_why, sig_fix = _SIGNAL_WHY.get(name, (None, None))
        why = why or sig_why
        fix = fix or sig_fix
    if err.get("type") == "SyntaxError" and not outcome.plan.config.module \
            and not outcome.plan.config.target.endswith(".py"):
        fix = (f"if {outcome.plan.config.target} is not a Python script (a shell script, a "
               "binary), run it with --no-python, as torchrun")
    if fix is None and (err or recorded is not None):
        fix = f"the traceback below is rank {root.rank}'s own; the other ranks were stopped"

    how = exit_words(root.returncode)
    if raised_then_killed:
        how = (f"raised, then its teardown outlived --grace and gpuwarden ended it ({how})")
    elif raised_then_crashed:
        how = (f"raised, then died as the interpreter exited ({how}: native threads still "
               "running, e.g. a process group not destroyed)")
    evidence = [f"rank {root.rank}: pid {root.pid}, {_device(outcome, root.rank)}, "
                f"{how} after {after:.1f} s"]
    for e in sorted(outcome.exits.values(), key=_by_rank):
        if e.rank == root.rank:
            continue
        line = _rank_line(outcome, e)
        if e.failed and not e.stopped_by_launcher:
            echo = ", an echo of it" if is_echo(e) else ""
            line += f" (failed after rank {root.rank}{echo})"
        evidence.append(line)
    if recorded is not None:
        when = f", recorded {recorded.time_text}" if recorded.time_text else ""
        evidence.append(f"torch's error file: {escape_untrusted(recorded.path, 500)}{when}")
    if outcome.peers is not None and outcome.peers.abort_sent:
        evidence.append("the other nodes were told through the job's store (gpuwarden/abort) "
                        "and stop their ranks")
    if diag is not None and diag.evidence:
        evidence.append(f"matched in rank {root.rank}'s output: {diag.evidence[-1].text.strip()}")
    fields: dict[str, Any] = {"rank": root.rank, "pid": root.pid, "device": _device(outcome, root.rank),
                              "returncode": root.returncode, "after_s": round(after, 3)}
    if root.returncode < 0:
        fields["signal"] = signal_name(-root.returncode)
    if err:
        fields["exception"] = err.get("type")
    elif recorded is not None and recorded.exception_type:
        fields["exception"] = recorded.exception_type
    if recorded is not None:
        fields["error_file"] = recorded.path
    if diag is not None and diag.fields:
        fields["explain"] = dict(diag.fields)  # what explain read in the rank's output (typed)
    exit_code = 1 if raised_then_killed or raised_then_crashed \
        else shell_exit_code(root.returncode)
    return LaunchReport(exit_code, code, what, why, fix, evidence, details,
                        root.rank, fields)


def stall_report(outcome: RunOutcome, stall: Stall) -> LaunchReport:
    """The report of ``stall``: RDZV_WORKERS_MISSING in init, else RANK_STALL. It names the odd
    ones out, what each rank waits in, and every rank's stack."""
    timeout = outcome.plan.config.stall_timeout_s
    world = outcome.plan.world_size
    waiting = ", ".join(map(str, stall.waiting))
    odd = _ranks_by_node(outcome, stall.elsewhere)
    in_init = stall.kind == "init"
    code = "RDZV_WORKERS_MISSING" if in_init else "RANK_STALL"
    if stall.kind == "mismatch":
        what = (f"ranks wait in different collectives for more than {timeout:g} s: rank(s) "
                f"{waiting} in {stall.point}, rank(s) {odd} in "
                f"{', '.join(sorted({stall.waits[r] for r in stall.elsewhere if r in stall.waits}))}")
        why = ("collectives are matched by order: every rank must call the same collective in the "
               "same order; here they diverged, and each waits for the others forever")
        fix = (f"look at the lines named below: rank(s) {odd} took another path (a rank-dependent "
               "branch around a collective)")
    else:
        point = {"wait": "a .wait() on an async collective",
                 "backward": "backward (DDP's gradient all-reduce)"}.get(stall.kind, stall.point)
        what = (f"rank(s) {waiting} waited in {point} for more than {timeout:g} s; "
                f"rank(s) {odd} of {world} did not get there")
        if in_init:
            why = ("init_process_group waits for all WORLD_SIZE ranks; PyTorch would wait for its "
                   "timeout (10-30 min) and then count the joined ranks without naming the missing "
                   "ones")
        else:
            why = ("a collective completes only when every rank calls it; the ranks named last "
                   "are somewhere else (dead, finished, stuck, or in a different collective)")
        fix = (f"see where rank(s) {odd} are (stacks below); raise --stall-timeout if they are "
               "legitimately slow, or --keep-waiting to only report")
    remote_missing = [r for r in stall.elsewhere if outcome.plan.spec(r) is None]
    if remote_missing:
        nodes = sorted({outcome.plan.node_of(r) for r in remote_missing})
        fix = (f"start (or look at) gpuwarden launch on node(s) {', '.join(map(str, nodes))}: its "
               "own output says why it cannot join (its preflight names DNS, firewall or port "
               "problems); every node needs the same --nnodes, -n, --master-addr and --master-port")
    evidence = []
    for rank in range(world):
        where = stall.where.get(rank, "unknown")
        if outcome.plan.spec(rank) is None:
            if rank not in stall.where or not where or where.startswith("arrived"):
                continue  # another node's rank that arrived: nothing to say
            evidence.append(f"rank {rank} {where}")
        else:
            evidence.append(f"rank {rank}: pid {outcome.pids.get(rank)}, "
                            f"{_device(outcome, rank)}, {where}")
    peers = outcome.peers
    if in_init and peers is not None and peers.arrived:
        remote = sorted(r for r in peers.arrived if outcome.plan.spec(r) is None)
        if remote:
            hosts = sorted({str(peers.arrived[r].get("host")) for r in remote})
            evidence.append(f"arrived from other nodes: rank(s) {', '.join(map(str, remote))} "
                            f"({', '.join(hosts)})")
    if in_init and peers is not None and not peers.reader_connected:
        evidence.append("this node's ranks could not reach the store at "
                        f"{outcome.plan.master_addr}:{outcome.plan.master_port}: other nodes' "
                        "ranks are not known" + (f" ({peers.store_error})" if peers.store_error
                                                 else ""))
    details: list[tuple[str, list[str]]] = []
    if stall.flight_records:
        details.append(("NCCL flight recorder", stall.flight_records))
    for rank in range(world):
        frames = stall.stacks.get(rank)
        if frames:
            details.append((f"stack of rank {rank} (innermost first)", frames))
    return LaunchReport(1, code, what, why, fix, evidence, details, None)
