"""A real Slurm cluster for the tests: Debian's ``slurm-wlm`` and ``munge``, nothing faked.

::

    login host (network namespace 0)          node hosts
    ┌───────────────────────────────┐
    │ munged  (unix socket in DIR)  │   one host:  slurmd -N n1, slurmd -N n2 beside slurmctld
    │ slurmctld                     │              (the same namespace, two ports)
    │ srun/sbatch/salloc/scancel... │   two hosts: slurmd -N n1 in namespace 1 (host name n1),
    └───────────────────────────────┘              slurmd -N n2 in namespace 2 (host name n2),
                                                   joined by a bridge (tests/_netns.py)

What a test gets is what a Slurm user gets: ``select/cons_tres``, ``Gres=gpu:2`` per node on
fake character devices (``mknod c 195 N`` under DIR, ``AutoDetect=off``), so slurmstepd sets
``CUDA_VISIBLE_DEVICES``, ``SLURM_STEP_GPUS``, ``SLURM_JOB_GPUS`` and ``GPU_DEVICE_ORDINAL`` as
on a cluster. The commands are the real ``srun``, ``sbatch``, ``salloc``, ``scancel`` and
``scontrol``, run on the login host (:meth:`Cluster.cmd`).

Per run: a private directory (configuration, state, spool, logs, munge key and socket), a
cluster name and network namespaces of its own, so the daemons' ports (fixed inside the
namespace) never meet another run's or the machine's. Each namespace resolves the cluster's
names through a hosts file of its own, bind-mounted over /etc/hosts in a private mount
namespace per command (not ``ip netns exec``, which remounts /sys and so hides the cgroup
file system that slurmd insists on reading at start).

What a node has of its own, as a real node has, comes from the cluster's ``TaskProlog`` (an
administrator's per-node set-up, run by slurmstepd before each task): the simulated GPUs that
match its fake devices (``GPUWARDEN_SIMULATE``: indices 0 and 1, UUIDs of its own), its lease
directory and its gpuwarden runtime directory. Nothing else is set in a job's environment.

Processes: every daemon is started here in the foreground (``-D``/``-F``), in its own process,
with ``PR_SET_PDEATHSIG`` so that a test run killed outright takes them along, and is stopped by
its pid (SIGTERM, then SIGKILL after a bound). slurmd starts each slurmstepd detached (double
fork: its parent is then pid 1), so a job's processes are found by what the kernel says about
them: the network namespaces they live in (:meth:`Cluster.job_pids`). Every wait polls for its
condition with a generous cap: a machine busy with other work is the normal machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _netns import Hosts, make_hosts, remove_hosts  # noqa: E402
from _netns import unavailable_reason as netns_unavailable  # noqa: E402

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "salloc", "scancel", "scontrol", "sinfo", "squeue")
NODES = ("n1", "n2")
GPUS_PER_NODE = 2
CTLD_PORT = 6817
SLURMD_PORT = 6818  # n1; n2 on the same host uses the next one
# The end of a job as Slurm names it (scontrol's JobState).
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                   "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
START_TIMEOUT_S = 60.0  # the daemons up and both nodes idle, on a loaded machine

# mount the cluster's hosts file, take the host name (two hosts), enter the namespace, exec
_ENTER = ('h=$0 n=$1 name=$2; shift 2; mount --bind "$h" /etc/hosts || exit 125; '
          '[ -z "$name" ] || hostname "$name" || exit 125; exec nsenter --net="$n" -- "$@"')


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be made here (None when it can)."""
    if os.geteuid() != 0:
        return "a Slurm cluster needs root (slurmd runs jobs as their users; fake GPU devices)"
    missing = [b for b in (*DAEMONS, *CLIENTS, "unshare", "nsenter", "mknod")
               if shutil.which(b) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): apt-get install "
                "slurm-wlm munge (.ci/run does as root on Debian)")
    return netns_unavailable()


