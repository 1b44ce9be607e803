"""The attempt loop of ``--max-restarts``: run, diagnose, decide (launch/restart/policy.py), back off,
run again, on the GPUs leased once for the whole job.

As torchrun, a restart stops and starts the whole group: every rank of the failed attempt has
ended (the supervisor reaps them all) before the next attempt starts, with
``TORCHELASTIC_RESTART_COUNT`` one higher, a fresh rendezvous (runner.attempt_port; several
nodes: a new round of torch's rendezvous) and its own ``attempt_<k>`` log directory. Several
nodes decide once for the job (job_store.py); a node joining or waiting to join (elastic) is a
re-rendezvous that uses no restart, as under torchrun. One line per failed attempt on stderr says the attempt, the
cause and the decision. A GPU blamed for the failure (a hardware fault, a GPU that refused a
CUDA context) is swapped for another GPU leased from the host before the next attempt; the
blamed GPU stays leased, unused, until the job ends, so no other job on this host is handed it
meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from gpuwarden.errors import GpuwardenError
from gpuwarden.inventory.snapshot import GPUSnapshot
from gpuwarden.launch.config import LaunchConfig
from gpuwarden.launch.outcome import Failure, LaunchReport, RunOutcome, Settled
from gpuwarden.launch.restart.policy import RestartPolicy, decide_restart, failure_of

if TYPE_CHECKING:
    from gpuwarden.lease.grant import Grant

# (attempt index on this node, restarts the job used, GPUs, notes) -> the attempt's report
RunAttempt = Callable[[int, int, tuple[GPUSnapshot, ...], tuple[str, ...]],
                      tuple[LaunchReport, RunOutcome]]
# Several nodes: the job's settlement of an attempt (job_store.py), None when it succeeded
Settle = Callable[[LaunchReport, RunOutcome, RestartPolicy, Callable[[], Failure]],
                  Settled | None]


def run_attempts(config: LaunchConfig, gpus: tuple[GPUSnapshot, ...], run_attempt: RunAttempt,
                 notes: tuple[str, ...], *, err: TextIO,
                 sleep: Callable[[float], None] = time.sleep,
                 settle: Settle | None = None) -> tuple[LaunchReport, RunOutcome]:
    """Run attempts until one succeeds or :func:`decide_restart` says stop; the last attempt's
    report, with every earlier attempt's failure in its evidence.

    ``settle`` (several nodes) replaces this node's own decision by the job's: the first
    failure anywhere, decided once for every node (job_store.py); the restarts used and their
    failures are then the job's too, so a node that joined late counts like the others."""
    policy = RestartPolicy(config.max_restarts, config.restart_on, config.restart_backoff_s,
                           config.multinode)
    total = config.max_restarts + 1
    history: list[Failure] = []
    restarts = 0
    said: list[str] = []  # one evidence line per failed attempt, for the final report
    swaps = _GPUSwaps(config)
    try:
        attempt_notes = notes
        attempt = 0
        while True:
            report, outcome = run_attempt(attempt, restarts, gpus, attempt_notes)
            attempt_notes = ()
            settled = None
            if settle is not None:
                settled = settle(report, outcome, policy,
                                 lambda r=report, o=outcome: failure_of(r, o))  # type: ignore[misc]
                if settled is not None and settled.report is not None:
                    report = settled.report
            if (settle is None and report.ok) or (settle is not None and settled is None):
                if history:
                    report.what += f" on attempt {restarts + 1} of {total} (after {restarts} " \
                                   f"restart(s): {'; '.join(f.describe() for f in history)})"
                return report, outcome
            if settled is not None:
                failure, decision = settled.failure, settled.decision
                next_history, next_restarts = settled.history, settled.restarts_used
            else:
                failure = failure_of(report, outcome)
                decision = decide_restart(history, failure, policy)
                counted = decision.restart and decision.counts
                next_history = [*history, failure] if counted else history
                next_restarts = restarts + (1 if counted else 0)
            if decision.restart and not decision.counts:
                line = f"{failure.what or failure.code}: {decision.reason}"
            else:
                line = (f"attempt {restarts + 1}/{total} failed: {failure.describe()}; "
                        f"{decision.reason}")
            if decision.restart and decision.exclude_gpus:
                try:
                    gpus, swapped = swaps.swap(gpus, decision.exclude_gpus)
                    line += f"; {swapped}"
                except GpuwardenError as exc:
                    line += f"; no GPU to replace the one that failed ({exc.what}), kept it"
            backoff = policy.backoff_s if decision.counts else 0.0
            if decision.restart and backoff > 0:
                line += f" in {backoff:g} s"
            if decision.restart or config.max_restarts:
                print(f"gpuwarden: {line}", file=err, flush=True)
            if decision.counts:
                said.append(f"attempt {restarts + 1}/{total}: {failure.describe()}")
            if not decision.restart:
                if len(said) > 1:
                    report.evidence += [f"earlier {s}" for s in said[:-1]]
                if config.max_restarts:
                    report.evidence.append(f"--max-restarts {config.max_restarts}: "
                                           f"{decision.reason}")
                return report, outcome
            history, restarts = next_history, next_restarts
            attempt += 1
            try:
                sleep(backoff)
            except KeyboardInterrupt:  # Ctrl-C between attempts: no rank runs, stop here
                report.evidence.append("interrupted (SIGINT) before the next attempt")
                return report, outcome
    finally:
        swaps.release()


class _GPUSwaps:
    """GPUs leased during the job to replace blamed ones (released when the job ends)."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.blamed: list[str] = []
        self._grants: list[Grant] = []

    def swap(self, gpus: tuple[GPUSnapshot, ...], blamed: tuple[str, ...]) -> \
            tuple[tuple[GPUSnapshot, ...], str]:
        from gpuwarden.lease import acquire
        from gpuwarden.select import Constraints

        self.blamed += [u for u in blamed if u not in self.blamed]
        out = [g for g in gpus if g.uuid in blamed]
        if not out:
            return gpus, "its GPU is not this node's"
        constraints = Constraints(count=len(out), min_free_bytes=self.config.min_free_bytes,
                                  exclude=tuple(dict.fromkeys([*self.blamed,
                                                               *(g.uuid for g in gpus)])))
        grant = acquire(len(out), min_free=self.config.min_free_bytes, constraints=constraints,
                        label=f"gpuwarden launch {self.config.target} (replacement)",
                        mem=self.config.mem_per_rank_bytes or None)
        self._grants.append(grant)
        by_old = {old.uuid: fresh for old, fresh in zip(out, grant.gpus, strict=True)}
        new = tuple(by_old.get(g.uuid, g) for g in gpus)
        pairs = ", ".join(f"{old.label} replaced by {by_old[old.uuid].label}" for old in out)
        return new, f"excluded {pairs} (newly leased)"

    def release(self) -> None:
        for grant in self._grants:
            grant.release()
