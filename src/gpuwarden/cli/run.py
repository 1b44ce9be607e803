"""``gpuwarden run``: lease GPUs, run a command on them, release when it ends."""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from types import FrameType
from typing import Any

from gpuwarden.cli._args import MAX_SLOTS_PER_GPU, add_simulate_arg, bounded_int, memory_size
from gpuwarden.cli._output import note
from gpuwarden.cli.select import add_constraint_args, constraints_from_args, wants_all
from gpuwarden.errors import UsageError
from gpuwarden.procs import (
    GroupReaper,
    announce_group,
    die_with_parent,
    live_group_members,
    shell_exit_code,
    short_command,
)

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
LEFTOVER_GRACE_S = 2.0  # after the command exits: how long its leftovers get after SIGTERM
VERIFY_S = 2.0  # how often the lease's files are checked while the command runs
MEM_STOP_GRACE_S = 5.0  # --mem-enforce stop: SIGTERM to the command's group, SIGKILL after this


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="lease GPUs, run a command on them with CUDA_VISIBLE_DEVICES set, release at its end",
        description="Lease GPUs (atomically, crash-safe: see `gpuwarden leases`), run CMD with "
        "CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER=PCI_BUS_ID naming them, forward SIGINT, "
        "SIGTERM, SIGHUP and SIGQUIT to it, and release the GPUs when it ends. Exits with CMD's "
        "exit code (128+N when CMD was killed by signal N), 4 when the GPUs could not be leased "
        "(in time), 2 for bad arguments, 3 when no GPU state can be read.",
        usage="gpuwarden run [options] -- CMD [ARGS...]",
    )
    add_constraint_args(p, count_flags=("--gpus", "-n"))
    p.add_argument("--slots-per-gpu", type=bounded_int("--slots-per-gpu", 1, MAX_SLOTS_PER_GPU),
                   default=1, metavar="K",
                   help="split each GPU into K slots shared by K requests (default 1: whole "
                   f"GPUs; at most {MAX_SLOTS_PER_GPU}, as `leases init` prepares)")
    p.add_argument("--slots-each", type=bounded_int("--slots-each", 1, MAX_SLOTS_PER_GPU),
                   default=1, metavar="S",
                   help="slots to take on each leased GPU (default 1; K = the whole GPU)")
    p.add_argument("--mem", type=memory_size("--mem"), default=None, metavar="SIZE",
                   help="a memory lease: SIZE of one GPU (e.g. 20GiB), shared with other leases "
                   "by memory and placed where it fits tightest; its processes' use is guarded "
                   "(docs/leases.md, Memory leases). Not with --slots-per-gpu")
    p.add_argument("--mem-enforce", choices=("warn", "stop"), default=None,
                   help="with --mem, when the command and its children use more than SIZE: warn "
                   "(default: name it on stderr, `ls`, `leases`, `status`) or stop (SIGTERM to "
                   f"its process group, SIGKILL {MEM_STOP_GRACE_S:g} s later)")
    p.add_argument("--mps-thread-pct", type=bounded_int("--mps-thread-pct", 1, 100),
                   default=None, metavar="PCT",
                   help="with --mem, where NVIDIA MPS runs: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for "
                   "the command (the share of SMs it may use)")
    p.add_argument("--wait", metavar="DURATION", default=None,
                   help="wait in line this long for the GPUs, e.g. 30s, 10m, inf "
                   "(default: do not wait, exit 4 when they are not free)")
    p.add_argument("--label", default=None,
                   help="what `gpuwarden leases` and waiting requests show for this lease "
                   "(default: the command line)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="do not print the leased GPUs or the waiting status")
    add_simulate_arg(p)
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD", help="the command to run")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gpuwarden.cli import inventory_of
    from gpuwarden.lease import StatusPrinter, acquire
    from gpuwarden.lease._fs import lease_dir_choice
    from gpuwarden.units import format_bytes, format_duration

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("no command given", fix="gpuwarden run --gpus 1 -- python train.py")
    constraints = constraints_from_args(args)
    if args.slots_each > args.slots_per_gpu:
        raise UsageError(f"--slots-each {args.slots_each} is more than --slots-per-gpu "
                         f"{args.slots_per_gpu}", fix="--slots-each K of --slots-per-gpu K "
                         "takes whole GPUs; fewer share each GPU")
    _check_memory_args(args)
    # Everything that can be checked now is, before any wait in line: a command that does not
    # exist, GPUs that are not there, a request no wait can serve.
    check_command(cmd)
    inventory = inventory_of(args)
    visible = _check_request(inventory, constraints, args)
    # "python train.py --lr 3e-4", the form NVML process lines take in every reason string.
    label = args.label or short_command([os.path.basename(cmd[0]), *cmd[1:]])
    _directory, warning = lease_dir_choice()
    if warning and not args.quiet:
        note(f"gpuwarden: note: {warning}")
    printer = StatusPrinter(sys.stderr)
    started = time.monotonic()
    try:
        with printer:
            grant = acquire("all" if wants_all(args) else None, constraints=constraints,
                            slots_per_gpu=args.slots_per_gpu, slots_each=args.slots_each,
                            wait=args.wait, label=label,
                            on_wait=None if args.quiet else printer, inventory=inventory,
                            visible=visible, mem=args.mem)
    except KeyboardInterrupt:
        note(f"gpuwarden: interrupted after {format_duration(time.monotonic() - started)} "
             "waiting in line; nothing was leased and the command did not run")
        return 128 + signal.SIGINT
    with grant:
        if not args.quiet:
            slots = "" if args.slots_per_gpu == 1 else \
                f" ({args.slots_each}/{args.slots_per_gpu} slots each)"
            waited = f" after {grant.waited_s:.1f}s in line" if grant.waited_s >= 0.1 else ""
            what = f"GPU {grant.visible_devices}" if not args.mem else \
                f"{format_bytes(args.mem)} of GPU {grant.visible_devices}"
            note(f"gpuwarden: leased {what}{slots}{waited}: "
                 f"CUDA_VISIBLE_DEVICES={grant.visible_devices}")
            if args.mem:  # why this GPU and not another, in bytes
                for state in grant.states:
                    note(f"gpuwarden:   {state.line()}")
        env = {**os.environ, **grant.env, "GPUWARDEN_LEASE_ID": grant.holder_id}
        if args.mem and args.mps_thread_pct is not None:
            from gpuwarden.mps import pinned_memory_env

            env.update(pinned_memory_env(args.mem, len(grant.gpus),
                                         thread_pct=args.mps_thread_pct))
        watch = _LeaseWatch(grant, inventory, enforce=args.mem_enforce or "warn")
        return run_child(cmd, env, tick=watch.tick, tick_s=watch.tick_s, on_start=watch.started)


def _check_memory_args(args: argparse.Namespace) -> None:
    if args.mem is None:
        for flag, value in (("--mem-enforce", args.mem_enforce),
                            ("--mps-thread-pct", args.mps_thread_pct)):
            if value is not None:
                raise UsageError(f"{flag} without --mem", fix=f"gpuwarden run --mem 20GiB {flag} "
                                 f"{value} -- CMD")
        return
    if args.slots_per_gpu != 1 or args.slots_each != 1:
        raise UsageError("--mem with --slots-per-gpu: a lease is memory or slots, not both",
                         fix="--mem 6GiB shares a GPU by memory; --slots-per-gpu K in K equal "
                         "slots")


class _LeaseWatch:
    """What `run` does while the command runs: check the lease's files every VERIFY_S and, for a
    memory lease, poll the guard every POLL_S; with ``enforce="stop"``, end the command's group
    when it uses more than its lease (SIGTERM, then SIGKILL after MEM_STOP_GRACE_S). Only the
    group run started, while its leader is unreaped, is ever signalled."""

    def __init__(self, grant: Any, inventory: Any, *, enforce: str) -> None:
        from gpuwarden.lease.guard import POLL_S, MemoryGuard

        self.grant = grant
        self.enforce = enforce
        self.guard = MemoryGuard(grant, inventory)
        self.tick_s = POLL_S if self.guard.active else VERIFY_S
        self._reported: set[str] = set()
        self._verified_at = time.monotonic()
        self._pgid: int | None = None
        self._kill_at: float | None = None
        self._guard_error = ""

    def started(self, pgid: int) -> None:
        self._pgid = pgid

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._verified_at >= VERIFY_S or not self.guard.active:
            self._verified_at = now
            _report_tampering(self.grant, self._reported)
        if self._kill_at is not None and now >= self._kill_at:
            self._kill_at = None
            self._signal(signal.SIGKILL)
        if not self.guard.active:
            return
        report = self.guard.poll()
        if report.error and report.error != self._guard_error:
            note(f"gpuwarden: warning: the memory guard cannot read the GPUs: {report.error}")
        self._guard_error = report.error
        for over in report.new:
            self._named(over)
        for over in report.ended:
            note(f"gpuwarden: note[LEASE_MEMORY_EXCEEDED]: back within its lease on GPU "
                 f"{over.gpu_index}")

    def _named(self, over: Any) -> None:
        from gpuwarden.findings import render_plain
        from gpuwarden.lease.guard import overuse_finding

        stopping = ""
        if self.enforce == "stop" and self._pgid is not None:
            stopping = self._stop(over)
        finding = overuse_finding(over, enforce=self.enforce, stopping=stopping,
                                  detected_at=time.time())
        note(render_plain(finding, head=f"gpuwarden: {finding.label}: {finding.what}"))

    def _stop(self, over: Any) -> str:
        assert self._pgid is not None
        outside = [pid for pid, _b in over.pids if _group_of(pid) != self._pgid]
        if self._kill_at is None:
            self._signal(signal.SIGTERM)
            self._kill_at = time.monotonic() + MEM_STOP_GRACE_S
        said = (f"the command's process group {self._pgid}: SIGTERM, SIGKILL "
                f"{MEM_STOP_GRACE_S:g} s later if it is still there")
        if outside:
            said += (f"; pid {', '.join(map(str, outside))} left that group and is not "
                     "signalled (gpuwarden signals only the group it started)")
        return said

    def _signal(self, signum: int) -> None:
        # The group's leader is our unreaped child while this runs: the group is ours.
        if self._pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._pgid, signum)


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def check_command(cmd: Sequence[str]) -> None:
    """UsageError when ``cmd[0]`` cannot be executed: not on PATH, missing, a directory, not
    executable. Checked before leasing, so a typo never waits in line for GPUs first."""
    import shutil

    program = cmd[0]
    if os.sep in program:
        if not os.path.exists(program):
            raise UsageError(f"command not found: {program!r} does not exist",
                             fix="give the path of an existing program")
        if os.path.isdir(program):
            raise UsageError(f"command {program!r} is a directory",
                             fix="give the program to run, not its directory")
        if not os.access(program, os.X_OK) or not _has_exec_bit(program):
            raise UsageError(f"command {program!r} is not executable",
                             fix=f"gpuwarden run -- python {program}" if program.endswith(".py")
                             else f"chmod +x {program}, or run it with its interpreter "
                             f"(gpuwarden run -- sh {program})")
        return
    if shutil.which(program) is None:
        raise UsageError(f"command not found: {program!r} is not on PATH",
                         fix="give a program on PATH, or its path (./script.sh)")


