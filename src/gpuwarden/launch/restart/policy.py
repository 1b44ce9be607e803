"""Restarts that understand the failure: the PURE policy of ``--max-restarts``.

torchrun restarts the whole group on any failure, N times, blindly: a KeyError in the config
burns every attempt. Here each attempt's failure is reduced to a :class:`Failure` (its failure
code, the rank, and for an exception its type and innermost ``file:line``), and
:func:`decide_restart` decides from it and the failures of the attempts before:

- causes that can pass are restarted: a rank killed by a signal (SIGKILL: the OOM killer, a
  scheduler), collective and rendezvous timeouts, refused connections, a stall, a GPU hardware
  fault or a busy GPU (that GPU is then excluded), another node's failure;
- a cause a restart cannot change (a configuration the job was started with: a missing
  ``__main__`` guard, CUDA before fork, a bad ordinal, no network interface) is not;
- anything else (an exception of the script) gets another attempt, unless it is the same
  failure as the attempt before: the same exception type at the same file:line in the same
  rank is a deterministic bug, and the job ends at once ("same failure twice").

``--restart-on always`` keeps torchrun's blind behaviour. Nothing here reads the host, so the
tests feed recorded failures (tests/test_launch_restart.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuwarden.launch.outcome import Decision, Failure, LaunchReport, RunOutcome, is_echo

RESTART_ON = ("auto", "always")
DEFAULT_RESTART_BACKOFF_S = 1.0

# Causes that can pass with time or elsewhere: restarted (budget permitting), never "the same
# failure twice" (a second OOM kill or network timeout in a row is bad luck, not a bug).
TRANSIENT_CODES = frozenset({
    "NCCL_WATCHDOG_TIMEOUT", "RDZV_CONNECT_TIMEOUT", "RDZV_CONN_REFUSED", "RDZV_WORKERS_MISSING",
    "RANK_STALL", "GPU_HARDWARE_FAULT", "CUDA_DEVICES_BUSY", "DATALOADER_WORKER_KILLED",
    "NODE_LOST", "GLOO_PEER_LOST",
})
# The job's own configuration: every attempt would fail the same way (failure-codes.md's fix
# is a change to the command line, the script or the host, never time).
PERMANENT_CODES = frozenset({
    "CUDA_FORK_REINIT", "MAIN_GUARD_MISSING", "CUDA_NO_DEVICE", "CUDA_DRIVER_TOO_OLD",
    "CUDA_INVALID_ORDINAL", "NCCL_DUPLICATE_GPU", "NCCL_NO_INTERFACE", "RDZV_DNS",
    # the host's NVSwitch fabric is not up (Fabric Manager): no attempt on this host can start
    "CUDA_SYSTEM_NOT_READY",
})
# A GPU that caused the failure: released, and another one leased for the next attempt.
EXCLUDE_GPU_CODES = frozenset({"GPU_HARDWARE_FAULT", "CUDA_DEVICES_BUSY"})

# "KeyError: ..." at the start of a failure's words: the exception's type
EXC_TYPE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\w*): ")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)', re.MULTILINE)


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 0
    restart_on: str = "auto"
    backoff_s: float = DEFAULT_RESTART_BACKOFF_S
    multinode: bool = False


def decide_restart(history: Sequence[Failure], failure: Failure, policy: RestartPolicy) -> Decision:
    """Restart after ``failure``? ``history``: the failures of the attempts before, oldest first
    (so ``len(history)`` restarts were already used)."""
    if failure.code == "LAUNCH_INTERRUPTED":
        return Decision(False, "stopped by a signal to gpuwarden, not restarting")
    if failure.code == "MEMBERSHIP_CHANGE":
        # torchrun's elastic semantics: every node restarts its workers on a new world size,
        # and that is not a restart of --max-restarts.
        return Decision(True, "re-rendezvous with the new set of nodes (a membership change, "
                        "not counted as a restart)", counts=False)
    if failure.code == "RDZV_STORE_LOST":
        return Decision(False, "the job's store is gone (its host, network or launcher "
                        "died): no rendezvous to restart on, not restarting")
    if len(history) >= policy.max_restarts:
        return Decision(False, f"no restarts left (--max-restarts {policy.max_restarts})")
    exclude = (failure.gpu,) if failure.code in EXCLUDE_GPU_CODES and failure.gpu else ()
    if policy.restart_on == "always":
        return Decision(True, "restarting (--restart-on always)", exclude)
    if failure.code in PERMANENT_CODES:
        return Decision(False, f"{failure.code} is in the job's configuration: every attempt "
                        "would fail the same way, not restarting")
    if failure.code in TRANSIENT_CODES or failure.echo or (failure.signal is not None
                                                           and failure.exc_type is None):
        return Decision(True, "a cause that can pass: restarting", exclude)
    if history and failure.signature is not None and history[-1].signature == failure.signature:
        return Decision(False, "same failure twice, not restarting")
    return Decision(True, "restarting (the same failure on the next attempt would end the job)",
                    exclude)


def _abort_record(outcome: RunOutcome) -> dict[str, Any] | None:
    """Multi-node: another node's failure record (the job's abort key), as this node's ranks'
    store watches saw it (the supervisor reads their last word after they ended)."""
    rec = outcome.peers.abort if outcome.peers is not None else None
    if rec is None or int(rec.get("node", -1)) == outcome.plan.node_rank:
        return None
    return rec


def _is_echo_root(outcome: RunOutcome, rank: int | None) -> bool:
    ex = outcome.exits.get(rank) if rank is not None else None
    return ex is not None and is_echo(ex)


def innermost_frame(traceback: str) -> str | None:
    """'file:line' of the last frame of a formatted traceback (where the exception was raised)."""
    frames = _FRAME.findall(traceback)
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else None


def failure_of(report: LaunchReport, outcome: RunOutcome) -> Failure:
    """The failure of one attempt, from its report and the supervisor's outcome."""
    from gpuwarden.procs import signal_name

    code = report.code or "RANK_FAILED"
    rank = report.root_rank
    abort = _abort_record(outcome)
    if abort is not None and (code == "NODE_ABORTED" or _is_echo_root(outcome, rank)):
        # Another node's failing rank, in its own words ("KeyError: 'lr'", "exit code -9"):
        # every node then decides alike, the same exception twice included.
        rec = abort
        what = str(rec.get("what", ""))
        typed = EXC_TYPE.match(what)
        return Failure(code, int(rec.get("rank", -1)), exc_type=typed.group(1) if typed else None,
                       where=f"node {rec.get('node')}", what=what)
    ex = outcome.exits.get(rank) if rank is not None else None
    spec = outcome.plan.spec(rank) if rank is not None else None
    gpu = spec.gpu if spec is not None else None
    exc_type = where = sig = None
    echo = False
    if ex is not None:
        echo = is_echo(ex)
        err = ex.error or {}
        if err.get("type"):
            exc_type = str(err["type"])
            where = innermost_frame(str(err.get("traceback", "")))
        if ex.returncode < 0 and not (err and ex.killed_by_launcher):
            sig = signal_name(-ex.returncode)
    return Failure(code, rank, exc_type, where, sig, gpu.uuid if gpu else None,
                   gpu.label if gpu else None, report.what, echo)
