"""``gpuwarden launch``: torchrun's command line, with GPUs chosen and leased first and a
diagnosis when ranks fail or stall.

Every flag of ``torchrun --help`` (torch 2.13) is accepted under its torchrun spellings (dashes
and underscores), and read from ``PET_<NAME>`` when not given, as torchrun reads it; what
gpuwarden does with each is in docs/launch.md ("torchrun's flags").
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from gpuwarden.errors import UsageError

# torchrun's option destinations: each is also read from PET_<DEST> (torch.distributed.argparse_util).
TORCHRUN_DESTS = (
    "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
    "standalone", "max_restarts", "monitor_interval", "start_method", "event_log_handler", "role",
    "module", "no_python", "run_path", "log_dir", "redirects", "tee", "local_ranks_filter",
    "duplicate_stdout_filters", "duplicate_stderr_filters", "node_rank", "master_addr",
    "master_port", "local_addr", "logs_specs", "numa_binding", "signals_to_handle",
    "shutdown_timeout", "virtual_local_rank",
)
C10D_DEFAULT_PORT = 29400  # torchrun's port for --rdzv-endpoint HOST without one
RDZV_BACKENDS = ("static", "c10d")


# Flags of other launchers that users carry over (accelerate, deepspeed, mpirun, torch's
# older launch module): the flag that does the same here.
OTHER_LAUNCHERS_FLAGS = {
    "--nprocs": "--nproc-per-node", "--nproc": "--nproc-per-node", "--np": "--nproc-per-node",
    "-np": "--nproc-per-node", "--num-processes": "--nproc-per-node",
    "--num_processes": "--nproc-per-node", "--num-gpus": "--gpus", "--num_gpus": "--gpus",
    "--main-process-port": "--master-port", "--main_process_port": "--master-port",
    "--main-process-ip": "--master-addr", "--main_process_ip": "--master-addr",
    "--num-machines": "--nnodes", "--num_machines": "--nnodes",
    "--machine-rank": "--node-rank", "--machine_rank": "--node-rank",
}


def add_parser(sub: Any) -> None:
    p = _add_parser(sub)
    p.known_aliases = OTHER_LAUNCHERS_FLAGS  # type: ignore[attr-defined]  # a CliParser
    for action in p._actions:  # torchrun reads PET_<DEST> for any option not given
        if action.dest in TORCHRUN_DESTS and f"PET_{action.dest.upper()}" in os.environ:
            raw = os.environ[f"PET_{action.dest.upper()}"]
            action.default = bool(int(raw or "0")) if action.nargs == 0 else raw


def _add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "launch",
        help="a drop-in for torchrun: GPUs chosen and leased first, fail fast, one report",
        description="Run SCRIPT (or -m MODULE) on N ranks as torchrun does: the same command "
        "line, the same environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, "
        "...), the same GPU visibility: every rank sees the job's GPUs in rank order, so "
        "cuda:LOCAL_RANK is its own (gpuwarden chooses and leases them first; --bind rank "
        "shows each rank only its own, as cuda:0). With no GPU, or --cpu, ranks run on CPU "
        "(gloo). The first rank to fail stops the others (SIGTERM, SIGKILL after --grace) and "
        "one report names it, its cause and its failure code; ranks stuck in "
        "init_process_group or a collective while others are missing or elsewhere are "
        "reported with their stacks after --stall-timeout. Exit code: the failing rank's "
        "(128+N for signal N); 1 for a stall; 2 usage; 3 no GPU; 4 too few GPUs. Multi-node: "
        "once per node with --nnodes N --node-rank R --master-addr HOST --master-port P "
        "(static), or the same line everywhere with --rdzv-backend c10d --rdzv-endpoint "
        "HOST:PORT [--nnodes MIN:MAX], or inside Slurm as `srun --ntasks-per-node=1 "
        "gpuwarden launch SCRIPT`. Every torchrun flag is accepted, also from PET_* variables; "
        "docs/launch.md says what each does here.",
    )
    g = p.add_argument_group("ranks and GPUs")
    g.add_argument("-n", "--nproc-per-node", "--nproc_per_node", dest="nproc_per_node",
                   default=None, metavar="N|auto|gpu|cpu",
                   help="ranks on this node: N; gpu: one per usable GPU; cpu: one per CPU core; "
                   "auto: gpu when there are GPUs, else cpu (default: --gpus, else 1)")
    g.add_argument("--gpus", default=None, metavar="N|all",
                   help="run on N GPUs, one rank each, or on every usable GPU")
    g.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even if GPUs are present")
    g.add_argument("--share", action="store_true",
                   help="allow more ranks than GPUs, round-robin (implies --bind rank); NCCL "
                   "refuses two ranks on one GPU, so gpuwarden.distributed.init() picks gloo for "
                   "ranks that share one")
    g.add_argument("--oversubscribe", action="store_true",
                   help="run CPU ranks even when they are far more than the cores (more than 4 "
                   "per core, and more than 16, is refused without it; mpirun's flag)")
    g.add_argument("--bind", choices=("all", "rank"), default=None,
                   help="all (default, torchrun's): every rank sees the job's GPUs in rank order, "
                   "cuda:LOCAL_RANK is its own; rank: each rank sees only its own GPU, as cuda:0, "
                   "and LOCAL_RANK=0 (= --virtual-local-rank; no NVLink/P2P between ranks)")
    g.add_argument("--virtual-local-rank", "--virtual_local_rank", dest="virtual_local_rank",
                   action="store_true", help="torchrun's name for --bind rank")
    g.add_argument("--min-free", metavar="SIZE", default="0", help="minimum free memory per GPU")
    g.add_argument("--wait", metavar="DURATION", default=None,
                   help="wait up to DURATION for enough usable GPUs (e.g. 10m)")
    g.add_argument("--mem-per-rank", metavar="SIZE", default=None,
                   help="lease SIZE of each rank's GPU (e.g. 20GiB) instead of the whole GPU: "
                   "GPUs are shared by memory with other leases, and a rank whose processes use "
                   "more is named (docs/leases.md, Memory leases)")
    g.add_argument("--mem-enforce", choices=("warn", "stop"), default=None,
                   help="with --mem-per-rank, when a rank uses more: warn (default: name it on "
                   "stderr and in `gpuwarden status`) or stop the job (LEASE_MEMORY_EXCEEDED)")

    g = p.add_argument_group("failures and stalls")
    g.add_argument("--stall-timeout", metavar="DURATION", default="5m",
                   help="report ranks waiting this long in init_process_group or a collective "
                   "while others are missing or elsewhere (default 5m: rank 0 alone preparing "
                   "data while the others wait at a barrier is legitimate)")
    g.add_argument("--keep-waiting", action="store_true",
                   help="after a stall report, keep the job running instead of stopping it")
    g.add_argument("--no-straggler-note", dest="straggler_note", action="store_false",
                   help="do not print the one line naming a rank the others keep waiting for "
                   "(`gpuwarden status` still shows it)")
    g.add_argument("--grace", "--shutdown-timeout", "--shutdown_timeout", dest="shutdown_timeout",
                   metavar="DURATION", default=None,
                   help="time between the stop signal and SIGKILL when stopping ranks (default "
                   "5s, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds); a second Ctrl-C kills at once")
    g.add_argument("--signals-to-handle", "--signals_to_handle", dest="signals_to_handle",
                   default=None, metavar="SIGS",
                   help="signals passed on to every rank's process group (default "
                   "SIGTERM,SIGINT,SIGHUP,SIGQUIT: each stops the job; SIGUSR1 and SIGUSR2 are "
                   "always passed on and the job goes on, as is any other signal named here)")
    g.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
                   metavar="N", help="restart the whole group up to N times after a failure, "
                   "as torchrun (TORCHELASTIC_RESTART_COUNT, a fresh rendezvous each attempt, "
                   "the GPUs kept), but only when the cause can pass: the same exception at the "
                   "same file:line in the same rank twice in a row ends the job (default 0)")
    g.add_argument("--restart-on", dest="restart_on", choices=("auto", "always"), default="auto",
                   help="auto (default): restart only failures that can pass; always: any "
                   "failure, as torchrun")
    g.add_argument("--restart-backoff", dest="restart_backoff", default="1s", metavar="DURATION",
                   help="wait between a failed attempt and the next (default 1s)")
    g.add_argument("--monitor-interval", "--monitor_interval", dest="monitor_interval",
                   type=float, default=None, metavar="SECONDS",
                   help="how often ranks are checked (default 0.05; a rank's exit is seen at "
                   "once in any case)")

    g = p.add_argument_group("rendezvous (multi-node)")
    g.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                   help="nodes in the job, each running gpuwarden launch (default 1, or Slurm's "
                   "SLURM_NNODES inside an srun step); MIN:MAX (with --rdzv-backend c10d): "
                   "start once MIN nodes joined, take up to MAX, re-rendezvous when one joins "
                   "or is lost, as torchrun's elastic membership")
    g.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=None,
                   metavar="R", help="static rendezvous: this node's index, 0..N-1; node 0 runs "
                   "rank 0 and hosts the job's store (default 0, or SLURM_NODEID); ignored with "
                   "--rdzv-backend c10d, which assigns node ranks on arrival")
    g.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   metavar="HOST", help="node 0's address, the same on every node (--nnodes > 1; "
                   "default localhost on one node)")
    g.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   metavar="PORT", help="rendezvous port (default: a free one; with --nnodes "
                   "required, the same on every node); a busy one fails at once")
    g.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default="static",
                   metavar="static|c10d", help="static (default): nodes numbered by "
                   "--node-rank; c10d: torch's own dynamic rendezvous, node ranks assigned on "
                   "arrival, the same command line on every node; the job's store runs on "
                   "whichever node hosts --rdzv-endpoint")
    g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default="",
                   metavar="HOST[:PORT]", help="the store's address, taken as --master-addr and "
                   f"--master-port (port {C10D_DEFAULT_PORT} when left out; static: 29500)")
    g.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default=None, metavar="ID",
                   help="the job's id (TORCHELASTIC_RUN_ID; names the --log-dir subdirectory)")
    g.add_argument("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", default="", metavar="K=V,...",
                   help="torch's rendezvous settings, torchrun's meanings: join_timeout (= "
                   "--rdzv-timeout), last_call_timeout, close_timeout, heartbeat_timeout, "
                   "read_timeout, is_host, keep_alive_interval, keep_alive_max_attempt "
                   "(seconds or counts)")
    g.add_argument("--rdzv-timeout", "--rdzv_timeout", dest="rdzv_timeout", default="5m",
                   metavar="DURATION", help="how long every node waits for the others before "
                   "any rank starts (the endpoint to answer, then every node to join), naming "
                   "who joined and who is missing as it goes (default 5m; join_timeout)")
    g.add_argument("--standalone", action="store_true",
                   help="one node on a free port (torchrun's standalone): the --rdzv-* flags "
                   "are ignored")
    g.add_argument("--local-addr", "--local_addr", dest="local_addr", default=None,
                   metavar="HOST", help="the address this node advertises to the others "
                   "(default: its host name, or a routable address when the name resolves to "
                   "loopback)")

    g = p.add_argument_group("output and logs")
    g.add_argument("--log-dir", "--log_dir", dest="log_dir", default=None, metavar="DIR",
                   help="torchrun's layout: DIR/<run id>_<random>/attempt_0/<local rank>/"
                   "{stdout,stderr}.log for the streams of --tee/--redirects, and error.json")
    g.add_argument("-r", "--redirects", dest="redirects", default="0", metavar="SPEC",
                   help="streams written to the log files only: 1 stdout, 2 stderr, 3 both, "
                   "or per local rank (0:1,1:2)")
    g.add_argument("-t", "--tee", dest="tee", default="0", metavar="SPEC",
                   help="streams written to the log files and the console (as --redirects)")
    g.add_argument("--local-ranks-filter", "--local_ranks_filter", dest="local_ranks_filter",
                   default="", metavar="RANKS",
                   help="show only these local ranks' output on the console (e.g. 0,1); "
                   "log files get every rank's")
    g.add_argument("--duplicate-stdout-filters", "--duplicate_stdout_filters",
                   dest="duplicate_stdout_filters", default="", metavar="WORDS",
                   help="also copy stdout lines containing any of these (comma-separated; ,, "
                   "for a comma) to attempt_0/filtered_stdout.log")
    g.add_argument("--duplicate-stderr-filters", "--duplicate_stderr_filters",
                   dest="duplicate_stderr_filters", default="", metavar="WORDS",
                   help="the same for stderr (filtered_stderr.log)")
    g.add_argument("--ranks-filter", "--ranks_filter", dest="ranks_filter", default="",
                   metavar="RANKS",
                   help="show only these global ranks' output on the console (e.g. 5 or 0,8-15; "
                   "--local-ranks-filter's counterpart across nodes); log files get every rank's")
    g.add_argument("--quiet", action="store_true", help="show only rank 0's output on the console")
    g.add_argument("--plain-console", "--plain_console", dest="plain_console",
                   action="store_true", default=_env_flag("GPUWARDEN_PLAIN_CONSOLE"),
                   help="on a terminal, relay every line of every rank as it comes (no live "
                   "region for progress bars, no identical lines said once); also "
                   "GPUWARDEN_PLAIN_CONSOLE=1. NO_COLOR and TERM=dumb get it too")
    g.add_argument("--collapse-window", "--collapse_window", dest="collapse_window",
                   default=os.environ.get("GPUWARDEN_COLLAPSE_WINDOW") or "50ms",
                   metavar="DURATION",
                   help="on a terminal, how long a rank's line may wait for the same line from "
                   "the other ranks, to be said once as [rank0-7]: ... (default 50ms, at most "
                   "2s; 0: nothing collapsed); also GPUWARDEN_COLLAPSE_WINDOW")
    g.add_argument("--json", action="store_true",
                   help="print the final report as JSON on stdout (schema_version 1)")

    g = p.add_argument_group("what each rank runs")
    g.add_argument("-m", "--module", action="store_true",
                   help="SCRIPT is a module name, run as python -m MODULE")
    g.add_argument("--no-python", "--no_python", dest="no_python", action="store_true",
                   help="run SCRIPT itself (an executable), not python SCRIPT; without the "
                   "bootstrap, stalls are not reported")
    g.add_argument("--run-path", "--run_path", dest="run_path", action="store_true",
                   help="run SCRIPT (an absolute path) with runpy.run_path, as every rank does "
                   "here anyway")
    g.add_argument("--role", default="default", help="the workers' role (ROLE_NAME)")
    g.add_argument("--start-method", "--start_method", dest="start_method", default="spawn",
                   choices=("spawn", "fork", "forkserver"),
                   help="accepted for torchrun command lines: ranks are always fresh processes "
                   "(python started anew, as spawn)")
    g.add_argument("--event-log-handler", "--event_log_handler", dest="event_log_handler",
                   default="null", metavar="NAME",
                   help="accepted for torchrun command lines; gpuwarden logs no torchelastic events")
    g.add_argument("--logs-specs", "--logs_specs", dest="logs_specs", default=None,
                   metavar="NAME", help="torchrun's custom LogsSpecs (an entry point of the group "
                   "torchrun.logs_specs): refused, naming the entry point torchrun would load "
                   "(the supervisor loads no torch plugins); --log-dir/--tee/--redirects give "
                   "torchrun's default layout")
    g.add_argument("--numa-binding", "--numa_binding", dest="numa_binding", default=None,
                   choices=("node", "socket", "exclusive", "core-complex"),
                   help="accepted for torchrun command lines; not applied yet on GPUs (a note "
                   "says so); refused for CPU ranks, which have no GPU whose NUMA node to bind "
                   "to (torchrun fails on them)")
    p.add_argument("script", metavar="SCRIPT", help="the script (or module with -m) to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="arguments for the script")
    p.set_defaults(run=run)
    return p


def config_from_args(args: argparse.Namespace) -> Any:
    from gpuwarden.cli._args import memory_size, min_free_bytes
    from gpuwarden.launch.config import STOP_SIGNALS, LaunchConfig
    from gpuwarden.units import parse_duration

    if args.logs_specs and not _is_default_logs_specs(args.logs_specs):
        raise _logs_specs_refused(args.logs_specs)
    if args.no_python and args.module:
        raise UsageError("--no-python and -m contradict each other (torchrun refuses them too)",
                         fix="give one of them")
    rdzv = _rendezvous(args)
    nproc, nproc_auto, cpu = _nproc(args.nproc_per_node), False, args.cpu
    gpus: int | str | None = args.gpus
    if args.nproc_per_node in ("auto", "gpu", "cpu"):
        nproc = None
        if args.nproc_per_node == "gpu":
            gpus = gpus or "all"
        elif args.nproc_per_node == "cpu":
            from gpuwarden.launch.plan import cpu_count

            cpu, nproc = True, cpu_count()
        else:
            nproc_auto = True
    if not args.standalone:
        slurm = _slurm(rdzv)
        if slurm is not None and nproc is None and gpus is None and not cpu and not nproc_auto:
            nproc = slurm.nproc
    nnodes, node_rank = rdzv["nnodes"], rdzv["node_rank"]
    master_addr, master_port = rdzv["master_addr"], rdzv["master_port"]
    if (nnodes or 1) > 1 and rdzv["backend"] == "c10d":
        node_rank = None  # assigned on arrival; torchrun ignores --node-rank here too
    elif node_rank is None and (nnodes or 1) == 1:
        node_rank = 0
    if (nnodes or 1) == 1:
        master_addr = _one_node_master_addr(args, rdzv)
    if isinstance(gpus, str) and gpus != "all":
        if not gpus.isdigit():
            raise UsageError(f"--gpus {gpus!r} is neither a number nor 'all'", fix="--gpus 2 or --gpus all")
        gpus = int(gpus)
    bind = "rank" if args.virtual_local_rank else (args.bind or "")
    if args.virtual_local_rank and args.bind == "all":
        raise UsageError("--virtual-local-rank and --bind all contradict each other",
                         fix="--virtual-local-rank is --bind rank: give one of them")
    signals = tuple(s.strip().upper() for s in args.signals_to_handle.split(",") if s.strip()) \
        if args.signals_to_handle else STOP_SIGNALS
    return LaunchConfig(
        target=args.script,
        args=tuple(args.script_args),
        module=args.module,
        nproc=nproc,
        nproc_auto=nproc_auto,
        gpus=gpus,
        cpu=cpu,
        share=args.share,
        oversubscribe=args.oversubscribe,
        bind=bind,
        min_free_bytes=min_free_bytes(args.min_free),
        wait_s=parse_duration(args.wait, what="--wait") if args.wait else None,
        mem_per_rank_bytes=memory_size("--mem-per-rank")(args.mem_per_rank)
        if args.mem_per_rank else 0,
        mem_enforce=args.mem_enforce or "warn",
        stall_timeout_s=parse_duration(args.stall_timeout, what="--stall-timeout"),
        keep_waiting=args.keep_waiting,
        straggler_note=args.straggler_note,
        grace_s=_grace(args.shutdown_timeout),
        master_port=master_port,
        master_addr=master_addr or "",
        nnodes=1 if nnodes is None else nnodes,
        min_nodes=rdzv["min_nodes"],
        node_rank=node_rank,
        rdzv_backend=rdzv["backend"],
        rdzv_conf=rdzv["conf"],
        local_addr=args.local_addr or None,
        expected_hosts=rdzv["hosts"],
        rdzv_timeout_s=rdzv["timeout_s"] if rdzv["timeout_s"] is not None
        else parse_duration(args.rdzv_timeout, what="--rdzv-timeout"),
        rdzv_id=None if args.standalone or args.rdzv_id in (None, "none") else args.rdzv_id,
        source=rdzv["source"],
        log_dir=args.log_dir,
        quiet=args.quiet,
        role=args.role,
        max_restarts=args.max_restarts,
        restart_on=args.restart_on,
        restart_backoff_s=parse_duration(args.restart_backoff, what="--restart-backoff"),
        monitor_interval_s=args.monitor_interval or 0.05,
        start_method=args.start_method,
        no_python=args.no_python,
        run_path=args.run_path,
        redirects=str(args.redirects),
        tee=str(args.tee),
        local_ranks_filter=_ranks_filter(args.local_ranks_filter),
        ranks_filter=_global_ranks_filter(args.ranks_filter),
        plain_console=bool(args.plain_console),
        collapse_window_s=parse_duration(str(args.collapse_window), what="--collapse-window"),
        duplicate_stdout_filters=_filters(args.duplicate_stdout_filters),
        duplicate_stderr_filters=_filters(args.duplicate_stderr_filters),
        log_line_prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or None,
        signals_to_handle=signals,
        numa_binding=args.numa_binding,
    )


LOGS_SPECS_GROUP = "torchrun.logs_specs"  # the entry-point group torchrun loads --logs-specs from


# torch's own entry point: its DefaultLogsSpecs, the layout gpuwarden writes
DEFAULT_LOGS_SPECS = "torch.distributed.elastic.multiprocessing:DefaultLogsSpecs"


def _is_default_logs_specs(name: str) -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == name and ep.value == DEFAULT_LOGS_SPECS
               for ep in entry_points(group=LOGS_SPECS_GROUP))


def _logs_specs_refused(name: str) -> UsageError:
    """--logs-specs NAME: which entry point torchrun would load (torch.distributed.run's
    _get_logs_specs_class), and that gpuwarden's supervisor loads none."""
    from importlib.metadata import entry_points

    found = list(entry_points(group=LOGS_SPECS_GROUP))
    mine = next((ep for ep in found if ep.name == name), None)
    fix = ("leave --logs-specs out: --log-dir with --tee/--redirects writes torchrun's default "
           "layout (its DefaultLogsSpecs)")
    if mine is None:
        others = ", ".join(sorted(ep.name for ep in found)) or "none"
        return UsageError(
            f"--logs-specs {name}: no installed package has the entry point {name!r} in the group "
            f"{LOGS_SPECS_GROUP!r} (installed there: {others}), so torchrun would fail too "
            f"(\"Could not find entrypoint under '{LOGS_SPECS_GROUP}[{name}]' key\"); and "
            "gpuwarden loads no LogsSpecs class", fix=fix)
    package = getattr(getattr(mine, "dist", None), "name", None)
    return UsageError(
        f"--logs-specs {name}: torchrun would load {mine.value} (entry point {name!r} of the "
        f"group {LOGS_SPECS_GROUP!r}{', package ' + package if package else ''}) into its agent; "
        "gpuwarden's supervisor loads no torch plugins, so custom LogsSpecs are not supported",
        fix=fix)


