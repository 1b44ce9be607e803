"""LaunchConfig: what the user asked for, validated once, before anything touches the host."""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpuwarden.boundedio import kind_of
from gpuwarden.errors import UsageError

DEFAULT_STALL_TIMEOUT_S = 300.0
DEFAULT_GRACE_S = 5.0
# MASTER_ADDR on one node is what torchrun gives its workers there (torch.distributed.run, checked
# against torchrun 2.13 itself): its static rendezvous (--master-port or --rdzv-endpoint given)
# hands them --master-addr, 127.0.0.1 by default; its c10d rendezvous (--standalone,
# --rdzv-backend c10d, or neither --master-port nor an endpoint: torchrun turns that into c10d on
# one node) hands them the node's own name, --local-addr or socket.getfqdn(). A script that
# checks MASTER_ADDR, or builds an init_method from it, sees the same.
STATIC_MASTER_ADDR = "127.0.0.1"
# LaunchConfig.master_addr left to the host: this host's name as torch's c10d rendezvous gives
# it, looked up before the plan (preflight.choose_master_addr).
DEFAULT_MASTER_ADDR = ""
DEFAULT_MONITOR_INTERVAL_S = 0.05
# On a terminal, how long a rank's line may wait for the same line from the other ranks (said
# once, "[rank0-7]: ..."); the most it may be set to: a line held longer reads as a stall.
DEFAULT_COLLAPSE_WINDOW_S = 0.05
MAX_COLLAPSE_WINDOW_S = 2.0
# torchrun's --signals-to-handle default: each stops the job, passed on to every rank.
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# Passed on to every rank's process group and the job goes on: Slurm's preemption notice
# (``--signal=USR1@60``) must reach the script, which decides (checkpoint, requeue, exit).
FORWARDED_SIGNALS = ("SIGUSR1", "SIGUSR2")
START_METHODS = ("spawn", "fork", "forkserver")
# How long a node waits for the job's other nodes (the rendezvous endpoint to accept connections,
# then the rendezvous to complete): torchrun's join_timeout. Nodes are started by hand, ssh or
# Slurm within minutes of each other, not hours; every wait is named as it goes.
DEFAULT_RDZV_TIMEOUT_S = 300.0
RDZV_BACKENDS = ("static", "c10d")
# torchrun's --rdzv-conf keys that torch's c10d rendezvous reads (dynamic_rendezvous.create_handler,
# c10d_rendezvous_backend.create_backend): whole seconds or counts, and is_host.
RDZV_CONF_INT_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
                      "read_timeout", "keep_alive_interval", "keep_alive_max_attempt")
RDZV_CONF_BOOL_KEYS = ("is_host",)


