"""The process context: start every rank, relay its output, watch it, stop all, reap all.

Shaped like torch.distributed.elastic's PContext (start → poll → close with SIGTERM, a grace
period, SIGKILL, per process group) but without torch: this process imports only the standard
library and psutil-free helpers, so a launch costs tens of milliseconds before the ranks start.

Rules it keeps:

- every rank is its own session and process group (``start_new_session``), so SIGTERM/SIGKILL
  reach the rank's own children (DataLoader workers, compile workers) too, and a Ctrl-C on the
  terminal reaches only gpuwarden, which then stops the ranks in order;
- the first rank to fail stops all others; a rank that exits 0 is simply done;
- nothing outlives the job: at the end every rank's group is SIGKILLed (harmless when empty),
  and a tiny reaper process kills the groups if this process itself is SIGKILLed (each rank also
  has PR_SET_PDEATHSIG, armed by :mod:`gpuwarden._rank`).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, TextIO

from gpuwarden.launch.config import FORWARDED_SIGNALS, STOP_SIGNALS
from gpuwarden.launch.placement import pids_of, render_warning, watch_for
from gpuwarden.launch.plan import LaunchPlan, RankSpec
from gpuwarden.launch.relay import JobRelay, RankRelay
from gpuwarden.launch.status import STACK_SIGNAL_NAME, Phase, RankStatus, StatusReader
from gpuwarden.procs import GroupReaper, describe_exit

_STACK_WAIT_S = 1.5
# Multi-node: how long ranks may still wait after node 0's store went away before this node
# stops (a normal end closes the store too, a moment before the last barrier returns).
STORE_LOST_GRACE_S = 3.0
ABORT_SELF_WAIT_S = 1.0  # a failing rank sets the abort key itself within milliseconds
ABORT_HELPER_WAIT_S = 8.0  # the helper imports torch (1-3 s) and connects with a 5 s bound


@dataclass
class RankExit:
    """How one rank ended. ``returncode`` as subprocess gives it: negative for a signal."""

    rank: int
    pid: int
    returncode: int
    ended_at: float  # monotonic, when the supervisor saw it
    stopped_by_launcher: bool  # it ended after gpuwarden began stopping the job
    error: dict[str, Any] | None = None  # the bootstrap's record of an uncaught exception
    fatal_dump: str = ""  # faulthandler's dump on SIGSEGV/SIGABRT/...
    stderr_tail: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.returncode != 0

    @property
    def failed_at(self) -> float:
        """When it failed: the exception's own time when recorded, else when it was seen to exit."""
        if self.error and isinstance(self.error.get("monotonic"), (int, float)):
            return min(float(self.error["monotonic"]), self.ended_at)
        return self.ended_at


@dataclass
class Stall:
    """Ranks waiting longer than the stall timeout while others were elsewhere."""

    waiting: list[int]  # ranks stuck at the same point
    elsewhere: list[int]  # ranks not at that point: missing, dead, finished, or further along
    where: dict[int, str]  # rank -> what it was doing
    stacks: dict[int, list[str]]  # rank -> top frames of its main thread
    detected_at: float
    point: str  # "init_process_group" or "all_reduce (collective #3)"


@dataclass
class PeerView:
    """Multi-node: what this node's ranks learned from the job's TCPStore (their peers files)."""

    arrived: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> host, pid, node
    reader_connected: bool = False  # local rank 0's watch reached the store (arrivals known)
    abort: dict[str, Any] | None = None  # another node's failure record
    abort_sent: bool = False  # a rank of this node set the abort key itself
    store_lost: str | None = None
    store_lost_at: float | None = None  # monotonic, when this supervisor saw it
    store_error: str | None = None


@dataclass
class RunOutcome:
    plan: LaunchPlan
    started_at: float
    ended_at: float
    exits: dict[int, RankExit]
    pids: dict[int, int]
    stall: Stall | None = None
    interrupted_by: str | None = None  # "SIGINT" / "SIGTERM" sent to the supervisor
    peers: PeerView | None = None  # multi-node only
    stopped_for: str | None = None  # "abort" (another node failed) / "store_lost"


