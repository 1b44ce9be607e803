"""What a doctor check reports: one :class:`Check` per question, with a status and a code."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from gpuwarden.errors import EXIT_FAILURE, EXIT_OK
from gpuwarden.findings import Finding, Severity


class Status(str, Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"  # the check does not apply here (no GPU, no MASTER_ADDR, torch missing ...)

    @property
    def rank(self) -> int:
        return {"skip": 0, "ok": 1, "warn": 2, "fail": 3}[self.value]


# A check's status as the severity of its finding: a skipped check found nothing wrong.
_SEVERITY = {Status.OK: Severity.OK, Status.SKIP: Severity.OK, Status.WARN: Severity.WARNING,
             Status.FAIL: Severity.ERROR}


@dataclass(frozen=True, kw_only=True)
class Check(Finding):
    """One check's finding. ``code`` is the failure code (docs/failure-codes.md) the check
    guards against, also when the status is ok: it says what would have gone wrong."""

    id: str
    status: Status
    evidence: Sequence[str] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "status": self.status.value, **super().to_dict()}


def check(id: str, code: str, status: Status, what: str, *, why: str | None = None,
          fix: str | None = None, evidence: Iterable[str] = (),
          fields: Mapping[str, Any] | None = None) -> Check:
    return Check(id=id, code=code, status=status, what=what, why=why, fix=fix,
                 evidence=tuple(evidence), fields=dict(fields or {}), severity=_SEVERITY[status])


@dataclass(frozen=True)
class Report:
    checks: tuple[Check, ...]
    elapsed_s: float
    context: dict[str, Any] = field(default_factory=dict)

    @property
    def worst(self) -> Status:
        return max((c.status for c in self.checks), key=lambda s: s.rank, default=Status.OK)

    @property
    def exit_code(self) -> int:
        """0 when nothing failed (warnings included), 1 when a check failed."""
        return EXIT_FAILURE if self.worst is Status.FAIL else EXIT_OK

    def counts(self) -> dict[str, int]:
        return {s.value: sum(1 for c in self.checks if c.status is s) for s in Status}

    def by_id(self, id: str) -> Check:
        for c in self.checks:
            if c.id == id:
                return c
        raise KeyError(id)

    def to_dict(self) -> dict[str, Any]:
        return {"context": self.context, "checks": [c.to_dict() for c in self.checks],
                "summary": self.counts(), "exit_code": self.exit_code,
                "elapsed_s": round(self.elapsed_s, 3)}

