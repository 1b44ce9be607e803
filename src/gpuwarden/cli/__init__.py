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
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NoReturn

from gpuwarden import __version__
from gpuwarden.errors import EXIT_FAILURE, EXIT_USAGE, GpuwardenError

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for `yes | head`

if TYPE_CHECKING:
    from gpuwarden.inventory import Inventory

# Subcommand modules, in the order `gpuwarden --help` lists them.
COMMANDS = ("ls", "select", "launch", "status", "stacks", "run", "leases", "worker", "doctor",
            "explain")


class CliParser(argparse.ArgumentParser):
    """argparse with gpuwarden's error form: one ``error[USAGE]`` line naming the subcommand,
    the nearest flag for an unknown one, and where to look (never the whole usage text)."""

    # Flags of other launchers and tools that users carry over: what gpuwarden calls them.
    known_aliases: Mapping[str, str] = {}

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extra = super().parse_known_args(args, namespace)
        if extra:  # each subcommand names its own unknown flags (the top level cannot)
            flag = next((a for a in extra if a.startswith("-")), None)
            if flag is None:
                self.error(f"unexpected argument {extra[0]!r}")
            near = nearest_option(flag.split("=", 1)[0], self._option_string_actions,
                                  self.known_aliases)
            self.error(f"unrecognized argument {flag}" + (f"; did you mean {near}?" if near else ""))
        return parsed, extra

    def error(self, message: str) -> NoReturn:
        from gpuwarden.errors import UsageError

        lead = "the following arguments are required: "
        if message.startswith(lead):
            # argparse lists a REMAINDER positional (launch's ARGS) as required: it is not
            optional = {a.metavar or a.dest for a in self._actions
                        if not a.option_strings and a.nargs in (argparse.REMAINDER, "*", "?")}
            names = [n for n in message[len(lead):].split(", ") if n not in optional]
            message = lead + ", ".join(names)
        raise UsageError(f"{self.prog}: {message}", fix=f"`{self.prog} --help` lists every option")


def nearest_option(flag: str, options: Iterable[str], aliases: Mapping[str, str] | None = None
                   ) -> str | None:
    """The option a mistyped ``flag`` most likely meant: a known alias, else the option sharing
    the longest start with it (--nprocs: --nproc-per-node, not --nnodes), else the closest."""
    if aliases and flag in aliases:
        return aliases[flag]

    def norm(text: str) -> str:
        return text.lstrip("-").replace("_", "-").lower()

    longs = sorted(o for o in options if o.startswith("--"))
    typed = norm(flag)
    if not typed:
        return None
    best, best_len = None, 0
    for option in longs:
        shared = len(_common_prefix(typed, norm(option)))
        if shared > best_len:
            best, best_len = option, shared
    if best is not None and best_len >= min(4, len(typed), len(norm(best))):
        return best
    import difflib  # only for a mistyped flag

    close = difflib.get_close_matches(typed, [norm(o) for o in longs], n=1, cutoff=0.6)
    return next((o for o in longs if close and norm(o) == close[0]), None)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``gpuwarden`` parser; ``only``: a command line that names this subcommand needs no
    other, and their modules are not imported (``gpuwarden launch`` starts faster)."""
    parser = CliParser(
        prog="gpuwarden",
        description="CUDA that works across processes: GPU inventory and selection through NVML, "
        "leases, a torchrun-compatible launcher, pools, and diagnoses of what went wrong.",
        epilog="GPU state comes from NVML; set GPUWARDEN_SIMULATE=<scenario name or file> "
        "(or give ls, select, run and doctor --simulate) to use a simulated host instead: "
        "two-idle, example, mig, sick ... ship with gpuwarden (docs/scenarios.md). Exit codes: 0 ok, 1 failure, 2 usage or bad input, "
        "3 no GPU/NVML, 4 constraint not met. Every failure code, its cause and fix: "
        "docs/failure-codes.md in the repository, or `gpuwarden explain --codes`.",
    )
    parser.add_argument("--version", action="version", version=f"gpuwarden {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS if only is None else (only,):
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
        from gpuwarden.launch.multinode import early

        early.start_early(words)
    try:
        return _main(argv, inventory)
    finally:
        if words[:1] == ["launch"]:
            early.discard_early()


def _main(argv: Sequence[str] | None, inventory: Inventory | None) -> int:
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(words[0] if words and words[0] in COMMANDS else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help/--version exit 0
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except GpuwardenError as exc:  # CliParser.error: one line with the fix
        exc.emit(sys.stderr)
        return exc.exit_code
    args.inventory = inventory
    if not getattr(args, "run", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.run(args))
    except GpuwardenError as exc:
        exc.emit(sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # commands that wait say what they were doing; this is the rest
        print("gpuwarden: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`gpuwarden ls --watch 1 | head -3`): a quiet end, with the exit
        # status of a process SIGPIPE stopped, as `yes | head` gives.
        return EXIT_BROKEN_PIPE
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
    """The inventory ``main`` was given, else ``--simulate``'s scenario, else the default one
    (NVML or GPUWARDEN_SIMULATE)."""
    from gpuwarden.inventory import Inventory

    given = getattr(args, "inventory", None)
    if given is not None:
        return given
    simulate = getattr(args, "simulate", None)
    if simulate:
        from gpuwarden.inventory.simulated import SimulatedBackend

        return Inventory(SimulatedBackend(simulate))
    return Inventory.from_env()



def console_main() -> None:
    code = main()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = EXIT_BROKEN_PIPE
    if code == EXIT_BROKEN_PIPE:
        # Python flushes stdout once more at exit, and would print a BrokenPipeError then.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(code)
