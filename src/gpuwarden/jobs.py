"""Every gpuwarden job on this host, for ``gpuwarden status``: who runs what, since when, on
which GPUs, and (for the asking user's own launches) what every rank is doing.

Three sources, each saying only what it may:

- the process table: every ``gpuwarden launch``, ``gpuwarden run`` and ``gpuwarden worker``
  process of every user, with its pid, owner, command line and start time: what ``ps`` shows
  every user anyway (a host mounted with ``hidepid`` hides other users' here too);
- the lease directory, through :func:`gpuwarden.lease.list_leases` (what ``gpuwarden leases``
  shows): the GPUs each holder leased, pools and Dask workers included;
- this user's launchers, through their control endpoints (``launch/observer/control.py``): ranks, phases,
  stalls, stragglers. Another user's endpoints sit in their own 0700 directory: the kernel
  refuses a connection, so their jobs are listed without any of it.

Strings from other processes and users (command lines, labels) are escaped before output by the
renderer (``cli/status.py``); here they are kept as read, bounded.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STATUS_SCHEMA = 1
KINDS = ("launch", "run", "worker")
MAX_CMDLINE_BYTES = 8192
ASK_TIMEOUT_S = 1.5
COMMAND_CHARS = 300


@dataclass
class Job:
    pid: int
    kind: str  # launch, spawn, run, worker, pool, lease
    uid: int | None
    user: str
    command: str
    started_at: float | None  # unix time
    mine: bool
    gpus: list[dict[str, Any]] = field(default_factory=list)  # from the lease directory
    launch: dict[str, Any] | None = None  # the launcher's own answer (this user's jobs)
    note: str | None = None  # why there is no more to show
    findings: list[dict[str, Any]] = field(default_factory=list)  # e.g. LEASE_MEMORY_EXCEEDED

    @property
    def id(self) -> str:
        return str(self.pid)

    def to_dict(self, now: float) -> dict[str, Any]:
        return {"id": self.id, "pid": self.pid, "kind": self.kind, "user": self.user,
                "uid": self.uid, "mine": self.mine, "private": not self.mine,
                "command": self.command, "started_at": self.started_at,
                "age_s": None if self.started_at is None else round(max(0.0, now - self.started_at), 1),
                "gpus": self.gpus, "note": self.note, "launch": self.launch,
                "findings": self.findings}


@dataclass(frozen=True)
class JobTable:
    host: str
    at: float
    jobs: tuple[Job, ...]
    lease_dir: str | None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "generated_at": self.at, "lease_dir": self.lease_dir,
                "jobs": [j.to_dict(self.at) for j in self.jobs], "notes": list(self.notes)}


def _user(uid: int | None) -> str:
    if uid is None:
        return "?"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _boot_time() -> float:
    with contextlib.suppress(OSError, ValueError), open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    return 0.0


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def gpuwarden_kind(argv: list[str]) -> str | None:
    """'launch', 'run' or 'worker' when ``argv`` runs that gpuwarden command (the console
    script, ``python .../bin/gpuwarden``, or ``python -m gpuwarden``), else None (ranks,
    helpers, a script that merely takes 'gpuwarden' as an argument)."""
    if not argv:
        return None
    rest = argv
    if os.path.basename(argv[0]).startswith("python"):
        i = 1
        while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
            i += 2 if argv[i] in ("-X", "-W") else 1  # the interpreter's options
        if i < len(argv) - 1 and argv[i] == "-m":
            if argv[i + 1] not in ("gpuwarden", "gpuwarden.cli"):
                return None
            rest = argv[i + 1:]
        else:
            rest = argv[i:]
    if not rest or os.path.basename(rest[0]) not in ("gpuwarden", "gpuwarden.cli"):
        return None
    sub = rest[1] if len(rest) > 1 else ""
    return sub if sub in KINDS else None


def scan_processes(proc: str = "/proc") -> list[Job]:
    """gpuwarden's commands in the process table, every user's."""
    from gpuwarden.launch.observer.control import process_start_ticks

    me = os.getuid()
    boot = _boot_time()
    out = []
    try:
        entries = [e.name for e in os.scandir(proc) if e.name.isdigit()]
    except OSError:
        return []
    for name in entries:
        try:
            with open(f"{proc}/{name}/cmdline", "rb") as f:
                raw = f.read(MAX_CMDLINE_BYTES)
            uid = os.stat(f"{proc}/{name}").st_uid
        except OSError:
            continue
        argv = [a.decode("utf-8", "surrogateescape") for a in raw.rstrip(b"\0").split(b"\0")]
        kind = gpuwarden_kind(argv)
        if kind is None:
            continue
        pid = int(name)
        ticks = process_start_ticks(pid)
        from gpuwarden.procs import short_command

        # "gpuwarden launch ...", as typed (not "python /venv/bin/gpuwarden launch ...")
        at = next(i for i, a in enumerate(argv) if os.path.basename(a) in ("gpuwarden",
                                                                            "gpuwarden.cli"))
        shown = ["gpuwarden", *argv[at + 1:]]
        out.append(Job(pid, kind, uid, _user(uid), short_command(shown, COMMAND_CHARS),
                       boot + ticks / _TICKS if ticks is not None and boot else None, uid == me))
    return out


def _lease_kind(label: str, command: str) -> str:
    for prefix, kind in (("gpuwarden pool", "pool"), ("gpuwarden worker", "worker"),
                         ("gpuwarden launch", "launch")):
        if label.startswith(prefix):
            return kind
    return "run" if "gpuwarden run" in command else "lease"


def _add_leases(jobs: dict[int, Job], notes: list[str]) -> str | None:
    from gpuwarden.lease import list_leases

    try:
        table = list_leases()
    except Exception as exc:  # a lease directory this user may not read says nothing here
        notes.append(f"leases not read: {type(exc).__name__}: {exc}"[:300])
        return None
    me = os.getuid()
    for holder in table.holders:
        gpus = [{"index": c.index, "uuid": c.uuid,
                 "slots": "memory" if c.is_memory else "all" if c.slots_per_gpu == 1
                 else f"{len(c.slots)} of {c.slots_per_gpu}",
                 **({"memory_bytes": c.memory_bytes, "holder_id": holder.record_id}
                    if c.is_memory else {})}
                for c in holder.claims]
        job = jobs.get(holder.pid)
        if job is None:
            uid = _uid_of(holder.pid)
            job = Job(holder.pid, _lease_kind(holder.label, holder.command), uid,
                      holder.user, holder.command[:COMMAND_CHARS], holder.started_at,
                      uid == me if uid is not None else holder.user == _user(me))
            jobs[holder.pid] = job
        job.gpus += gpus
        if job.kind in ("run", "launch", "worker") and holder.label.startswith("gpuwarden pool"):
            job.kind = "pool"
    return str(table.directory)


def _uid_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _ask_status(path: Path) -> dict[str, Any]:
    from gpuwarden.launch.observer.control import ask

    return ask(path, {"op": "status"}, timeout_s=ASK_TIMEOUT_S)


def list_jobs(*, leases: bool = True) -> JobTable:
    """Every gpuwarden job of this host, with this user's launches asked for their ranks."""
    from gpuwarden.launch.observer.control import EndpointError, registered_jobs

    notes: list[str] = []
    jobs = {j.pid: j for j in scan_processes()}
    mine = registered_jobs()
    for reg in mine:
        job = jobs.get(reg.pid)
        rec = reg.record
        if job is None:  # a launch inside another program (spawn(), a notebook), or hidepid
            job = Job(reg.pid, str(rec.get("kind") or "launch"), os.getuid(), _user(os.getuid()),
                      str(rec.get("command") or "")[:COMMAND_CHARS],
                      rec.get("started_at") if isinstance(rec.get("started_at"), float) else None,
                      True)
            jobs[reg.pid] = job
        elif rec.get("kind") == "spawn":
            job.kind = "spawn"
    lease_dir = _add_leases(jobs, notes) if leases else None
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(mine)))) as pool:
        answers = {reg.pid: pool.submit(_ask_status, reg.endpoint.socket_path) for reg in mine}
    for pid, future in answers.items():
        try:
            answer = future.result()
        except EndpointError as exc:
            jobs[pid].note = f"its launcher did not answer: {exc}"
            continue
        if answer.get("ok") and isinstance(answer.get("job"), dict):
            jobs[pid].launch = answer["job"]
        else:
            jobs[pid].note = f"its launcher did not answer: {answer.get('error')}"
    for job in jobs.values():
        if not job.mine:
            job.note = "another user's job: its ranks and stacks are private to its owner"
        elif job.kind in ("launch", "spawn") and job.launch is None and job.note is None:
            job.note = "no control endpoint found for it (started by an older gpuwarden, or " \
                       "with another GPUWARDEN_RUNTIME_DIR)"
    ordered = sorted(jobs.values(), key=lambda j: (not j.mine, j.started_at or 0.0, j.pid))
    return JobTable(socket.gethostname(), time.time(), tuple(ordered), lease_dir, tuple(notes))


