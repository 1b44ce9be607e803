"""Lease latency before and after a change, beside filelock, and under the attacks of issue 25.

What is measured (simulated 2-GPU host, private lease directories in /dev/shm, CPU only), for
the implementation of this checkout ("after") and the one of a git ref ("before", default
``main``, extracted with ``git archive``) in the same run, each in fresh processes:

- uncontended: one process leasing 1 GPU and releasing it, in a loop (before and after
  alternate, twice each: the host's load drifts);
- contended: P processes looping "lease 1 GPU (wait), hold H ms, release"; latency = asking
  to granted, hand-off = a release to the next grant of that GPU, throughput;
- attacks, one request each (time to answer; one attempt): with 10k names planted in the
  directory (600 of them slot-like for K values nobody uses), with 3000 live records padded
  with '[', and with 100k flocks held elsewhere on the host (/proc/locks grows by as many
  lines) while one lease is held;
- competitor: filelock.FileLock (what ad-hoc "GPU lock" scripts use; torch depends on it)
  on one lock file per GPU, same loops. filelock polls every 50 ms by default when waiting;
- memory leases (issue 41, ``--sections memory``): ask -> granted of a slot lease (2 per GPU),
  before and after, beside a memory lease (``mem=``, sized so that 2 share a GPU), uncontended
  and contended; and the memory guard's cost: one holder's polls of 8 GPUs running 64 of its
  processes, through NVML's code path (the test suite's double of pynvml: gpuwarden's own
  work, not the driver's) and through the simulated host.

It is not a test; run it: ``python benchmarks/bench_lease.py [--quick] [--before REF]``.
While the 100k flocks are held, any program that reads /proc/locks (an older gpuwarden
included) is slow host-wide: the flocks are held for the few seconds of that measurement.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = {
    "hostname": "bench",
    "gpus": [{"index": i, "uuid": f"GPU-bench-{i}", "memory_total_mib": 24576,
              "memory_used_mib": 0} for i in range(2)],
}
ATTACK_TIMEOUT_S = 30.0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(name: str, values_s: list[float]) -> str:
    ms = [v * 1000 for v in values_s]
    return (f"{name:<46} n={len(ms):<5} median {statistics.median(ms):8.3f} ms   "
            f"p99 {pct(ms, 0.99):8.3f} ms")


# -- what runs inside one implementation's process ---------------------------------------------

LEASES: dict[str, dict[str, object]] = {
    "whole": {}, "slot": {"slots_per_gpu": 2},
    # Two of these fit one simulated 24 GiB GPU (1 GiB reserve): as many holders as 2 slots.
    "mem": {"mem": 11 * 1024**3},
}


def uncontended(n: int, lease: str = "whole") -> list[float]:
    from gpuwarden.lease import acquire

    kwargs = LEASES[lease]
    acquire(1, **kwargs).release()  # warm: files exist, modules imported
    out = []
    for _ in range(n):
        t = time.perf_counter()
        acquire(1, **kwargs).release()
        out.append(time.perf_counter() - t)
    return out


def one_request(hold_gpu1: bool) -> tuple[float, float]:
    """Seconds of one acquire(1)+release (one attempt: a GPU is free), wall and this process's
    CPU (the work itself, on a host where other jobs share the cores). ``hold_gpu1``: a child
    holds GPU 1 meanwhile, so the directory has a live record to read."""
    from gpuwarden.lease import acquire

    # Everything a first lease imports, in a directory of its own: what is timed below is the
    # request in the attacked directory, not the interpreter's first use of the modules.
    scratch = Path(tempfile.mkdtemp(prefix="warm-", dir="/dev/shm"))
    acquire(1, lease_dir=scratch / "leases").release()
    child_r, child_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = -1
    if hold_gpu1:
        pid = os.fork()
        if pid == 0:
            grant = acquire(1, constraints=_only("GPU-bench-1"))
            os.write(child_w, b"1")
            os.read(stop_r, 1)
            grant.release()
            os._exit(0)
        os.read(child_r, 1)
    try:
        t, cpu = time.perf_counter(), time.process_time()
        acquire(1).release()
        return time.perf_counter() - t, time.process_time() - cpu
    finally:
        if pid > 0:
            os.write(stop_w, b"1")
            os.waitpid(pid, 0)
        shutil.rmtree(scratch, ignore_errors=True)


def _only(uuid: str) -> object:
    from gpuwarden.select import Constraints

    return Constraints(include=(uuid,))


def contended_loop(out: Path, loops: int, hold_s: float, lease: str = "whole"
                   ) -> Callable[[], None]:
    def body() -> None:
        from gpuwarden.lease import acquire

        lines = []
        for _ in range(loops):
            asked = time.monotonic()
            grant = acquire(1, wait=float("inf"), **LEASES[lease])
            got = time.monotonic()
            time.sleep(hold_s)
            gpu = grant.gpus[0].uuid
            released = time.monotonic()
            grant.release()
            lines.append(json.dumps([asked, got, released, gpu]))
        with open(out, "a") as f:
            f.write("\n".join(lines) + "\n")

    return body


def filelock_loop(out: Path, loops: int, hold_s: float, directory: Path) -> Callable[[], None]:
    def body() -> None:
        from filelock import FileLock, Timeout

        locks = [FileLock(str(directory / f"gpu{i}.lock")) for i in range(2)]
        lines = []
        for _ in range(loops):
            asked = time.monotonic()
            held = None
            while held is None:  # any free GPU, else wait on the first one (filelock's poll)
                for i, lock in enumerate(locks):
                    try:
                        lock.acquire(timeout=0)
                        held = i
                        break
                    except Timeout:
                        pass
                if held is None:
                    try:
                        locks[0].acquire(timeout=0.05)
                        held = 0
                    except Timeout:
                        pass
            got = time.monotonic()
            time.sleep(hold_s)
            released = time.monotonic()
            locks[held].release()
            lines.append(json.dumps([asked, got, released, f"gpu{held}"]))
        with open(out, "a") as f:
            f.write("\n".join(lines) + "\n")

    return body


def uncontended_filelock(n: int, directory: Path) -> list[float]:
    from filelock import FileLock

    lock = FileLock(str(directory / "gpu0.lock"))
    out = []
    for _ in range(n):
        t = time.perf_counter()
        lock.acquire()
        lock.release()
        out.append(time.perf_counter() - t)
    return out


def run_processes(make: Callable[[Path], Callable[[], None]], procs: int, tmp: Path
                  ) -> dict[str, object]:
    out = tmp / f"out-{time.monotonic_ns()}.jsonl"
    started = time.monotonic()
    gate_r, gate_w = os.pipe()
    pids = []
    for _ in range(procs):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(gate_w)
                os.read(gate_r, 1)
                make(out)()
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(gate_r)
    os.close(gate_w)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"a benchmark process failed (pid {pid})")
    wall_s = time.monotonic() - started
    rows = [json.loads(line) for line in out.read_text().splitlines() if line]
    latency = [got - asked for asked, got, _rel, _gpu in rows]
    handoff = []
    by_gpu: dict[str, list[tuple[float, float, float]]] = {}
    for asked, got, released, gpu in rows:
        by_gpu.setdefault(gpu, []).append((got, released, asked))
    for spans in by_gpu.values():
        spans.sort()
        for (_g1, r1, _a1), (g2, _r2, a2) in zip(spans, spans[1:], strict=False):
            if a2 < r1:  # the next holder was already waiting when this one released
                handoff.append(g2 - r1)
    return {"latency": latency, "handoff": handoff, "wall_s": wall_s, "ops": len(rows)}


def guard_cost(seconds: float, tmp: Path) -> dict[str, object]:
    """CPU time of a memory lease holder's guard: 8 leased GPUs, 64 of its processes on them
    (8 each, real children), polled every POLL_S for ``seconds``; through NVML's code path (the
    test double of pynvml) and through the simulated host (a scenario naming the same pids)."""
    sys.path.insert(0, str(ROOT))
    import subprocess as sp

    from gpuwarden.inventory import Inventory
    from gpuwarden.inventory.nvml import NvmlBackend
    from gpuwarden.inventory.simulated import SimulatedBackend
    from gpuwarden.lease import acquire
    from gpuwarden.lease.guard import POLL_S, MemoryGuard
    from tests.fake_pynvml import FakeDriver, FakeGPU, FakeProcess

    uuids = [f"GPU-guard-{i}" for i in range(8)]
    children = [sp.Popen(["sleep", "600"]) for _ in range(64)]
    try:
        procs = [[children[g * 8 + k].pid for k in range(8)] for g in range(8)]
        host = {"hostname": "guard", "gpus": [
            {"index": i, "uuid": u, "memory_total_mib": 81559, "memory_used_mib": 8 * 1024,
             "processes": [{"pid": p, "used_memory_mib": 1024} for p in procs[i]]}
            for i, u in enumerate(uuids)]}
        path = tmp / f"guard-{time.monotonic_ns()}.json"
        path.write_text(json.dumps(host))
        os.environ["GPUWARDEN_SIMULATE"] = str(path)
        grant = acquire(8, mem=9 * 1024**3)
        driver = FakeDriver([FakeGPU(uuid=u, used_bytes=8 * 1024**3, compute=[
            FakeProcess(p, 1024**3) for p in procs[i]]) for i, u in enumerate(uuids)])
        out: dict[str, object] = {"poll_s": POLL_S}
        for name, backend in (("nvml", NvmlBackend(driver.module(), nested_pid_namespace=False)),
                              ("simulated", SimulatedBackend(path))):
            guard = MemoryGuard(grant, Inventory(backend, env={}))
            cpu = time.process_time()
            report = guard.poll()  # the first poll looks every process up once
            first = time.process_time() - cpu
            assert not report.error and not report.current, report
            polls, cpu, wall = 0, time.process_time(), time.monotonic()
            while time.monotonic() - wall < seconds:
                guard.poll()
                polls += 1
                time.sleep(max(0.0, wall + polls * POLL_S - time.monotonic()))
            used = time.process_time() - cpu
            elapsed = time.monotonic() - wall
            out[name] = {"first_poll_cpu_s": first, "polls": polls, "cpu_s": used,
                         "wall_s": elapsed, "per_poll_cpu_s": used / max(1, polls),
                         "core_pct": 100 * used / elapsed}
        grant.release()
        return out
    finally:
        for child in children:
            child.kill()
        for child in children:
            child.wait()


def worker(args: argparse.Namespace) -> None:
    """One measurement in this process, with the implementation on sys.path[0]; JSON out."""
    if args.kind == "uncontended":
        result: object = uncontended(args.n, args.lease)
    elif args.kind == "contended":
        tmp = Path(args.tmp)
        result = run_processes(lambda out: contended_loop(out, args.loops, args.hold_s,
                                                          args.lease), args.procs, tmp)
    elif args.kind == "guard":
        result = guard_cost(args.seconds, Path(args.tmp))
    elif args.kind == "request":
        result = one_request(args.hold_gpu1)
    else:
        raise SystemExit(f"unknown kind {args.kind}")
    print(json.dumps(result))


# -- the parent: one implementation after another, in fresh processes ----------------------------

def extract(ref: str, into: Path) -> Path:
    """The package of git ref ``ref``, extracted under ``into``; its src directory."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref,
                              "src/gpuwarden"], capture_output=True, check=True).stdout
    into.mkdir(parents=True, exist_ok=True)
    tar = into / "before.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into / "src"


