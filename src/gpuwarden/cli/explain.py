"""``gpuwarden explain``: a log or traceback in, the failure code, its cause and fix out."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, TextIO

from gpuwarden.cli._output import emit_json, is_terminal

if TYPE_CHECKING:
    from gpuwarden.explain import Diagnosis, Finding

EXIT_FOUND = 0
EXIT_UNKNOWN = 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "explain",
        help="read a log or traceback and name the failure code, its cause and the fix",
        description="Read a log or traceback (a file, '-' or nothing for stdin; gzip is read "
        "as such; any size, streamed) and answer with the failure codes of gpuwarden's "
        "knowledge base: the primary code (the root cause, not the other ranks' echoes), the "
        "other codes seen, the evidence lines with their numbers, why it happened and what "
        "to do. When nothing matches, the answer is NONE: gpuwarden says it does not know.",
        epilog="Exit codes: 0 a failure code was found, 1 NONE (no known failure), "
        "2 unreadable input (missing file, a directory, binary data).",
    )
    p.add_argument("file", nargs="?", default="-", metavar="FILE",
                   help="the log to read; '-' or nothing reads stdin")
    p.add_argument("--json", action="store_true",
                   help="machine-readable output (schema_version 1)")
    p.add_argument("--knowledge", metavar="TOML", default=None,
                   help="use this knowledge base instead of the one shipped with gpuwarden")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gpuwarden.explain import explain_file, load_knowledge

    kb = load_knowledge(args.knowledge) if args.knowledge else None
    diag = explain_file(args.file, kb)
    if args.json:
        emit_json(diag.to_dict())
    elif is_terminal(sys.stdout):
        _render_rich(diag)
    else:
        sys.stdout.write(render_plain(diag))
    return EXIT_FOUND if diag.found else EXIT_UNKNOWN


def _where(f: Finding) -> str:
    rank = f", rank {f.first_rank}" if f.first_rank is not None else ""
    return f"line {f.first_line}{rank}"


def _report_rows(diag: Diagnosis) -> list[tuple[str, str, str]]:
    """The four-part report of STYLE.md as (label, text, rich style) rows; the first is the head."""
    p = diag.primary
    if not diag.found:
        return [("unknown[NONE]", f"no known failure in {diag.source} ({diag.lines_read} lines "
                 "read)", "bold yellow"), ("why", p.why, "bold"), ("fix", p.fix, "bold")]
    rows = [(f"error[{p.code}]", f"{p.title}  (confidence {p.confidence:.2f}, {_where(p)})",
             "bold red"), ("why", p.why, "bold"), ("fix", p.fix, "bold green")]
    rows += [("look at", detail, "bold cyan") for detail in p.details]
    if p.next:
        rows.append(("next", p.next, "bold"))
    rows += [("evidence", f"{diag.source}:{e.line}: {e.text}", "bold") for e in p.evidence]
    rows += [("echo" if f.echo else "also seen",
              f"{f.code} at {_where(f)}, {f.matches} line(s): {f.title}", "dim" if f.echo else "yellow")
             for f in diag.others]
    return rows


def render_plain(diag: Diagnosis) -> str:
    """The report as plain text (piped output)."""
    rows = _report_rows(diag)
    head, *rest = rows
    return "\n".join([f"{head[0]}: {head[1]}", *(f"  {label}: {text}" for label, text, _ in rest)]) + "\n"


def _render_rich(diag: Diagnosis, stream: TextIO | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(file=stream or sys.stdout, highlight=False, soft_wrap=True)
    for i, (label, text, style) in enumerate(_report_rows(diag)):
        console.print(f"{'' if i == 0 else '  '}[{style}]{escape(label)}[/]: {escape(text)}")