def gpu_memory_by_pid(inventory: Any) -> dict[int, int] | None:
    """pid -> GPU memory it uses (all GPUs), from NVML; None when there is no NVML."""
    from gpuwarden.errors import GpuwardenError

    try:
        host = inventory.read_host()
    except GpuwardenError:
        return None
    used: dict[int, int] = {}
    for gpu in host.gpus:
        for dev in (gpu, *gpu.mig_devices):
            for p in dev.processes:
                if p.used_memory_bytes is not None:
                    used[p.pid] = used.get(p.pid, 0) + p.used_memory_bytes
    return used


def add_memory_leases(table: JobTable, inventory: Any) -> None:
    """Each memory lease of a job gets ``used_bytes`` (what the job's processes use of that GPU,
    per NVML), and a job past its memory gets its LEASE_MEMORY_EXCEEDED findings."""
    from gpuwarden.lease import list_leases
    from gpuwarden.lease.guard import lease_memory, overuse_finding

    if not any("memory_bytes" in g for j in table.jobs for g in j.gpus):
        return
    try:
        leases = list_leases()
    except Exception:  # unreadable: the jobs are listed without it, as _add_leases does
        return
    memory = lease_memory(leases, inventory)
    for job in table.jobs:
        for gpu in job.gpus:
            if "memory_bytes" not in gpu:
                continue
            holder = next((h for h in leases.holders if h.record_id == gpu.get("holder_id")),
                          None)
            gpu["used_bytes"] = None if holder is None else memory.use_of(holder, gpu["uuid"])
        for over in memory.overuses:
            if over.holder.pid == job.pid:
                job.findings.append(overuse_finding(over).to_dict())


