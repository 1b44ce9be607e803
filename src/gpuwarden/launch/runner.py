"""One launch end to end: take GPUs → choose the port → plan → supervise → report.

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
from typing import TextIO

from gpuwarden.launch.config import LaunchConfig
from gpuwarden.launch.plan import make_plan
from gpuwarden.launch.preflight import choose_port, take_gpus
from gpuwarden.launch.relay import needs_log_files
from gpuwarden.launch.report import LaunchReport, build_report, stall_report
from gpuwarden.launch.supervisor import RunOutcome, Stall, Supervisor


def launch(config: LaunchConfig, *, stdout: TextIO | None = None, stderr: TextIO | None = None,
           argv: tuple[str, ...] | None = None,
           run_dir: str | None = None) -> tuple[LaunchReport, RunOutcome]:
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
    taken = take_gpus(config)
    own_dir = run_dir is None
    work = run_dir or tempfile.mkdtemp(prefix="gpuwarden-launch-")
    try:
        # Multi-node: the port was checked by the preflight (node 0: free; others: reachable).
        # (LaunchConfig refuses --nnodes > 1 without --master-port.)
        port = config.master_port if config.multinode and config.master_port is not None \
            else choose_port(config)
        run_id = config.run_id or _run_id(config)
        log_run_dir = _log_run_dir(config, run_id)
        plan = make_plan(config, taken.gpus, master_port=port, run_id=run_id, run_dir=work,
                         supervisor_pid=os.getpid(), python=sys.executable, base_env=os.environ,
                         log_run_dir=log_run_dir)
        for spec in plan.ranks:
            # torch's @record writes TORCHELASTIC_ERROR_FILE without creating its directory;
            # torchrun's agent creates attempt_0/<local rank>/ for every rank, so does this
            os.makedirs(os.path.dirname(spec.env["TORCHELASTIC_ERROR_FILE"]), exist_ok=True)
        if argv is not None:  # spawn(): every rank runs this command instead of the target
            plan = replace(plan, ranks=tuple(replace(r, argv=argv) for r in plan.ranks))
        notes = [*taken.notes, *plan.notes]
        if log_run_dir is not None:
            notes.append(f"log directory: {log_run_dir}")
        if config.max_restarts:
            notes.append(f"--max-restarts {config.max_restarts}: restarts are not implemented yet; "
                         "the job runs once and its first failure ends it")
        for note in notes:
            print(f"gpuwarden: {note}", file=err)
        supervisor = Supervisor(plan, stdout=stdout, stderr=stderr)

        def on_stall(stall: Stall) -> None:
            print(stall_report(supervisor.outcome(stall.detected_at), stall).render()
                  + "\n  (--keep-waiting: still waiting)", file=err, flush=True)

        supervisor.on_stall = on_stall
        outcome = supervisor.run()
        return build_report(outcome), outcome
    finally:
        taken.release()
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)


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