def _one_node_master_addr(args: argparse.Namespace, rdzv: dict[str, Any]) -> str:
    """MASTER_ADDR on one node, as torchrun gives it: its static rendezvous (a --master-port or
    an endpoint given) hands the workers --master-addr (127.0.0.1 when left out) or the
    endpoint's host; its c10d rendezvous (--standalone, --rdzv-backend c10d, or neither a port
    nor an endpoint, which torchrun runs as c10d on one node) this host's own name: "" here,
    looked up before the plan (launch/preflight.py: choose_master_addr)."""
    from gpuwarden.launch.config import DEFAULT_MASTER_ADDR, STATIC_MASTER_ADDR

    c10d = args.standalone or rdzv["backend"] == "c10d" or (
        not args.rdzv_endpoint and rdzv["master_port"] is None)
    if c10d:
        return DEFAULT_MASTER_ADDR
    return rdzv["master_addr"] or STATIC_MASTER_ADDR


def _nproc(text: str | None) -> int | None:
    if text is None or text in ("auto", "gpu", "cpu"):
        return None
    if str(text).strip().isdigit():
        return int(text)
    if text == "xpu":
        raise UsageError("--nproc-per-node xpu: gpuwarden launches on NVIDIA GPUs or CPU",
                         fix="--nproc-per-node gpu, cpu, auto or a number")
    raise UsageError(f"--nproc-per-node {text!r} is not a number, auto, gpu or cpu",
                     fix="e.g. --nproc-per-node 4 or --nproc-per-node gpu")