@dataclass
class Daemon:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Cluster:
    tag: str
    root: Path  # the private directory
    conf: Path  # slurm.conf
    hosts: Hosts  # the namespaces: [login, n1, n2] (two hosts) or [login] (one host)
    two_hosts: bool
    proctrack: str
    hostname: str  # the login host's name (one host: this machine's, as slurmctld wants)
    daemons: list[Daemon] = field(default_factory=list)
    nodes: tuple[str, ...] = NODES

    # -- running commands -------------------------------------------------------------------

    def host_of(self, node: str | None) -> int:
        """The namespace index of ``node`` (None: the login host)."""
        if node is None or not self.two_hosts:
            return 0
        return 1 + self.nodes.index(node)

    def cmd(self, argv: Sequence[str], node: str | None = None) -> list[str]:
        """``argv`` as run on the login host (or on ``node``'s host)."""
        i = self.host_of(node)
        name = self.host_names[i] if self.two_hosts else ""
        return ["unshare", "--mount", "--propagation", "private", *(["--uts"] if name else []),
                "--", "sh", "-c", _ENTER, str(self.root / f"hosts.{i}"),
                f"/run/netns/{self.hosts.names[i]}", name, *argv]

    def host_name_of(self, node: str) -> str:
        """The host name ``node``'s processes see (one host: this machine's)."""
        return node if self.two_hosts else self.hostname

    @property
    def host_names(self) -> list[str]:
        return ["login", *self.nodes] if self.two_hosts else [self.hostname]

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The test's environment as a user's shell on the login host: this cluster's
        configuration, the test's Python environment first on PATH, none of an enclosing
        Slurm job's variables."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))
               and k not in ("GPUWARDEN_JOB_STEP", "GPUWARDEN_SIMULATE", "CUDA_VISIBLE_DEVICES")}
        env["SLURM_CONF"] = str(self.conf)
        # `gpuwarden`, `torchrun` and `python` as a user who activated the environment has them
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
        env.update(extra or {})
        return env

    def run(self, argv: Sequence[str], *, timeout: float = 180, env: Mapping[str, str] | None = None,
            cwd: str | Path | None = None, input: str | None = None,
            node: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.cmd(argv, node), capture_output=True, text=True,
                              timeout=timeout, env=self.env(env), cwd=cwd, input=input)

    def popen(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: str | Path | None = None, node: str | None = None,
              **kwargs: Any) -> subprocess.Popen[str]:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        return subprocess.Popen(self.cmd(argv, node), text=True, env=self.env(env), cwd=cwd,
                                **kwargs)

    def check(self, argv: Sequence[str], **kwargs: Any) -> str:
        r = self.run(argv, **kwargs)
        if r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {r.returncode}:\n{r.stdout}{r.stderr}")
        return r.stdout

    # -- jobs ---------------------------------------------------------------------------------

    def sbatch(self, script: str, *options: str, cwd: str | Path,
               env: Mapping[str, str] | None = None) -> int:
        """Submit ``script`` (its text) with ``options``; the job id."""
        path = Path(cwd) / f"job-{secrets.token_hex(3)}.sh"
        path.write_text(script)
        out = self.check(["sbatch", "--parsable", *options, str(path)], env=env, cwd=cwd)
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o``'s fields ({} once Slurm forgot the job)."""
        r = self.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=30)
        if r.returncode != 0:
            return {}
        return dict(re.findall(r"(\S+?)=(.*?)(?= \S+?=|\s*$)", r.stdout.strip()))

    def state(self, job_id: int) -> str:
        return self.job(job_id).get("JobState", "")

    def wait_state(self, job_id: int, states: Iterable[str] = ENDED, timeout: float = 180) -> str:
        """Poll until the job is in one of ``states``; the state (AssertionError after
        ``timeout``, naming the state it was in)."""
        wanted = set(states)
        state = ""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state in wanted:
                return state
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} still {state or 'unknown'} after {timeout:g} s, "
                             f"not {sorted(wanted)}")

    def steps(self, job_id: int) -> list[str]:
        """The job's running steps, ``<job>.<step>`` (``batch`` and ``extern`` included)."""
        r = self.run(["squeue", "-h", "-s", "-j", str(job_id), "-o", "%i"], timeout=30)
        return r.stdout.split() if r.returncode == 0 else []

    def queue(self) -> list[int]:
        r = self.run(["squeue", "-h", "-o", "%A"], timeout=30)
        return [int(x) for x in r.stdout.split()] if r.returncode == 0 else []

    def cancel_all(self) -> list[int]:
        """Cancel every job this cluster knows; the ids cancelled."""
        jobs = self.queue()
        if jobs:
            self.run(["scancel", *map(str, jobs)], timeout=30)
        return jobs

    # -- processes ------------------------------------------------------------------------------

    def daemon_pids(self) -> set[int]:
        return {d.proc.pid for d in self.daemons} | {
            c.pid for d in self.daemons for c in _children(d.proc.pid)}

    def job_pids(self) -> list[int]:
        """Every process in the cluster's namespaces that is not one of its daemons: slurmstepd,
        the tasks and whatever they started (also those whose parent died), srun and salloc."""
        daemons = self.daemon_pids()
        return [p for p in self.hosts.pids() if p not in daemons and _alive(p)]

    def wait_no_job_processes(self, timeout: float = 30) -> list[int]:
        """Poll until no job process is left; those still there after ``timeout``."""
        deadline = time.monotonic() + timeout
        left = self.job_pids()
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = self.job_pids()
        return left

    def processes(self, node: str | None = None, match: str = "") -> list[tuple[int, str]]:
        """(pid, command line) of the job processes on ``node`` (SLURMD_NODENAME in their
        environment) whose command line contains ``match``."""
        out = []
        for pid in self.job_pids():
            cmdline = _cmdline(pid)
            if match not in cmdline:
                continue
            if node is not None and _environ(pid).get("SLURMD_NODENAME") != node:
                continue
            out.append((pid, cmdline))
        return out

    def describe(self, pids: Iterable[int]) -> str:
        return "; ".join(f"{p}: {_cmdline(p)[:160]}" for p in pids)

    def nodes_state(self) -> dict[str, str]:
        r = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=30)
        return dict(line.split()[:2] for line in r.stdout.splitlines() if len(line.split()) >= 2)

    def wait_idle(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            self.check_daemons()
            states = self.nodes_state()
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the nodes are not idle after {timeout:g} s: {states}\n"
                           + self.logs())

    def check_daemons(self) -> None:
        for d in self.daemons:
            if d.proc.poll() is not None:
                raise RuntimeError(f"{d.name} exited {d.proc.returncode}:\n{d.tail()}")

    def logs(self) -> str:
        return "\n".join(f"--- {d.name}\n{d.tail()}" for d in self.daemons)

    def node_dir(self, node: str) -> Path:
        return self.root / "nodes" / node

    def leases_on(self, node: str) -> Path:
        return self.node_dir(node) / "leases"

    # -- start and stop -------------------------------------------------------------------------

    def _start(self, name: str, argv: list[str], node: str | None = None) -> Daemon:
        log = self.root / "log" / f"{name}.out"
        with open(log, "ab") as out:
            proc = subprocess.Popen(self.cmd(argv, node), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=self.env(),
                                    preexec_fn=_die_with_parent)
        daemon = Daemon(name, proc, log)
        self.daemons.append(daemon)
        return daemon

    def stop(self) -> list[str]:
        """Stop every daemon this cluster started, by its pid, in the reverse order; what
        needed SIGKILL (a problem worth a look) or outlived its daemon."""
        problems = []
        for d in reversed(self.daemons):
            kids = [c.pid for c in _children(d.proc.pid)]  # slurmctld's slurmscriptd
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
                try:
                    d.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    d.proc.kill()
                    d.proc.wait(timeout=20)
                    problems.append(f"{d.name} needed SIGKILL")
            for pid in kids:
                if _alive(pid):
                    problems.append(f"{d.name}'s child {pid} outlived it: {_cmdline(pid)}")
        return problems


