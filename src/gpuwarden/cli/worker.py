"""``gpuwarden worker``: lease this host's GPUs and serve them to a Dask scheduler."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

from gpuwarden.cli._args import bounded_int, min_free_bytes
from gpuwarden.cli._output import note
from gpuwarden.errors import EXIT_OK, UsageError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "worker",
        help="lease GPUs and start Dask workers on them for a Dask scheduler (multi-host pools)",
        description="Lease GPUs on this host (the same leases as `gpuwarden run`, launch and "
        "the pool), then start K Dask workers per GPU (distributed's Nanny and Worker), each "
        "with its own CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER=PCI_BUS_ID, a name that says "
        "host and GPU (box-a/GPU1/0) and a GPU=1 resource. A worker that dies fails its task "
        "with the host, GPU and signal. Stops the workers and releases the GPUs on SIGTERM, "
        "SIGINT or SIGHUP, and when the scheduler closes or goes away (client.shutdown(), "
        "scheduler stopped or lost): exit 0, as dask worker. Exit 1 when the scheduler does "
        "not answer within --connect-timeout or already has workers of these names, 3 without "
        "a GPU, 4 when the GPUs cannot be leased (in time), 2 for bad arguments. Needs the "
        "dask extra (pip install 'gpuwarden[dask]').",
    )
    p.add_argument("scheduler", metavar="SCHEDULER_ADDRESS",
                   help="the Dask scheduler, e.g. tcp://10.0.0.4:8786")
    p.add_argument("--gpus", default="all", metavar="N|all",
                   help="how many GPUs to lease (default all: every usable GPU)")
    p.add_argument("--workers-per-gpu", type=bounded_int("--workers-per-gpu", 1), default=1,
                   metavar="K",
                   help="Dask workers per GPU (default 1); each GPU is leased whole")
    p.add_argument("--min-free", default=None, metavar="SIZE", type=_min_free,
                   help="minimum free memory per GPU, e.g. 20GiB")
    p.add_argument("--allow-shared", action="store_true",
                   help="accept GPUs that already run other processes (default compute mode)")
    p.add_argument("--memory-fraction", type=float, default=None, metavar="F",
                   help="cap PyTorch's allocator in each worker at F of its GPU "
                   "(torch.cuda.set_per_process_memory_fraction), e.g. 0.45 with K=2")
    p.add_argument("--mem-per-worker", default=None, metavar="SIZE",
                   help="lease K x SIZE of each GPU (a memory lease, shared with other leases "
                   "of the host by memory) instead of the whole GPU, e.g. 6GiB")
    p.add_argument("--wait", default=None, metavar="DURATION",
                   help="wait in line this long for the GPUs, e.g. 10m, inf (default: exit 4 "
                   "when they are not free)")
    p.add_argument("--nthreads", type=bounded_int("--nthreads", 1), default=1, metavar="T",
                   help="threads per worker (default 1: one task at a time per worker)")
    p.add_argument("--host", default=None, metavar="ADDRESS",
                   help="address the workers listen on (default: the one that routes to the "
                   "scheduler)")
    p.add_argument("--name", default=None, metavar="PREFIX",
                   help="the workers' name prefix instead of this host's name "
                   "(PREFIX/GPU0/0, ...): for two hosts or containers of one host name")
    p.add_argument("--connect-timeout", default="30s", metavar="DURATION",
                   help="how long to wait for the scheduler to answer (default 30s, as "
                   "dask worker's --death-timeout)")
    p.add_argument("--cpu", action="store_true",
                   help="no GPU, no lease: N x K CPU workers (N from --gpus, 1 for all), to test a set-up")
    p.add_argument("-v", "--verbose", action="store_true", help="Dask's own INFO logs")
    p.set_defaults(run=run)


def _min_free(text: str) -> str:
    min_free_bytes(text)  # checked here, in the flag's own words; the library parses it again
    return text


def _gpus(text: str) -> int | str:
    if text == "all":
        return "all"
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--gpus {text!r}: expected a count or 'all'", fix="--gpus 2") from None


# Variables `gpuwarden worker` sets in its own process for the processes it starts; given back
# when it returns, so that main(["worker", ...]) embedded in a program (or a test) leaves the
# program's environment as it was (the suite found CUDA_VISIBLE_DEVICES='' left behind).
_OWN_ENV = ("CUDA_VISIBLE_DEVICES", "DASK_LOGGING__DISTRIBUTED")


def run(args: argparse.Namespace) -> int:
    saved = {key: os.environ.get(key) for key in _OWN_ENV}
    try:
        return _run(args)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run(args: argparse.Namespace) -> int:
    try:
        import distributed  # noqa: F401
    except ImportError as exc:
        raise UsageError("gpuwarden worker needs Dask distributed, which is not installed",
                         why=str(exc), fix="pip install 'gpuwarden[dask]'") from exc
    from gpuwarden.dask.workers import (
        GPUWorkers,
        WorkerOptions,
        describe,
        hide_gpus_from_children,
        lease_for_workers,
        serve,
    )
    from gpuwarden.lease import StatusPrinter

    options = WorkerOptions(
        args.scheduler, _gpus(args.gpus), args.workers_per_gpu,  # type: ignore[arg-type]
        min_free=args.min_free, memory_fraction=args.memory_fraction, wait=args.wait,
        mem_per_worker=args.mem_per_worker,
        cpu=args.cpu, nthreads=args.nthreads, listen_host=args.host,
        allow_shared=args.allow_shared, name=args.name,
        connect_timeout_s=_duration(args.connect_timeout, "--connect-timeout"),
        dask_log_level=logging.INFO if args.verbose else logging.WARNING).check()
    quiet_dask_logs(options.dask_log_level)
    if not args.verbose:
        # The worker processes read Dask's logging config when they import distributed (the
        # nannies' silence_logs only lowers a handler, restored while a worker closes): the
        # same level there, unless the user configured Dask's logging.
        os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    printer = StatusPrinter(sys.stderr)
    with printer:
        leased = lease_for_workers(options, on_wait=printer)
    try:
        hide_gpus_from_children()
        what = f"GPU {leased.visible_devices}" if leased.gpus else "no GPU (--cpu)"
        workers = GPUWorkers(options, leased)

        def started(w: GPUWorkers) -> None:
            note(f"gpuwarden: {leased.host}: leased {what}; {len(w.nannies)} Dask worker(s) "
                 f"for {options.scheduler_address}:")
            for line in describe(w):
                note(f"  {line}")

        why = asyncio.run(_serve_until_signal(workers, serve, started, leased.release))
    finally:
        leased.release()
    released = f", {what} released" if leased.gpus else ""
    if why == "stopped":
        note(f"gpuwarden: {leased.host}: workers stopped{released}")
    else:
        # As dask worker: the scheduler's end (client.shutdown(), stopped, lost) is the end of
        # the workers' job, not a failure of this command (a Slurm step is marked COMPLETED).
        note(f"gpuwarden: {leased.host}: the scheduler at {options.scheduler_address} closed "
             f"or went away; workers stopped{released}")
    return EXIT_OK


def quiet_dask_logs(level: int) -> None:
    """Dask's INFO lines (every nanny start and close) only with -v. distributed sets its
    loggers up when imported, so import it first, then lower them."""
    import distributed  # noqa: F401

    for name in list(logging.root.manager.loggerDict):
        if name == "distributed" or name.startswith("distributed."):
            logging.getLogger(name).setLevel(level)
    logging.getLogger("gpuwarden.dask").setLevel(logging.INFO)
    from gpuwarden.dask._logs import shorten_connection_errors

    shorten_connection_errors()


def _duration(text: str, flag: str) -> float:
    from gpuwarden.units import parse_duration

    return parse_duration(text, what=flag)


def _silence_dask_logs() -> None:
    """The scheduler is gone: what Dask logs while its workers are stopped (connection errors,
    tracebacks of a worker that was still starting) says nothing the line that follows does
    not."""
    for name in list(logging.root.manager.loggerDict):
        if name == "distributed" or name.startswith("distributed."):
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)


async def _serve_until_signal(workers: Any, serve: Any, started: Any, release: Any) -> str:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    try:
        return str(await serve(workers, stop, started, on_wait=note, on_gone=_silence_dask_logs))
    finally:
        # The workers' processes are gone (serve's close kills and joins them): the GPUs go
        # back now, not after asyncio.run has waited for Dask's own tasks to wind down.
        release()