def _grace(text: str | None) -> float:
    """--grace/--shutdown-timeout (torchrun's is in seconds: a bare number is seconds here too),
    else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 5 s."""
    from gpuwarden.launch.config import DEFAULT_GRACE_S
    from gpuwarden.units import parse_duration

    if text is None:
        env = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
        if not env:
            return DEFAULT_GRACE_S
        text = env
    return parse_duration(text, what="--shutdown-timeout")


def _ranks_filter(text: str) -> frozenset[int] | None:
    if not text:
        return None
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not all(p.isdigit() for p in parts):
        raise UsageError(f"--local-ranks-filter {text!r} is not a list of local ranks",
                         fix="e.g. --local-ranks-filter 0,1")
    return frozenset(int(p) for p in parts)


def _global_ranks_filter(text: str) -> frozenset[int] | None:
    """--ranks-filter: global ranks, ranges allowed (``0,8-15``)."""
    if not text:
        return None
    ranks: set[int] = set()
    for part in (p.strip() for p in str(text).split(",")):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise UsageError(f"--ranks-filter {text!r} is not a list of global ranks",
                             fix="e.g. --ranks-filter 5, or 0,8-15")
        ranks.update(range(int(low), int(high if dash else low) + 1))
        if len(ranks) > 1 << 20:
            raise UsageError(f"--ranks-filter {text!r} names more than {1 << 20} ranks",
                             fix="e.g. --ranks-filter 0,8-15")
    return frozenset(ranks)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _filters(text: str | Sequence[str]) -> tuple[str, ...]:
    """torchrun's comma-separated list, where ``,,`` stands for a comma."""
    if not isinstance(text, str):
        return tuple(text)
    marker = "\0"
    return tuple(p.replace(marker, ",") for p in text.replace(",,", marker).split(",") if p)


