"""The one exception tree of gpuwarden.

Every failure a user can see is a :class:`GpuwardenError` carrying four parts —
what happened, why, the fix, and the evidence — plus a stable ``code`` and the
process exit code the CLI uses for it. Codes come from ``failure-codes.md``
(CUDA/NCCL/rendezvous failures) or, for gpuwarden's own conditions, from
:data:`GPUWARDEN_CODES` below.

Tree (exit code in brackets)::

    GpuwardenError [1]
    ├── UsageError [2]            bad argument, variable, or input file
    │   ├── ScenarioError         simulated-host file unreadable or invalid
    │   ├── VisibilityError       CUDA_VISIBLE_DEVICES / Slurm variables unusable
    │   ├── CudaTensorArgumentError  a CUDA tensor passed to a pool task
    │   ├── InputUnreadableError  a log for `explain` is missing, a directory, or binary
    │   ├── KnowledgeBaseError    explain's knowledge.toml (or one given) is malformed
    │   └── LeaseDirError         lease directory missing, unwritable or unsafe
    ├── NoGPUError [3]            NVML/driver missing where a GPU is required
    ├── NVMLError [1]             NVML present but a query failed
    ├── ConstraintError [4]       a request could not be met (selection, lease wait)
    │   ├── LeaseUnavailableError a lease asked without waiting could not be granted now
    │   └── LeaseTimeoutError     a lease wait ran out before the request was served
    ├── PoolError [1]             a GPU worker pool failed
    │   ├── WorkerDiedError       a pool worker died while running a task (signal, exit code)
    │   │   └── DaskWorkerDiedError  the same for a `gpuwarden worker` Dask worker (host, GPU)
    │   ├── SchedulerUnreachableError  `gpuwarden worker`: the Dask scheduler does not answer
    │   ├── WorkerNameTakenError  `gpuwarden worker`: the scheduler has a worker of that name
    │   └── PoolBrokenError       the pool cannot run tasks (initializer failed, shut down)
    ├── LaunchError [1]           a launch cannot start (preflight), or a job failed
    │   ├── PortInUseError        an explicit MASTER_PORT is taken (RDZV_PORT_IN_USE)
    │   └── RendezvousError       rendezvous preflight: MASTER_ADDR/PORT unusable from this node
    │                             (RDZV_DNS, also on one node; RDZV_CONNECT_TIMEOUT, ...)
    └── JobQueryError [1]         `status`/`stacks` could not ask a running job (JOB_UNREACHABLE)
        ├── JobNotFoundError [2]  no such job of this user's on this host (JOB_NOT_FOUND)
        └── JobDeniedError        the job is another user's: the kernel refused (JOB_DENIED)

Low-level errors (pynvml, OSError, json) are mapped at the boundary and chained
with ``raise ... from``, so the original is kept as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from gpuwarden.findings import Finding, emit, render_one_line, render_plain

# gpuwarden's own codes, beside the failure vocabulary of failure-codes.md.
GPUWARDEN_CODES = {
    "USAGE": "a command-line argument or environment variable is malformed",
    "SCENARIO_INVALID": "the simulated-host scenario file cannot be read or is invalid",
    "NVML_UNAVAILABLE": "no NVML library or driver: GPU state cannot be read",
    "NVML_ERROR": "NVML answered a query with an error",
    "SELECT_UNSATISFIED": "fewer usable GPUs than requested",
    "LEASE_DIR": "the lease directory does not exist, cannot be written, or is unsafe to share",
    "LEASE_UNAVAILABLE": "the GPUs a lease asks for are leased, reserved or refused right now",
    "LEASE_TIMEOUT": "a lease waited its whole --wait and was not served",
    "POOL_WORKER_DIED": "a pool worker process died while running a task",
    "POOL_BROKEN": "a pool cannot run tasks: its workers cannot start, or it was shut down",
    "POOL_CUDA_ARGUMENT": "a CUDA tensor was passed as a pool task argument",
    "DASK_SCHEDULER_UNREACHABLE": "the Dask scheduler given to `gpuwarden worker` does not answer",
    "DASK_WORKER_NAME_TAKEN": "the Dask scheduler already has a worker of the name `gpuwarden "
    "worker` would use (two hosts with one host name)",
    "DASK_RESOURCE_UNOFFERED": "a Dask task asks for a resource (GPU) that no worker of the "
    "scheduler offers: it waits until such a worker joins",
    # Not in failure-codes.md: DataLoader's "received 0 items of ancdata" / "Too many open files".
    "NOFILE_LIMIT": "the open-files limit is below what DataLoader's file_descriptor sharing needs",
    "INPUT_UNREADABLE": "a log given to explain is missing, a directory, or binary data",
    "KB_INVALID": "the explain knowledge base (knowledge.toml) is malformed",
    "RANK_FAILED": "a rank failed in a way no failure code describes (its exception or exit is shown)",
    "RANK_STALL": "ranks waited in init_process_group or a collective longer than --stall-timeout "
    "while other ranks were missing, dead or elsewhere",
    "RANK_EXITED_EARLY": "a rank exited (code 0) while the other ranks still needed it in a "
    "collective: their errors are echoes of it",
    "LAUNCH_INTERRUPTED": "gpuwarden launch was asked to stop (SIGINT/SIGTERM) and stopped every rank",
    "OUT_OF_MEMORY": "gpuwarden's own process ran out of memory (its limit is lower than it "
    "needs); what it started was stopped",
    "NODE_ABORTED": "another node of a multi-node job failed (or its rendezvous store went away), "
    "so this node stopped its ranks",
    "RANK_STRAGGLER": "the other ranks keep waiting in collectives for one rank, the last to "
    "enter them (a note while the job runs, not a failure)",
    "JOB_NOT_FOUND": "`gpuwarden stacks`/`status` was given a job that is not a running gpuwarden "
    "launch of this user's on this host",
    "JOB_DENIED": "the job belongs to another user: the kernel refused the connection to its "
    "control endpoint (a 0700 directory)",
    "JOB_UNREACHABLE": "a running launch did not answer `gpuwarden status`/`stacks` in time (its "
    "launcher is busy, stopped, or ending)",
    "LEASE_MEMORY_EXCEEDED": "a process (with its children) uses more GPU memory than its "
    "memory lease (`--mem`): named by the holder, `ls`, `leases` and `status`; ended with "
    "`--mem-enforce stop`",
    "NODE_LOST": "a node of a multi-node job went silent in the job's store (its host, network or "
    "launcher died); the others stopped, and restart without it when --max-restarts allows",
}

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NO_GPU = 3
EXIT_CONSTRAINT = 4


class GpuwardenError(Exception):
    """Base of every gpuwarden error: what, why, fix, evidence, code, exit code.

    :attr:`finding` is the error as a :class:`~gpuwarden.findings.Finding`, the type every
    report of gpuwarden shares; :meth:`render` and :meth:`to_dict` are that finding's.
    ``fields`` carries the evidence as data (pid, rank, gpu, host, port ...) for ``--json``.
    """

    code: str = "INTERNAL"
    exit_code: int = EXIT_FAILURE

    def __init__(
        self,
        what: str,
        *,
        why: str | None = None,
        fix: str | None = None,
        evidence: str | Sequence[str] | None = None,
        code: str | None = None,
        fields: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(what)
        self.what = what
        self.why = why
        self.fix = fix
        if evidence is None:
            self.evidence: tuple[str, ...] = ()
        elif isinstance(evidence, str):
            self.evidence = (evidence,)
        else:
            self.evidence = tuple(evidence)
        if code is not None:
            self.code = code
        self.fields: dict[str, Any] = dict(fields or {})

    def __str__(self) -> str:
        # What the CLI prints, not only ``what``: a library user sees str(e) (a traceback, a
        # log line, a notebook), and the why, the fix and the evidence (each GPU's verdict for
        # a lease) are the point of the error.
        return self.render()

    @property
    def finding(self) -> Finding:
        return Finding(code=self.code, what=self.what, why=self.why, fix=self.fix,
                       evidence=self.evidence, fields=self.fields)

    def render(self) -> str:
        """The multi-line report of STYLE.md: ``error[CODE]: what`` then why/fix/evidence."""
        return render_plain(self.finding)

    def to_dict(self) -> dict[str, Any]:
        return {**self.finding.to_dict(), "exit_code": self.exit_code}

    def emit(self, stream: TextIO) -> None:
        """Print the report to ``stream``: coloured on a terminal, :meth:`render` when piped."""
        emit(self.finding, stream)


class _OneLine(GpuwardenError):
    """Errors about the setup rather than a run: one line with the fix, no evidence block."""

    def render(self) -> str:
        return render_one_line(self.finding)

    def emit(self, stream: TextIO) -> None:
        stream.write(self.render() + "\n")


class UsageError(_OneLine):
    """A malformed argument, variable or input: rendered on one line, exit code 2."""

    code = "USAGE"
    exit_code = EXIT_USAGE


class ScenarioError(UsageError):
    """The file named by GPUWARDEN_SIMULATE is missing, not JSON, or has a bad field."""

    code = "SCENARIO_INVALID"


class VisibilityError(UsageError):
    """CUDA_VISIBLE_DEVICES (or Slurm's GPU variables) name no usable device.

    Usual causes: an empty value or ``-1``, an entry that matches no GPU (CUDA stops
    enumerating at the first invalid one), a repeated entry (CUDA then sees none).
    """

    code = "CUDA_NO_DEVICE"


class NoGPUError(_OneLine):
    """GPU state cannot be read at all: no NVML library, no driver, or no device node."""

    code = "NVML_UNAVAILABLE"
    exit_code = EXIT_NO_GPU


class NVMLError(GpuwardenError):
    """NVML is present but answered a query with an error."""

    code = "NVML_ERROR"


class ConstraintError(GpuwardenError):
    """The request was valid but cannot be met now: too few usable GPUs, a wait timed out."""

    code = "SELECT_UNSATISFIED"
    exit_code = EXIT_CONSTRAINT


class LeaseDirError(UsageError):
    """The lease directory (GPUWARDEN_LEASE_DIR or the default) cannot be used.

    Usual causes: its parent does not exist; it is owned by another user, or a link or a
    parent is (they could delete or swap lock files in use: prepare one with ``gpuwarden
    leases init``); it is writable by others without the sticky bit; it is a link loop or
    a link to nothing; a read-only file system; not writable for this user; its mutex is
    not a regular file (a FIFO planted by another user).
    """

    code = "LEASE_DIR"


class LeaseUnavailableError(ConstraintError):
    """A lease requested without ``wait`` found too few GPUs free right now.

    The evidence names, per GPU, what blocks it: a lease (pid, user, command, for how
    long), an earlier request waiting in line, or NVML state (foreign process, compute
    mode, memory).
    """

    code = "LEASE_UNAVAILABLE"


class LeaseTimeoutError(ConstraintError):
    """A lease waited for its whole ``wait`` duration without being served.

    Same evidence as :class:`LeaseUnavailableError`, as it stood when the time ran out.
    """

    code = "LEASE_TIMEOUT"
class CudaTensorArgumentError(UsageError):
    """A pool task's arguments hold a CUDA tensor.

    Refused because each worker sees only its own GPU as ``cuda:0``: unpickled there, the
    tensor would be re-created on a different GPU than the one it lives on. Pass CPU tensors
    and move them inside the task.
    """

    code = "POOL_CUDA_ARGUMENT"


class PoolError(GpuwardenError):
    """A failure of gpuwarden's GPU worker pool."""

    code = "POOL_BROKEN"


class WorkerDiedError(PoolError):
    """A pool worker died while it ran a task; the pool replaced it and goes on.

    Usual causes: the host's OOM killer (SIGKILL, see ``dmesg``), a segfault in a native
    library or a CUDA error that aborted the process, ``os._exit``/``sys.exit`` in the task,
    or someone killing the process.
    """

    code = "POOL_WORKER_DIED"

    def __init__(self, what: str, *, worker: str = "", gpu: str = "", exit_status: str = "",
                 task: str = "", **kwargs: Any) -> None:
        super().__init__(what, **kwargs)
        self.worker = worker
        self.gpu = gpu
        self.exit_status = exit_status
        self.task = task
        self.fields.update({k: v for k, v in (("worker", worker), ("gpu", gpu),
                                              ("exit", exit_status), ("task", task)) if v})


class DaskWorkerDiedError(WorkerDiedError):
    """A Dask worker started by ``gpuwarden worker`` died while it ran this task.

    Raised from the task's future (and so from joblib's ``dask`` backend) in place of Dask's
    generic ``KilledWorker``; the worker's nanny reported the signal, the scheduler plugin made
    the task fail with it. Usual causes as :class:`WorkerDiedError`. It crosses processes
    (scheduler -> client) by pickle, with all its parts.
    """

    def __init__(self, what: str, *, host: str = "", **kwargs: Any) -> None:
        super().__init__(what, **kwargs)
        self.host = host

    def __reduce__(self) -> tuple[Any, ...]:
        parts = {"why": self.why, "fix": self.fix, "evidence": list(self.evidence),
                 "worker": self.worker, "gpu": self.gpu, "exit_status": self.exit_status,
                 "task": self.task, "host": self.host}
        return (_rebuild, (type(self), self.what, parts))


def _rebuild(cls: type[GpuwardenError], what: str, parts: dict[str, Any]) -> GpuwardenError:
    return cls(what, **parts)


class SchedulerUnreachableError(PoolError):
    """The Dask scheduler given to ``gpuwarden worker`` does not answer, or its workers could not
    start there.

    Usual causes: it is not started yet, a wrong address or port, a firewall between the hosts.
    """

    code = "DASK_SCHEDULER_UNREACHABLE"


class WorkerNameTakenError(PoolError):
    """The Dask scheduler already has a worker with one of the names ``gpuwarden worker`` would
    give its workers (Dask refuses it: "name taken").

    Usual causes: two hosts (or containers) with the same host name, or a second
    ``gpuwarden worker`` on one host for the same scheduler.
    """

    code = "DASK_WORKER_NAME_TAKEN"


class PoolBrokenError(PoolError):
    """The pool cannot run tasks: its workers fail to start (initializer error, preload crash,
    repeated deaths at start-up) or it has been shut down."""

    code = "POOL_BROKEN"


class InputUnreadableError(UsageError):
    """A log handed to ``gpuwarden explain`` cannot be read as text.

    Usual causes: a wrong path, a directory, no read permission, or binary data
    (a core dump, a checkpoint) instead of a log.
    """

    code = "INPUT_UNREADABLE"


class KnowledgeBaseError(UsageError):
    """The explain knowledge base is missing, not TOML, or has a malformed entry.

    Usual causes: a regex that does not compile (TOML basic strings eat backslashes:
    write patterns in single quotes), a keyword with upper-case letters, a misspelt
    field, ``requires`` naming a context that is not defined.
    """

    code = "KB_INVALID"
class LaunchError(GpuwardenError):
    """A launch cannot start, or a job it ran failed (the report says which rank and why)."""

    code = "RANK_FAILED"


class PortInUseError(LaunchError):
    """The MASTER_PORT given explicitly is already bound on this host.

    Usual causes: another job (or a stale rank of an earlier run) holds it; two launches given the
    same --master-port. gpuwarden picks a free port when none is given.
    """

    code = "RDZV_PORT_IN_USE"


class RendezvousError(LaunchError):
    """A launch cannot reach its rendezvous from this node (raised before any rank starts; on
    one node only RDZV_DNS, for a --master-addr that does not resolve). ``code`` names which
    failure: RDZV_DNS (MASTER_ADDR unknown to this host's resolver), RDZV_CONNECT_TIMEOUT (packets dropped: a firewall, or a wrong address),
    RDZV_CONN_REFUSED (nothing listened on MASTER_PORT for the whole window: node 0 not started,
    a wrong port; or no route), NCCL_NO_INTERFACE (a *_SOCKET_IFNAME names no usable interface),
    USAGE (MASTER_ADDR is loopback, or node 0 does not own it).
    """

    code = "RDZV_CONN_REFUSED"


class JobQueryError(GpuwardenError):
    """``gpuwarden status``/``stacks`` could not get an answer from a running launch.

    Usual causes: the launcher is stopped (Ctrl-Z, SIGSTOP) or ending, or its machine is so
    loaded that it did not answer within the timeout.
    """

    code = "JOB_UNREACHABLE"


class JobNotFoundError(JobQueryError):
    """No running gpuwarden launch of this user's matches the job asked for (a pid, or a run
    id prefix), or none runs at all."""

    code = "JOB_NOT_FOUND"
    exit_code = EXIT_USAGE


class JobDeniedError(JobQueryError):
    """The job is another user's: its control endpoint lives in that user's 0700 runtime
    directory and the kernel refused the connection (EACCES). Only its owner (or root) can
    read its ranks' stacks; ``gpuwarden status`` lists it without them."""

    code = "JOB_DENIED"