@dataclass(frozen=True)
class LaunchConfig:
    """One launch on this node (of ``nnodes``; ``node_rank`` is this node's index).

    ``nproc`` ranks run ``target`` (a script path, or a module name when ``module``).
    ``gpus``: None lets the host decide (GPUs when NVML shows usable ones, else CPU),
    an int asks for that many GPUs (one per rank), "all" for every usable GPU.
    ``bind``: "all" (the default, torchrun's visibility) gives every rank all the job's GPUs
    in rank order, so ``cuda:LOCAL_RANK`` is its own; "rank" gives each rank only its own GPU,
    as ``cuda:0``, with ``LOCAL_RANK=0`` (torchrun's ``--virtual-local-rank``).

    The torchrun-only settings (``role``, ``no_python``, ``run_path``, ``redirects``, ``tee``,
    ``local_ranks_filter``, ``signals_to_handle``, ``max_restarts``, ...) keep torchrun's
    meaning; docs/launch.md lists each flag and what gpuwarden does with it.
    """

    target: str
    args: tuple[str, ...] = ()
    module: bool = False
    nproc: int | None = None
    nproc_auto: bool = False  # torchrun's --nproc-per-node auto: every usable GPU, else CPU cores
    gpus: int | str | None = None
    cpu: bool = False
    share: bool = False
    # CPU ranks far beyond the cores (CPU_RANKS_PER_CORE) are refused unless asked for: mpirun's
    # --oversubscribe
    oversubscribe: bool = False
    bind: str = ""  # "": "all", or "rank" with --share (CUDA refuses one GPU named twice)
    min_free_bytes: int = 0
    wait_s: float | None = None
    # --mem-per-rank: a memory lease of this many bytes on each rank's GPU (0: whole GPUs), and
    # what the launcher does when a rank's processes use more (--mem-enforce: warn or stop).
    mem_per_rank_bytes: int = 0
    mem_enforce: str = "warn"
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    keep_waiting: bool = False
    straggler_note: bool = True  # one stderr line when a straggler persists (launch/watch/straggler.py)
    grace_s: float = DEFAULT_GRACE_S
    # "" (DEFAULT_MASTER_ADDR): this host's name, as torchrun's c10d rendezvous gives it
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int | None = None
    log_dir: str | None = None
    quiet: bool = False
    run_id: str | None = None
    extra_env: tuple[tuple[str, str], ...] = field(default=())
    nnodes: int = 1  # the most nodes: MAX of torchrun's --nnodes MIN:MAX
    # None: this node's index is assigned on arrival by torch's c10d rendezvous (--rdzv-backend
    # c10d); an int: --node-rank, ranks numbered node by node (static).
    node_rank: int | None = 0
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S
    # Where the multi-node settings came from ("flags", "slurm"): said in notes and reports.
    source: str = "flags"
    min_nodes: int | None = None  # MIN of --nnodes MIN:MAX (None: nnodes, fixed membership)
    rdzv_backend: str = "static"
    # --rdzv-conf KEY=VALUE pairs handed to torch's rendezvous (join_timeout is rdzv_timeout_s)
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    local_addr: str | None = None  # torchrun's --local-addr: the address this node advertises
    # The job's hosts when the scheduler says (Slurm's node list): waits name the missing ones.
    expected_hosts: tuple[str, ...] = ()
    role: str = "default"
    max_restarts: int = 0
    # --max-restarts' policy (launch/restart/policy.py): "auto" decides from the failure, "always" is
    # torchrun's; the backoff is the wait between an attempt's end and the next one's start.
    restart_on: str = "auto"
    restart_backoff_s: float = 1.0
    monitor_interval_s: float = DEFAULT_MONITOR_INTERVAL_S
    start_method: str = "spawn"
    no_python: bool = False
    run_path: bool = False
    # torchrun's Std spec per local rank: 0 none, 1 stdout, 2 stderr, 3 both ("3" or "0:1,1:2")
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: frozenset[int] | None = None
    # gpuwarden's --ranks-filter: the global ranks shown on the console (files get every rank's)
    ranks_filter: frozenset[int] | None = None
    # On a terminal showing several ranks: bars in a live region, identical lines said once
    # (launch/ranks/terminal.py); --plain-console (GPUWARDEN_PLAIN_CONSOLE=1) relays every line
    # as it comes instead. A line waits at most collapse_window_s for the same line of other
    # ranks (--collapse-window, GPUWARDEN_COLLAPSE_WINDOW; 0: nothing is collapsed).
    plain_console: bool = False
    collapse_window_s: float = DEFAULT_COLLAPSE_WINDOW_S
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    # torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: the tag of a tee'd stream's lines
    # (${role_name}, ${rank}, ${local_rank}); None: "[<role><local rank>]:"
    log_line_prefix_template: str | None = None
    # torchrun's --numa-binding (node, socket, exclusive, core-complex): binds a rank to its GPU's
    # NUMA node there; not applied here yet, and refused for CPU ranks (torchrun fails on them)
    numa_binding: str | None = None
    signals_to_handle: tuple[str, ...] = STOP_SIGNALS
    rdzv_id: str | None = None

    def __post_init__(self) -> None:
        if not self.bind:
            object.__setattr__(self, "bind", "rank" if self.share else "all")
        _validate(self)

    @property
    def multinode(self) -> bool:
        """More than one node may take part: the node agent and the job's store are used."""
        return self.nnodes > 1

    @property
    def fewest_nodes(self) -> int:
        return self.nnodes if self.min_nodes is None else self.min_nodes

    @property
    def elastic(self) -> bool:
        """--nnodes MIN:MAX with MIN < MAX: the job runs on whoever joined (torchrun's elastic)."""
        return self.fewest_nodes < self.nnodes

    @property
    def dynamic(self) -> bool:
        """Node ranks assigned on arrival by torch's c10d rendezvous (no --node-rank)."""
        return self.multinode and self.node_rank is None

    @property
    def explicit_gpu_count(self) -> int | None:
        return self.gpus if isinstance(self.gpus, int) else None