def _rendezvous(args: argparse.Namespace) -> dict[str, Any]:
    """torchrun's rendezvous flags: ``static`` numbers the nodes by --node-rank; ``c10d`` with
    several nodes runs torch's own dynamic rendezvous, which assigns node ranks on arrival
    (--node-rank is then ignored, as torchrun ignores it)."""
    from gpuwarden.units import parse_duration

    lo, hi = _nnodes(args.nnodes) if args.nnodes is not None else (None, None)
    out: dict[str, Any] = {"nnodes": hi, "min_nodes": lo, "node_rank": args.node_rank,
                           "master_addr": args.master_addr, "master_port": args.master_port,
                           "timeout_s": None, "backend": "static", "conf": (), "hosts": (),
                           "source": "flags", "notes": []}
    if args.standalone:
        out["min_nodes"] = None
        out["nnodes"] = 1 if hi is None else hi
        return out  # torchrun: the --rdzv-* flags are ignored
    backend = str(args.rdzv_backend).lower()
    if backend not in RDZV_BACKENDS:
        raise UsageError(f"--rdzv-backend {args.rdzv_backend}: gpuwarden supports static and c10d",
                         why="torch's c10d rendezvous runs on a TCPStore every node reaches; etcd "
                         "and custom backends would need their own clients",
                         fix="--rdzv-backend c10d --rdzv-endpoint HOST:PORT, or --master-addr "
                         "HOST --master-port PORT")
    out["backend"] = backend
    conf: list[tuple[str, str]] = []
    for item in (s for s in str(args.rdzv_conf).split(",") if s.strip()):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise UsageError(f"--rdzv-conf {args.rdzv_conf!r}: {item!r} is not KEY=VALUE",
                             fix="e.g. --rdzv-conf join_timeout=900")
        if key == "join_timeout":
            out["timeout_s"] = parse_duration(value, what="--rdzv-conf join_timeout")
        else:
            conf.append((key, value))
    out["conf"] = tuple(conf)
    if args.rdzv_endpoint:
        default_port = C10D_DEFAULT_PORT if backend == "c10d" else 29500
        host, port = _endpoint(args.rdzv_endpoint, default_port)
        # torchrun's single-node idiom --rdzv-endpoint localhost:0: any free port
        out["master_addr"], out["master_port"] = host, (port or None)
        if out["nnodes"] is None:
            out["nnodes"] = out["min_nodes"] = 1
    return out


