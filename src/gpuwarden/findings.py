"""One finding type for everything gpuwarden reports, one renderer, one ``to_dict``.

An error (:class:`gpuwarden.errors.GpuwardenError`), a doctor check, a launch report and a
diagnosis of ``explain`` all say the same four things (STYLE.md): what happened, why, the fix,
the evidence, under a failure code (docs/failure-codes.md). They are all a :class:`Finding` here,
rendered by :func:`render_plain` / :func:`render_rich` (:func:`emit` picks: rich on a terminal,
plain when piped) and serialized by :meth:`Finding.to_dict`, so the four read and parse alike::

    error[RDZV_DNS]: rank 1 cannot resolve MASTER_ADDR 'wrong.address'
      why: the name is unknown to this host's resolver (gai error -2)
      fix: set MASTER_ADDR to an address every node can reach, e.g. 10.0.0.4
      look at: rank 1: MASTER_ADDR was 'wrong.address'
      next: `getent hosts wrong.address` on the failing node
      evidence: node box-b, rank 1, after 0.4 s

``fields`` holds the same evidence as data (pid, rank, gpu, bytes, host, port ...) for
``--json`` readers and programs; the text lines are for people.

This module imports nothing heavy: rich loads only when a terminal is written to.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple, TextIO


class Severity(str, Enum):
    """How bad a finding is; names the head of its report (``error[CODE]``, ``warning[CODE]``)."""

    ERROR = "error"
    WARNING = "warning"
    UNKNOWN = "unknown"  # explain found nothing it knows: it says so rather than guess
    OK = "ok"            # a doctor check that passed, a launch that finished


class EvidenceLine(NamedTuple):
    """One line of a log that supports a finding: ``(line, text)``, ``line`` 1-based."""

    line: int
    text: str


Evidence = str | EvidenceLine


@dataclass(frozen=True)
class Section:
    """A block printed under the evidence (a traceback tail, a rank's stack)."""

    heading: str
    lines: Sequence[str]


class Row(NamedTuple):
    """One line of a rendered finding: ``label: text``; a label of None is a ``- text`` bullet."""

    label: str | None
    text: str
    style: str = "bold"


_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "bold yellow",
          Severity.UNKNOWN: "bold yellow", Severity.OK: "bold green"}


@dataclass(frozen=True, kw_only=True)
class Finding:
    """What happened, why, the fix, the evidence, under a failure code.

    ``details`` are the specific things seen that point at the cause ("look at": the process
    holding the GPU, the variable's value); ``next`` is where to look next in general. Both come
    from explain's knowledge base; an error or a check may carry them too.
    """

    code: str
    what: str
    why: str | None = None
    fix: str | None = None
    evidence: Sequence[Evidence] = ()
    details: Sequence[str] = ()
    next: str | None = None
    sections: Sequence[Section] = ()
    fields: Mapping[str, Any] = field(default_factory=dict)
    severity: Severity = Severity.ERROR

    @property
    def label(self) -> str:
        """``error[CODE]`` (``warning[...]``, ``unknown[...]``; ``gpuwarden`` for an OK one)."""
        if self.severity is Severity.OK:
            return "gpuwarden"
        return f"{self.severity.value}[{self.code}]"

    def rows(self, *, source: str | None = None, bullets: bool = False) -> list[Row]:
        """The lines under the head, in reading order. An OK finding shows only its evidence.

        ``source`` prefixes log evidence lines (``train.log:12: ...``); ``bullets`` writes
        evidence as ``- text`` (a checklist) instead of ``evidence: text``.
        """
        rows: list[Row] = []
        if self.severity is not Severity.OK:
            if self.why:
                rows.append(Row("why", self.why))
            if self.fix:
                rows.append(Row("fix", self.fix, "bold green"))
            rows += [Row("look at", d, "bold cyan") for d in self.details]
            if self.next:
                rows.append(Row("next", self.next))
        for e in self.evidence:
            text = e if isinstance(e, str) else f"{source or '<text>'}:{e.line}: {e.text}"
            rows.append(Row(None if bullets else "evidence", text))
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "severity": self.severity.value,
            "what": self.what,
            "why": self.why,
            "fix": self.fix,
            "evidence": [e if isinstance(e, str) else {"line": e.line, "text": e.text}
                         for e in self.evidence],
            "details": list(self.details),
            "next": self.next,
            "sections": [{"heading": s.heading, "lines": list(s.lines)} for s in self.sections],
            "fields": dict(self.fields),
        }


def render_plain(finding: Finding, *, head: str | None = None, extra: Sequence[Row] = (),
                 indent: str = "  ", source: str | None = None, bullets: bool = False) -> str:
    """The finding as plain text, no trailing newline: the head line, then indented rows.

    ``head`` replaces ``label: what`` (a doctor check's ``[FAIL] id  what  (CODE)``); ``extra``
    rows follow the finding's own (explain's other codes), then its sections.
    """
    lines = [head if head is not None else f"{finding.label}: {finding.what}"]
    for row in (*finding.rows(source=source, bullets=bullets), *extra):
        lines.append(f"{indent}- {row.text}" if row.label is None
                     else f"{indent}{row.label}: {row.text}")
    for section in finding.sections:
        lines.append(f"{indent}{section.heading}:")
        lines += [f"{indent}  {line}" for line in section.lines]
    return "\n".join(lines)


def render_one_line(finding: Finding) -> str:
    """``error[CODE]: what (why); fix: fix`` — for setup errors, where one line says it all."""
    line = f"{finding.label}: {finding.what}"
    if finding.why:
        line += f" ({finding.why})"
    if finding.fix:
        line += f"; fix: {finding.fix}"
    return line


def render_rich(finding: Finding, stream: TextIO, *, head: str | None = None,
                extra: Sequence[Row] = (), indent: str = "  ", source: str | None = None,
                bullets: bool = False) -> None:
    """The same lines as :func:`render_plain`, with colours, on a terminal."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(file=stream, highlight=False, soft_wrap=True)
    style = _STYLE[finding.severity]
    if head is None:
        console.print(f"[{style}]{escape(finding.label)}[/]: {escape(finding.what)}")
    else:
        console.print(escape(head), style=style if finding.severity is not Severity.OK else None)
    for row in (*finding.rows(source=source, bullets=bullets), *extra):
        if row.label is None:
            console.print(f"{indent}- {escape(row.text)}")
        else:
            console.print(f"{indent}[{row.style}]{escape(row.label)}[/]: {escape(row.text)}")
    for section in finding.sections:
        console.print(f"{indent}[bold]{escape(section.heading)}[/]:")
        for line in section.lines:
            console.print(f"{indent}  {escape(line)}", style="dim")


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default stdout) is a terminal: rich output there, plain when piped."""
    stream = sys.stdout if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def emit(finding: Finding, stream: TextIO | None = None, *, head: str | None = None,
         extra: Sequence[Row] = (), indent: str = "  ", source: str | None = None,
         bullets: bool = False) -> None:
    """Write ``finding`` to ``stream`` (default stdout): rich on a terminal, plain when piped."""
    stream = sys.stdout if stream is None else stream
    if is_terminal(stream):
        render_rich(finding, stream, head=head, extra=extra, indent=indent, source=source,
                    bullets=bullets)
    else:
        stream.write(render_plain(finding, head=head, extra=extra, indent=indent, source=source,
                                  bullets=bullets) + "\n")
