"""The process context: start ranks, signal their process groups, stop them with bounded waits,
and keep every descendant (shaped like torch.distributed.elastic's ``PContext``).

- every rank is its own session and process group (``start_new_session``), so SIGTERM/SIGKILL
  reach the rank's own children (DataLoader workers, compile workers) too, and a Ctrl-C on the
  terminal reaches only gpuwarden, which then stops the ranks in order;
- **a group is signalled only while it is known to be ours**: a rank that exits is not reaped
  at once (``waitid(WNOWAIT)`` reads its exit status and leaves the zombie), and the zombie
  keeps its pid, so its group's number cannot be given to another process meanwhile. At the
  end the group gets its SIGKILL (what the rank left in it), the watcher forgets the group,
  and only then is the rank reaped; after that its group is never signalled again;
- a stop is SIGTERM to every group, SIGKILL after the grace period, then a *bounded* reap: a
  process stuck in the kernel (D state) cannot hold the launcher forever;
- **every descendant is tracked**: where the host lets this user make a cgroup (cgroup v2,
  root or a delegated subtree: ``systemd-run --user --scope -p Delegate=yes gpuwarden
  launch ...``) and no Slurm job tracks the processes already (:func:`in_slurm_job`), the
  ranks start in a cgroup of the job's own, which nothing started in it can
  leave without privilege, and which is killed whole at the end; elsewhere the launcher is
  the child subreaper (``PR_SET_CHILD_SUBREAPER``): a descendant that double-forks and calls
  ``setsid`` (a daemon) is re-parented here instead of to init, and the descendants that
  left their rank's group while their parent lives (``start_new_session=True``) are looked
  for every :data:`DESCENDANT_CHECK_S` and told to the watcher;
- a tiny watcher process (:class:`gpuwarden.procs.GroupReaper`) kills all of it if this process
  itself is SIGKILLed, checking each group and process is still the one registered; each
  rank also has PR_SET_PDEATHSIG (armed by the bootstrap).

What cannot be caught without a cgroup: a descendant that leaves its rank's group less than
:data:`DESCENDANT_CHECK_S` before the launcher is SIGKILLed; processes started through another
service (``systemd-run``, ``ssh``, a container runtime), which are not descendants.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from gpuwarden.procs import _PRCTL, GroupReaper, ProcStat, announce_group, proc_stat

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
REAP_WAIT_S = 5.0  # after SIGKILL: a process in uninterruptible sleep is left, not waited for
DESCENDANT_CHECK_S = 1.0  # the supervisor's adopt() tick: descendants looked for this often
MAX_DESCENDANTS = 4096  # a descendant walk stops here (a fork bomb is not tracked one by one)


def _in_child(cgroup: JobCgroup | None, reaper_fd: int) -> None:
    """A rank between fork and exec (after setsid): into the job's cgroup, and known to the
    watcher, before it runs a single instruction of its own. System calls only."""
    if cgroup is not None:
        cgroup.join_in_child()
    announce_group(reaper_fd)


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


def children_of(pid: int) -> set[int]:
    """The pids whose parent is ``pid`` (empty when it cannot be read)."""
    kids: set[int] = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                kids.update(int(p) for p in f.read().split())
        return kids
    except (OSError, ValueError):
        pass
    if pid != os.getpid():
        return kids
    for name in os.listdir("/proc"):  # no children files (CONFIG_PROC_CHILDREN off)
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None and st.ppid == pid:
                kids.add(st.pid)
    return kids


def children_of_self() -> set[int]:
    """The pids whose parent is this process (ranks, helpers, and adopted orphans)."""
    return children_of(os.getpid())


# -- a cgroup per job -----------------------------------------------------------------------------

def in_slurm_job(env: Mapping[str, str]) -> bool:
    """This process runs in a Slurm job on one of its nodes (slurmstepd started it or an
    ancestor: a step's task, a batch script). Slurm tracks every process of the job there
    (proctrack): its cgroups, its signals, its end. The ranks stay in Slurm's container: a
    cgroup of the job's own, nested under a task's cgroup v2, would take them out of what
    Slurm reads (task_N/cgroup.procs), out of reach of scancel and of its limits."""
    return bool((env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")) and env.get("SLURMD_NODENAME"))


def _cgroup2_mount() -> str | None:
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if right.split(" ", 1)[0] == "cgroup2":
                    return left.split()[4]
    except OSError:
        pass
    return None


def _own_cgroup() -> str | None:
    try:
        with open("/proc/self/cgroup", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return None


class JobCgroup:
    """A cgroup v2 of one job, made beside nothing else under this process's own cgroup.

    Made only where this user may: root, or a delegated subtree (systemd's ``Delegate=yes``
    makes the user's scope writable). A process started in it stays in it, with every
    process it starts, whatever it does with sessions and groups: killing it
    (``cgroup.kill``) kills exactly the job's processes, never a reused pid."""

    def __init__(self, path: str, procs_fd: int) -> None:
        self.path = path
        self._procs_fd = procs_fd

    @classmethod
    def create(cls) -> JobCgroup | None:
        mount, own = _cgroup2_mount(), _own_cgroup()
        if mount is None or own is None:
            return None
        parent = os.path.join(mount, own.lstrip("/"))
        if not os.access(os.path.join(parent, "cgroup.procs"), os.W_OK):
            return None  # moving a process into a child needs this: no delegation here
        path = os.path.join(parent, f"gpuwarden-job-{os.getpid()}-{os.urandom(4).hex()}")
        try:
            os.mkdir(path)
        except OSError:
            return None
        try:
            fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(path)
            return None
        return cls(path, fd)

    def join_in_child(self) -> None:
        """Move the calling process into the cgroup: a ``preexec_fn``, system calls only, so a
        rank is in it before it runs a single instruction of its own."""
        with contextlib.suppress(OSError):
            os.write(self._procs_fd, b"0")

    def holds(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
                return any(line.startswith("0::") and self.path.endswith(line[3:].strip())
                           for line in f)
        except OSError:
            return False

    def populated(self) -> bool:
        try:
            with open(os.path.join(self.path, "cgroup.events"), encoding="ascii") as f:
                return any(line.strip() == "populated 1" for line in f)
        except OSError:
            return False

    def kill(self) -> None:
        try:
            with open(os.path.join(self.path, "cgroup.kill"), "w", encoding="ascii") as f:
                f.write("1")
            return
        except OSError:
            pass
        # Before Linux 5.14: freeze (nothing forks meanwhile), kill each, thaw.
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(self.path, "cgroup.freeze"), "w", encoding="ascii") as f:
                f.write("1")
            with open(os.path.join(self.path, "cgroup.procs"), encoding="ascii") as f:
                members = [int(x) for x in f.read().split()]
            for pid in members:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            with open(os.path.join(self.path, "cgroup.freeze"), "w", encoding="ascii") as f:
                f.write("0")

    def remove(self, timeout_s: float = REAP_WAIT_S) -> bool:
        """Kill what is left in it, and remove it once empty; False when something would not
        die within ``timeout_s`` (a process in D state): the empty cgroup is left then."""
        with contextlib.suppress(OSError):
            os.close(self._procs_fd)
        deadline = time.monotonic() + timeout_s
        if self.populated():
            self.kill()
        while time.monotonic() < deadline:
            try:
                os.rmdir(self.path)
                return True
            except FileNotFoundError:
                return True
            except OSError:
                time.sleep(0.02)
        return False


# -- the processes of one job ----------------------------------------------------------------------

@dataclass
class _Member:
    """A process started here: its group is ours while it is unreaped."""

    proc: subprocess.Popen[bytes]
    pgid: int
    returncode: int | None = None  # read with WNOWAIT: the zombie is kept
    reaped: bool = False


class ProcessContext:
    """The ranks' processes: start, signal, stop, reap; plus the descendants it adopts."""

    def __init__(self, *, cgroup: bool = True, hold: Iterable[int] = ()) -> None:
        # The watcher holds the signals passed on to the ranks (see signal_reached_ranks).
        self.reaper = GroupReaper(hold)
        self.cgroup = JobCgroup.create() if cgroup and not in_slurm_job(os.environ) else None
        if self.cgroup is not None:
            self.reaper.add_cgroup(self.cgroup.path)
        self._own: set[int] = {self.reaper.pid}  # started here: never "adopted"
        # Children this process had before (a notebook's, a test runner's) are not the job's;
        # nor is a new child in this process's own session (started by another of its threads):
        # the ranks and everything they start live in sessions of their own.
        self._own |= children_of_self()
        self._session = os.getsid(0)
        self._members: dict[int, _Member] = {}
        self.adopted: dict[int, int] = {}  # pid -> start ticks
        self._escaped: dict[int, int] = {}  # descendants outside their rank's group -> start
        self._was_subreaper = _is_subreaper()
        self.subreaper = self._was_subreaper or _prctl_subreaper(True)

    def start(self, argv: Sequence[str], env: Mapping[str, str], *,
              stdin: int | None = subprocess.DEVNULL, stdout: int = subprocess.PIPE,
              stderr: int = subprocess.PIPE) -> subprocess.Popen[bytes]:
        """Start one rank in a session of its own; ``stdin=None`` inherits the launcher's (as
        torchrun's ranks do), ``stdout``/``stderr`` are descriptors (launch/ranks/stdio.RankStdio)."""
        proc = subprocess.Popen(
            list(argv), env=dict(env), stdin=stdin, stdout=stdout, stderr=stderr,
            start_new_session=True, close_fds=True,
            preexec_fn=partial(_in_child, self.cgroup, self.reaper.announce_fd))
        self._members[proc.pid] = _Member(proc, proc.pid)
        self._own.add(proc.pid)
        self.reaper.add(proc.pid)
        return proc

    def track(self, pid: int) -> None:
        """A process started here by the caller (its own session): its group dies if the
        launcher dies (checked against its start time, whoever reaps it)."""
        self._own.add(pid)
        self.reaper.add(pid)

    # -- one rank ----------------------------------------------------------------------------

    def poll(self, proc: subprocess.Popen[bytes]) -> int | None:
        """The rank's exit status once it exited (None while it runs), without reaping it: its
        zombie keeps the pid, and so the number of its process group, ours."""
        member = self._members.get(proc.pid)
        if member is None:
            return proc.poll()
        if member.returncode is not None:
            return member.returncode
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped by someone else (proc.wait()): its group is not ours
            member.reaped = True
            self.reaper.remove(member.pgid)
            member.returncode = proc.returncode if proc.returncode is not None else -1
            return member.returncode
        if info is None or info.si_pid == 0:
            return None
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        member.returncode = code
        return code

    def signal_reached_ranks(self, sig: int) -> bool | None:
        """Whether ``sig``, just received by this process, was sent to its ranks too: the
        watcher, placed as a rank is (a child of this process in a session of its own), holds
        it pending. Slurm signals a step's whole process tree under proctrack/linuxproc and its
        cgroup under proctrack/cgroup, the ranks included, but only the task's process group
        under proctrack/pgid; ``pkill`` reaches every process of a name; a user's ``kill``
        reaches this process alone. (A job cgroup of gpuwarden's own holds the ranks but not
        the watcher; it is never made inside a Slurm job, and every other sender that signals
        a cgroup does it with its sub-cgroups.) None when the watcher cannot tell: it does not
        hold ``sig``, or it is gone."""
        got = self.reaper.got(sig)
        if got:
            self.reaper.forget_signals()
        return got

    def signal_rank(self, proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        """Signal the rank's process group, only while its leader is unreaped (the group is then
        certainly this rank's); a reaped rank's group number may be another process's now."""
        member = self._members.get(proc.pid)
        if member is None or member.reaped:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(member.pgid, sig)

    def _reap(self, member: _Member, timeout_s: float) -> bool:
        """Reap a rank whose group got its SIGKILL: the watcher forgets the group first."""
        deadline = time.monotonic() + timeout_s
        while self.poll(member.proc) is None:
            if time.monotonic() >= deadline:
                return False  # stuck in the kernel: left unreaped (its pid stays pinned)
            time.sleep(0.01)
        if member.reaped:
            return True
        self.reaper.remove(member.pgid)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(member.proc.pid, 0)
        member.reaped = True
        member.proc.returncode = member.returncode  # Popen must not wait for it again
        return True

    def kill_and_reap(self, procs: Sequence[subprocess.Popen[bytes]],
                      timeout_s: float = REAP_WAIT_S) -> None:
        """SIGKILL each process's group (what a rank left in it too) and reap it, all within
        ``timeout_s``."""
        members = [self._members[p.pid] for p in procs if p.pid in self._members]
        for p in procs:
            if p.pid in self._members:
                self.signal_rank(p, signal.SIGKILL)
            elif p.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    p.kill()
        deadline = time.monotonic() + timeout_s
        for member in members:
            self._reap(member, max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.pid not in self._members:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(0.0, deadline - time.monotonic()))

    # -- descendants ---------------------------------------------------------------------------

    def adopt(self) -> set[int]:
        """Take note of orphans re-parented here (reap those that already ended), and of the
        descendants that left their rank's group. Returns the live adopted pids."""
        if self.subreaper:
            for pid in children_of_self() - self._own - set(self.adopted):
                st = proc_stat(pid)
                if st is None or st.session == self._session:
                    self._own.add(pid)
                    continue
                self.adopted[pid] = st.start_ticks
                self.reaper.add_process(pid, st.start_ticks)
            for pid in list(self.adopted):
                self._check_adopted(pid)
        if self.cgroup is None:
            self._track_escaped()
        return set(self.adopted)

    def _check_adopted(self, pid: int) -> None:
        """An adopted orphan: reap it once it ended (the watcher forgets it first); while it
        lives, the watcher knows the group it leads now (a daemon may setsid again)."""
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            info = None
            ended = True
        else:
            ended = info is not None and info.si_pid != 0
        if ended:
            self.reaper.remove(pid)
            self.reaper.remove_process(pid)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            del self.adopted[pid]
            return
        st = proc_stat(pid)
        if st is not None and st.pgrp == pid and pid not in self.reaper.groups:
            self.reaper.add(pid)  # it leads a group now: the group goes with it

    def _track_escaped(self) -> None:
        """Without a cgroup: the descendants of live ranks that are not in their rank's group
        (a child started with ``start_new_session``) are told to the watcher, one by one, so
        that a SIGKILLed launcher leaves them no more than its ranks."""
        found: dict[int, int] = {}
        for member in self._members.values():
            if member.returncode is not None or member.reaped:
                continue
            todo = [member.proc.pid]
            while todo and len(found) < MAX_DESCENDANTS:
                for kid in children_of(todo.pop()):
                    st: ProcStat | None = proc_stat(kid)
                    if st is None:
                        continue
                    todo.append(kid)
                    if st.pgrp != member.pgid:
                        found[kid] = st.start_ticks
        for pid, start in found.items():
            if self._escaped.get(pid) != start:
                self._escaped[pid] = start
                self.reaper.add_process(pid, start)
        for pid in list(self._escaped):
            if pid not in found:
                del self._escaped[pid]
                self.reaper.remove_process(pid)

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
                # Unreaped children of ours: their pids (and a group one leads) are pinned.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    st = proc_stat(pid)
                    if st is not None and st.pgrp == pid:
                        os.killpg(pid, signal.SIGKILL)
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        return stopped

    def _kill_escaped(self) -> None:
        """The descendants that left their rank's group, still running after the ranks ended
        (not our children, so not adopted: their parent lives): by pidfd, after checking."""
        for pid, start in list(self._escaped.items()):
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                st = proc_stat(pid)
                if st is not None and st.start_ticks == start:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)

    def close(self) -> None:
        """The job is over: nothing it started survives; the reaper exits; subreaper off again
        (gpuwarden may run inside a longer-lived process, a test runner or a notebook)."""
        self._kill_escaped()
        if self.cgroup is not None:
            self.cgroup.kill()
        self.stop_adopted()
        if self.cgroup is not None:
            self.cgroup.remove()
        if self.subreaper and not self._was_subreaper:
            _prctl_subreaper(False)
        self.reaper.close()