def _has_exec_bit(path: str) -> bool:
    # root passes os.access(X_OK) for a file with any execute bit, and exec fails on none
    return bool(os.stat(path).st_mode & 0o111)


def _check_request(inventory: Any, constraints: Any, args: argparse.Namespace) -> Any:
    """The visible GPUs, after refusing at once what waiting could never serve: --include
    naming a GPU that is not visible, more GPUs than could ever be usable."""
    from gpuwarden.select import check_include, never_satisfiable, select

    _host, vis = inventory.visibility()
    if not args.quiet:
        for line in vis.notes:
            note(f"gpuwarden: note: {line}")
    check_include(vis.gpus, constraints)
    if args.mem:
        _check_memory_fits(vis.gpus, args.mem)
    if args.wait is not None and not wants_all(args):
        problem = never_satisfiable(select(vis.gpus, constraints))
        if problem is not None:
            raise problem
    return vis.gpus


def _check_memory_fits(gpus: Sequence[Any], memory_bytes: int) -> None:
    """ConstraintError (exit 4) at once when no visible GPU could ever lend ``memory_bytes``:
    no wait in line would serve it."""
    from gpuwarden.errors import ConstraintError
    from gpuwarden.lease._fs import lease_dir_path, prepared_config
    from gpuwarden.lease.memory import DEFAULT_RESERVE_BYTES
    from gpuwarden.units import format_bytes

    config = prepared_config(lease_dir_path())
    reserve = DEFAULT_RESERVE_BYTES if config is None or config.memory_reserve_bytes is None \
        else config.memory_reserve_bytes
    if not gpus or any(g.memory_total_bytes - reserve >= memory_bytes for g in gpus):
        return
    largest = max(gpus, key=lambda g: g.memory_total_bytes)
    raise ConstraintError(
        f"--mem {format_bytes(memory_bytes)}: no visible GPU can ever lend that much",
        why=f"the largest, {largest.label}, has {format_bytes(largest.memory_total_bytes)} of "
        f"which {format_bytes(reserve)} is kept out of memory leases",
        fix=f"ask for at most {format_bytes(max(0, largest.memory_total_bytes - reserve))}, or "
        "run where larger GPUs are visible",
        evidence=[f"{g.label}: {format_bytes(g.memory_total_bytes)}" for g in gpus])


