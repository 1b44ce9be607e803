"""One launch end to end: take GPUs → choose the port → plan → supervise → report
(with ``--max-restarts``, again per attempt: ``restart/attempts.py``).

The GPUs (a lease, when the lease manager is installed) are held here, in the supervising
process, for as long as ranks run; ranks never inherit the lease's file descriptors
(``close_fds``). Each attempt's supervisor hosts the control endpoint (``observer/``) that
``gpuwarden status`` and ``stacks`` ask. Several nodes (:class:`_MultiNode`): each attempt is
a round of torch's rendezvous in the node agent, settled with the other nodes through the
job's store; ``multinode/`` is imported only then.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TextIO

from gpuwarden.errors import UsageError
from gpuwarden.launch.config import LaunchConfig, needs_log_files
from gpuwarden.launch.observer.control import serve
from gpuwarden.launch.outcome import Failure, LaunchReport, RunOutcome, Settled
from gpuwarden.launch.plan import LaunchPlan, make_plan, rank_count
from gpuwarden.launch.preflight import choose_master_addr, choose_port, take_gpus
from gpuwarden.launch.report import build_report, stall_report
from gpuwarden.launch.supervisor import Supervisor

# How long the node hosting the job's store keeps it up, at most, for nodes still ending (each
# also stops being waited for once it has been silent NODE_LOST_S).
_DONE_WAIT_S = 300.0
TIDY_BUDGET_S = 1.0  # the empty error-file tree is removed within this, else left as torchrun's

if TYPE_CHECKING:
    from gpuwarden.inventory import Inventory
    from gpuwarden.inventory.snapshot import GPUSnapshot
    from gpuwarden.launch.multinode.job_store import JobRound
    from gpuwarden.launch.multinode.node_agent import NodeAgent, Round
    from gpuwarden.launch.multinode.rendezvous import RendezvousPreflight
    from gpuwarden.launch.restart.policy import RestartPolicy
    from gpuwarden.launch.watch.memory import MemoryWatch
    from gpuwarden.launch.watch.stall import Stall


def launch(config: LaunchConfig, *, stdout: TextIO | None = None, stderr: TextIO | None = None,
           argv: tuple[str, ...] | None = None,
           run_dir: str | None = None, inventory: Inventory | None = None,
           agent: NodeAgent | None = None) -> tuple[LaunchReport, RunOutcome]:
    """Run ``config`` to the end and return its report (printed by the caller) and outcome.

    Raises before any rank starts: UsageError (exit 2), NoGPUError (3), ConstraintError with
    every GPU's verdict (4), PortInUseError (RDZV_PORT_IN_USE) for a busy --master-port;
    several nodes: RendezvousError (the preflight's codes, RDZV_WORKERS_MISSING when the other
    nodes do not join within the join timeout, naming them). ``agent``: the node agent when
    the caller started it already (the CLI does, before importing this module); launch ends it.
    """
    err = stderr or sys.stderr
    own_dir = run_dir is None
    errors_only: str | None = None
    addr_notes: tuple[str, ...] = ()
    made_log_dir: str | None = None  # removed again if the launch ends before any rank ran
    ran = False
    work = run_dir or tempfile.mkdtemp(prefix="gpuwarden-launch-")
    taken = None
    try:
        pre = None
        if config.multinode:
            from gpuwarden.launch.multinode.node_agent import NodeAgent
            from gpuwarden.launch.multinode.rendezvous import check_rendezvous

            # First thing: the agent's torch import overlaps the preflight and the GPU lease.
            agent = agent or NodeAgent.start()

            # Before GPUs are leased: a node that cannot reach the rendezvous holds nothing.
            pre = check_rendezvous(config, dict(os.environ), err=err)
            if pre.env:
                config = replace(config, extra_env=(*config.extra_env, *pre.env.items()))
        else:
            # Before GPUs are leased too: a MASTER_ADDR that does not resolve is refused at once.
            addr, addr_notes = choose_master_addr(config)
            config = replace(config, master_addr=addr)
        run_id = config.run_id or _run_id(config)
        # Before GPUs are leased: a --log-dir that cannot be made (read-only, /proc/x) is a
        # one-line usage error that holds nothing.
        log_run_dir = _log_run_dir(config, run_id)
        if log_run_dir is None:
            # torch's error files go where torchrun puts them, a /tmp/torchelastic_* tree
            log_run_dir = errors_only = _error_file_dir(run_id)
        else:
            made_log_dir = log_run_dir
        taken = take_gpus(config, inventory)
        notes = [*addr_notes, *taken.notes]
        memory = _memory_watch(config, taken, inventory)
        if log_run_dir != errors_only:
            notes.append(f"log directory: {log_run_dir}")
        ran = True
        if agent is not None:
            assert pre is not None
            job = _MultiNode(config, agent, pre, run_id, len(taken.gpus), err)
            return job.run(taken.gpus, notes, stdout, stderr, work, log_run_dir, argv)

        def run_attempt(attempt: int, restarts: int, gpus: tuple[GPUSnapshot, ...],
                        notes: tuple[str, ...]) -> tuple[LaunchReport, RunOutcome]:
            plan = _attempt_plan(config, attempt, gpus, run_id=run_id, work=work,
                                 log_run_dir=log_run_dir, argv=argv)
            for note in (*notes, *(plan.notes if attempt == 0 else ())):
                print(f"gpuwarden: {note}", file=err)
            return _supervise(plan, stdout, stderr, err, inherit_stdin=argv is None,
                              memory=memory)

        if not config.max_restarts:
            return run_attempt(0, 0, taken.gpus, tuple(notes))
        from gpuwarden.launch.restart.attempts import run_attempts

        return run_attempts(config, taken.gpus, run_attempt, tuple(notes), err=err)
    finally:
        if agent is not None:
            agent.close()
        if taken is not None:
            taken.release()
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
        if errors_only is not None:
            _drop_if_no_error_file(os.path.dirname(errors_only))
        if made_log_dir is not None and not ran:
            with contextlib.suppress(OSError):
                os.rmdir(made_log_dir)  # empty: refused before a rank could write in it


class _MultiNode:
    """A multi-node job on this node: each attempt joins a round of torch's rendezvous (in the
    node agent), runs its ranks, and settles with the other nodes through the job's store
    (job_store.py): one first failure and one decision for the whole job."""

    def __init__(self, config: LaunchConfig, agent: NodeAgent, pre: RendezvousPreflight,
                 run_id: str, gpu_count: int, err: TextIO) -> None:
        self.config = config
        self.agent = agent
        self.pre = pre
        self.run_id = run_id
        self.err = err
        self.local_world_size = rank_count(config, gpu_count)
        self.round: Round | None = None
        self.job: JobRound | None = None
        self.hosting = False

    def run(self, gpus: tuple[GPUSnapshot, ...], notes: list[str], stdout: TextIO | None,
            stderr: TextIO | None, work: str, log_run_dir: str | None,
            argv: tuple[str, ...] | None) -> tuple[LaunchReport, RunOutcome]:
        from gpuwarden.launch.multinode.rendezvous import connect
        from gpuwarden.launch.restart.attempts import run_attempts

        config = self.config
        self.hosting = connect(self.agent, config, self.pre, run_id=self.run_id,
                               local_world_size=self.local_world_size)

        def run_attempt(attempt: int, restarts: int, gpus: tuple[GPUSnapshot, ...],
                        notes: tuple[str, ...]) -> tuple[LaunchReport, RunOutcome]:
            from gpuwarden.launch.multinode.job_store import JobRound, job_history
            from gpuwarden.launch.multinode.rendezvous import join_round

            previous = self.round.nodes if self.round is not None else ()
            # As torch's: the join has its own join_timeout, whatever the wait for the
            # endpoint to come up took (that wait had its own bound, and said what it waited for).
            rnd = join_round(self.agent, config, self.err, previous=previous,
                             timeout_s=config.rdzv_timeout_s)
            self.round, self.job = rnd, JobRound(self.agent, rnd)
            restarts, _history = job_history(rnd)
            round_config = replace(config, nnodes=rnd.group_world_size, min_nodes=None,
                                   node_rank=rnd.group_rank, master_addr=rnd.master_addr,
                                   master_port=rnd.master_port)
            plan = _attempt_plan(round_config, attempt, gpus, run_id=self.run_id, work=work,
                                 log_run_dir=log_run_dir, argv=argv, restart_count=restarts,
                                 agent_store=True)
            for note in (*notes, *(plan.notes if attempt == 0 else ())):
                print(f"gpuwarden: {note}", file=self.err)
            return _supervise(plan, stdout, stderr, self.err, inherit_stdin=argv is None,
                              job=self.job)

        try:
            report, outcome = run_attempts(config, gpus, run_attempt, tuple(notes), err=self.err,
                                           settle=self.settle)
        except KeyboardInterrupt:
            # Ctrl-C while this node waited for the others: the rendezvous is closed, so the
            # nodes that joined stop too instead of waiting out join_timeout.
            self._finish(ok=False, wait_s=0.0)
            from gpuwarden.errors import LaunchError

            stopped = LaunchError("interrupted (SIGINT) while no rank ran here (waiting for "
                                  "the other nodes, or between attempts)",
                                  why="the other nodes see this one leave: the rendezvous is "
                                  "closed, or torch drops it when its heartbeat expires",
                                  code="LAUNCH_INTERRUPTED")
            stopped.exit_code = 130
            raise stopped from None
        except BaseException:
            self._finish(ok=False, wait_s=0.0)
            raise
        self._finish(ok=report.ok, wait_s=_DONE_WAIT_S)
        return report, outcome

    def settle(self, report: LaunchReport, outcome: RunOutcome, policy: RestartPolicy,
               local: Callable[[], Failure]) -> Settled | None:
        """This round's end for the whole job; None when the job succeeded here."""
        from gpuwarden.launch.multinode import job_store

        assert self.job is not None and self.round is not None
        restarts, history = job_store.job_history(self.round)
        if report.ok and outcome.own_record is None and outcome.stopped_for is None:
            # Every rank here finished of its own accord: the job's work is done on this node
            # (a node that asked to join only now, or a failure elsewhere after this node's
            # ranks finished, changes nothing here).
            self._end_round()
            return None
        own = outcome.own_record or job_store.new_record(
            job_store.ECHO, node=self.round.group_rank, echo=True,
            what=f"this node's ranks were stopped ({outcome.stopped_for or 'no cause seen here'})")
        # Only an echo here: the record of a real cause elsewhere, or of a lost node, wins.
        rec, gone = self.job.first_failure(own, outcome.job_failure)
        if gone:
            rec = rec or job_store.new_record(job_store.STORE_LOST, node=self.round.group_rank,
                                              what="the job's store went away")
        settled = self.job.settle(rec, local, policy, restarts, history)
        self._end_round()
        if rec is not None and not job_store.is_mine(rec):
            outcome.job_failure = rec
            report = build_report(outcome)
        if rec is not None and rec.get("kind") != job_store.MEMBERSHIP:
            line = f"the job's first failure ({settled.failure.code}): {job_store.describe(rec)}"
            report.evidence.append(line)
            report.fields["job_root"] = {"code": settled.failure.code, **{
                k: rec.get(k) for k in ("kind", "node", "host", "rank", "what")}}
        settled.report = report
        return settled

    def _end_round(self) -> None:
        from gpuwarden.launch.multinode.node_agent import AgentError

        try:
            self.agent.call("end_round", timeout_s=30)
        except AgentError:
            pass

    def _finish(self, *, ok: bool, wait_s: float) -> None:
        """The job ended here: the node hosting the store keeps it up until the other nodes
        ended too (they read the decision from it), saying whom it waits for; then the
        rendezvous is closed."""
        tty = self.err.isatty() if hasattr(self.err, "isatty") else False
        said = [0.0]

        def on_event(event: dict[str, object]) -> None:
            if event.get("event") != "finishing":
                return
            now = time.monotonic()
            if now - said[0] < (3.0 if tty else 30.0):
                return
            said[0] = now
            waiting = event.get("waiting_for")
            names = ", ".join(str(n.get("host", "?")) for n in
                              (waiting if isinstance(waiting, list) else []) if isinstance(n, dict))
            print(f"gpuwarden: waiting for {names} to finish: the job's store runs on this "
                  "node", file=self.err, flush=True)

        from gpuwarden.launch.multinode.node_agent import AgentError

        try:
            # A join cut short (Ctrl-C) still runs in the agent, which then reads no command:
            # it is simply ended; torch drops this node once its heartbeat expires.
            if self.agent.alive() and not self.agent.busy:
                self.agent.call("done", wait_s=wait_s, timeout_s=wait_s + 60, on_event=on_event)
        except (AgentError, KeyboardInterrupt):
            pass
        del ok


