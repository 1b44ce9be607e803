"""What explain answers: a :class:`Finding` per failure code seen in a log, and the
:class:`Diagnosis` that names one of them the root cause (:func:`rank_findings`: the earliest
code that is not an echo of another). The matcher that finds them is ``engine.py``'s."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from gpuwarden import findings
from gpuwarden.explain.knowledge import ANY_CODE, KnowledgeBase
from gpuwarden.findings import EvidenceLine

NONE_CODE = "NONE"


@dataclass(frozen=True, kw_only=True)
class Finding(findings.Finding):
    """A failure code seen in a log: the common :class:`gpuwarden.findings.Finding` (``what`` is
    the knowledge base's title, ``evidence`` the log lines as :class:`EvidenceLine`, ``details``
    what those lines name) plus where and how firmly it was seen."""

    evidence: list[EvidenceLine] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    confidence: float = 0.0
    first_line: int | None = None
    first_rank: int | None = None
    ranks: list[int] = field(default_factory=list)
    matches: int = 0
    echo: bool = False  # another code seen in the same log is the root cause of this one
    # Typed evidence (pid, rank, gpu, host, port, bytes, exception, frame...): what the
    # details say, for programs (`explain --json`, the launcher, scripts).
    fields: dict[str, Any] = field(default_factory=dict)
    # How the root cause is chosen (not part of the answer): seen only by weak signatures
    # (a retry warning, an abort), and the codes the lines that identified it are echoes
    # of, besides the code's own echo_of.
    weak: bool = field(default=False, compare=False)
    echo_of: frozenset[str] = field(default=frozenset(), compare=False)

    @property
    def title(self) -> str:
        return self.what

    def to_dict(self) -> dict[str, Any]:
        common = super().to_dict()
        return {  # the code, its title and the confidence first: what a reader wants first
            "code": common.pop("code"),
            "title": self.what,
            "confidence": self.confidence,
            **common,
            "first_line": self.first_line,
            "first_rank": self.first_rank,
            "ranks": list(self.ranks),
            "matches": self.matches,
            "echo": self.echo,
        }


NONE_FINDING = Finding(
    code=NONE_CODE,
    what="no known failure found",
    severity=findings.Severity.UNKNOWN,
    why="no line matches a signature of the knowledge base; gpuwarden does not know this "
        "failure and does not guess",
    fix="read the first traceback of the log; if it is a CUDA, NCCL or rendezvous failure "
        "gpuwarden should know, add a signature to the knowledge base (docs/explain.md)",
    next="",
)


@dataclass(frozen=True)
class Diagnosis:
    """What :func:`gpuwarden.explain.explain_text` found: the root cause and the rest."""

    primary: Finding
    others: list[Finding]
    lines_read: int
    bytes_read: int
    source: str = "<text>"

    @property
    def found(self) -> bool:
        return self.primary.code != NONE_CODE

    def to_dict(self) -> dict[str, Any]:
        return {  # the answer first: `explain --json` prints exactly this
            "primary": self.primary.to_dict(),
            "others": [f.to_dict() for f in self.others],
            "source": self.source,
            "lines_read": self.lines_read,
            "bytes_read": self.bytes_read,
        }




def _echo_of(f: Finding, kb: KnowledgeBase) -> frozenset[str]:
    """The codes ``f`` is an echo of: its code's, and those of the lines that identified it."""
    return kb.entry(f.code).echo_of | f.echo_of


def _is_echo(f: Finding, found: list[Finding], kb: KnowledgeBase) -> bool:
    echo_of = _echo_of(f, kb)
    for g in found:
        if g.code == f.code:
            continue
        if g.code in echo_of:
            return True
        if ANY_CODE in echo_of and ANY_CODE not in _echo_of(g, kb):
            return True
    return False


def rank_findings(findings: list[Finding], *, lines_read: int, bytes_read: int,
                  source: str, kb: KnowledgeBase) -> Diagnosis:
    """Choose the root cause among ``findings``: the earliest code that is not an echo.

    A code is an echo when a code named in its ``echo_of`` (or in that of the signatures
    that identified it) was also seen (``"*"``: any code that is not itself an echo of
    everything). If every code is an echo of another (a cycle), the earliest one wins.
    Among the rest, a specific code comes before a generic one (a rank's bare exception),
    and that before a code seen only by weak signatures.
    """
    if not findings:
        return Diagnosis(NONE_FINDING, [], lines_read, bytes_read, source)
    echoes = {f.code for f in findings if _is_echo(f, findings, kb)}
    pool = [f for f in findings if f.code not in echoes] or findings
    # a rank's bare exception is the answer only when nothing more specific explains the log,
    # and a weak trace (a retry warning, an abort) only when not even that was found
    pool = ([f for f in pool if not f.weak and not kb.entry(f.code).generic]
            or [f for f in pool if not f.weak] or pool)

    def order(f: Finding) -> tuple[int, float]:
        return (f.first_line if f.first_line is not None else 1 << 62, -f.confidence)

    primary = min(pool, key=order)
    others = sorted((f for f in findings if f is not primary), key=order)
    others = [replace(f, echo=f.code in echoes) for f in others]
    return Diagnosis(primary, others, lines_read, bytes_read, source)