def _report_tampering(grant: Any, reported: set[str]) -> None:
    """Say once per problem when the lease's files were deleted or replaced under it."""
    for problem in grant.verify():
        if problem not in reported:
            reported.add(problem)
            note(f"gpuwarden: warning: {problem} while this lease holds GPU "
                 f"{grant.visible_devices}. The lease stands (its live record keeps other "
                 "gpuwarden requests off the GPU), but the lease directory is not safe from "
                 "other users: ask an admin to run `gpuwarden leases init`")


def run_child(cmd: Sequence[str], env: dict[str, str], *,
              tick: Callable[[], None] | None = None, tick_s: float = VERIFY_S,
              on_start: Callable[[int], None] | None = None) -> int:
    """Run ``cmd`` in its own process group, forward signals to the group, wait, clean up.

    ``tick`` is called every ``tick_s`` while the command runs; ``on_start`` with the
    command's process group once it runs.

    The group is what makes "leave no process behind" hold for a shell script's children
    too; on a terminal it is made the foreground group, so Ctrl-C and terminal reads go to
    the command exactly as they would without gpuwarden.
    """
    # The reaper first: it kills the command's group if gpuwarden itself is SIGKILLed. Started
    # after the command, a kill during its start-up (~20 ms) left the command's children alive:
    # PDEATHSIG reaches only the direct child.
    reaper = GroupReaper()
    # Forwarding too: a signal that comes while the command starts is passed on once its group
    # is known (before, it stopped gpuwarden alone and left the command running).
    forwarder = _Forwarder()
    try:
        with forwarder:
            child = _start(cmd, env, reaper.announce_fd)
            pgid = child.pid
            reaper.add(pgid)
            forwarder.target(pgid)
            if on_start is not None:
                on_start(pgid)
            with _foreground(pgid):
                returncode = _wait_unreaped(child, tick, tick_s)
                # The command's exit is read without reaping it: its zombie keeps the pid,
                # so its group's number cannot go to another process while we signal it.
                _reap_group(pgid)
        reaper.remove(pgid)  # before the reap: after it, the number may be reused
        child.wait()
    finally:
        reaper.close()
    return shell_exit_code(returncode)


