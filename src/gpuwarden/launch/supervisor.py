"""The supervisor: runs one plan to the end, watching the ranks from outside.

It composes the parts that each own one thing, and returns a :class:`~.outcome.RunOutcome`:

- ``ranks/pcontext.py``: processes (start, signal groups, stop with bounded waits, adopted
  orphans); ``ranks/relay.py``: the ranks' output, a rank's stderr tail kept for the report;
- ``watch/``: each rank's phase record, its stacks and CPU time sampled now and then
  (``sampler.py``), and the pure stall and straggler decisions over them;
- several nodes (``multinode/``): this node's first failure offered to the job's store, and a
  stop when another node's failure, a lost node or a node waiting to join (elastic) is
  reported by the node agent (``job_store.py``); also the ranks' own abort key in the workers'
  store (``peers.py``); imported only when the plan has several nodes;
- what a rank left behind when it ended (``ranks/exit_records.py``);
- the launcher's own signals (a stop, a notice passed on to the ranks once, a terminal's
  resize): ``ranks/signals.py`` records them and wakes the loop, which acts on them;
- an endpoint hosted by the loop (``serve``: the runner passes ``observer/control.py``'s), whose
  requests run between two polls; the supervisor knows it only as :class:`Endpoint`.

Rules it keeps: the first rank to fail stops all others (SIGTERM, SIGKILL after --grace); a rank
that exits 0 is simply done; nothing outlives the job. This process imports only the standard
library: a launch costs tens of milliseconds before the ranks start, and never touches CUDA.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from gpuwarden.boundedio import read_json_object
from gpuwarden.launch.config import forwarded_signals
from gpuwarden.launch.outcome import PeerView, RankExit, RunOutcome, echoes, is_echo
from gpuwarden.launch.plan import LaunchPlan, RankSpec
from gpuwarden.launch.ranks.exit_records import fatal_dump_in, read_fatal_dump, read_torch_error
from gpuwarden.launch.ranks.pcontext import ProcessContext
from gpuwarden.launch.ranks.pipes import RankPipes, gather
from gpuwarden.launch.ranks.relay import JobRelay, RankRelay
from gpuwarden.launch.ranks.signals import LauncherSignals
from gpuwarden.launch.ranks.stdio import RankStdio
from gpuwarden.launch.watch.placement import pids_of, render_warning, watch_for
from gpuwarden.launch.watch.sampler import RankSampler, make_request_fifo, sample_interval
from gpuwarden.launch.watch.stall import (
    RankView,
    Stall,
    current_wait,
    decide_stall,
    main_thread_frames,
)
from gpuwarden.launch.watch.status import Phase, RankStatus, StatusReader, sample_paths
from gpuwarden.launch.watch.straggler import Straggler, decide_straggler

if TYPE_CHECKING:
    from gpuwarden.launch.multinode.job_store import JobRound
    from gpuwarden.launch.multinode.peers import PeerFiles
    from gpuwarden.launch.watch.memory import MemoryWatch

REPORT_STACK_FRAMES = 12
ADOPT_CHECK_S = 1.0  # how often orphans re-parented to the launcher are looked for
STOP_SETTLE_S = 0.25  # a failure's stop waits this long for ranks already ending (_settle)
START_PROGRESS_S = 2.0  # a start of many ranks says how far it got this often
PUMP_ROUNDS_S = 0.01  # reading rounds in one pump while output keeps coming (terminal view)
# Multi-node: how long ranks may still wait after node 0's store went away before this node
# stops (a normal end closes the store too, a moment before the last barrier returns).
STORE_LOST_GRACE_S = 3.0
STRAGGLER_PERSIST_S = 4.0  # a straggler named this long (3 samples or more) gets its one line
NOTICE_POLL_S = 0.01  # the loop's wake-up while a signal waits for that decision
_AGENT = "agent"  # the selector's mark of the node agent's pipe
_ENDPOINT = "endpoint"  # ... and of the endpoint's requests for the loop


class Endpoint(Protocol):
    """What the loop hosts (``observer/control.py``'s ControlServer): requests that need the
    job's state are handed to the loop, which runs them between two polls."""

    def fileno(self) -> int: ...  # readable when a request waits for the loop
    def clear_wakeups(self) -> None: ...
    def run_pending(self) -> None: ...  # in the loop: run what was handed over
    def close(self) -> None: ...


Serve = Callable[["Supervisor"], "Endpoint | None"]


class _Rank:
    def __init__(self, spec: RankSpec, proc: subprocess.Popen[bytes], status: StatusReader,
                 relay: RankRelay, stdio: RankStdio) -> None:
        self.spec = spec
        self.proc = proc
        self.stdio = stdio  # the ends of its stdout and stderr this process reads
        self.pgid = proc.pid  # start_new_session: the rank leads its own group
        self.status = status
        self.relay = relay
        self.exit: RankExit | None = None
        self.sampler: RankSampler | None = None  # once the bootstrap armed its stack handler
        self.tail_at_stop: list[str] = []  # its last stderr lines when the stop began


class Supervisor:
    """Runs one plan. ``run()`` returns when every rank has ended and every group is reaped."""

    def __init__(self, plan: LaunchPlan, *, stdout: TextIO | None = None, stderr: TextIO | None = None,
                 poll_interval_s: float = 0.05, inherit_stdin: bool = True,
                 job: JobRound | None = None, serve: Serve | None = None,
                 memory: MemoryWatch | None = None) -> None:
        self.plan = plan
        # torchrun's ranks read the launcher's stdin (pdb, piped input); spawn()'s, as
        # multiprocessing's children, read nothing.
        self.inherit_stdin = inherit_stdin
        self.job = job  # multi-node: this round in the job's store (through the node agent)
        self.config = plan.config
        self.out = stdout or sys.stdout
        self.err = stderr or sys.stderr
        self.poll_interval_s = min(poll_interval_s, self.config.monitor_interval_s)
        self.relay = JobRelay(self.out, self.err, redirects=self.config.redirects,
                              tee=self.config.tee, local_ranks_filter=self.config.local_ranks_filter,
                              quiet=self.config.quiet, attempt_dir=plan.attempt_dir,
                              duplicate_stdout_filters=self.config.duplicate_stdout_filters,
                              duplicate_stderr_filters=self.config.duplicate_stderr_filters,
                              role=self.config.role,
                              prefix_template=self.config.log_line_prefix_template,
                              ranks_filter=self.config.ranks_filter,
                              node=plan.node_rank if plan.nnodes > 1 else None,
                              layout=[(r.rank, r.local_rank) for r in plan.ranks],
                              plain_console=self.config.plain_console,
                              collapse_window_s=self.config.collapse_window_s)
        self.ranks: list[_Rank] = []
        self._placement = watch_for([(r.rank, r.gpu) for r in plan.ranks], self.config.bind)
        self._sel = selectors.DefaultSelector()
        self._pipes = RankPipes(self._sel)  # the ranks' streams in it (paused while the view waits)
        # What the launcher's signals asked (a stop, a notice to pass on, a resize).
        self._signals = LauncherSignals(
            self._sel, forwarded_signals(self.config.signals_to_handle),
            watch_resize=self.relay.stdout.isatty or self.relay.stderr.isatty)
        self._stop_began: float | None = None
        self._killed = False
        self._failing: set[int] = set()  # ranks seen FAILED before they exited
        self._stall: Stall | None = None  # set once: a stall is reported once
        self._ctx: ProcessContext | None = None
        self.sample_interval_s = sample_interval(self.config.stall_timeout_s)
        # Enough samples to cover the stall timeout with a margin (the stall clock starts at
        # the first sample that shows the unchanged stack).
        self._keep_samples = int(self.config.stall_timeout_s / self.sample_interval_s) + 4
        self.on_stall: Any = None  # callback(Stall) for --keep-waiting reports
        self._peer_files: PeerFiles | None = None
        if plan.nnodes > 1:
            from gpuwarden.launch.multinode.peers import PeerFiles

            self._peer_files = PeerFiles(plan)
        self.peers: PeerView | None = self._peer_files.view if self._peer_files else None
        self._stopped_for: str | None = None
        self._job_failure: dict[str, Any] | None = None
        self._own_record: dict[str, Any] | None = None
        self._started = 0.0  # monotonic, set by run()
        # `gpuwarden status` / `stacks` (observer/control.py): their requests run in this loop.
        self._serve = serve
        self._endpoint: Endpoint | None = None
        self.straggler: Straggler | None = None  # the latest verdict (launch/watch/straggler.py)
        self._straggler_since: float | None = None
        self._straggler_said = False
        # --mem-per-rank: the lease's memory guard (launch/watch/memory.py), polled in the loop
        self._memory = memory if memory is not None and memory.active else None
        self._memory_stop: dict[str, Any] | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def run(self) -> RunOutcome:
        self._started = time.monotonic()
        self._signals.install()
        if self.job is not None:
            self._sel.register(self.job.agent.fileno(), selectors.EVENT_READ, _AGENT)
        try:
            if self._serve is not None:
                self._endpoint = self._serve(self)
            if self._endpoint is not None:
                self._sel.register(self._endpoint.fileno(), selectors.EVENT_READ, _ENDPOINT)
            self._ctx = ProcessContext(hold=forwarded_signals(self.config.signals_to_handle))
            self._start_ranks()
            self._loop()
        finally:
            self._final_cleanup()
            self._signals.restore()
        return self.outcome(time.monotonic())

    def outcome(self, now: float) -> RunOutcome:
        """What happened so far (the final outcome once run() returned; a stall report's
        outcome while --keep-waiting lets the job run on)."""
        exits = {r.spec.rank: r.exit for r in self.ranks if r.exit is not None}
        return RunOutcome(self.plan, self._started, now, exits,
                          {r.spec.rank: r.proc.pid for r in self.ranks}, self._stall,
                          self._signals.interrupt, self.peers, self._stopped_for, self._job_failure,
                          self._own_record, self._memory_stop)

    def _start_ranks(self) -> None:
        """Start the plan's ranks. A stop signal (Ctrl-C, SIGTERM) ends the starting: the loop
        then stops the ranks already started. A start that takes long says how far it got."""
        total = len(self.plan.ranks)
        next_note = time.monotonic() + START_PROGRESS_S
        for started, spec in enumerate(self.plan.ranks):
            if self._signals.interrupt is not None:
                self._say(f"gpuwarden: {self._signals.interrupt} while starting ranks: {started} of "
                          f"{total} started, stopping them")
                return
            self._start(spec)
            if time.monotonic() >= next_note and started + 1 < total:
                next_note = time.monotonic() + START_PROGRESS_S
                self._say(f"gpuwarden: started {started + 1} of {total} ranks")

    def _say(self, line: str) -> None:
        """A line of gpuwarden's own on stderr while ranks run (above a terminal's live region)."""
        with self.relay.aside():
            print(line, file=self.err, flush=True)

    def _start(self, spec: RankSpec) -> None:
        # torch's @record writes TORCHELASTIC_ERROR_FILE without creating its directory;
        # torchrun's agent creates attempt_<k>/<local rank>/ for each rank it starts, so does
        # this (only for ranks started: a stop during a long start has only those to remove)
        error_file = spec.env.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            os.makedirs(os.path.dirname(error_file), exist_ok=True)
        status = StatusReader(spec.files.status)
        for path in (spec.files.error, spec.files.stacks, spec.files.fatal,
                     sample_paths(spec.files.stacks)[1]):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        make_request_fifo(spec.files.stacks)
        env = dict(os.environ)
        env.update(spec.env)
        assert self._ctx is not None
        relay = self.relay.open_rank(spec.rank, spec.local_rank)
        stdio = relay.open_stdio()
        try:
            proc = self._ctx.start(spec.argv, env,
                                   stdin=None if self.inherit_stdin else subprocess.DEVNULL,
                                   stdout=stdio.child_out, stderr=stdio.child_err)
        except BaseException:
            stdio.started()
            stdio.close()
            raise
        stdio.started()
        rank = _Rank(spec, proc, status, relay, stdio)
        for fd, is_err in stdio.reads:
            self._sel.register(fd, selectors.EVENT_READ, (rank, is_err))
        self.ranks.append(rank)

    def _loop(self) -> None:
        next_sample = 0.0
        next_adopt = time.monotonic() + ADOPT_CHECK_S
        next_memory = 0.0
        while True:
            self._pump(NOTICE_POLL_S if self._signals.notices else self.poll_interval_s)
            if self._signals.notices:
                self._signals.pass_on(time.monotonic(), self._ctx, self._signal_live_ranks)
            self._reap_exited()
            if self._endpoint is not None:
                self._endpoint.run_pending()
            now = time.monotonic()
            live = [r for r in self.ranks if r.exit is None]
            if not live:
                break
            if now >= next_adopt and self._ctx is not None:
                next_adopt = now + ADOPT_CHECK_S
                self._ctx.adopt()  # orphans re-parented here: noted, reaped when they end
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
                if self._memory is not None and now >= next_memory and not failed:
                    next_memory = now + self._memory.interval_s
                    self._check_memory()
                if self._signals.interrupt is not None or failed or self._stopped_for == "memory":
                    self._begin_stop()
                elif now >= next_sample:
                    next_sample = now + self.sample_interval_s
                    self._sample(now)
                    if self.peers is not None:
                        self._check_peers(now)
                    if self._stop_began is None:
                        self._check_stall(now)
                        self._check_straggler(now)
                    self._check_placement()
            else:
                if not self._killed and (self._signals.hurry or now - self._stop_began >= self.config.grace_s):
                    self._killed = True
                    for r in live:
                        self._signal(r, signal.SIGKILL)
        # Output still in the pipes after the last exit (a child of a rank may hold them open:
        # do not wait for EOF longer than a moment). Only the ranks' pipes are waited for: the
        # signal wake-up, the endpoint and the node agent stay registered to the end. Every
        # pipe is read to its end now, none paused.
        self._pipes.end()
        deadline = time.monotonic() + 0.3
        while self._pipes.is_open() and time.monotonic() < deadline:
            if not self._pump(0.05):
                break

    def _begin_stop(self) -> None:
        if self._signals.interrupt is None and self._may_be_an_echo():
            self._settle()
        self._stop_began = time.monotonic()
        # As torchrun: a stop because gpuwarden got SIGINT/SIGTERM/SIGHUP/SIGQUIT passes that
        # signal on (a Ctrl-C is a KeyboardInterrupt in every rank); any other stop is SIGTERM.
        sig = self._signals.stop_signal if self._signals.interrupt is not None else signal.SIGTERM
        for r in self.ranks:
            if r.exit is None:
                r.tail_at_stop = list(r.relay.stderr_tail)
            if r.exit is None and r.spec.rank not in self._failing:
                self._signal(r, sig)
        self._offer_failure()  # after the signals: it may read the failure's text with explain

    def _signal(self, r: _Rank, sig: signal.Signals) -> None:
        """Signal a rank's group: only through the process context, which knows the group is
        still the rank's (never a reaped rank's pgid, which may be another process's now)."""
        if self._ctx is not None:
            self._ctx.signal_rank(r.proc, sig)

    def _signal_live_ranks(self, sig: signal.Signals) -> None:
        for r in self.ranks:
            if r.exit is None:
                self._signal(r, sig)

    def _may_be_an_echo(self) -> bool:
        """Whether the stop could be for an echo: a failure seen whose own words say a peer went
        away, or a stop for anything but this node's failures (a stall, another node). Only
        then is a rank that may be leaving on its own worth waiting for (_settle); a rank's
        own error (a KeyError, exit code 3, a signal) stops the others at once, as torchrun's
        next monitor tick would (it was 0.25 s later than needed on every failure)."""
        failures = 0
        for r in self.ranks:
            if r.exit is not None:
                if not r.exit.failed or r.exit.stopped_by_launcher:
                    continue
                failures += 1
                if is_echo(r.exit):
                    return True
            elif r.spec.rank in self._failing:
                failures += 1
                message = str((read_json_object(r.spec.files.error) or {}).get("message", ""))
                if echoes(" ".join([message, *list(r.relay.stderr_tail)[-5:]])):
                    return True
        return failures == 0

    def _settle(self) -> None:
        """Before the first signal: let a rank that is already ending finish ending. A process's
        sockets close before it can be reaped (memory and files go first), so its peer's
        'Connection closed by peer' may be seen before its own exit: a rank that leaves in
        this moment left on its own (os._exit(0) mid-job), and must not count as stopped."""
        deadline = time.monotonic() + STOP_SETTLE_S
        while time.monotonic() < deadline:
            self._pump(0.02)
            self._reap_exited()

    def _check_memory(self) -> None:
        """A rank (with its children) using more GPU memory than the lease: named on stderr;
        with --mem-enforce stop, the job stops for it (LEASE_MEMORY_EXCEEDED)."""
        assert self._memory is not None
        lines, stop = self._memory.check()
        for line in lines:
            print(line, file=self.err, flush=True)
        if stop is not None and self._stopped_for is None:
            self._stopped_for = "memory"
            self._memory_stop = stop

    def _check_placement(self) -> None:
        """Ranks crowding one GPU (a script without set_device): say so once, with the fix."""
        if self._placement is None:
            return
        found = self._placement.check(
            lambda: {r.spec.rank: pids_of(r.proc.pid) for r in self.ranks if r.exit is None})
        if found is not None:
            self._say(render_warning(found))

    # ---- multi-node ------------------------------------------------------------------------

    def _check_peers(self, now: float) -> None:
        """Read what the ranks' store watches wrote; stop on another node's abort, or when the
        store (node 0) is gone while this node's ranks still wait for the others."""
        assert self._peer_files is not None
        view = self._peer_files.read(now)
        if view.abort is not None and int(view.abort.get("node", -1)) != self.plan.node_rank:
            self._stopped_for = "abort"
            self._begin_stop()
        elif view.store_lost_at is not None and now - view.store_lost_at >= STORE_LOST_GRACE_S:
            # Node 0's normal end also closes the store: stop only ranks still *waiting* for
            # others (init or a collective) well after it went away.
            waiting = [r for r in self.ranks if r.exit is None and r.sampler is not None
                       and current_wait(r.sampler.samples, _source_line) is not None]
            if waiting:
                self._stopped_for = "store_lost"
                self._begin_stop()

    def _offer_failure(self) -> None:
        """This node stops of its own accord (a rank failed, a stall, an interrupt), or its
        last rank failed: offer its first failure as the job's (the first node to write it
        wins; an echo waits for a real cause elsewhere: job_store.py)."""
        if self.job is None or self._stopped_for is not None or self._own_record is not None:
            return
        failed = any(r.exit is not None and r.exit.failed and not r.exit.stopped_by_launcher
                     for r in self.ranks)
        if not (failed or self._failing or self._stall is not None or self._signals.interrupt):
            return
        self._own_record = self._local_record()
        if not self._own_record.get("echo"):
            self.job.publish(self._own_record)

    def _agent_events(self) -> None:
        """What the node agent saw in the job's store: another node's first failure, a node
        lost, nodes waiting to join, the store gone: each stops this node's ranks."""
        assert self.job is not None
        if self.job.agent.eof:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(self.job.agent.fileno())  # the agent exited
        for stop_for, rec in self.job.poll():
            if rec is not None:
                self._job_failure = self._job_failure or rec
            if stop_for == "store_lost" and self.peers is not None and self.peers.store_lost is None:
                self.peers.store_lost = "the job's store went away"
            if stop_for is not None and self._stop_began is None:
                self._stopped_for = stop_for
                self._begin_stop()

    def _local_record(self) -> dict[str, Any]:
        """This node's first failure as a record for the job's store (job_store.py)."""
        from gpuwarden.launch.multinode import job_store

        failed = []
        for r in self.ranks:
            if r.spec.rank in self._failing or (
                    r.exit is not None and r.exit.failed and not r.exit.stopped_by_launcher):
                failed.append(job_store.RankFailure(
                    r.spec.rank, read_json_object(r.spec.files.error) or {},
                    r.exit.returncode if r.exit is not None else None,
                    list(r.relay.stderr_tail), read_fatal_dump(r.spec.files.fatal),
                    r.exit.ended_at if r.exit is not None else time.monotonic()))
        return job_store.local_record(self.plan.node_rank, failed, interrupt=self._signals.interrupt,
                                      stall=self._stall,
                                      stall_timeout_s=self.config.stall_timeout_s)

    def _reap_exited(self) -> None:
        for r in self.ranks:
            if r.exit is not None:
                continue
            assert self._ctx is not None
            code = self._ctx.poll(r.proc)  # not reaped yet: its group stays its own
            if code is None:
                continue
            now = time.monotonic()
            r.exit = RankExit(
                rank=r.spec.rank, pid=r.proc.pid, returncode=code, ended_at=now,
                stopped_by_launcher=self._stop_began is not None
                and r.spec.rank not in self._failing,
                killed_by_launcher=self._killed and code == -signal.SIGKILL,
                error=read_json_object(r.spec.files.error),
                fatal_dump=read_fatal_dump(r.spec.files.fatal),
                stderr_before_stop=r.tail_at_stop,
                finished_script=code < 0 and _phase(r) is Phase.FINISHED)
            if code != 0:
                r.exit.torch_error = read_torch_error(r.spec.env.get("TORCHELASTIC_ERROR_FILE", ""))
                # Lines still in the pipe belong in the report's tail.
                self._pipes.drain(r)
                r.exit.stderr_tail = list(r.relay.stderr_tail)
                if not r.exit.fatal_dump.strip():
                    # torch's @record (elastic's error handler) re-enables faulthandler on
                    # stderr, replacing the bootstrap's file: the dump is in the output then.
                    r.exit.fatal_dump = fatal_dump_in(r.exit.stderr_tail)

    def _final_cleanup(self) -> None:
        # Anything left in a rank's group (its own children) goes now, with a bounded reap.
        if self._ctx is not None:
            self._ctx.kill_and_reap([r.proc for r in self.ranks])
        if self.job is not None:
            self._offer_failure()  # the last rank failed: no stop was needed, say it anyway
            # Events that came after the last look (the round's record, most often).
            self._agent_events()
        if self._ctx is not None:
            self._ctx.close()  # adopted orphans (daemons of the ranks) go too
        if self._peer_files is not None:
            self._peer_files.late_abort()  # the ranks are gone: their peers files are final
        for key in list(self._sel.get_map().values()):
            self._sel.unregister(key.fd)  # the node agent's pipe too (it outlives the round)
        self._pipes.clear()
        self._sel.close()
        for r in self.ranks:
            r.stdio.close()
            if r.sampler is not None:
                r.sampler.close()
            r.status.close()
        self.relay.close()
        if self._endpoint is not None:
            self._endpoint.close()

    # ---- output ----------------------------------------------------------------------------

    def _pump(self, timeout: float) -> bool:
        """Relay whatever the ranks wrote; True when there was something. The relay's own
        deadlines (a line held on a terminal for the same line of other ranks) cut the wait.

        With the terminal's view each ready stream is read once per round, the streams in
        turn (ranks/pipes.py), and rounds follow one another here while output keeps coming,
        for at most PUMP_ROUNDS_S: the loop's other work (reaping, sampling) is not done for
        every few kilobytes; a signal ends the rounds at once. A round whose reads all found
        little is followed by a short nap (ranks/pipes.py, gather)."""
        due = self.relay.next_due()
        if due is not None:
            timeout = max(0.0, min(timeout, due - time.monotonic()))
        got = False
        rounds_until = time.monotonic() + PUMP_ROUNDS_S if self.relay.view is not None else 0.0
        while True:
            ready = self._sel.select(timeout)
            signalled = False
            fullest = 0
            for key, _ in ready:
                if key.data is None:  # the signal wake-up socket
                    self._signals.clear_wakeup()
                    signalled = True
                    continue
                if key.data is _ENDPOINT:  # a status/stacks request: run_pending() follows
                    assert self._endpoint is not None
                    self._endpoint.clear_wakeups()
                    signalled = True
                    continue
                if key.data is _AGENT:
                    self._agent_events()
                    signalled = True
                    continue
                rank, is_err = key.data
                got = True
                fullest = max(fullest, self._pipes.read(rank, key.fd, is_err))
            if self._signals.take_resize():
                self.relay.resized()
            self.relay.tick()
            self._pipes.resume_ready()
            if signalled or not ready or time.monotonic() >= rounds_until:
                return got
            gather(fullest)
            timeout = 0.0

    # ---- stalls ----------------------------------------------------------------------------

    def _sample(self, now: float) -> None:
        """One look at every live rank whose stack handler is armed (see sampler.py)."""
        for r in self.ranks:
            if r.exit is not None:
                continue
            st = _safe_status(r)
            if st is None or st.phase is not Phase.STARTED:
                continue
            if r.sampler is None:
                r.sampler = RankSampler(r.proc.pid, r.spec.files.stacks, self._keep_samples)
            r.sampler.tick(now)

    def views(self) -> dict[int, RankView]:
        """What is known of every rank of the job, for decide_stall."""
        views: dict[int, RankView] = {}
        for r in self.ranks:
            rank = r.spec.rank
            if r.exit is not None:
                views[rank] = RankView(rank, "exited", returncode=r.exit.returncode)
                continue
            st = _safe_status(r)
            if st is None or st.phase is Phase.NOT_STARTED:
                views[rank] = RankView(rank, "not_started")
            elif st.phase is Phase.FINISHED:
                views[rank] = RankView(rank, "finished")
            else:
                samples = tuple(r.sampler.samples) if r.sampler is not None else ()
                views[rank] = RankView(rank, "running", samples)
        if self.peers is not None and self.peers.reader_connected:
            # Other nodes' ranks: only the store's word on who reached init_process_group.
            for rank in range(self.plan.world_size):
                if rank in views:
                    continue
                missing = "" if rank in self.peers.arrived else (
                    f"(node {self.plan.node_of(rank)}) has not reached init_process_group (not "
                    "in the job's store); last seen: never")
                views[rank] = RankView(rank, "remote", remote_where=missing)
        return views

    def _check_stall(self, now: float) -> None:
        if self._stall is not None:
            return
        stall = decide_stall(self.views(), now, self.config.stall_timeout_s, _source_line)
        if stall is None:
            return
        stall.stacks = self.collect_stacks([r for r in self.ranks if r.exit is None])
        from gpuwarden.launch.watch import flight_recorder

        stall.flight_records = flight_recorder.summary(self.plan.run_dir)
        self._stall = stall
        if self.config.keep_waiting:
            if self.on_stall is not None:
                with self.relay.aside():
                    self.on_stall(self._stall)
        else:
            self._begin_stop()

    def _check_straggler(self, now: float) -> None:
        """Name a rank the others keep waiting for (status shows it at once), and say it once
        on stderr when it persists (--no-straggler-note: never)."""
        found = decide_straggler(self.views(), now, _source_line)
        if found is None or self.straggler is None or found.rank != self.straggler.rank:
            self._straggler_since = now if found is not None else None
        self.straggler = found
        if found is not None and not self._straggler_said and self.config.straggler_note \
                and self._straggler_since is not None \
                and now - self._straggler_since >= STRAGGLER_PERSIST_S:
            self._straggler_said = True
            self._say(f"gpuwarden: note[RANK_STRAGGLER]: {found.describe()}")

    def collect_stacks(self, ranks: list[_Rank]) -> dict[int, list[str]]:
        """A fresh dump of each rank's script thread (its latest sample when none comes)."""
        out = {}
        for r in ranks:
            if r.sampler is None:
                continue
            self._pump(0)
            frames = main_thread_frames(r.sampler.fresh_dump(), REPORT_STACK_FRAMES)
            if frames:
                out[r.spec.rank] = frames
        return out


def _source_line(path: str, lineno: int) -> str:
    return linecache.getline(path, lineno)


def _phase(r: _Rank) -> Phase | None:
    st = _safe_status(r)
    return st.phase if st is not None else None


def _safe_status(r: _Rank) -> RankStatus | None:
    try:
        return r.status.read()
    except (OSError, ValueError):
        return None
