"""Parsing and printing of sizes and durations given by users, and of rank sets.

Sizes: ``K/M/G/T`` and ``KiB/MiB/GiB/TiB`` are binary (as nvidia-smi counts
memory), ``KB/MB/GB/TB`` decimal, a bare number is bytes.
Durations: ``500ms``, ``30s``, ``10m``, ``1h``, ``1h30m``, a bare number is seconds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from gpuwarden.errors import UsageError

MIB = 1024**2
GIB = 1024**3

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_PART_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(text: str, *, what: str = "size") -> int:
    """``'20GiB'`` → 21474836480. Raises :class:`UsageError` naming the value and the fix."""
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise UsageError(
            f"{what} {text!r} is not a size",
            fix="write it like 20GiB, 20G, 512MiB or a plain number of bytes",
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_duration(text: str | float | int, *, what: str = "duration") -> float:
    """``'10m'`` → 600.0 seconds; ``'1h30m'`` → 5400.0; ``'2.5'`` → 2.5."""
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        raw = text.strip().lower()
        try:
            seconds = float(raw)
        except ValueError:
            pos = 0
            seconds = 0.0
            for match in _DURATION_PART_RE.finditer(raw):
                if match.start() != pos:
                    break
                seconds += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
                pos = match.end()
            if pos != len(raw) or not raw:
                raise UsageError(
                    f"{what} {text!r} is not a duration",
                    fix="write it like 30s, 10m, 1h30m, 500ms or a plain number of seconds",
                ) from None
    if math.isnan(seconds):  # float() accepts "nan"; it would poison every deadline
        raise UsageError(f"{what} {text!r} is not a duration",
                         fix="write it like 30s, 10m, 1h30m, 500ms or a plain number of seconds")
    if seconds < 0:
        raise UsageError(f"{what} {text!r} is negative", fix="give a duration of 0 or more")
    return seconds


def format_bytes(n: int | None) -> str:
    """Human-readable binary size: 71200 MiB → '69.5 GiB'."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit in ("B", "KiB", "MiB") else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    """Short duration for status lines: 42s, 3m, 2h05m."""
    if seconds < 9.95:
        return f"{seconds:.1f}s"
    seconds = round(seconds)  # first, else 599.7 s would print as 9m60s
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{(seconds % 3600) // 60:02.0f}m"


def rank_runs(ranks: Iterable[int]) -> list[str]:
    """Consecutive ranks as ranges, in order: [0, 1, 2, 3, 5, 7] -> ['0-3', '5', '7'] (what
    ``gpuwarden stacks`` and the console's collapsed lines write, joined their own way)."""
    out: list[str] = []
    start = prev = None
    for r in sorted(set(ranks)):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return out