def _start(cmd: Sequence[str], env: dict[str, str], reaper_fd: int) -> subprocess.Popen[bytes]:
    # Its own process group, and death with gpuwarden: the lease ends with gpuwarden, so must
    # the command's use of the GPUs; the watcher learns of the group from the child itself,
    # before the command runs. (Other threads may exist at the fork: the preexec_fn makes
    # system calls only, see procs.die_with_parent.)
    parent = os.getpid()
    try:
        if sys.version_info >= (3, 11):
            return subprocess.Popen(list(cmd), env=env, process_group=0, preexec_fn=partial(
                _in_child, parent, reaper_fd))
        return subprocess.Popen(list(cmd), env=env,
                                preexec_fn=partial(_setpgid_then_die_with_parent, parent,
                                                   reaper_fd))
    except FileNotFoundError as exc:
        raise UsageError(f"command not found: {cmd[0]!r}", fix="give a program on PATH or a path"
                         ) from exc
    except OSError as exc:  # no permission, not a program (ENOEXEC: a script without #!)
        raise UsageError(f"command {cmd[0]!r} cannot be executed", why=exc.strerror,
                         fix=f"chmod +x {cmd[0]}, or run it with its interpreter "
                         f"(gpuwarden run -- sh {cmd[0]})") from exc


