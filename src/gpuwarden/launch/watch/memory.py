"""A launch's memory lease, watched from outside the ranks (``--mem-per-rank``).

The supervisor's loop calls :meth:`MemoryWatch.check` every :attr:`interval_s`; it reads the
leased GPUs' memory through the inventory (NVML, or the simulated host) with the lease's own
guard (``gpuwarden.lease.guard``) and returns the lines to print and, with ``--mem-enforce
stop``, the finding the job stops for. Nothing here reaches into a rank: a rank's memory is what
NVML shows for it and its children, as torchrun's contract inside a rank is left alone.
"""

from __future__ import annotations

import time
from typing import Any


class MemoryWatch:
    """The memory guard of a launch's lease, for the supervisor's loop."""

    def __init__(self, grant: Any, inventory: Any, enforce: str = "warn") -> None:
        from gpuwarden.lease.guard import POLL_S, MemoryGuard

        self.guard = MemoryGuard(grant, inventory)
        self.enforce = enforce
        self.interval_s = POLL_S
        self._error = ""

    @property
    def active(self) -> bool:
        return self.guard.active

    def check(self) -> tuple[list[str], dict[str, Any] | None]:
        """(lines for the launcher's stderr, the finding to stop the job for or None)."""
        from gpuwarden.findings import render_plain
        from gpuwarden.lease.guard import overuse_finding

        report = self.guard.poll()
        lines = []
        if report.error and report.error != self._error:
            lines.append(f"gpuwarden: warning: the memory guard cannot read the GPUs: "
                         f"{report.error}")
        self._error = report.error
        stop = None
        for over in report.new:
            stopping = "the job (every rank: SIGTERM, SIGKILL after --grace)" \
                if self.enforce == "stop" else ""
            finding = overuse_finding(over, enforce=self.enforce, stopping=stopping,
                                      detected_at=time.time())
            if stopping:  # the job's report says it all when it has stopped
                lines.append(f"gpuwarden: {finding.label}: {finding.what}: stopping the job")
                if stop is None:
                    stop = finding.to_dict()
                continue
            lines.append(render_plain(finding, head=f"gpuwarden: {finding.label}: "
                                      f"{finding.what}"))
        for over in report.ended:
            lines.append(f"gpuwarden: note[LEASE_MEMORY_EXCEEDED]: back within its lease on GPU "
                         f"{over.gpu_index}")
        return lines, stop
