"""The process context: start ranks, signal their process groups, stop them with bounded waits,
and keep every descendant (shaped like torch.distributed.elastic's ``PContext``).

- every rank is its own session and process group (``start_new_session``), so SIGTERM/SIGKILL
  reach the rank's own children (DataLoader workers, compile workers) too, and a Ctrl-C on the
  terminal reaches only gpuwarden, which then stops the ranks in order;
- a stop is SIGTERM to every group, SIGKILL after the grace period, then a *bounded* reap: a
  process stuck in the kernel (D state) cannot hold the launcher forever;
- the launcher is the child subreaper (``PR_SET_CHILD_SUBREAPER``, Linux): a rank's descendant
  that double-forks and calls ``setsid`` (a daemon) is re-parented here instead of to init, is
  told to the group reaper (so it dies if the launcher is SIGKILLed), and is stopped at the end
  of the job;
- a tiny reaper process (:class:`gpuwarden.procs.GroupReaper`) SIGKILLs the registered groups if
  this process itself is SIGKILLed; each rank also has PR_SET_PDEATHSIG (armed by the bootstrap).

What cannot be caught: a descendant that escapes while the launcher is SIGKILLed (the kernel
then re-parents it to init before anyone sees it) and has left its process group; processes
started through another service (``systemd-run``, ``ssh``, a container runtime), which are not
descendants; on a kernel without ``/proc/PID/task/TID/children`` the launcher scans ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

from gpuwarden.procs import _PRCTL, GroupReaper

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
REAP_WAIT_S = 5.0  # after SIGKILL: a process in uninterruptible sleep is left, not waited for


def _prctl_subreaper(on: bool) -> bool:
    if _PRCTL is None:
        return False
    return _PRCTL(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0


def _is_subreaper() -> bool:
    if _PRCTL is None:
        return False
    import ctypes

    flag = ctypes.c_int(0)
    _PRCTL(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
    return bool(flag.value)


def children_of_self() -> set[int]:
    """The pids whose parent is this process (ranks, helpers, and adopted orphans)."""
    me = os.getpid()
    kids: set[int] = set()
    try:
        for tid in os.listdir(f"/proc/{me}/task"):
            with open(f"/proc/{me}/task/{tid}/children", encoding="ascii") as f:
                kids.update(int(p) for p in f.read().split())
        return kids
    except OSError:
        pass
    for name in os.listdir("/proc"):  # no children files (CONFIG_PROC_CHILDREN off)
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(b")") + 2:].split()
            if len(fields) > 1 and int(fields[1]) == me:
                kids.add(int(name))
    return kids


class ProcessContext:
    """The ranks' processes: start, signal, stop, reap; plus the descendants it adopts."""

    def __init__(self) -> None:
        self.reaper = GroupReaper()
        self._own: set[int] = {self.reaper.pid}  # started here: never "adopted"
        # Children this process had before (a notebook's, a test runner's) are not the job's;
        # nor is a new child in this process's own session (started by another of its threads):
        # the ranks and everything they start live in sessions of their own.
        self._own |= children_of_self()
        self._session = os.getsid(0)
        self.adopted: set[int] = set()
        self._was_subreaper = _is_subreaper()
        self.subreaper = self._was_subreaper or _prctl_subreaper(True)

    def start(self, argv: Sequence[str], env: Mapping[str, str], *,
              stdin: int | None = subprocess.DEVNULL, stdout: int = subprocess.PIPE,
              stderr: int = subprocess.PIPE) -> subprocess.Popen[bytes]:
        """Start one rank in a session of its own; ``stdin=None`` inherits the launcher's (as
        torchrun's ranks do), ``stdout``/``stderr`` are descriptors (launch/relay.RankStdio)."""
        proc = subprocess.Popen(
            list(argv), env=dict(env), stdin=stdin, stdout=stdout, stderr=stderr,
            start_new_session=True, close_fds=True)
        self.track(proc.pid)
        return proc

    def track(self, pid: int) -> None:
        """A process started here (its own session): its group dies if the launcher dies."""
        self._own.add(pid)
        self.reaper.add(pid)

    @staticmethod
    def signal_group(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def adopt(self) -> set[int]:
        """Take note of orphans re-parented here; reap those that already ended. Returns the
        live adopted pids."""
        if not self.subreaper:
            return set()
        for pid in children_of_self() - self._own - self.adopted:
            if _sid(pid) in (self._session, None):
                self._own.add(pid)
                continue
            self.adopted.add(pid)
            self.reaper.add(_pgid(pid))
        for pid in list(self.adopted):
            if _reap(pid, block=False):
                self.adopted.discard(pid)
        return set(self.adopted)

    def stop_adopted(self, timeout_s: float = REAP_WAIT_S) -> list[int]:
        """SIGKILL every adopted descendant (and the group it leads), including those re-parented
        while doing so, and reap them within ``timeout_s``. Returns the pids stopped."""
        stopped: list[int] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = self.adopt()
            if not live:
                break
            for pid in live:
                if pid not in stopped:
                    stopped.append(pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if _pgid(pid) == pid:
                        os.killpg(pid, signal.SIGKILL)
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        return stopped

    @staticmethod
    def kill_and_reap(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = REAP_WAIT_S) -> None:
        """SIGKILL each process's group and wait for it, all within ``timeout_s``."""
        for proc in procs:
            ProcessContext.signal_group(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """The job is over: nothing adopted survives; the reaper exits; subreaper off again
        (gpuwarden may run inside a longer-lived process, a test runner or a notebook)."""
        self.stop_adopted()
        if self.subreaper and not self._was_subreaper:
            _prctl_subreaper(False)
        self.reaper.close()


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except OSError:
        return pid


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _reap(pid: int, *, block: bool) -> bool:
    """True when ``pid`` has ended (and is reaped, or was not ours to reap)."""
    try:
        done, _status = os.waitpid(pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
        return True
    return done == pid