def _wait_unreaped(child: subprocess.Popen[bytes], tick: Callable[[], None] | None,
                   tick_s: float = VERIFY_S) -> int:
    """``child``'s exit status once it exited, leaving it a zombie (``waitid(WNOWAIT)``);
    ``tick`` every ``tick_s`` meanwhile. Woken by the child's pidfd, no polling."""
    pidfd = -1
    next_tick = time.monotonic() + tick_s
    with contextlib.suppress(OSError, AttributeError):
        pidfd = os.pidfd_open(child.pid)
    try:
        while True:
            try:
                info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if info is not None and info.si_pid:
                    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                timeout = tick_s if tick is not None else None
                if pidfd >= 0:
                    ready, _, _ = select.select([pidfd], [], [], timeout)
                else:  # no pidfd (Linux < 5.3): look again every 20 ms
                    time.sleep(0.02)
                    ready = [True]
                    if tick is not None and time.monotonic() >= next_tick:
                        ready = []
                if not ready and tick is not None:
                    next_tick = time.monotonic() + tick_s
                    tick()
            except KeyboardInterrupt:  # SIGINT is forwarded; a stray one must not orphan it
                continue
    finally:
        if pidfd >= 0:
            os.close(pidfd)


class _Forwarder:
    """SIGINT, SIGTERM, SIGHUP and SIGQUIT passed on to the command's group; those that come
    before the group is known are passed on as soon as it is."""

    def __init__(self) -> None:
        self._pgid: int | None = None
        self._pending: list[int] = []
        self._previous: dict[int, Any] = {}

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        if self._pgid is None:
            self._pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._pgid, signum)

    def target(self, pgid: int) -> None:
        self._pgid = pgid
        pending, self._pending = self._pending, []
        for signum in pending:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signum)

    def __enter__(self) -> _Forwarder:
        for sig in FORWARDED:
            with contextlib.suppress(ValueError, OSError):  # not the main thread: no forwarding
                self._previous[sig] = signal.signal(sig, self._forward)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _in_child(parent: int, reaper_fd: int) -> None:
    announce_group(reaper_fd)
    die_with_parent(parent, exit_code=128 + signal.SIGKILL)


def _setpgid_then_die_with_parent(parent: int, reaper_fd: int) -> None:
    # Python 3.10 has no Popen(process_group=...): the same system calls, by hand.
    os.setpgid(0, 0)
    _in_child(parent, reaper_fd)


@contextlib.contextmanager
def _foreground(pgid: int) -> Iterator[None]:
    """Give the terminal to the command's group while it runs (what a shell does)."""
    tty = _controlling_tty_fd()
    if tty is None:
        yield
        return
    try:
        _set_foreground(tty, pgid)
        yield
    finally:
        _set_foreground(tty, os.getpgrp())


def _controlling_tty_fd() -> int | None:
    try:
        fd = sys.stdin.fileno()
        if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
            return fd
    except (OSError, ValueError, AttributeError):
        pass
    return None


def _set_foreground(fd: int, pgid: int) -> None:
    # A background group that calls tcsetpgrp gets SIGTTOU unless it ignores it.
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        with contextlib.suppress(OSError):
            os.tcsetpgrp(fd, pgid)
    finally:
        signal.signal(signal.SIGTTOU, old)


def _reap_group(pgid: int) -> None:
    """Processes the command left in its group (daemons, background jobs) would keep
    using GPUs the lease no longer covers: SIGTERM, then SIGKILL after a grace period.
    Called while the command (the group's leader) is an unreaped zombie: the group is then
    certainly its own."""
    if not live_group_members(pgid):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while time.monotonic() < deadline:
        if not live_group_members(pgid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
