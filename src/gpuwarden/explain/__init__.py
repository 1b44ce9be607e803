"""Turn a log or traceback into a failure code of failure-codes.md, its cause and fix.

    >>> from gpuwarden.explain import explain_text
    >>> diag = explain_text(log_text)
    >>> diag.primary.code, diag.primary.why, diag.primary.fix, diag.primary.evidence
    >>> [f.code for f in diag.others]        # the other codes seen, echoes included

``explain_file`` streams a file (or ``"-"`` for stdin, gzip read transparently) in
bounded memory; ``Explainer`` takes a log in pieces as it is produced (a caller
that streams; the launcher instead calls ``explain_text`` once on a failed rank's
output, after the fact). What is known about each failure is data:
``knowledge.toml`` next to this module (format: docs/explain.md).
"""

from __future__ import annotations

import gzip
import io
import os
import sys
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from gpuwarden.boundedio import InputRefused, open_stream
from gpuwarden.errors import InputUnreadableError
from gpuwarden.explain.diagnosis import NONE_CODE, Diagnosis, Finding
from gpuwarden.explain.engine import BLOCK_BYTES, EvidenceLine, Explainer, rank_of
from gpuwarden.explain.knowledge import KnowledgeBase, load_knowledge

__all__ = [
    "NONE_CODE", "Diagnosis", "EvidenceLine", "Explainer", "Finding", "KnowledgeBase",
    "explain_file", "explain_lines", "explain_stream", "explain_text", "load_knowledge",
    "rank_of",
]

# How much of the start of an input is checked for binary data: a NUL byte there
# means a core dump, a checkpoint or an archive, not a log (git and grep decide alike).
_SNIFF_BYTES = 8192


def explain_text(text: str, kb: KnowledgeBase | None = None) -> Diagnosis:
    """Diagnose a log held in memory."""
    ex = Explainer(kb or load_knowledge())
    ex.feed_bytes(text.encode("utf-8", "replace"))
    return ex.result()


def explain_lines(lines: Iterable[str], kb: KnowledgeBase | None = None,
                  source: str = "<lines>") -> Diagnosis:
    """Diagnose a log given as an iterable of lines (consumed once, in bounded memory)."""
    ex = Explainer(kb or load_knowledge(), source)
    ex.feed_lines(lines)
    return ex.result()


def explain_stream(stream: BinaryIO, kb: KnowledgeBase | None = None,
                   source: str = "<stream>") -> Diagnosis:
    """Diagnose a binary stream of log text, read block by block.

    Raises :class:`~gpuwarden.errors.InputUnreadableError` when the start of the
    stream holds a NUL byte (binary data, not a log).
    """
    ex = Explainer(kb or load_knowledge(), source)
    # read1: what one read of the source gives. read() would go on reading until the block is
    # full, and a terminal then needed Ctrl-D twice (its first end of input only ends a read).
    read = getattr(stream, "read1", stream.read)
    sniffed = 0
    while True:
        try:
            data = read(BLOCK_BYTES)
        # a truncated gzip (EOFError), a corrupt one (zlib.error, not an OSError),
        # an I/O error mid-way
        except (OSError, EOFError, zlib.error) as exc:
            raise InputUnreadableError(f"{source}: reading failed ({exc})",
                                       fix="give a complete, readable log") from exc
        if not data:
            break
        if sniffed < _SNIFF_BYTES and b"\x00" in data[:_SNIFF_BYTES - sniffed]:
            raise InputUnreadableError(
                f"{source} is binary data, not a log",
                why="its first bytes hold NUL characters",
                fix="give the text log (stdout/stderr of the job), not a core dump or a checkpoint",
            )
        sniffed += len(data)
        ex.feed_bytes(data)
    return ex.result()


def explain_file(path: str | os.PathLike[str], kb: KnowledgeBase | None = None) -> Diagnosis:
    """Diagnose a log file (``"-"``: stdin); a gzip-compressed file is read as such.

    Raises :class:`~gpuwarden.errors.InputUnreadableError` for a missing file, a
    directory, a file without read permission, or binary data.
    """
    if str(path) == "-":
        return _explain_binary(sys.stdin.buffer, kb, "<stdin>")
    p = Path(path)
    try:
        # Regular files and FIFOs (`explain <(cmd)`); a FIFO nobody writes, a device or a
        # directory is refused at once rather than hanging or reading forever.
        raw = open_stream(p)
    except InputRefused as exc:
        fix = "name a log file inside it" if p.is_dir() else exc.fix
        raise InputUnreadableError(f"{p} {exc.problem}", fix=fix) from exc
    except FileNotFoundError as exc:
        raise InputUnreadableError(f"{p}: no such file", fix="check the path") from exc
    except OSError as exc:
        raise InputUnreadableError(f"{p}: cannot be opened ({exc.strerror or exc})",
                                   fix="check the path and its permissions") from exc
    with raw:
        return _explain_binary(raw, kb, str(p))


def _explain_binary(raw: BinaryIO, kb: KnowledgeBase | None, source: str) -> Diagnosis:
    """Diagnose *raw* (an opened file, a pipe, stdin), un-gzipping it when it is gzip.

    The gzip magic is looked at with ``peek`` rather than read-then-seek, so a
    pipe or FIFO (``explain <(cat x.log)``, ``explain - < x.log.gz``) works too.
    """
    buffered = (raw if isinstance(raw, io.BufferedReader)
                else io.BufferedReader(raw))  # type: ignore[type-var]
    try:
        magic = buffered.peek(2)[:2]
    except OSError as exc:
        raise InputUnreadableError(f"{source}: reading failed ({exc})",
                                   fix="give a complete, readable log") from exc
    if magic != b"\x1f\x8b":
        return explain_stream(buffered, kb, source)
    with gzip.GzipFile(fileobj=buffered) as unzipped:
        return explain_stream(unzipped, kb, source)  # type: ignore[arg-type]
