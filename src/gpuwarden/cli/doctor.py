"""``gpuwarden doctor``: check driver, GPUs, shared memory, limits and the rendezvous."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from gpuwarden.cli._args import add_simulate_arg
from gpuwarden.cli._output import emit_json
from gpuwarden.errors import UsageError


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-65535)")
    return int(text)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of 1 or more")
    return int(text)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="check driver, GPUs, compute modes, /dev/shm, limits, MASTER_ADDR/PORT, interfaces",
        description="Check this host for the causes of CUDA, DataLoader and rendezvous failures "
        "before a job runs, and print a report to paste into a bug report. GPU state comes from "
        "NVML (never a CUDA context in this process); torch's view from a subprocess; network "
        "probes are bounded to 3 s each. Exit 0 when no check failed (warnings included), "
        "1 when one failed, 2 for bad arguments.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
    p.add_argument("--nproc", type=_positive, metavar="N",
                   help="check that N ranks each get a GPU no other job uses, as `launch -n N` "
                   "requires")
    p.add_argument("--master-addr", metavar="HOST",
                   help="rendezvous host to check (default: $MASTER_ADDR)")
    p.add_argument("--master-port", type=_port, metavar="PORT",
                   help="rendezvous port: free here if HOST is this host, else reachable "
                   "(default: $MASTER_PORT)")
    p.add_argument("--nnodes", type=_positive, default=1, metavar="N",
                   help="number of nodes of the job; >1 makes loopback names failures (default 1)")
    add_simulate_arg(p)
    p.set_defaults(run=run)


_MARK = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def render(report: Any, stream: TextIO) -> None:
    """Plain text meant for pasting into an issue (colours on a terminal): every check, its
    evidence, why and fix for those that warn or fail."""
    from gpuwarden.findings import emit

    ctx = report.context
    stream.write(f"gpuwarden doctor {ctx['gpuwarden']} on {ctx['hostname']}: Python "
                 f"{ctx['python']}, {ctx['platform']}, torch {ctx['torch'] or 'not installed'}, "
                 f"GPUs from {ctx['gpu_source'] or 'nowhere (no NVML)'}\n\n")
    width = max(len(c.id) for c in report.checks)
    for c in report.checks:
        emit(c, stream, head=f"[{_MARK[c.status.value]:>4}] {c.id:<{width}}  {c.what}  ({c.code})",
             indent=" " * (width + 9), bullets=True)
    stream.flush()
    counts = report.counts()
    stream.write(f"\n{counts['fail']} failed, {counts['warn']} warnings, {counts['ok']} ok, "
                 f"{counts['skip']} skipped in {report.elapsed_s:.2f} s\n")


@contextlib.contextmanager
def _checking(stream: TextIO) -> Iterator[None]:
    """A transient 'checking ...' line while the probes run, on a terminal only."""
    from gpuwarden.cli._output import is_terminal

    if not is_terminal(stream):
        yield
        return
    from rich.console import Console

    with Console(file=stream).status("gpuwarden doctor: checking the driver, GPUs, torch, "
                                     "/dev/shm, limits and the rendezvous ..."):
        yield


def run(args: argparse.Namespace) -> int:
    from gpuwarden.doctor import Options, run_doctor

    if (args.master_port is not None) and not args.master_addr and args.nnodes > 1:
        raise UsageError("--master-port without --master-addr in a multi-node check",
                         fix="give --master-addr (rank 0's host) too")
    from gpuwarden.cli import inventory_of
    from gpuwarden.doctor.probes import Probes

    inventory = inventory_of(args)
    bad_input: list[UsageError] = []

    def read_host(_env: Any) -> Any:
        try:
            return inventory.read_host()
        except UsageError as exc:  # a broken scenario file is bad input, not "no driver"
            bad_input.append(exc)
            raise

    options = Options(nproc=args.nproc, master_addr=args.master_addr,
                      master_port=args.master_port, nnodes=args.nnodes)
    with _checking(sys.stderr):  # network probes take up to 3 s: never silent on a terminal
        report = run_doctor(options, Probes(read_host=read_host))
    if bad_input:  # as `gpuwarden ls` does: one line, exit 2
        raise bad_input[0]
    if args.json:
        emit_json(report.to_dict())
    else:
        render(report, sys.stdout)
    return report.exit_code
