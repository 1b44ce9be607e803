"""Argument types shared by the subcommands: each refuses a bad value with one line that names
the flag as it was typed and a fix (argparse's own message names neither the range nor the fix).

They raise :class:`~gpuwarden.errors.UsageError`, which argparse lets through unchanged (it only
rewrites TypeError, ValueError and ArgumentTypeError), so ``main`` prints it as every other
usage error: one ``error[USAGE]`` line, exit 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Literal

from gpuwarden.errors import UsageError

# The most slots a GPU is split into: what `gpuwarden leases init --slots-per-gpu` prepares at
# most (lease/admin.py), so that a request never asks for more than a prepared directory has.
MAX_SLOTS_PER_GPU = 64


# No GPU has this much memory (the largest have a few hundred GiB): a larger --min-free is a
# typo, refused as one instead of being judged against every GPU.
MAX_MIN_FREE_BYTES = 2**50  # 1 PiB


def min_free_bytes(text: str, *, flag: str = "--min-free") -> int:
    """``--min-free SIZE`` in bytes; a size no GPU could have free is a usage error."""
    from gpuwarden.units import parse_size

    value = parse_size(text, what=flag)
    if value > MAX_MIN_FREE_BYTES:
        raise UsageError(f"{flag} {text[:40]}: more memory than any GPU has (over 1 PiB)",
                         fix=f"give the free memory one GPU needs, e.g. {flag} 20GiB")
    return value


def bounded_int(flag: str, lo: int, hi: int | None = None, *, fix: str | None = None
                ) -> Callable[[str], int]:
    """An argparse ``type`` for an integer in ``lo..hi`` (``hi`` None: no upper bound)."""
    span = f"{lo} or more" if hi is None else f"between {lo} and {hi}"

    def parse(text: str) -> int:
        stripped = text.strip()
        digits = stripped.lstrip("+-")
        if not digits.isdigit() or not digits.isascii() or len(digits) > 18:
            raise UsageError(f"{flag} {text[:40]!r} is not a whole number",
                             fix=fix or f"give {flag} a number {span}")
        value = int(stripped)
        if value < lo or (hi is not None and value > hi):
            raise UsageError(f"{flag} {value}: must be {span}", fix=fix or f"give {flag} {span}")
        return value

    parse.__name__ = "int"  # argparse names the type in its own messages
    return parse


def count_or_all(flag: str) -> Callable[[str], int | Literal["all"]]:
    """An argparse ``type`` for a GPU count: a number of 1 or more, or ``all`` (every usable GPU)."""
    number = bounded_int(flag, 1, fix=f"{flag} 2, or {flag} all for every usable GPU")

    def parse(text: str) -> int | Literal["all"]:
        return "all" if text.strip().lower() == "all" else number(text)

    parse.__name__ = "count"
    return parse


def add_simulate_arg(p: argparse.ArgumentParser) -> None:
    """``--simulate SCENARIO``: this command reads a simulated host instead of NVML."""
    p.add_argument("--simulate", metavar="SCENARIO", default=None,
                   help="read a simulated host instead of NVML: a scenario shipped with "
                   "gpuwarden (two-idle, example, eight-idle, mig, busy, sick, no-gpu) or a "
                   "scenario file (docs/scenarios.md); GPUWARDEN_SIMULATE does the same for "
                   "every command")


def memory_size(flag: str, *, zero: bool = False) -> Callable[[str], int]:
    """An argparse ``type`` for an amount of one GPU's memory (``--mem 20GiB``): more than 0
    bytes (0 too with ``zero``), at most what a GPU could have."""
    from gpuwarden.units import parse_size

    def parse(text: str) -> int:
        value = parse_size(text, what=flag)
        if not (0 if zero else 1) <= value <= MAX_MIN_FREE_BYTES:
            least = "0 bytes or more" if zero else "more than 0 bytes"
            raise UsageError(f"{flag} {text[:40]}: must be {least} and at most what a GPU has",
                             fix=f"e.g. {flag} 20GiB")
        return value

    parse.__name__ = "size"
    return parse
