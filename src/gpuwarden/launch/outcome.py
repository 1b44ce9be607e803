"""What one attempt of a launch produced, as every layer above the plan reads it.

The supervisor fills :class:`RunOutcome` (a :class:`RankExit` per rank, with what the rank left:
its error record, its fatal-signal dump, torch's :class:`TorchError`; on several nodes what its
ranks learned from the job's store, a :class:`PeerView`); the report turns it into a
:class:`LaunchReport`; the restart policy reduces that to a :class:`Failure` and a
:class:`Decision`; on several nodes the job's store settles the attempt for every node
(:class:`Settled`). The echo rule (:func:`is_echo`) is here too: the report, the restart policy
and the job's store all ask whether a rank failed only because a peer went away.

This module sits below every layer that shares these types (supervisor, report, restart,
multinode, observer) and imports none of them: as torch elastic keeps ``WorkerSpec``,
``WorkerGroup`` and ``RunResult`` in ``agent/server/api.py``. It names only what the types hold:
the plan the attempt ran (``plan.py``) and the stall the watchers found (``watch/stall.py``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuwarden.findings import Finding, Section, Severity, render_plain

if TYPE_CHECKING:
    from gpuwarden.launch.plan import LaunchPlan
    from gpuwarden.launch.watch.stall import Stall

# What a rank prints when a *peer* went away under a collective: a consequence, not a cause.
# (Compiled at its first use, by re's own cache: a launch whose ranks all succeed never asks.)
ECHO_PATTERN = (
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Socket closed|"
    r"NCCL communicator was aborted|ProcessGroupGloo.*(?:Read|Write) error|"
    r"\[enforce fail at .*gloo.*\].*(?:closed|reset)|remote process exited|peer .* closed|"
    r"Watchdog caught collective operation timeout|Timed out waiting \d+ms for|"
    r"Rank \d+ is closing|Gloo connectFullMesh failed|failed to recv, got 0 bytes"
)


def echoes(text: str) -> bool:
    """Whether ``text`` (a rank's error message, its last stderr lines) says a peer went away."""
    return re.search(ECHO_PATTERN, text, re.IGNORECASE) is not None


# ---- one rank, one attempt ------------------------------------------------------------------


@dataclass(frozen=True)
class TorchError:
    """One rank's torch error file, as torchrun's ``ProcessFailure`` reads it
    (``ranks/exit_records.py`` reads the file)."""

    path: str
    message: str  # "KeyError: 'lr'"
    traceback: str | None  # py_callstack: the traceback torch formatted when it recorded
    timestamp: int | None  # seconds since the epoch, as torch wrote it

    @property
    def exception_type(self) -> str | None:
        """'KeyError' from "KeyError: 'lr'", when the message has that shape."""
        head, sep, _ = self.message.partition(":")
        return head if sep and head.isidentifier() else None

    @property
    def time_text(self) -> str | None:
        """torchrun's ``timestamp_isoformat``: local time, ``YYYY-MM-DD_HH:MM:SS``."""
        if self.timestamp is None:
            return None
        try:
            return time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(self.timestamp))
        except (OverflowError, OSError, ValueError):
            return None


@dataclass
class RankExit:
    """How one rank ended. ``returncode`` as subprocess gives it: negative for a signal."""

    rank: int
    pid: int
    returncode: int
    ended_at: float  # monotonic, when the supervisor saw it
    stopped_by_launcher: bool  # it ended after gpuwarden began stopping the job
    error: dict[str, Any] | None = None  # the bootstrap's record of an uncaught exception
    fatal_dump: str = ""  # faulthandler's dump on SIGSEGV/SIGABRT/...
    stderr_tail: list[str] = field(default_factory=list)
    killed_by_launcher: bool = False  # gpuwarden SIGKILLed it (after --grace) before it ended
    torch_error: TorchError | None = None  # what it recorded in TORCHELASTIC_ERROR_FILE
    # Its script had returned (the bootstrap's FINISHED phase) when it ended: a signal after
    # that came while the interpreter shut down.
    finished_script: bool = False
    # Its last stderr lines when gpuwarden began stopping the job (what a stop signal makes a
    # rank print, torch's C++ stack of an interrupted call, comes after and would push them out)
    stderr_before_stop: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.returncode != 0

    @property
    def failed_at(self) -> float:
        """When it failed: the exception's own time when recorded, else when it was seen to exit."""
        if self.error and isinstance(self.error.get("monotonic"), (int, float)):
            return min(float(self.error["monotonic"]), self.ended_at)
        return self.ended_at


def is_echo(ex: RankExit) -> bool:
    """Whether the rank failed only because a peer went away (its own words say so)."""
    text = " ".join([str((ex.error or {}).get("message", "")), *ex.stderr_tail[-5:]])
    # A death by signal is never an echo, unless the rank had raised first (and gpuwarden
    # SIGKILLed its slow teardown): its own exception says what it was.
    return (ex.returncode > 0 or ex.error is not None) and echoes(text)