def _slurm(rdzv: dict[str, Any]) -> Any:
    """Inside a Slurm step, whatever the flags leave open comes from Slurm's variables, also
    beside --nnodes and c10d (srun torchrun --nnodes=$SLURM_NNODES ... --rdzv-backend=c10d):
    the node count, this node's index (static), node 0's address and port (static), and the
    job's hosts, which waits name when a node is missing. Updates ``rdzv``; Slurm's settings
    (None outside Slurm)."""
    if not (os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")):
        return None  # not in an allocation (slurm_settings says the same)
    from gpuwarden.launch.multinode.slurm import slurm_settings

    dynamic = rdzv["backend"] == "c10d"
    wants = rdzv["nnodes"] is None or (not dynamic and (
        rdzv["node_rank"] is None or rdzv["master_addr"] is None or rdzv["master_port"] is None))
    try:
        slurm = slurm_settings(os.environ)
    except UsageError:
        if wants:
            raise
        return None  # the flags say everything; a batch-script launch of a given topology
    if slurm is None:
        return None
    if rdzv["nnodes"] is None:
        rdzv["nnodes"], rdzv["min_nodes"], rdzv["source"] = slurm.nnodes, slurm.nnodes, "slurm"
    multinode = rdzv["nnodes"] > 1
    if multinode and not dynamic:
        if rdzv["node_rank"] is None:
            rdzv["node_rank"], rdzv["source"] = slurm.node_rank, "slurm"
        # One node needs no shared port: it picks a free one, so two launches in one
        # allocation never collide (and a busy derived port is no user error).
        rdzv["master_addr"] = rdzv["master_addr"] or slurm.master_addr
        rdzv["master_port"] = rdzv["master_port"] or slurm.master_port
    if multinode and len(slurm.hosts) == slurm.nnodes:
        rdzv["hosts"] = slurm.hosts
    return slurm


def _endpoint(text: str, default_port: int) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = text.rpartition(":") if text.count(":") == 1 else (text, "", "")
    if not port_text:
        return host, default_port
    if not port_text.isdigit():
        raise UsageError(f"--rdzv-endpoint {text!r}: {port_text!r} is not a port",
                         fix="--rdzv-endpoint HOST:PORT, e.g. 10.0.0.4:29400")
    return host, int(port_text)


def _nnodes(text: str) -> tuple[int, int]:
    """``N`` or torchrun's ``MIN:MAX`` (elastic membership: torch's c10d rendezvous only)."""
    lo, sep, hi = str(text).strip().partition(":")
    hi = hi if sep else lo
    if not (lo.strip().isdigit() and hi.strip().isdigit()):
        raise UsageError(f"--nnodes {text!r} is not a number or MIN:MAX",
                         fix="--nnodes 2, or --nnodes 1:4 (elastic, with --rdzv-backend c10d)")
    return int(lo), int(hi)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    agent = None
    if config.multinode:
        from gpuwarden.launch.multinode.early import take_early
        from gpuwarden.launch.multinode.node_agent import NodeAgent

        # Several nodes: torch's rendezvous runs in the node agent, whose torch import is the
        # longest step before the ranks start; `gpuwarden launch` started it before parsing.
        agent = take_early() or NodeAgent.start()
    from gpuwarden.cli import inventory_of
    from gpuwarden.launch.runner import launch

    notes = []
    if args.node_rank is not None and config.dynamic:
        notes.append(f"--node-rank {args.node_rank} is ignored with --rdzv-backend c10d: torch's "
                     "rendezvous assigns node ranks on arrival (as torchrun)")
    if args.master_addr and not config.master_addr:
        notes.append(f"--master-addr {args.master_addr} is not used: on one node without "
                     "--master-port (or with --standalone or --rdzv-backend c10d) torchrun runs "
                     "its c10d rendezvous, whose ranks get this host's own name as MASTER_ADDR; "
                     "so does gpuwarden")
    if args.event_log_handler not in (None, "null"):
        notes.append(f"--event-log-handler {args.event_log_handler}: gpuwarden logs no "
                     "torchelastic events")
    for note in notes:
        print(f"gpuwarden: {note}", file=sys.stderr)
    try:
        # --cpu reads no GPU: the default inventory (NVML's module) is not even made
        inventory = getattr(args, "inventory", None) if config.cpu else inventory_of(args)
    except BaseException:
        if agent is not None:
            agent.close()  # launch() ends it from here on
        raise
    try:
        report, _outcome = launch(config, inventory=inventory, agent=agent)
    except KeyboardInterrupt:  # once ranks run, the supervisor handles Ctrl-C itself
        print("gpuwarden: interrupted before any rank started (waiting for GPUs, or checking "
              "the rendezvous); nothing was leased or left running", file=sys.stderr)
        return 130
    if not report.ok or not args.quiet:
        from gpuwarden.findings import emit

        emit(report.finding, sys.stderr)
    if args.json:
        from gpuwarden.cli._output import emit_json

        emit_json({"report": report.to_dict()})
    return report.exit_code