def start_cluster(*, two_hosts: bool = False, proctrack: str = "linuxproc") -> Cluster:
    """Write the configuration, start munged, slurmctld and one slurmd per node, wait until
    both nodes are idle. On any failure everything started is stopped and removed again."""
    tag = secrets.token_hex(3)
    # Under /tmp, not pytest's 0700 directories: munged wants every directory above its socket
    # searchable by all, and the jobs' users read the configuration.
    root = Path(tempfile.mkdtemp(prefix=f"gwslurm-{tag}-", dir="/tmp"))
    cluster: Cluster | None = None
    try:
        root.chmod(0o755)
        cluster = Cluster(tag, root, root / "slurm.conf", make_hosts(3 if two_hosts else 1),
                          two_hosts, proctrack, socket.gethostname().split(".")[0])
        _write_files(cluster)
        c = cluster
        c._start("munged", ["munged", "-F", f"--key-file={root / 'munge' / 'munge.key'}",
                            f"--socket={root / 'run' / 'munge.sock'}",
                            f"--pid-file={root / 'run' / 'munged.pid'}",
                            f"--seed-file={root / 'munge' / 'munged.seed'}",
                            f"--log-file={root / 'log' / 'munged.log'}"])
        _wait_for(lambda: (root / "run" / "munge.sock").exists(), 20, "munged's socket", c)
        c._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(c.conf)])
        for node in c.nodes:
            c._start(f"slurmd-{node}", ["slurmd", "-D", "-f", str(c.conf), "-N", node], node)
        c.wait_idle()
    except BaseException:
        if cluster is not None:
            cluster.stop()
            remove_hosts(cluster.hosts)
        shutil.rmtree(root, ignore_errors=True)
        raise
    return cluster