@dataclass
class PeerView:
    """Multi-node: what this node's ranks learned from the job's TCPStore (their peers files)."""

    arrived: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> host, pid, node
    reader_connected: bool = False  # local rank 0's watch reached the store (arrivals known)
    abort: dict[str, Any] | None = None  # another node's failure record
    abort_sent: bool = False  # a rank of this node set the abort key itself
    store_lost: str | None = None
    store_lost_at: float | None = None  # monotonic, when this supervisor saw it
    store_error: str | None = None


@dataclass
class RunOutcome:
    """One attempt as the supervisor saw it end (``Supervisor.run``)."""

    plan: LaunchPlan
    started_at: float
    ended_at: float
    exits: dict[int, RankExit]
    pids: dict[int, int]
    stall: Stall | None = None
    interrupted_by: str | None = None  # "SIGINT" / "SIGTERM" sent to the supervisor
    peers: PeerView | None = None  # multi-node only
    # "abort" (another node failed, or was lost), "membership" (nodes wait to join: elastic),
    # "store_lost" (the job's or the workers' store went away)
    stopped_for: str | None = None
    job_failure: dict[str, Any] | None = None  # the round's first failure, as the job's store has it
    own_record: dict[str, Any] | None = None  # this node's first failure, as offered to it
    # stopped_for "memory" (--mem-enforce stop): the LEASE_MEMORY_EXCEEDED finding, as a dict
    memory_stop: dict[str, Any] | None = None


# ---- the report -------------------------------------------------------------------------------


@dataclass
class LaunchReport:
    """The outcome of a launch: its exit code and, as a :class:`~gpuwarden.findings.Finding`
    (:attr:`finding`), what happened, why, the fix and the evidence (``report.py`` builds it)."""

    exit_code: int
    code: str | None  # failure code (failure-codes.md or gpuwarden's own); None on success
    what: str
    why: str | None = None
    fix: str | None = None
    evidence: list[str] = field(default_factory=list)
    # (heading, lines): the traceback tail, the stacks; printed indented under the evidence
    sections: list[tuple[str, list[str]]] = field(default_factory=list)
    root_rank: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)  # the evidence as data, for --json

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def finding(self) -> Finding:
        # A heading with nothing under it says nothing: a section comes only with its lines.
        return Finding(code=self.code or "", what=self.what, why=self.why, fix=self.fix,
                       evidence=self.evidence,
                       sections=[Section(h, b) for h, b in self.sections if b],
                       fields=self.fields, severity=Severity.OK if self.ok else Severity.ERROR)

    def render(self) -> str:
        return render_plain(self.finding)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "exit_code": self.exit_code, **self.finding.to_dict(),
                "code": self.code, "root_rank": self.root_rank}


# ---- the failure and what is done about it ----------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """One attempt's failure, as the restart policy sees it (``restart/policy.py``)."""

    code: str  # the report's failure code (RANK_FAILED when explain knew nothing better)
    rank: int | None = None  # the root-cause rank (another node's, for NODE_ABORTED)
    exc_type: str | None = None  # "KeyError", "torch.distributed.DistBackendError", ...
    where: str | None = None  # the innermost frame, "file:line"
    signal: str | None = None  # "SIGKILL" when the rank died by a signal
    gpu: str | None = None  # the rank's GPU uuid, None on CPU or another node
    gpu_label: str | None = None  # how reports name it
    what: str = ""  # one line for the attempt's line on stderr
    echo: bool = False  # the rank failed because a peer went away (another node's failure)

    @property
    def signature(self) -> tuple[object, ...] | None:
        """What makes two failures "the same": an exception's type and place in one rank."""
        if self.exc_type is None:
            return None
        return (self.rank, self.exc_type, self.where)

    def describe(self) -> str:
        # A rank that raised and then died of a signal (torch's gloo threads abort the
        # interpreter's exit: SIGABRT) failed of its exception, as the policy judges it: that
        # is named first, the signal after it.
        if self.exc_type:
            how = f"{self.exc_type} at {self.where}" + (f", then {self.signal}" if self.signal else "")
        else:
            how = self.signal or self.what
        if self.rank is None or self.rank < 0:  # a node lost, a membership change, a stall...
            return f"{self.code} ({how})" if how else self.code
        who = f"rank {self.rank}"
        return f"{self.code} ({who}: {how})" if how else f"{self.code} ({who})"


@dataclass(frozen=True)
class Decision:
    restart: bool
    reason: str
    exclude_gpus: tuple[str, ...] = ()  # uuids released before the next attempt
    counts: bool = True  # a restart that uses one of --max-restarts (not a membership change)


@dataclass
class Settled:
    """How one attempt ended for the whole job (several nodes: ``multinode/job_store.py``)."""

    record: dict[str, Any] | None  # the round's first failure (None: this node saw none)
    decision: Decision
    failure: Failure  # the job's failure, as every node names it
    restarts_used: int  # after this decision
    history: list[Failure] = field(default_factory=list)  # the failures that used restarts
    store_lost: bool = False
    report: LaunchReport | None = None  # this node's report of the round, in the job's words