def _attempt_plan(config: LaunchConfig, attempt: int, gpus: tuple[GPUSnapshot, ...], *,
                  run_id: str, work: str, log_run_dir: str | None,
                  argv: tuple[str, ...] | None, restart_count: int | None = None,
                  agent_store: bool = False) -> LaunchPlan:
    """Attempt ``attempt``'s plan: its own port (a fresh rendezvous), files and log directory.
    Several nodes: ``config`` is the round's (its node rank, node count and workers' store)."""
    port = config.master_port if config.multinode or restart_count is not None \
        else attempt_port(config, attempt)
    assert port is not None
    plan = make_plan(config, gpus, master_port=port, run_id=run_id,
                     run_dir=_attempt_dir(work, attempt), supervisor_pid=os.getpid(),
                     python=sys.executable, base_env=os.environ, log_run_dir=log_run_dir,
                     attempt=attempt, restart_count=restart_count, agent_store=agent_store)
    if argv is not None:  # spawn(): every rank runs this command instead of the target
        plan = replace(plan, ranks=tuple(replace(r, argv=argv) for r in plan.ranks))
    return plan


def attempt_port(config: LaunchConfig, attempt: int) -> int:
    """MASTER_PORT of an attempt on one node: the one given (checked free) or a free one, and a
    fresh free one for every restart, so no rank connects to the old attempt's store. Several
    nodes: the node that runs rank 0 picks it for each round (the node agent publishes it)."""
    return choose_port(config if attempt == 0 else replace(config, master_port=None))


