"""One launch end to end: take GPUs → choose the port → plan → supervise → report
(with ``--max-restarts``, again per attempt: launch/attempts.py).

The GPUs (a lease, when the lease manager is installed) are held here, in the supervising
process, for as long as ranks run; ranks never inherit the lease's file descriptors
(``close_fds``).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, TextIO

from gpuwarden.inventory.snapshot import GPUSnapshot
from gpuwarden.launch.config import LaunchConfig
from gpuwarden.launch.plan import LaunchPlan, make_plan
from gpuwarden.launch.preflight import choose_port, take_gpus
from gpuwarden.launch.relay import needs_log_files
from gpuwarden.launch.report import LaunchReport, build_report, stall_report
from gpuwarden.launch.supervisor import RunOutcome, Stall, Supervisor

if TYPE_CHECKING:
    from gpuwarden.inventory import Inventory


def launch(config: LaunchConfig, *, stdout: TextIO | None = None, stderr: TextIO | None = None,
           argv: tuple[str, ...] | None = None,
           run_dir: str | None = None, inventory: Inventory | None = None
           ) -> tuple[LaunchReport, RunOutcome]:
    """Run ``config`` to the end and return its report (printed by the caller) and outcome.

    Raises before any rank starts: UsageError (exit 2), NoGPUError (3), ConstraintError with
    every GPU's verdict (4), PortInUseError (RDZV_PORT_IN_USE) for a busy --master-port.
    """
    err = stderr or sys.stderr
    if config.multinode:
        # Before GPUs are leased: a node that cannot reach the rendezvous holds nothing.
        from gpuwarden.launch.rendezvous import check_rendezvous

        pre = check_rendezvous(config, dict(os.environ), err=err)
        if pre.env:
            config = replace(config, extra_env=(*config.extra_env, *pre.env.items()))
    taken = take_gpus(config, inventory)
    own_dir = run_dir is None
    errors_only: str | None = None
    work = run_dir or tempfile.mkdtemp(prefix="gpuwarden-launch-")
    try:
        run_id = config.run_id or _run_id(config)
        log_run_dir = _log_run_dir(config, run_id)
        if log_run_dir is None:
            # torch's error files go where torchrun puts them, a /tmp/torchelastic_* tree
            log_run_dir = errors_only = _error_file_dir(run_id)

        def run_attempt(attempt: int, gpus: tuple[GPUSnapshot, ...],
                        notes: tuple[str, ...]) -> tuple[LaunchReport, RunOutcome]:
            if config.multinode and attempt > 0:
                # The restart's rendezvous (--master-port + attempt): node 0 checks it is free,
                # the others wait (--rdzv-timeout) for node 0's restarted rank 0 to bind it; a
                # node 0 that ended the job is then named rather than waited for forever.
                _restart_rendezvous(config, attempt, err)
            plan = _attempt_plan(config, attempt, gpus, run_id=run_id, work=work,
                                 log_run_dir=log_run_dir, argv=argv)
            for note in (*notes, *(plan.notes if attempt == 0 else ())):
                print(f"gpuwarden: {note}", file=err)
            return _supervise(plan, stdout, stderr, err, inherit_stdin=argv is None)

        notes = [*taken.notes]
        if log_run_dir != errors_only:
            notes.append(f"log directory: {log_run_dir}")
        if not config.max_restarts:
            return run_attempt(0, taken.gpus, tuple(notes))
        from gpuwarden.launch.attempts import run_attempts

        return run_attempts(config, taken.gpus, run_attempt, tuple(notes), err=err)
    finally:
        taken.release()
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
        if errors_only is not None:
            _drop_if_no_error_file(os.path.dirname(errors_only))


def _attempt_plan(config: LaunchConfig, attempt: int, gpus: tuple[GPUSnapshot, ...], *,
                  run_id: str, work: str, log_run_dir: str | None,
                  argv: tuple[str, ...] | None) -> LaunchPlan:
    """Attempt ``attempt``'s plan: its own port (a fresh rendezvous), files and log directory."""
    plan = make_plan(config, gpus, master_port=attempt_port(config, attempt), run_id=run_id,
                     run_dir=_attempt_dir(work, attempt), supervisor_pid=os.getpid(),
                     python=sys.executable, base_env=os.environ, log_run_dir=log_run_dir,
                     attempt=attempt)
    for spec in plan.ranks:
        # torch's @record writes TORCHELASTIC_ERROR_FILE without creating its directory;
        # torchrun's agent creates attempt_<k>/<local rank>/ for every rank, so does this
        os.makedirs(os.path.dirname(spec.env["TORCHELASTIC_ERROR_FILE"]), exist_ok=True)
    if argv is not None:  # spawn(): every rank runs this command instead of the target
        plan = replace(plan, ranks=tuple(replace(r, argv=argv) for r in plan.ranks))
    return plan


