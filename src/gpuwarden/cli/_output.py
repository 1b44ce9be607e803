"""Terminal output: rich tables on a terminal, aligned plain text when piped, JSON on request."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from gpuwarden.findings import is_terminal

__all__ = ["SCHEMA_VERSION", "emit_json", "emit_table", "is_terminal", "note"]

SCHEMA_VERSION = 1


def emit_json(payload: dict[str, Any], stream: TextIO | None = None) -> None:
    """Print ``payload`` with ``schema_version`` first."""
    stream = sys.stdout if stream is None else stream
    body = {"schema_version": SCHEMA_VERSION, **payload}
    stream.write(json.dumps(body, indent=2) + "\n")


def emit_table(columns: Sequence[str], rows: Sequence[Sequence[str]], *, title: str | None = None,
               stream: TextIO | None = None) -> None:
    stream = sys.stdout if stream is None else stream
    if is_terminal(stream):
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        # Cells as Text, never markup: they carry labels, commands and process names that
        # other users choose ("[blink]..." must print as written).
        table = Table(title=Text(title) if title else None, title_justify="left")
        for col in columns:
            table.add_column(col)
        for row in rows:
            table.add_row(*(Text(str(cell)) for cell in row))
        Console(file=stream).print(table)
        return
    if title:
        stream.write(title + "\n")
    widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) if rows else len(str(c))
              for i, c in enumerate(columns)]
    for row in (columns, *rows):
        stream.write("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() + "\n")


def note(message: str) -> None:
    """A diagnostic for the user (stderr)."""
    print(message, file=sys.stderr)
