"""``gpuwarden select``: pick N GPUs and say why each GPU was taken or refused."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from gpuwarden.cli._args import add_simulate_arg, count_or_all, min_free_bytes
from gpuwarden.cli._output import emit_json, is_terminal, note
from gpuwarden.errors import EXIT_CONSTRAINT, UsageError

if TYPE_CHECKING:  # the CLI imports select.py lazily, inside the command
    from gpuwarden.select import Constraints


def add_constraint_args(p: argparse.ArgumentParser, *, count_flags: tuple[str, ...] = ("-n", "--count")
                        ) -> None:
    """The selection flags shared by select and run (launch takes only --min-free: its GPU count
    is its rank count)."""
    if count_flags:
        p.add_argument(*count_flags, dest="count", type=count_or_all(count_flags[0]), default=1,
                       metavar="N|all", help="how many GPUs (default 1); all: every usable GPU")
    p.add_argument("--min-free", metavar="SIZE", default="0",
                   help="minimum free memory per GPU, e.g. 20GiB, 512MiB, or bytes")
    p.add_argument("--max-util", metavar="PCT", type=int, default=None,
                   help="maximum GPU utilization in percent")
    p.add_argument("--allow-shared", action="store_true",
                   help="accept GPUs that already run other processes (default compute mode only)")
    p.add_argument("--include", metavar="IDS", default="",
                   help="only consider these GPUs (comma-separated indices or UUIDs)")
    p.add_argument("--exclude", metavar="IDS", default="",
                   help="never pick these GPUs (comma-separated indices or UUIDs)")


def constraints_from_args(args: argparse.Namespace) -> Constraints:
    """The Constraints the flags describe; ``count`` is 1 for ``-n all`` (see wants_all)."""
    from gpuwarden.select import Constraints, parse_gpu_ids
    count = getattr(args, "count", 1)
    if count == "all":
        count = 1
    if count is None or count < 1:
        raise UsageError(f"-n {count}: the number of GPUs must be at least 1", fix="give -n 1 or more")
    if args.max_util is not None and not 0 <= args.max_util <= 100:
        raise UsageError(f"--max-util {args.max_util} is not a percentage", fix="give 0..100")
    return Constraints(
        count=count,
        min_free_bytes=min_free_bytes(args.min_free),
        max_util_pct=args.max_util,
        allow_shared=args.allow_shared,
        include=parse_gpu_ids(args.include, what="--include"),
        exclude=parse_gpu_ids(args.exclude, what="--exclude"),
    )


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "select",
        help="pick N GPUs by free memory, utilization, compute mode and foreign processes",
        description="Pick N GPUs and print their ids (for CUDA_VISIBLE_DEVICES, with "
        "CUDA_DEVICE_ORDER=PCI_BUS_ID). The reason for every GPU goes to stderr. "
        "Exit 0 when N were found, 4 when not, 3 when no GPU can be read, 2 for bad input.",
    )
    add_constraint_args(p)
    add_simulate_arg(p)
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
    out.add_argument("--format", choices=("ids", "env", "csv"), default="ids",
                     help="ids: 1,3 (default); env: CUDA_VISIBLE_DEVICES=1,3; csv: a row per GPU")
    p.add_argument("-v", "--verbose", action="store_true", help="print every GPU's verdict on success too")
    p.set_defaults(run=run)


def wants_all(args: argparse.Namespace) -> bool:
    """``-n all`` / ``--gpus all``: every usable GPU (at least one)."""
    return getattr(args, "count", 1) == "all"


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from gpuwarden.cli import inventory_of
    from gpuwarden.select import check_include, select

    constraints = constraints_from_args(args)
    _host, vis = inventory_of(args).visibility()
    gpus = vis.gpus
    for line in vis.notes:  # e.g. CUDA stopped at an invalid entry: fewer GPUs than listed
        note(f"gpuwarden: note: {line}")
    check_include(gpus, constraints)
    if wants_all(args):
        usable = len(select(gpus, replace(constraints, count=0)).acceptable)
        constraints = replace(constraints, count=max(1, usable))
    selection = select(gpus, constraints)
    if args.json:
        emit_json({
            "selected": [v.to_dict() for v in selection.verdicts if v.gpu in selection.selected],
            "rejected": [v.to_dict() for v in selection.rejected],
            "unselected": [v.to_dict() for v in selection.verdicts
                           if v.accepted and v.gpu not in selection.selected],
            "satisfied": selection.satisfied,
            "notes": list(vis.notes),
        })
    if not selection.satisfied:
        note(selection.error().render())
        return EXIT_CONSTRAINT
    if not args.json:
        ids = ",".join(g.cuda_id for g in selection.selected)
        if args.format == "env":
            print(f"CUDA_VISIBLE_DEVICES={ids}")
        elif args.format == "csv":
            print("index,uuid,name,memory_free_bytes,utilization_gpu_pct")
            for g in selection.selected:
                util = "" if g.utilization_gpu_pct is None else g.utilization_gpu_pct
                print(f"{g.index},{g.uuid},{g.name},{g.memory_free_bytes},{util}")
        else:
            print(ids)
    if args.verbose or is_terminal(sys.stderr):
        note("\n".join(v.line() for v in selection.verdicts))
    return 0