def attempt_port(config: LaunchConfig, attempt: int) -> int:
    """MASTER_PORT of an attempt. One node: the one given (checked free) or a free one, and a
    fresh free one for every restart, so no rank connects to the old attempt's store. Several
    nodes: ``--master-port + attempt``, which every node derives alike (the port was checked
    by the preflight for attempt 0; LaunchConfig refuses --nnodes > 1 without --master-port)."""
    if config.multinode and config.master_port is not None:
        return config.master_port + attempt
    return choose_port(config if attempt == 0 else replace(config, master_port=None))


def _restart_rendezvous(config: LaunchConfig, attempt: int, err: TextIO) -> None:
    from gpuwarden.errors import RendezvousError
    from gpuwarden.launch.rendezvous import check_rendezvous

    try:
        check_rendezvous(replace(config, master_port=attempt_port(config, attempt)),
                         dict(os.environ), err=err)
    except RendezvousError as exc:
        if config.node_rank == 0 or exc.code != "RDZV_CONN_REFUSED":
            raise
        raise RendezvousError(
            f"node 0 did not start attempt {attempt + 1} of {config.max_restarts + 1} within "
            f"{config.rdzv_timeout_s:g} s (--rdzv-timeout); this node stops too", code=exc.code,
            why="node 0 ended the job instead of restarting it: its own report says why (the "
            "same failure twice, no restarts left, or a cause a restart cannot fix)",
            fix="read node 0's report", evidence=exc.evidence) from None


def _attempt_dir(work: str, attempt: int) -> str:
    """Each attempt's ranks write their progress, error and stack files apart from the last's."""
    if attempt == 0:
        return work
    path = os.path.join(work, f"attempt_{attempt}")
    os.makedirs(path, exist_ok=True)
    return path


def _supervise(plan: LaunchPlan, stdout: TextIO | None, stderr: TextIO | None,
               err: TextIO, *, inherit_stdin: bool = True) -> tuple[LaunchReport, RunOutcome]:
    supervisor = Supervisor(plan, stdout=stdout, stderr=stderr, inherit_stdin=inherit_stdin)

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
    base = config.log_dir or tempfile.mkdtemp(prefix="torchelastic_")
    os.makedirs(base, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
    return tempfile.mkdtemp(prefix=f"{safe}_", dir=base)


def _error_file_dir(run_id: str) -> str:
    """Without --log-dir, torchrun's agent makes ``/tmp/torchelastic_<random>/<run id>_<random>``
    for its ranks' error files (TORCHELASTIC_ERROR_FILE): the same here."""
    base = tempfile.mkdtemp(prefix="torchelastic_")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
    return tempfile.mkdtemp(prefix=f"{safe}_", dir=base)


def _drop_if_no_error_file(base: str) -> None:
    """Keep the error-file tree when a rank wrote an error file (the report names it), remove it
    when it holds nothing but empty rank directories: torchrun leaves one behind on every run."""
    for _dirpath, _dirs, files in os.walk(base):
        if files:
            return
    shutil.rmtree(base, ignore_errors=True)


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