# A CPU world is refused beyond this many ranks per core (never below MIN_CPU_RANK_LIMIT) unless
# --oversubscribe: each rank is an interpreter that imports torch (seconds of CPU and ~300 MB
# each); 999 ranks on 2 cores started 121 of them before anyone could stop it.
CPU_RANKS_PER_CORE = 4
MIN_CPU_RANK_LIMIT = 16

# More ranks than one node runs: the largest nodes have a few hundred cores and 72 GPUs, and
# every rank is a process with its own pipes and files in the supervisor.
MAX_RANKS_PER_NODE = 1024


def _validate(c: LaunchConfig) -> None:
    if c.nproc is not None and c.nproc < 1:
        raise UsageError(f"-n {c.nproc}: a job needs at least one rank", fix="give -n 1 or more")
    if c.nproc is not None and c.nproc > MAX_RANKS_PER_NODE:
        raise UsageError(f"-n {c.nproc}: more ranks than one node runs (at most "
                         f"{MAX_RANKS_PER_NODE})", fix="fewer ranks per node, or spread them "
                         "over nodes (--nnodes N, one gpuwarden launch per node)")
    if isinstance(c.gpus, str) and c.gpus != "all":
        raise UsageError(f"--gpus {c.gpus!r} is neither a number nor 'all'", fix="--gpus 2 or --gpus all")
    if isinstance(c.gpus, int) and c.gpus < 1:
        raise UsageError(f"--gpus {c.gpus}: at least one GPU", fix="give --gpus 1 or more, or --cpu")
    if c.cpu and c.gpus is not None:
        raise UsageError("--cpu and --gpus contradict each other", fix="give one of them")
    if c.cpu and c.share:
        raise UsageError("--share is about GPUs and means nothing with --cpu", fix="drop --share")
    if c.gpus is not None and c.nproc is not None and c.gpus != "all" and c.gpus != c.nproc \
            and not c.share:
        raise UsageError(
            f"-n {c.nproc} and --gpus {c.gpus} disagree: gpuwarden runs one rank per GPU",
            fix=f"give only one of them, or --share to put {c.nproc} ranks on {c.gpus} GPU(s)",
        )
    if c.mem_per_rank_bytes and (c.cpu or c.share):
        raise UsageError(f"--mem-per-rank with {'--cpu' if c.cpu else '--share'}: a memory "
                         "lease is a share of one GPU per rank",
                         fix="drop one of them (--share puts ranks together on whole GPUs)")
    if c.mem_enforce not in ("warn", "stop"):
        raise UsageError(f"--mem-enforce {c.mem_enforce!r} is not 'warn' or 'stop'",
                         fix="--mem-enforce warn (name it) or stop (end the job)")
    if c.mem_enforce == "stop" and not c.mem_per_rank_bytes:
        raise UsageError("--mem-enforce without --mem-per-rank",
                         fix="gpuwarden launch --mem-per-rank 20GiB --mem-enforce stop ...")
    if c.bind not in ("rank", "all"):
        raise UsageError(f"--bind {c.bind!r} is not 'rank' or 'all'", fix="--bind all (default) or rank")
    if c.bind == "all" and c.share:
        raise UsageError("--bind all with --share would name one GPU twice in CUDA_VISIBLE_DEVICES "
                         "(CUDA then sees none)", fix="leave --bind out with --share (each rank "
                         "then sees its GPU as cuda:0, LOCAL_RANK=0)")
    if c.max_restarts < 0:
        raise UsageError(f"--max-restarts {c.max_restarts} is negative", fix="--max-restarts 0")
    if c.restart_on not in ("auto", "always"):
        raise UsageError(f"--restart-on {c.restart_on!r} is not 'auto' or 'always'",
                         fix="--restart-on auto (decide from the failure) or always (torchrun's)")
    if c.restart_backoff_s < 0:
        raise UsageError("--restart-backoff is negative", fix="e.g. --restart-backoff 1s")
    if not 0 <= c.collapse_window_s <= MAX_COLLAPSE_WINDOW_S:
        raise UsageError(f"--collapse-window {c.collapse_window_s:g}s is outside 0 to "
                         f"{MAX_COLLAPSE_WINDOW_S:g} s (a line waits that long at most for the "
                         "same line of other ranks)", fix="e.g. --collapse-window 50ms, or 0 to "
                         "collapse nothing")
    if c.monitor_interval_s <= 0:
        raise UsageError("--monitor-interval must be more than 0", fix="e.g. --monitor-interval 0.1")
    if c.start_method not in START_METHODS:
        raise UsageError(f"--start-method {c.start_method!r} is not one of {', '.join(START_METHODS)}",
                         fix="--start-method spawn")
    if c.run_path and not c.module and not os.path.isabs(c.target):
        raise UsageError(f"--run-path needs an absolute script path, not {c.target!r}",
                         why="torchrun runs it with runpy.run_path in its own interpreter, which "
                         "resolves a relative path against wherever that process stands",
                         fix=f"--run-path {os.path.abspath(c.target)}")
    _validate_signals(c.signals_to_handle)
    parse_std_spec(c.redirects, what="--redirects")
    parse_std_spec(c.tee, what="--tee")
    if c.master_port is not None and not 1 <= c.master_port <= 65535:
        raise UsageError(f"--master-port {c.master_port} is not a TCP port", fix="give 1..65535")
    if c.stall_timeout_s <= 0:
        raise UsageError("--stall-timeout must be more than 0", fix="e.g. --stall-timeout 30s")
    if c.nnodes < 1 or c.fewest_nodes < 1:
        raise UsageError(f"--nnodes {c.fewest_nodes}:{c.nnodes}: a job has at least one node",
                         fix="--nnodes 2")
    if c.fewest_nodes > c.nnodes:
        raise UsageError(f"--nnodes {c.fewest_nodes}:{c.nnodes}: MIN is more than MAX",
                         fix=f"--nnodes {c.nnodes}:{c.fewest_nodes}")
    if c.rdzv_backend not in RDZV_BACKENDS:
        raise UsageError(f"--rdzv-backend {c.rdzv_backend}: gpuwarden supports static and c10d",
                         fix="--rdzv-backend c10d --rdzv-endpoint HOST:PORT")
    if c.elastic and c.rdzv_backend != "c10d":
        raise UsageError(f"--nnodes {c.fewest_nodes}:{c.nnodes}: elastic membership needs torch's "
                         "dynamic rendezvous", why="the static rendezvous numbers a fixed set of "
                         "nodes 0..N-1 (as torchrun's)",
                         fix=f"--rdzv-backend c10d --rdzv-endpoint HOST:PORT, or --nnodes {c.nnodes}")
    if c.node_rank is None:
        if c.rdzv_backend != "c10d":
            raise UsageError("no --node-rank: only torch's c10d rendezvous assigns node ranks",
                             fix="--node-rank R on each node, or --rdzv-backend c10d")
    elif not 0 <= c.node_rank < c.nnodes:
        raise UsageError(f"--node-rank {c.node_rank} is not in 0..{c.nnodes - 1} (--nnodes "
                         f"{c.nnodes})", fix="number the nodes 0 to N-1; node 0 hosts rank 0")
    if c.rdzv_timeout_s <= 0:
        raise UsageError("--rdzv-timeout must be more than 0", fix="e.g. --rdzv-timeout 5m")
    _validate_rdzv_conf(c.rdzv_conf)
    if c.multinode and c.rdzv_backend == "c10d":
        if c.master_port is None:
            raise UsageError(f"--nnodes {c.nnodes} with --rdzv-backend c10d needs "
                             "--rdzv-endpoint HOST:PORT (the same on every node)",
                             fix="e.g. --rdzv-endpoint node0:29400")
    elif c.multinode:
        if c.master_port is None:
            # Every node must use the same port: a free port picked here is unknown elsewhere.
            raise UsageError(f"--nnodes {c.nnodes} needs --master-port (the same on every node)",
                             fix="e.g. --master-port 29500; under Slurm it is derived from the job id")
        if c.master_addr == DEFAULT_MASTER_ADDR:
            raise UsageError(f"--nnodes {c.nnodes} needs --master-addr: node 0's address, the "
                             "same on every node", fix="--master-addr 10.0.0.4 (node 0's address "
                             "on the network the nodes share; 127.0.0.1 to rehearse with every "
                             "node on this host)")
    if not c.target:
        raise UsageError("no script to run", fix="gpuwarden launch -n 2 train.py [ARGS...]")
    if not c.module:
        check_script(c.target, executable=c.no_python and not c.run_path)
    if c.log_dir is not None and os.path.exists(c.log_dir) and not os.path.isdir(c.log_dir):
        raise UsageError(f"--log-dir {c.log_dir!r} is a file", fix="name a directory")


