"""``gpuwarden explain``: a log or traceback in, the failure code, its cause and fix out."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from gpuwarden.cli._output import emit_json

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
        "2 unreadable input (missing file, a directory, binary data). The codes, their causes, "
        "fixes and signatures: docs/failure-codes.md in the repository (generated from the "
        "knowledge base), or `gpuwarden explain --codes`.",
    )
    p.add_argument("file", nargs="?", default="-", metavar="FILE",
                   help="the log to read; '-' or nothing reads stdin")
    p.add_argument("--json", action="store_true",
                   help="machine-readable output (schema_version 1)")
    p.add_argument("--knowledge", metavar="TOML", default=None,
                   help="use this knowledge base instead of the one shipped with gpuwarden")
    p.add_argument("--codes", action="store_true",
                   help="print the failure-code reference (docs/failure-codes.md, Markdown) of "
                   "the knowledge base and exit")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gpuwarden.explain import explain_file, load_knowledge
    from gpuwarden.findings import emit

    kb = load_knowledge(args.knowledge) if args.knowledge else None
    if args.codes:
        from gpuwarden.explain.reference import failure_codes_markdown

        sys.stdout.write(failure_codes_markdown(kb))
        return EXIT_FOUND
    if args.file in (None, "-") and sys.stdin.isatty():
        # A blank screen otherwise: say what it waits for, and how to end it.
        print("gpuwarden explain: reading a log from standard input: paste it, then press "
              "Ctrl-D on a line of its own (or give a file: gpuwarden explain LOG)",
              file=sys.stderr)
    diag = explain_file(args.file, kb)
    if args.json:
        emit_json(diag.to_dict())
    else:
        emit(diag.primary, sys.stdout, **report_layout(diag))
    return EXIT_FOUND if diag.found else EXIT_UNKNOWN


def _where(f: Finding) -> str:
    rank = f", rank {f.first_rank}" if f.first_rank is not None else ""
    return f"line {f.first_line}{rank}"


def report_layout(diag: Diagnosis) -> dict[str, Any]:
    """How the primary finding is shown (head, the other codes as extra rows), for
    :func:`gpuwarden.findings.emit` / :func:`~gpuwarden.findings.render_plain`."""
    from gpuwarden.findings import Row

    p = diag.primary
    if not diag.found:
        head = f"{p.label}: no known failure in {diag.source} ({diag.lines_read} lines read)"
        return {"head": head, "source": diag.source}
    head = f"{p.label}: {p.title}  (confidence {p.confidence:.2f}, {_where(p)})"
    extra = [Row("echo" if f.echo else "also seen",
                 f"{f.code} at {_where(f)}, {f.matches} line(s): {f.title}",
                 "dim" if f.echo else "yellow")
             for f in diag.others]
    return {"head": head, "extra": extra, "source": diag.source}