def measure(src: Path, kind: str, env: dict[str, str], *extra: str,
            timeout_s: float | None = None) -> object | None:
    """Run one measurement with the implementation at ``src``; None when it timed out."""
    cmd = [sys.executable, __file__, "--worker", kind, "--impl", str(src), *extra]
    try:
        proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        raise SystemExit(f"{kind} with {src} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fresh_dir(tmp: Path, name: str) -> Path:
    path = tmp / f"{name}-{time.monotonic_ns()}"
    path.mkdir(mode=0o700)
    return path


def plant_names(directory: Path) -> None:
    """10k names: 600 slot-like for K values nobody uses (an older gpuwarden opened K files
    for each, under its mutex), and 9400 others."""
    for i in range(600):
        (directory / f"slot.GPU-bench-0.k{9700 + i}.s0.lock").touch()
    for i in range(9400):
        (directory / f"junk.{i}").touch()


def hold_padded_records(directory: Path, count: int) -> int:
    """A child holding ``count`` live records padded with '[' (a flock, as an older gpuwarden
    checks, and a record lock, as this one does); returns its pid (SIGTERM ends it)."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        fds = []
        pad = b"[" * 16000
        for i in range(count):
            path = directory / f"ticket.padded{i}.json"
            path.write_bytes(pad)
            fd = os.open(path, os.O_RDWR)
            fcntl.flock(fd, fcntl.LOCK_EX)
            fcntl.lockf(fd, fcntl.LOCK_EX)
            fds.append(fd)
        os.write(ready_w, b"1")
        time.sleep(3600)
        os._exit(0)
    os.read(ready_r, 1)
    return pid


def hold_flocks(count: int, tmp: Path) -> list[int]:
    """Children holding ``count`` flocks on files of their own, a few per file (the kernel's
    per-file lists stay short), each child within the open-files limit; returns their pids."""
    import resource

    per_child = max(1000, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 200)
    own = tmp / f"flocks-{time.monotonic_ns()}"
    own.mkdir()
    files = [own / str(i) for i in range(-(-count // 20))]
    for f in files:
        f.touch()
    pids = []
    ready_r, ready_w = os.pipe()
    for start in range(0, count, per_child):
        pid = os.fork()
        if pid == 0:
            fds = []
            for i in range(start, min(count, start + per_child)):
                fd = os.open(files[i // 20], os.O_RDONLY)
                fcntl.flock(fd, fcntl.LOCK_SH)
                fds.append(fd)
            os.write(ready_w, b"1")
            time.sleep(3600)
            os._exit(0)
        pids.append(pid)
    for _ in pids:
        os.read(ready_r, 1)
    return pids


def stop(pids: list[int]) -> None:
    import signal

    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        os.waitpid(pid, 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--hold-ms", type=float, default=5.0)
    parser.add_argument("--before", default="main", help="git ref of the implementation to "
                        "compare with (default: main)")
    parser.add_argument("--flocks", type=int, default=100_000)
    parser.add_argument("--sections", default="all", choices=("all", "memory"),
                        help="all (default), or only the memory leases' (issue 41)")
    # Internal: one measurement in a fresh process.
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--impl", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=1000, help=argparse.SUPPRESS)
    parser.add_argument("--loops", type=int, default=40, help=argparse.SUPPRESS)
    parser.add_argument("--hold-s", type=float, default=0.005, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hold-gpu1", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lease", default="whole", choices=tuple(LEASES), help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=20.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, args.impl)
        args.kind = args.worker
        worker(args)
        return 0

    n = 200 if args.quick else 1000
    loops = 15 if args.quick else 40
    hold_s = args.hold_ms / 1000
    with tempfile.TemporaryDirectory(prefix="gpuwarden-bench-", dir="/dev/shm") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "host.json").write_text(json.dumps(SCENARIO))
        before = extract(args.before, tmp / "before")
        after = ROOT / "src"
        impls = {"before": before, "after": after}
        base_env = {"GPUWARDEN_SIMULATE": str(tmp / "host.json")}
        print(f"simulated 2-GPU host, {os.cpu_count()} CPU(s), python {sys.version.split()[0]}, "
              f"load average {os.getloadavg()[0]:.1f}; before = {args.before}, after = this "
              "checkout")
        if args.sections == "memory":
            memory_sections(args, impls, base_env, tmp, n, loops, hold_s)
            return 0

        print(f"uncontended acquire+release, 1 process ({n} x 2 runs each, alternating):")
        runs: dict[str, list[float]] = {"before": [], "after": []}
        for _round in range(2):
            for name, src in impls.items():
                env = {**base_env, "GPUWARDEN_LEASE_DIR": str(fresh_dir(tmp, name))}
                runs[name] += measure(src, "uncontended", env, "--n", str(n))  # type: ignore[operator]
        for name in impls:
            print("  " + summary(f"gpuwarden {name}", runs[name]))
        os.environ.update(base_env)
        (tmp / "fl").mkdir()
        theirs = uncontended_filelock(n, tmp / "fl")
        print("  " + summary("filelock.FileLock (one lock, no selection)", theirs))
        ratio = statistics.median(runs["after"]) / statistics.median(runs["before"])
        print(f"  after / before (median): {ratio:.2f}x; after / filelock: "
              f"{statistics.median(runs['after']) / statistics.median(theirs):.1f}x")

        print(f"contended: {args.procs} processes x {loops} loops, hold {args.hold_ms:g} ms, "
              "2 GPUs:")
        results: dict[str, dict[str, object]] = {}
        for name, src in impls.items():
            env = {**base_env, "GPUWARDEN_LEASE_DIR": str(fresh_dir(tmp, name))}
            results[name] = measure(src, "contended", env, "--loops", str(loops), "--hold-s",  # type: ignore[assignment]
                                    str(hold_s), "--tmp", str(tmp), "--n", "0",
                                    *("--procs", str(args.procs)))
        results["filelock"] = run_processes(
            lambda out: filelock_loop(out, loops, hold_s, tmp / "fl"), args.procs, tmp)
        for name, r in results.items():
            lat = r["latency"]
            print("  " + summary(f"{name}: ask -> granted", lat)  # type: ignore[arg-type]
                  + f"   max {max(lat) * 1000:8.1f} ms")  # type: ignore[arg-type]
        for name, r in results.items():
            print("  " + summary(f"{name}: release -> next waiter's grant", r["handoff"]))  # type: ignore[arg-type]
        print("  throughput: " + ", ".join(
            f"{name} {r['ops'] / r['wall_s']:6.1f} leases/s"  # type: ignore[operator]
            for name, r in results.items()) + f" (ideal {2 / hold_s:.0f}/s with 2 GPUs)")

        print(f"one request under attack (one attempt, modules already imported; wall time and "
              f"the requesting process's CPU time; '>{ATTACK_TIMEOUT_S:.0f} s' = not answered):")
        attacks = {
            "10k planted names (600 slot-like)": ("names", False),
            "3000 live records padded with '['": ("padded", True),
            f"{args.flocks // 1000}k flocks held elsewhere, 1 lease held": ("flocks", True),
        }
        for label, (what, hold_gpu1) in attacks.items():
            line = []
            for name, src in impls.items():
                directory = fresh_dir(tmp, f"{name}-{what}")
                env = {**base_env, "GPUWARDEN_LEASE_DIR": str(directory)}
                measure(src, "request", env)  # the directory made, modules warm on disk
                helpers: list[int] = []
                if what == "names":
                    plant_names(directory)
                elif what == "padded":
                    helpers = [hold_padded_records(directory, 3000)]
                else:
                    helpers = hold_flocks(args.flocks, tmp)
                try:
                    took = measure(src, "request", env, *(["--hold-gpu1"] if hold_gpu1 else []),
                                   timeout_s=ATTACK_TIMEOUT_S)
                finally:
                    stop(helpers)
                if took is None:
                    line.append(f"{name} >{ATTACK_TIMEOUT_S:.0f} s")
                else:
                    wall, cpu = took  # type: ignore[misc]
                    line.append(f"{name} {wall * 1000:8.1f} ms ({cpu * 1000:6.1f} ms CPU)")
            print(f"  {label:<44} " + "   ".join(line))
    return 0


def memory_sections(args: argparse.Namespace, impls: dict[str, Path], base_env: dict[str, str],
                    tmp: Path, n: int, loops: int, hold_s: float) -> None:
    """Issue 41: a memory lease's ask -> granted beside a slot lease's (before and after, in
    this run), and the guard's cost."""
    runs = {("before", "slot"): [], ("after", "slot"): [], ("after", "mem"): []}
    print(f"uncontended acquire+release, 1 process ({n} x 2 runs each, alternating):")
    for _round in range(2):
        for (name, lease), values in runs.items():
            env = {**base_env, "GPUWARDEN_LEASE_DIR": str(fresh_dir(tmp, f"{name}-{lease}"))}
            values += measure(impls[name], "uncontended", env, "--n", str(n),  # type: ignore[operator]
                              "--lease", lease)
    for (name, lease), values in runs.items():
        what = "slot lease (1 of 2)" if lease == "slot" else "memory lease (11 GiB of 24)"
        print("  " + summary(f"{name}: {what}", values))
    print(f"contended: {args.procs} processes x {loops} loops, hold {args.hold_ms:g} ms, "
          "2 GPUs, 2 holders per GPU at most:")
    for name, lease in runs:
        env = {**base_env, "GPUWARDEN_LEASE_DIR": str(fresh_dir(tmp, f"c-{name}-{lease}"))}
        r = measure(impls[name], "contended", env, "--loops", str(loops), "--hold-s",
                    str(hold_s), "--tmp", str(tmp), "--n", "0", "--procs", str(args.procs),
                    "--lease", lease)
        lat = r["latency"]  # type: ignore[index]
        what = "slot lease" if lease == "slot" else "memory lease"
        print("  " + summary(f"{name}: {what}: ask -> granted", lat)
              + f"   max {max(lat) * 1000:8.1f} ms   "
              f"{r['ops'] / r['wall_s']:6.1f} leases/s")  # type: ignore[index,operator]
    seconds = 10.0 if args.quick else 30.0
    env = {**base_env, "GPUWARDEN_LEASE_DIR": str(fresh_dir(tmp, "guard"))}
    cost = measure(impls["after"], "guard", env, "--seconds", str(seconds), "--tmp", str(tmp))
    print(f"the memory guard: 8 leased GPUs, 64 of the holder's processes, a poll every "
          f"{cost['poll_s']} s for {seconds:g} s (the holder's CPU time):")  # type: ignore[index]
    for backend in ("nvml", "simulated"):
        c = cost[backend]  # type: ignore[index]
        print(f"  {backend + ' path':<18} {c['polls']:4d} polls  {c['per_poll_cpu_s'] * 1000:6.2f} "
              f"ms CPU per poll  {c['core_pct']:5.2f} % of a core  (first poll, every process "
              f"looked up: {c['first_poll_cpu_s'] * 1000:.1f} ms)")


if __name__ == "__main__":
    raise SystemExit(main())
