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
from collections.abc import Callable
from typing import TextIO

from gpuwarden.launch.config import LaunchConfig
from gpuwarden.launch.plan import LaunchPlan, make_plan
from gpuwarden.launch.preflight import choose_port, take_gpus
from gpuwarden.launch.report import LaunchReport, build_report
from gpuwarden.launch.supervisor import RunOutcome, Stall, Supervisor


def launch(config: LaunchConfig, *, stdout: TextIO | None = None, stderr: TextIO | None = None,
           argv_for: Callable[[LaunchConfig], tuple[str, ...]] | None = None,
           run_dir: str | None = None) -> tuple[LaunchReport, RunOutcome]:
    """Run ``config`` to the end and return its report (printed by the caller) and outcome.

    Raises before any rank starts: UsageError (exit 2), NoGPUError (3), ConstraintError with
    every GPU's verdict (4), PortInUseError (RDZV_PORT_IN_USE) for a busy --master-port.
    """
    err = stderr or sys.stderr
    taken = take_gpus(config)
    own_dir = run_dir is None
    work = run_dir or tempfile.mkdtemp(prefix="gpuwarden-launch-")
    try:
        port = choose_port(config)
        plan = make_plan(config, taken.gpus, master_port=port,
                         run_id=config.run_id or uuid.uuid4().hex[:12], run_dir=work,
                         supervisor_pid=os.getpid(), python=sys.executable, base_env=os.environ)
        if argv_for is not None:
            plan = _with_argv(plan, argv_for(config))
        for note in (*taken.notes, *plan.notes):
            print(f"gpuwarden: {note}", file=err)
        supervisor = Supervisor(plan, stdout=stdout, stderr=stderr)

        def on_stall(stall: Stall) -> None:
            from gpuwarden.launch.report import _stall_report

            outcome = RunOutcome(plan, supervisor_started, stall.detected_at, {}, {
                r.spec.rank: r.proc.pid for r in supervisor.ranks}, stall)
            print(_stall_report(outcome, stall).render() + "\n  (--keep-waiting: still waiting)",
                  file=err, flush=True)

        import time

        supervisor_started = time.monotonic()
        supervisor.on_stall = on_stall
        outcome = supervisor.run()
        return build_report(outcome), outcome
    finally:
        taken.release()
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)


def _with_argv(plan: LaunchPlan, argv: tuple[str, ...]) -> LaunchPlan:
    from dataclasses import replace

    return replace(plan, ranks=tuple(replace(r, argv=argv) for r in plan.ranks))