def destroy_cluster(cluster: Cluster) -> list[str]:
    """Cancel what runs, stop the daemons, remove the namespaces and the directory; the
    problems seen on the way (processes left, a daemon that needed SIGKILL)."""
    problems = []
    with contextlib.suppress(Exception):
        cluster.cancel_all()
    left = cluster.wait_no_job_processes(30)
    if left:
        problems.append(f"job processes left at the end: {cluster.describe(left)}")
    problems += cluster.stop()
    remove_hosts(cluster.hosts)
    shutil.rmtree(cluster.root, ignore_errors=True)
    return problems


@contextlib.contextmanager
def cluster_of(**kwargs: Any) -> Iterator[Cluster]:
    cluster = start_cluster(**kwargs)
    try:
        yield cluster
    finally:
        destroy_cluster(cluster)


# -- files -------------------------------------------------------------------------------------

def _write_files(c: Cluster) -> None:
    root = c.root
    for sub in ("state", "log", "spool", "nodes"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    # munge: the key readable by its daemon only; the socket's directory searchable by all
    (root / "munge").mkdir(mode=0o700)
    (root / "run").mkdir(mode=0o755)
    key = root / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)
    for d in (root, root / "run", root / "log", root / "nodes"):
        d.chmod(0o755)

    one = not c.two_hosts
    addrs = c.hosts.addrs
    node_addr = {n: addrs[0] if one else addrs[1 + i] for i, n in enumerate(c.nodes)}
    # Every host resolves every host; the one-host cluster's names all point at its address.
    names = ([f"{addrs[0]} {c.hostname} {' '.join(c.nodes)}"] if one else
             [f"{addrs[i]} {name}" for i, name in enumerate(c.host_names)])
    for i in range(len(c.hosts.names)):
        (root / f"hosts.{i}").write_text("127.0.0.1 localhost\n" + "\n".join(names) + "\n")

    gres = ["AutoDetect=off"]
    node_lines = []
    for i, node in enumerate(c.nodes):
        nd = c.node_dir(node)
        (nd / "dev").mkdir(parents=True)
        for g in range(GPUS_PER_NODE):
            os.mknod(nd / "dev" / f"nvidia{g}", 0o666 | 0o020000, os.makedev(195, g))
        gres.append(f"NodeName={node} Name=gpu File={nd / 'dev'}/nvidia[0-{GPUS_PER_NODE - 1}]")
        (nd / "gpus.json").write_text(json.dumps(_scenario(node, c.tag)))
        for sub in ("leases", "run"):
            (nd / sub).mkdir(mode=0o1777)
            (nd / sub).chmod(0o1777)
        port = SLURMD_PORT + i if one else SLURMD_PORT
        hostname = c.hostname if one else node
        node_lines.append(f"NodeName={node} NodeHostname={hostname} NodeAddr={node_addr[node]} "
                          f"Port={port} CPUs=8 RealMemory=4000 Gres=gpu:{GPUS_PER_NODE} "
                          "State=UNKNOWN")
    (root / "gres.conf").write_text("\n".join(gres) + "\n")

    prolog = root / "task_prolog.sh"
    nodes = root / "nodes"
    prolog.write_text(f"""#!/bin/sh
# What this node has of its own, as a real node has: its GPUs (simulated to match its fake
# devices), its lease directory and its runtime directory (per user, 0700, made by gpuwarden).
echo "export GPUWARDEN_SIMULATE={nodes}/$SLURMD_NODENAME/gpus.json"
echo "export GPUWARDEN_LEASE_DIR={nodes}/$SLURMD_NODENAME/leases"
echo "export GPUWARDEN_RUNTIME_DIR={nodes}/$SLURMD_NODENAME/run/$SLURM_JOB_UID"
""")
    prolog.chmod(0o755)

    ctl_host = c.host_names[0]
    c.conf.write_text(f"""# gpuwarden's test cluster {c.tag}: written by tests/_slurm.py
ClusterName=gw{c.tag}
SlurmctldHost={ctl_host}({addrs[0]})
SlurmctldPort={CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a requeued job waits before it may start again (5 s at the least;
# also how long a step's launch credential is good for: srun to slurmd takes milliseconds)
AuthInfo=socket={root}/run/munge.sock,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/{c.proctrack}
TaskPlugin=task/none
TaskProlog={prolog}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
GresTypes=gpu
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
KillWait=10
MinJobAge=600
InactiveLimit=0
{chr(10).join(node_lines)}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")


def _scenario(node: str, tag: str) -> dict[str, Any]:
    """The node's two GPUs as NVML would report them, indices matching its device files."""
    serial = int(tag, 16) % 10**8
    return {"comment": f"node {node} of test cluster {tag}", "hostname": node,
            "driver_version": "580.159.04", "cuda_driver_version": "13.0",
            "gpus": [{"index": g, "uuid": f"GPU-{serial:08d}-0000-0000-0000-{node}{g:0>10}",
                      "name": "Simulated GPU", "memory_total_mib": 24576, "memory_used_mib": 0,
                      "utilization_gpu_pct": 0, "compute_mode": "default", "processes": []}
                     for g in range(GPUS_PER_NODE)]}


# -- small things ------------------------------------------------------------------------------

def _die_with_parent() -> None:
    # A test run killed outright takes its daemons along (the attribute survives the execs of
    # the namespace wrappers; slurmd's detached slurmstepd do not inherit it).
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _wait_for(cond: Callable[[], bool], timeout: float, what: str, c: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        c.check_daemons()
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} after {timeout:g} s\n{c.logs()}")
        time.sleep(0.05)


def _children(pid: int) -> list[Any]:
    import psutil

    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out