class _Rank:
    def __init__(self, spec: RankSpec, proc: subprocess.Popen[bytes], status: StatusReader,
                 relay: RankRelay) -> None:
        self.spec = spec
        self.proc = proc
        self.pgid = proc.pid  # start_new_session: the rank leads its own group
        self.status = status
        self.relay = relay
        self.exit: RankExit | None = None


class Supervisor:
    """Runs one plan. ``run()`` returns when every rank has ended and every group is reaped."""

    def __init__(self, plan: LaunchPlan, *, stdout: TextIO | None = None, stderr: TextIO | None = None,
                 poll_interval_s: float = 0.05) -> None:
        self.plan = plan
        self.config = plan.config
        self.out = stdout or sys.stdout
        self.err = stderr or sys.stderr
        self.poll_interval_s = min(poll_interval_s, self.config.monitor_interval_s)
        self.relay = JobRelay(self.out, self.err, redirects=self.config.redirects,
                              tee=self.config.tee, local_ranks_filter=self.config.local_ranks_filter,
                              quiet=self.config.quiet, attempt_dir=plan.attempt_dir,
                              duplicate_stdout_filters=self.config.duplicate_stdout_filters,
                              duplicate_stderr_filters=self.config.duplicate_stderr_filters)
        self.ranks: list[_Rank] = []
        self._placement = watch_for([(r.rank, r.gpu) for r in plan.ranks], self.config.bind)
        self._sel = selectors.DefaultSelector()
        self._interrupt: str | None = None
        self._stop_signal = signal.SIGTERM  # what a stop sends the ranks: the one received
        self._hurry = False  # a second stop signal (Ctrl-C twice): SIGKILL without the grace
        self._stop_began: float | None = None
        self._killed = False
        self._failing: set[int] = set()  # ranks seen FAILED before they exited
        self._stall: Stall | None = None  # set once: a stall is reported once
        self._reaper: GroupReaper | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup_fd: int | None = None
        self.on_stall: Any = None  # callback(Stall) for --keep-waiting reports
        self.peers: PeerView | None = PeerView() if plan.nnodes > 1 else None
        self._stopped_for: str | None = None
        self._abort_helper: subprocess.Popen[bytes] | None = None
        self._abort_decided = False
        self._peer_mtimes: dict[int, float] = {}
        self._peer_states: dict[int, dict[str, Any]] = {}
        self._started = 0.0  # monotonic, set by run()

    # ---- lifecycle -------------------------------------------------------------------------

    def run(self) -> RunOutcome:
        self._started = time.monotonic()
        self._install_signals()
        try:
            self._reaper = GroupReaper()
            for spec in self.plan.ranks:
                self._start(spec)
            self._loop()
        finally:
            self._final_cleanup()
            self._restore_signals()
        return self.outcome(time.monotonic())

    def outcome(self, now: float) -> RunOutcome:
        """What happened so far (the final outcome once run() returned; a stall report's
        outcome while --keep-waiting lets the job run on)."""
        exits = {r.spec.rank: r.exit for r in self.ranks if r.exit is not None}
        return RunOutcome(self.plan, self._started, now, exits,
                          {r.spec.rank: r.proc.pid for r in self.ranks}, self._stall,
                          self._interrupt, self.peers, self._stopped_for)

    def _reap_if_we_die(self, pgid: int) -> None:
        if self._reaper is not None:
            self._reaper.add(pgid)

    def _start(self, spec: RankSpec) -> None:
        status = StatusReader(spec.files.status)
        for path in (spec.files.error, spec.files.stacks, spec.files.fatal):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        env = dict(os.environ)
        env.update(spec.env)
        proc = subprocess.Popen(
            list(spec.argv), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        rank = _Rank(spec, proc, status, self.relay.open_rank(spec.rank, spec.local_rank))
        self._reap_if_we_die(rank.pgid)
        for stream in (proc.stdout, proc.stderr):
            assert stream is not None
            os.set_blocking(stream.fileno(), False)
            self._sel.register(stream.fileno(), selectors.EVENT_READ, (rank, stream))
        self.ranks.append(rank)

    def _loop(self) -> None:
        next_stall_check = 0.0
        while True:
            self._pump(self.poll_interval_s)
            self._reap_exited()
            now = time.monotonic()
            live = [r for r in self.ranks if r.exit is None]
            if not live:
                break
            if self._stop_began is None:
                failed = any(r.exit is not None and r.exit.failed for r in self.ranks)
                if not failed:
                    # A rank that raised has written its error record and marked itself FAILED
                    # before its (slow, with torch loaded) interpreter teardown: stop the
                    # others now, let it finish exiting on its own.
                    for r in live:
                        st = _safe_status(r)
                        if st is not None and st.phase is Phase.FAILED:
                            self._failing.add(r.spec.rank)
                            failed = True
                if self._interrupt is not None or failed:
                    self._begin_stop()
                elif now >= next_stall_check:
                    next_stall_check = now + 0.2
                    if self.peers is not None:
                        self._check_peers(now)
                    if self._stop_began is None:
                        self._check_stall(now)
                    self._check_placement()
            else:
                # Two independent steps of a stop: telling the other nodes must never hold
                # back the SIGKILL of ranks that ignore SIGTERM.
                if self.peers is not None and not self._abort_decided \
                        and now - self._stop_began >= ABORT_SELF_WAIT_S:
                    self._tell_other_nodes()
                if not self._killed and (self._hurry or now - self._stop_began >= self.config.grace_s):
                    self._killed = True
                    for r in live:
                        self._signal_group(r, signal.SIGKILL)
        # Output still in the pipes after the last exit (a child of a rank may hold them open:
        # do not wait for EOF longer than a moment).
        deadline = time.monotonic() + 0.3
        while self._sel.get_map() and time.monotonic() < deadline:
            if not self._pump(0.05):
                break

    def _begin_stop(self) -> None:
        self._stop_began = time.monotonic()
        # As torchrun: a stop because gpuwarden got SIGINT/SIGTERM/SIGHUP/SIGQUIT passes that
        # signal on (a Ctrl-C is a KeyboardInterrupt in every rank); any other stop is SIGTERM.
        sig = self._stop_signal if self._interrupt is not None else signal.SIGTERM
        for r in self.ranks:
            if r.exit is None and r.spec.rank not in self._failing:
                self._signal_group(r, sig)

    def _check_placement(self) -> None:
        """Ranks crowding one GPU (a script without set_device): say so once, with the fix."""
        if self._placement is None:
            return
        found = self._placement.check(
            lambda: {r.spec.rank: pids_of(r.proc.pid) for r in self.ranks if r.exit is None})
        if found is not None:
            print(render_warning(found), file=self.err, flush=True)

    # ---- multi-node ------------------------------------------------------------------------

    def _check_peers(self, now: float) -> None:
        """Read what the ranks' store watches wrote; stop on another node's abort, or when the
        store (node 0) is gone while this node's ranks still wait for the others."""
        view = self._read_peers(now)
        if view.abort is not None and int(view.abort.get("node", -1)) != self.plan.node_rank:
            self._stopped_for = "abort"
            self._begin_stop()
        elif view.store_lost_at is not None and now - view.store_lost_at >= STORE_LOST_GRACE_S:
            # Node 0's normal end also closes the store: stop only ranks still *waiting* for
            # others (init or a collective) well after it went away.
            waiting = [st for st in (_safe_status(r) for r in self.ranks if r.exit is None)
                       if st is not None and st.phase in (Phase.IN_INIT, Phase.IN_COLLECTIVE)]
            if waiting:
                self._stopped_for = "store_lost"
                self._begin_stop()

    def _read_peers(self, now: float) -> PeerView:
        assert self.peers is not None
        view = self.peers
        for r in self.ranks:
            path = r.spec.files.peers
            try:
                mtime = os.stat(path).st_mtime_ns
            except OSError:
                continue
            if self._peer_mtimes.get(r.spec.rank) != mtime:
                data = _read_json(path)
                if data is not None:
                    self._peer_mtimes[r.spec.rank] = mtime
                    self._peer_states[r.spec.rank] = data
        for rank, data in self._peer_states.items():
            for key, rec in (data.get("arrived") or {}).items():
                if str(key).isdigit() and isinstance(rec, dict):
                    view.arrived[int(key)] = rec
            if data.get("connected") and self.plan.spec(rank) is not None \
                    and self.plan.spec(rank).local_rank == 0:  # type: ignore[union-attr]
                view.reader_connected = True
            view.abort_sent = view.abort_sent or bool(data.get("abort_sent"))
            if data.get("store_error") and view.store_error is None:
                view.store_error = str(data["store_error"])
            if isinstance(data.get("abort"), dict) and view.abort is None:
                view.abort = data["abort"]
            if data.get("store_lost") and view.store_lost is None:
                view.store_lost, view.store_lost_at = str(data["store_lost"]), now
        return view

    def _tell_other_nodes(self) -> None:
        """This node stops of its own accord: set the job's abort key so every node stops.
        A failing rank sets it itself (compare_set keeps the first), so this waits
        ABORT_SELF_WAIT_S for the rank's word before it starts a short-lived helper, which
        covers deaths by signal, stalls and interrupts. Node 0 needs none: its end takes the
        store down, which the other nodes notice."""
        if self.peers is None or self._abort_decided:
            return
        # Decided once, whatever the answer: node 0 and a node told to stop send nothing.
        self._abort_decided = True
        if self._stopped_for is not None or self.plan.node_rank == 0:
            return
        if self._read_peers(time.monotonic()).abort_sent or not self.peers.reader_connected:
            return  # already told, or the store was never reached: nobody to tell
        failing = sorted(self._failing | {r.spec.rank for r in self.ranks
                                          if r.exit is not None and r.exit.failed})
        if failing:
            what = f"rank {failing[0]} failed"
        elif self._interrupt:
            what = f"gpuwarden received {self._interrupt}"
        else:
            what = "ranks stalled"
        record = {"rank": failing[0] if failing else -1, "node": self.plan.node_rank,
                  "host": socket.gethostname(), "pid": os.getpid(), "what": what,
                  "time": time.time(), "from": "launcher"}
        with contextlib.suppress(OSError):
            self._abort_helper = subprocess.Popen(
                [sys.executable, "-m", "gpuwarden._store_watch", "--abort", self.plan.master_addr,
                 str(self.plan.master_port), json.dumps(record)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, close_fds=True)
            self._reap_if_we_die(self._abort_helper.pid)

    def _signal_group(self, rank: _Rank, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rank.pgid, sig)

    def _reap_exited(self) -> None:
        for r in self.ranks:
            if r.exit is not None:
                continue
            code = r.proc.poll()
            if code is None:
                continue
            now = time.monotonic()
            r.exit = RankExit(
                rank=r.spec.rank, pid=r.proc.pid, returncode=code, ended_at=now,
                stopped_by_launcher=self._stop_began is not None
                and r.spec.rank not in self._failing,
                error=_read_json(r.spec.files.error), fatal_dump=_read_text(r.spec.files.fatal))
            if code != 0:
                # Lines still in the pipe belong in the report's tail.
                self._drain(r)
                r.exit.stderr_tail = list(r.relay.stderr_tail)

    def _final_cleanup(self) -> None:
        # Anything left in a rank's group (its own children) goes now; then the reaper may exit.
        for r in self.ranks:
            self._signal_group(r, signal.SIGKILL)
            if r.exit is None:
                with contextlib.suppress(Exception):
                    r.proc.kill()
                    r.proc.wait(5)
        if self._stop_began is not None:
            self._tell_other_nodes()
        if self._abort_helper is not None:
            try:
                self._abort_helper.wait(ABORT_HELPER_WAIT_S)
            except subprocess.TimeoutExpired:
                self._abort_helper.kill()
                self._abort_helper.wait()
        if self._reaper is not None:
            self._reaper.close()
        for key in list(self._sel.get_map().values()):
            self._sel.unregister(key.fd)
        self._sel.close()
        for r in self.ranks:
            for stream in (r.proc.stdout, r.proc.stderr):
                if stream is not None:
                    stream.close()
            r.status.close()
        self.relay.close()

    # ---- output ----------------------------------------------------------------------------

    def _pump(self, timeout: float) -> bool:
        """Relay whatever the ranks wrote; True when there was something."""
        got = False
        for key, _ in self._sel.select(timeout):
            if key.data is None:  # the signal wake-up socket
                with contextlib.suppress(OSError):
                    assert self._wake_r is not None
                    self._wake_r.recv(4096)
                continue
            rank, stream = key.data
            got = True
            self._read_stream(rank, stream)
        return got

    def _drain(self, rank: _Rank) -> None:
        for stream in (rank.proc.stdout, rank.proc.stderr):
            if stream is not None and stream.fileno() in {k.fd for k in self._sel.get_map().values()}:
                self._read_stream(rank, stream)

    def _read_stream(self, rank: _Rank, stream: IO[bytes]) -> None:
        fd = stream.fileno()
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._sel.unregister(fd)
                rank.relay.finish(stream is rank.proc.stderr)
                return
            rank.relay.feed(stream is rank.proc.stderr, data)

    # ---- stalls ----------------------------------------------------------------------------

    def _check_stall(self, now: float) -> None:
        if self._stall is not None:
            return
        timeout = self.config.stall_timeout_s
        states: dict[int, RankStatus | None] = {}
        for r in self.ranks:
            states[r.spec.rank] = None if r.exit is not None else _safe_status(r)
        waiting = [rank for rank, st in states.items() if st is not None
                   and st.phase in (Phase.IN_INIT, Phase.IN_COLLECTIVE) and now - st.since > timeout]
        if not waiting:
            return
        ref = states[waiting[0]]
        assert ref is not None
        same = [rank for rank, st in states.items() if st is not None and st.point == ref.point]
        elsewhere = [rank for rank in states if rank not in same]
        remote: dict[int, str] = {}
        if ref.phase is Phase.IN_INIT and self.peers is not None:
            remote = self._remote_missing()
            elsewhere += sorted(remote)
        if not elsewhere:
            return  # everyone waits at the same point: a slow collective, not a missing rank
        where: dict[int, str] = {}
        for r in self.ranks:
            st = states[r.spec.rank]
            if r.exit is not None:
                how = "exited with code 0" if r.exit.returncode == 0 else _exit_words(r.exit.returncode)
                where[r.spec.rank] = f"{how} (pid {r.proc.pid})"
            elif st is not None:
                where[r.spec.rank] = st.describe(now)
        where.update(remote)
        point = ("init_process_group" if ref.phase is Phase.IN_INIT
                 else f"{ref.op} (collective #{ref.collectives})")
        stacks = self.collect_stacks([r for r in self.ranks if r.exit is None])
        self._stall = Stall(sorted(same), sorted(elsewhere), where, stacks, now, point)
        if self.config.keep_waiting:
            if self.on_stall is not None:
                self.on_stall(self._stall)
        else:
            self._begin_stop()

    def _remote_missing(self) -> dict[int, str]:
        """Ranks of other nodes that have not reached init_process_group, per the store."""
        assert self.peers is not None
        if not self.peers.reader_connected:
            return {}  # no word from the store: nothing can be said about other nodes
        local = set(self.plan.local_ranks)
        out = {}
        for rank in range(self.plan.world_size):
            if rank in local or rank in self.peers.arrived:
                continue
            out[rank] = (f"(node {self.plan.node_of(rank)}) has not reached init_process_group "
                         "(not in the job's store); last seen: never")
        return out

    def collect_stacks(self, ranks: list[_Rank]) -> dict[int, list[str]]:
        """Ask each rank for a faulthandler dump (only once its handler is armed) and read it."""
        sig = getattr(signal, STACK_SIGNAL_NAME)
        sizes: dict[int, int] = {}
        asked = []
        for r in ranks:
            st = _safe_status(r)
            if st is None or st.phase in (Phase.NOT_STARTED, Phase.FINISHED, Phase.FAILED):
                continue
            sizes[r.spec.rank] = _size(r.spec.files.stacks)
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.proc.pid, sig)
                asked.append(r)
        deadline = time.monotonic() + _STACK_WAIT_S
        last: dict[int, int] = {}
        while time.monotonic() < deadline:
            self._pump(0.05)
            now_sizes = {r.spec.rank: _size(r.spec.files.stacks) for r in asked}
            grown = all(now_sizes[k] > sizes[k] for k in now_sizes)
            if grown and now_sizes == last:
                break  # every dump has started and none grew since the last look
            last = now_sizes
        out = {}
        for r in asked:
            with open(r.spec.files.stacks, "rb") as f:
                f.seek(sizes[r.spec.rank])
                out[r.spec.rank] = main_thread_frames(f.read().decode(errors="replace"))
        return out

    # ---- signals ---------------------------------------------------------------------------

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers only work there; the loop still polls every interval
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._sel.register(self._wake_r.fileno(), selectors.EVENT_READ, None)
        self._old_wakeup_fd = signal.set_wakeup_fd(self._wake_w.fileno())

        def on_stop(signum: int, _frame: Any) -> None:
            if self._interrupt is None:
                self._interrupt = signal.Signals(signum).name
                self._stop_signal = signal.Signals(signum)
            else:
                self._hurry = True  # asked twice: the user will not wait out the grace

        def on_forward(signum: int, _frame: Any) -> None:
            for r in self.ranks:
                if r.exit is None:
                    self._signal_group(r, signal.Signals(signum))

        # SIGCHLD only wakes the loop: a rank's death is handled within milliseconds.
        handlers: list[tuple[signal.Signals, Any]] = [(signal.SIGCHLD, lambda *_: None)]
        handlers += [(s, on_stop) for s in stop_signals()]
        handlers += [(s, on_forward) for s in forwarded_signals(self.config.signals_to_handle)]
        for sig, handler in handlers:
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        if self._wake_w is not None:
            signal.set_wakeup_fd(self._old_wakeup_fd if self._old_wakeup_fd is not None else -1)
            self._wake_w.close()
            assert self._wake_r is not None
            self._wake_r.close()


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


def main_thread_frames(dump: str, limit: int = 6) -> list[str]:
    """The innermost frames of the thread running the script, from a faulthandler dump,
    without the bootstrap's and runpy's frames. faulthandler lists the most recent call first."""
    blocks: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append([])
        elif line.startswith("  File ") and blocks:
            blocks[-1].append(line.strip())
    if not blocks:
        return []
    main = next((b for b in blocks if any("gpuwarden/_rank.py" in f for f in b)), blocks[0])
    noise = ("gpuwarden/_rank.py", "runpy", "c10d_logger.py")  # bootstrap, runpy, torch's log wrapper
    frames = [f for f in main if not any(n in f for n in noise)]
    return frames[:limit]


def _exit_words(returncode: int) -> str:
    return f"killed by {describe_exit(returncode)}" if returncode < 0 else f"exited with {describe_exit(returncode)}"


def _safe_status(r: _Rank) -> RankStatus | None:
    try:
        return r.status.read()
    except (OSError, ValueError):
        return None


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""