def _attempt_dir(work: str, attempt: int) -> str:
    """Each attempt's ranks write their progress, error and stack files apart from the last's."""
    if attempt == 0:
        return work
    path = os.path.join(work, f"attempt_{attempt}")
    os.makedirs(path, exist_ok=True)
    return path


def _memory_watch(config: LaunchConfig, taken: Any, inventory: Inventory | None
                  ) -> MemoryWatch | None:
    """--mem-per-rank: the guard of the launch's memory lease (launch/watch/memory.py)."""
    if not config.mem_per_rank_bytes or taken.grant is None:
        return None
    from gpuwarden.inventory import Inventory
    from gpuwarden.launch.watch.memory import MemoryWatch

    return MemoryWatch(taken.grant, inventory or Inventory.from_env(), config.mem_enforce)


def _supervise(plan: LaunchPlan, stdout: TextIO | None, stderr: TextIO | None,
               err: TextIO, *, inherit_stdin: bool = True,
               job: JobRound | None = None,
               memory: MemoryWatch | None = None) -> tuple[LaunchReport, RunOutcome]:
    supervisor = Supervisor(plan, stdout=stdout, stderr=stderr, inherit_stdin=inherit_stdin,
                            job=job, serve=serve, memory=memory)

    def on_stall(stall: Stall) -> None:
        print(stall_report(supervisor.outcome(stall.detected_at), stall).render()
              + "\n  (--keep-waiting: still waiting)", file=err, flush=True)

    supervisor.on_stall = on_stall
    outcome = supervisor.run()
    return build_report(outcome), outcome


