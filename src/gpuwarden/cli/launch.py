"""``gpuwarden launch``: run a torchrun-style script on N ranks, one GPU each (or CPU)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gpuwarden.errors import UsageError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "launch",
        help="run a script on N ranks like torchrun: one GPU per rank, fail fast, one report",
        description="Run SCRIPT (or -m MODULE) on N ranks with torchrun's environment (RANK, "
        "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...). Each rank gets its own GPU as "
        "cuda:0 (CUDA_VISIBLE_DEVICES + CUDA_DEVICE_ORDER=PCI_BUS_ID; set_device(LOCAL_RANK) is "
        "mapped to it); with no GPU, or --cpu, ranks run on CPU (gloo). The first rank to fail "
        "stops the others (SIGTERM, SIGKILL after --grace) and one report names it, its cause "
        "and its failure code; ranks stuck in init_process_group or a collective while others "
        "are missing or elsewhere are reported with their stacks after --stall-timeout. Exit code: the "
        "failing rank's (128+N for signal N); 1 for a stall; 2 usage; 3 no GPU; 4 too few GPUs. "
        "Multi-node: run it once per node with --nnodes N --node-rank R --master-addr HOST "
        "--master-port P (torchrun's static rendezvous: ranks numbered node by node, rank 0 hosts "
        "the c10d TCPStore), or inside a Slurm allocation as `srun --ntasks-per-node=1 gpuwarden "
        "launch SCRIPT` with no flags; every node runs a bounded preflight of the rendezvous "
        "first, a node whose rank fails stops every node, and node 0 names missing ranks.",
    )
    p.add_argument("-n", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=None,
                   metavar="N", help="number of ranks (default: --gpus, else 1)")
    p.add_argument("--gpus", default=None, metavar="N|all",
                   help="run on N GPUs, one rank each, or on every usable GPU")
    p.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even if GPUs are present")
    p.add_argument("--share", action="store_true",
                   help="allow more ranks than GPUs, round-robin; NCCL refuses two ranks on one "
                   "GPU, so gpuwarden.distributed.init() picks gloo for ranks that share one")
    p.add_argument("--bind", choices=("rank", "all"), default="rank",
                   help="rank: each rank sees only its GPU, as cuda:0 (default); all: every rank "
                   "sees the job's GPUs in rank order, as torchrun does")
    p.add_argument("--min-free", metavar="SIZE", default="0", help="minimum free memory per GPU")
    p.add_argument("--wait", metavar="DURATION", default=None,
                   help="wait up to DURATION for enough usable GPUs (e.g. 10m)")
    p.add_argument("--stall-timeout", metavar="DURATION", default="5m",
                   help="report ranks waiting this long in init_process_group or a collective "
                   "while others are missing or elsewhere (default 5m; rank 0 alone preparing data while the others wait at a barrier is legitimate, so the default is not seconds)")
    p.add_argument("--keep-waiting", action="store_true",
                   help="after a stall report, keep the job running instead of stopping it")
    p.add_argument("--grace", metavar="DURATION", default="5s",
                   help="time between SIGTERM and SIGKILL when stopping ranks (default 5s)")
    p.add_argument("--master-port", "--master_port", type=int, default=None, metavar="PORT",
                   help="rendezvous port (default: a free one; with --nnodes required, the same "
                   "on every node); a busy one fails at once")
    p.add_argument("--master-addr", "--master_addr", default=None, metavar="HOST",
                   help="node 0's address, the same on every node (--nnodes > 1; default "
                   "127.0.0.1 on one node)")
    p.add_argument("--nnodes", default=None, metavar="N",
                   help="nodes in the job, each running gpuwarden launch (default 1, or Slurm's "
                   "SLURM_NNODES inside an srun step); torchrun's N:N form is accepted")
    p.add_argument("--node-rank", "--node_rank", type=int, default=None, metavar="R",
                   help="this node's index, 0..N-1; node 0 runs rank 0 and hosts the store "
                   "(default 0, or SLURM_NODEID)")
    p.add_argument("--rdzv-timeout", "--rdzv_timeout", default="5m", metavar="DURATION",
                   help="nodes > 0: how long to wait for MASTER_ADDR:MASTER_PORT to accept "
                   "connections before any rank starts (default 5m)")
    p.add_argument("--log-dir", "--log_dir", default=None, metavar="DIR",
                   help="also write each rank's output to DIR/rank<N>.log")
    p.add_argument("--quiet", action="store_true", help="show only rank 0's output on the terminal")
    p.add_argument("--json", action="store_true",
                   help="print the final report as JSON on stdout (schema_version 1)")
    p.add_argument("-m", "--module", action="store_true",
                   help="SCRIPT is a module name, run as python -m MODULE")
    # torchrun flag accepted for drop-in use: one node, nothing to rendezvous with.
    p.add_argument("--standalone", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("script", metavar="SCRIPT", help="the script (or module with -m) to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="arguments for the script")
    p.set_defaults(run=run)


def config_from_args(args: argparse.Namespace) -> Any:
    import os

    from gpuwarden.launch.config import DEFAULT_MASTER_ADDR, LaunchConfig
    from gpuwarden.units import parse_duration, parse_size

    nnodes = _nnodes(args.nnodes) if args.nnodes is not None else None
    node_rank, master_addr, master_port = args.node_rank, args.master_addr, args.master_port
    nproc, source = args.nproc, "flags"
    if nnodes is None and not args.standalone:
        from gpuwarden.launch.slurm import slurm_settings

        slurm = slurm_settings(os.environ)
        if slurm is not None:
            nnodes, source = slurm.nnodes, "slurm"
            node_rank = slurm.node_rank if node_rank is None else node_rank
            if slurm.nnodes > 1:
                # One node needs no shared port: it picks a free one, so two launches in one
                # allocation never collide (and a busy derived port is no user error).
                master_addr = master_addr or slurm.master_addr
                master_port = master_port or slurm.master_port
            if nproc is None and args.gpus is None and not args.cpu:
                nproc = slurm.nproc
    gpus: int | str | None = args.gpus
    if isinstance(gpus, str) and gpus != "all":
        if not gpus.isdigit():
            raise UsageError(f"--gpus {gpus!r} is neither a number nor 'all'", fix="--gpus 2 or --gpus all")
        gpus = int(gpus)
    return LaunchConfig(
        target=args.script,
        args=tuple(args.script_args),
        module=args.module,
        nproc=nproc,
        gpus=gpus,
        cpu=args.cpu,
        share=args.share,
        bind=args.bind,
        min_free_bytes=parse_size(args.min_free, what="--min-free"),
        wait_s=parse_duration(args.wait, what="--wait") if args.wait else None,
        stall_timeout_s=parse_duration(args.stall_timeout, what="--stall-timeout"),
        keep_waiting=args.keep_waiting,
        grace_s=parse_duration(args.grace, what="--grace"),
        master_port=master_port,
        master_addr=master_addr or DEFAULT_MASTER_ADDR,
        nnodes=1 if nnodes is None else nnodes,
        node_rank=node_rank or 0,
        rdzv_timeout_s=parse_duration(args.rdzv_timeout, what="--rdzv-timeout"),
        source=source,
        log_dir=args.log_dir,
        quiet=args.quiet,
    )


def _nnodes(text: str) -> int:
    """``N`` or torchrun's ``MIN:MAX`` with MIN == MAX (static membership only)."""
    lo, _, hi = str(text).partition(":")
    hi = hi or lo
    if not (lo.isdigit() and hi.isdigit()):
        raise UsageError(f"--nnodes {text!r} is not a number", fix="--nnodes 2")
    if lo != hi:
        raise UsageError(f"--nnodes {text}: elastic membership (MIN:MAX) is not supported",
                         why="ranks are numbered node by node from a fixed node count, as "
                         "torchrun's static rendezvous does", fix=f"--nnodes {hi}")
    return int(lo)


def run(args: argparse.Namespace) -> int:
    from gpuwarden.launch.runner import launch

    config = config_from_args(args)
    report, _outcome = launch(config)
    if not report.ok or not args.quiet:
        from gpuwarden.findings import emit

        emit(report.finding, sys.stderr)
    if args.json:
        from gpuwarden.cli._output import emit_json

        emit_json({"report": report.to_dict()})
    return report.exit_code