def add_gpu_memory(table: JobTable, used: dict[int, int] | None) -> None:
    """Each of this user's ranks gets ``gpu_memory_bytes``: its own and its children's."""
    import psutil

    for job in table.jobs:
        for row in (job.launch or {}).get("ranks", []):
            if used is None or not isinstance(row.get("pid"), int):
                row["gpu_memory_bytes"] = None
                continue
            pids = {row["pid"]}
            with contextlib.suppress(psutil.Error):
                pids |= {c.pid for c in psutil.Process(row["pid"]).children(recursive=True)}
            total = [used[p] for p in pids if p in used]
            row["gpu_memory_bytes"] = sum(total) if total else None


# ---- one job's endpoint, for `gpuwarden stacks JOB` --------------------------------------


@dataclass(frozen=True)
class Target:
    """Where to ask one job: its endpoint's possible paths (another user's: by convention)."""

    pid: int
    uid: int
    paths: tuple[Path, ...]
    record: dict[str, Any] = field(default_factory=dict)  # the registry's (this user's jobs)


def find_job(job: str | None) -> Target:
    """The running launch ``job`` names (a pid, or a run id prefix), or this user's only one.

    Raises JobNotFoundError (no such job, exit 2), JobQueryError (JOB_NOT_FOUND: none runs),
    UsageError (several run and none was named)."""
    from gpuwarden.errors import JobNotFoundError, JobQueryError
    from gpuwarden.launch.observer.control import registered_jobs, runtime_dirs

    mine = registered_jobs()
    if job is None:
        if not mine:
            raise JobQueryError("no gpuwarden launch of yours runs on this host",
                                code="JOB_NOT_FOUND",
                                fix="`gpuwarden status` lists every gpuwarden job of this host; "
                                "give one as `gpuwarden stacks PID`")
        return _target(_one_of(mine))
    if job.isdigit():
        hit = [r for r in mine if r.pid == int(job)]
        if hit:
            return _target(hit[0])
        return _other_users_job(int(job), runtime_dirs)
    hit = [r for r in mine if str(r.record.get("run_id") or "").startswith(job)]
    if not hit:
        raise JobNotFoundError(f"no running gpuwarden launch of yours has run id {job!r}",
                               fix="give the pid of its launcher (JOB in `gpuwarden status`)")
    return _target(_one_of(hit))