def _log_run_dir(config: LaunchConfig, run_id: str) -> str | None:
    """torchrun's ``<log-dir>/<run id>_<random>`` (a fresh one per launch, so runs sharing a
    --log-dir never mix); with --tee/--redirects but no --log-dir a temporary base, as torchrun's
    ``torchelastic_*``, kept after the run (its files are the only copy of redirected output)."""
    if config.log_dir is None and not needs_log_files(config.redirects, config.tee, (
            *config.duplicate_stdout_filters, *config.duplicate_stderr_filters)):
        return None
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
    try:
        base = config.log_dir or tempfile.mkdtemp(prefix="torchelastic_")
        os.makedirs(base, exist_ok=True)
        return tempfile.mkdtemp(prefix=f"{safe}_", dir=base)
    except OSError as exc:
        raise _unwritable(config.log_dir, exc) from exc


def _error_file_dir(run_id: str) -> str:
    """Without --log-dir, torchrun's agent makes ``/tmp/torchelastic_<random>/<run id>_<random>``
    for its ranks' error files (TORCHELASTIC_ERROR_FILE): the same here."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
    try:
        base = tempfile.mkdtemp(prefix="torchelastic_")
        return tempfile.mkdtemp(prefix=f"{safe}_", dir=base)
    except OSError as exc:
        raise _unwritable(None, exc) from exc


def _unwritable(log_dir: str | None, exc: OSError) -> UsageError:
    """A log directory that cannot be made: one line, exit 2 (it was a traceback, exit 1)."""
    where = exc.filename if isinstance(exc.filename, str) else (log_dir or tempfile.gettempdir())
    reason = exc.strerror or str(exc)
    if log_dir is not None:
        return UsageError(f"--log-dir {log_dir}: cannot create {where} ({reason})",
                          fix="name a directory this user can write, e.g. --log-dir ./logs, "
                          "or leave --log-dir out")
    return UsageError(f"cannot create a directory for torch's error files under "
                      f"{tempfile.gettempdir()}: {where} ({reason})",
                      fix="point TMPDIR at a directory this user can write, or give --log-dir")


def _drop_if_no_error_file(base: str, budget_s: float = TIDY_BUDGET_S) -> None:
    """Keep the error-file tree when a rank wrote an error file (the report names it), remove it
    when it holds nothing but empty rank directories: torchrun leaves one behind on every run.
    Within ``budget_s``: a slow disk takes milliseconds per directory, and the job's end must
    not wait on tidying (what is left is the empty tree torchrun would leave)."""
    deadline = time.monotonic() + budget_s
    dirs = []
    for dirpath, _dirs, files in os.walk(base):
        if files:
            return
        dirs.append(dirpath)
    for path in reversed(dirs):  # the deepest first
        if time.monotonic() >= deadline:
            return
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _run_id(config: LaunchConfig) -> str:
    """One id for the whole job: every node derives the same (TORCHELASTIC_RUN_ID); torchrun's
    --rdzv-id when given."""
    if config.rdzv_id:
        return config.rdzv_id
    if not config.multinode:
        return str(uuid.uuid4())
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        return f"slurm-{job}"
    return f"{config.master_addr}-{config.master_port}"

