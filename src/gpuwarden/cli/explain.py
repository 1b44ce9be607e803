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
        emit_json(_json_payload(diag))
    elif is_terminal(sys.stdout):
        _render_rich(diag)
    else:
        sys.stdout.write(render_plain(diag))
    return EXIT_FOUND if diag.found else EXIT_UNKNOWN


def _json_payload(diag: Diagnosis) -> dict[str, Any]:
    d = diag.to_dict()
    return {"primary": d["primary"], "others": d["others"], "source": d["source"],
            "lines_read": d["lines_read"], "bytes_read": d["bytes_read"]}


def _where(f: Finding) -> str:
    rank = f", rank {f.first_rank}" if f.first_rank is not None else ""
    return f"line {f.first_line}{rank}"


def render_plain(diag: Diagnosis) -> str:
    """The four-part report of STYLE.md as plain text (also what the launcher prints)."""
    p = diag.primary
    out: list[str] = []
    if not diag.found:
        out.append(f"unknown[NONE]: no known failure in {diag.source} "
                   f"({diag.lines_read} lines read)")
        out.append(f"  why: {p.why}")
        out.append(f"  fix: {p.fix}")
        return "\n".join(out) + "\n"
    out.append(f"error[{p.code}]: {p.title}  (confidence {p.confidence:.2f}, {_where(p)})")
    out.append(f"  why: {p.why}")
    out.append(f"  fix: {p.fix}")
    for detail in p.details:
        out.append(f"  look at: {detail}")
    if p.next:
        out.append(f"  next: {p.next}")
    for e in p.evidence:
        out.append(f"  evidence: {diag.source}:{e.line}: {e.text}")
    for f in diag.others:
        kind = "echo" if f.echo else "also seen"
        out.append(f"  {kind}: {f.code} at {_where(f)}, {f.matches} line(s): {f.title}")
    return "\n".join(out) + "\n"


def _render_rich(diag: Diagnosis, stream: TextIO | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(file=stream or sys.stdout, highlight=False, soft_wrap=True)
    p = diag.primary
    if not diag.found:
        console.print(f"[bold yellow]unknown[NONE][/]: no known failure in "
                      f"{escape(diag.source)} ({diag.lines_read} lines read)")
        console.print(f"  [bold]why:[/] {escape(p.why)}")
        console.print(f"  [bold]fix:[/] {escape(p.fix)}")
        return
    console.print(f"[bold red]error\\[{p.code}][/]: [bold]{escape(p.title)}[/]  "
                  f"[dim](confidence {p.confidence:.2f}, {_where(p)})[/]")
    console.print(f"  [bold]why:[/] {escape(p.why)}")
    console.print(f"  [bold green]fix:[/] {escape(p.fix)}")
    for detail in p.details:
        console.print(f"  [bold cyan]look at:[/] {escape(detail)}")
    if p.next:
        console.print(f"  [bold]next:[/] {escape(p.next)}")
    for e in p.evidence:
        console.print(f"  [bold]evidence:[/] [dim]{escape(diag.source)}:{e.line}:[/] "
                      f"{escape(e.text)}")
    for f in diag.others:
        kind = "[dim]echo[/]" if f.echo else "[yellow]also seen[/]"
        console.print(f"  {kind}: {f.code} at {_where(f)}, {f.matches} line(s): "
                      f"{escape(f.title)}")