def _target(reg: Any) -> Target:
    return Target(reg.pid, os.getuid(), (reg.endpoint.socket_path,), dict(reg.record))


def _one_of(regs: list[Any]) -> Any:
    if len(regs) == 1:
        return regs[0]
    if len({r.record.get("run_id") for r in regs}) == 1:
        # Several nodes of one job on this host (namespaces, a test): node 0's launcher.
        return min(regs, key=lambda r: (r.record.get("node_rank") or 0, r.pid))
    from gpuwarden.errors import UsageError

    raise UsageError(f"{len(regs)} gpuwarden launches of yours run on this host: name one",
                     fix="gpuwarden stacks PID (the JOB column of `gpuwarden status`)",
                     evidence=[f"{r.pid}: {str(r.record.get('command', ''))[:120]}" for r in regs])


def _other_users_job(pid: int, runtime_dirs: Any) -> Target:
    from gpuwarden.errors import JobNotFoundError

    uid = _uid_of(pid)
    if uid is None:
        raise JobNotFoundError(f"no process {pid} runs on this host",
                               fix="`gpuwarden status` lists the jobs (JOB column)")
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode("utf-8", "surrogateescape")
                    for a in f.read(MAX_CMDLINE_BYTES).rstrip(b"\0").split(b"\0")]
    except OSError:
        argv = []
    if gpuwarden_kind(argv) != "launch":
        raise JobNotFoundError(f"process {pid} is not a `gpuwarden launch`",
                               fix="give the pid of a launcher (JOB in `gpuwarden status`)")
    if uid == os.getuid():
        raise JobNotFoundError(f"the launch {pid} has no control endpoint here",
                               why="it was started by an older gpuwarden, or with another "
                               "GPUWARDEN_RUNTIME_DIR", fix="run `gpuwarden stacks` with its "
                               "GPUWARDEN_RUNTIME_DIR")
    return Target(pid, uid, tuple(d / f"{pid}.sock" for d in runtime_dirs(uid)))


def ask_job(target: Target, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Ask the job's endpoint; JobDeniedError when the kernel refuses (another user's job),
    JobQueryError when it does not answer, JobNotFoundError when no endpoint is there."""
    import errno

    from gpuwarden.errors import JobDeniedError, JobNotFoundError, JobQueryError
    from gpuwarden.launch.observer.control import EndpointError, ask

    denied: EndpointError | None = None
    for path in target.paths:
        try:
            return ask(path, request, timeout_s=timeout_s)
        except EndpointError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):
                denied = exc
            elif exc.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR):
                raise JobQueryError(
                    f"the launch {target.pid} did not answer: {exc.strerror or exc}",
                    fix="try again; `gpuwarden status` shows whether it still runs (a stopped "
                    "launcher, Ctrl-Z, answers nothing)", evidence=f"endpoint {path}") from exc
    if denied is not None:
        owner = _user(target.uid)
        raise JobDeniedError(
            f"the launch {target.pid} is {owner}'s: its stacks are readable by {owner} only",
            why=f"the kernel refused the connection to its control endpoint ({denied.strerror}: "
            f"{denied.filename}): a directory of {owner}'s with mode 0700",
            fix=f"ask {owner} to run `gpuwarden stacks {target.pid}`"
            + (" (root can too)" if owner != "root" else "")
            + "; `gpuwarden status` lists the job without its details",
            fields={"pid": target.pid, "owner": owner})
    raise JobNotFoundError(f"the launch {target.pid} has no control endpoint where gpuwarden "
                           "looks", evidence=[str(p) for p in target.paths],
                           fix="it ended meanwhile, or it runs with another GPUWARDEN_RUNTIME_DIR")
