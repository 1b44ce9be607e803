"""The ``gpuwarden`` command line: parse, call the library, report.

Each subcommand lives in its own module of this package with two functions,
``add_parser(subparsers)`` and ``run(args) -> int``; their top-level imports stay
cheap (no torch, no rich) so that every command starts fast. Data goes to
stdout, diagnostics to stderr. Exit codes: 0 ok, 1 failure, 2 usage or bad
input, 3 no GPU/NVML where one is required, 4 constraint not met.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpuwarden import __version__
from gpuwarden.errors import EXIT_FAILURE, EXIT_USAGE, GpuwardenError

if TYPE_CHECKING:
    from gpuwarden.inventory import Inventory

# Subcommand modules, in the order `gpuwarden --help` lists them.
COMMANDS = ("ls", "select", "launch", "status", "stacks", "run", "leases", "worker", "doctor",
            "explain")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuwarden",
        description="CUDA that works across processes: GPU inventory and selection through NVML, "
        "leases, a torchrun-compatible launcher, pools, and diagnoses of what went wrong.",
        epilog="GPU state comes from NVML; set GPUWARDEN_SIMULATE=<scenario.json> to use a "
        "simulated host instead. Exit codes: 0 ok, 1 failure, 2 usage or bad input, "
        "3 no GPU/NVML, 4 constraint not met. Every failure code, its cause and fix: "
        "docs/failure-codes.md in the repository, or `gpuwarden explain --codes`.",
    )
    parser.add_argument("--version", action="version", version=f"gpuwarden {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"gpuwarden.cli.{name.replace('-', '_')}")
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None, *, inventory: Inventory | None = None) -> int:
    """Run the CLI with ``argv`` (default: sys.argv[1:]) and return the exit code.

    ``inventory``: the GPUs every command reads (default: NVML, or the host GPUWARDEN_SIMULATE
    names), so a test or a program embedding the CLI can hand it a host.
    """
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["launch"]:  # several nodes: the node agent's torch import starts first
        from gpuwarden.launch import node_agent

        node_agent.start_early(words)
    try:
        return _main(argv, inventory)
    finally:
        if words[:1] == ["launch"]:
            node_agent.discard_early()


def _main(argv: Sequence[str] | None, inventory: Inventory | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help/--version exit 0, bad usage exits 2
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    args.inventory = inventory
    if not getattr(args, "run", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.run(args))
    except GpuwardenError as exc:
        exc.emit(sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except MemoryError:
        # gpuwarden's own process hit its memory limit (ulimit -v, a cgroup's memory.max):
        # a report, not a traceback. What it started was stopped on the way out (launch's
        # supervisor stops its ranks in a finally block).
        return _out_of_memory(args)


def _out_of_memory(args: argparse.Namespace) -> int:
    import gc

    gc.collect()  # what the failed work held is garbage now: room to say what happened
    command = " ".join(x for x in ("gpuwarden", getattr(args, "command", None)) if x)
    error = GpuwardenError(
        f"{command} ran out of memory in its own process (pid {os.getpid()})",
        why="an allocation failed (MemoryError): the process's memory limit (ulimit -v, the "
        "cgroup's memory.max, a job scheduler's limit) is lower than it needs",
        fix="raise the memory limit of the process that runs gpuwarden; for launch, the ranks "
        "have limits of their own",
        code="OUT_OF_MEMORY")
    try:
        error.emit(sys.stderr)
    except MemoryError:
        os.write(2, b"error[OUT_OF_MEMORY]: gpuwarden ran out of memory in its own process\n")
    return EXIT_FAILURE


def inventory_of(args: argparse.Namespace) -> Inventory:
    """The inventory ``main`` was given, else the default one (NVML or GPUWARDEN_SIMULATE)."""
    from gpuwarden.inventory import Inventory

    given = getattr(args, "inventory", None)
    return given if given is not None else Inventory.from_env()


def console_main() -> None:
    sys.exit(main())