def _validate_rdzv_conf(conf: tuple[tuple[str, str], ...]) -> None:
    for key, value in conf:
        if key in RDZV_CONF_INT_KEYS and not (value.isdigit() and int(value) > 0):
            raise UsageError(f"--rdzv-conf {key}={value!r} is not a whole number of seconds "
                             "(or a count) above 0", fix=f"e.g. --rdzv-conf {key}=30")
        if key in RDZV_CONF_BOOL_KEYS and value.lower() not in ("1", "0", "true", "false", "yes",
                                                                 "no", "y", "n", "t", "f"):
            raise UsageError(f"--rdzv-conf {key}={value!r} is not a boolean",
                             fix=f"--rdzv-conf {key}=true or {key}=false")
        if key == "store_type" and value.lower() != "tcp":
            raise UsageError(f"--rdzv-conf store_type={value}: only the TCP store reaches "
                             "other nodes", fix="leave store_type out (tcp)")


def check_script(path: str, *, executable: bool = False) -> None:
    """Refuse, once and before any rank starts, a script N ranks could not run: missing, a
    directory, a FIFO or other special file (a rank would block on it, or read it once), or
    unreadable (and, with --no-python, not executable). UsageError (exit 2) naming which."""
    fix = "give the path of a Python script, or -m MODULE"
    if executable and os.sep not in path:
        import shutil

        if shutil.which(path) is not None:
            return  # --no-python runs a command from PATH, as torchrun's exec does
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UsageError(f"script {path!r} does not exist", fix=fix) from None
    except OSError as exc:
        raise UsageError(f"script {path!r} cannot be read: {exc.strerror}", fix=fix) from None
    if stat.S_ISDIR(st.st_mode):
        hint = os.path.join(path, "__main__.py")
        raise UsageError(f"script {path!r} is a directory",
                         fix=f"name the script inside it{' (' + hint + ')' if os.path.exists(hint) else ''}, "
                         "or run a package with -m PACKAGE")
    if stat.S_ISFIFO(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise UsageError(f"script {path!r} is {kind_of(st.st_mode)}",
                         why="every rank would open it: each would block on it, or read what "
                         "another rank already consumed", fix=fix)
    if not os.access(path, os.R_OK):
        raise UsageError(f"script {path!r} is not readable by this user",
                         why="every rank would fail at once with 'Permission denied'",
                         fix=f"chmod a+r {path}, or run as a user who may read it")
    if executable and not os.access(path, os.X_OK):
        raise UsageError(f"--no-python: {path!r} is not executable",
                         why="the ranks run it directly, without python", fix=f"chmod +x {path}")


def _validate_signals(names: tuple[str, ...]) -> None:
    for name in names:
        sig = getattr(signal, name, None)
        if not name.startswith("SIG") or not isinstance(sig, signal.Signals):
            raise UsageError(f"--signals-to-handle: {name!r} is not a signal name",
                             fix="e.g. --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise UsageError(f"--signals-to-handle: {name} cannot be caught, so not passed on",
                             fix=f"drop {name}")


def stop_signals() -> tuple[signal.Signals, ...]:
    """Signals that stop the job, passed on to every rank (torchrun's default
    --signals-to-handle). Always handled: left to their default action they would kill
    gpuwarden alone, and its ranks only through PDEATHSIG, without the grace period."""
    return tuple(getattr(signal, name) for name in STOP_SIGNALS)


def forwarded_signals(signals_to_handle: tuple[str, ...]) -> tuple[signal.Signals, ...]:
    """Signals passed on to every rank's process group while the job goes on: SIGUSR1 and
    SIGUSR2 (Slurm's preemption notice, ``--signal=USR1@60``), and any other signal that
    --signals-to-handle names."""
    names = dict.fromkeys((*FORWARDED_SIGNALS, *signals_to_handle))
    # SIGCHLD is the supervisor's own wake-up (its ranks' deaths), never a message for them
    return tuple(getattr(signal, n) for n in names if n not in (*STOP_SIGNALS, "SIGCHLD"))


# torchrun's Std values for --redirects and --tee: which of a rank's streams go to its log files
STD_NONE, STD_OUT, STD_ERR, STD_ALL = 0, 1, 2, 3


def parse_std_spec(text: str, *, what: str = "--redirects") -> int | dict[int, int]:
    """torchrun's Std spec: ``"3"`` for every local rank, or ``"0:1,1:2"`` per local rank
    (0 none, 1 stdout, 2 stderr, 3 both). UsageError (exit 2) on anything else."""
    fix = f"{what} 3 (stdout and stderr of every rank), or per local rank: {what} 0:1,1:2"

    def one(value: str) -> int:
        if value.strip() not in ("0", "1", "2", "3"):
            raise UsageError(f"{what} {text!r}: {value!r} is not 0, 1, 2 or 3", fix=fix)
        return int(value)

    text = str(text).strip()
    if ":" not in text:
        return one(text)
    out: dict[int, int] = {}
    for item in text.split(","):
        rank, sep, value = item.partition(":")
        if not sep or not rank.strip().isdigit():
            raise UsageError(f"{what} {text!r}: {item!r} is not LOCAL_RANK:STREAMS", fix=fix)
        out[int(rank)] = one(value)
    return out


def std_for(spec: int | dict[int, int], local_rank: int) -> int:
    return spec if isinstance(spec, int) else spec.get(local_rank, STD_NONE)


def needs_log_files(redirects: str, tee: str, filters: Iterable[str]) -> bool:
    """Whether a launch writes log files at all (torchrun then makes a directory even without
    --log-dir)."""
    return parse_std_spec(redirects) != STD_NONE or parse_std_spec(tee, what="--tee") != STD_NONE \
        or any(True for _ in filters)
