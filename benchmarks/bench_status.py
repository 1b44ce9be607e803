"""`gpuwarden stacks` and `gpuwarden status` from outside a running job (not a test).

    python benchmarks/bench_status.py [--ranks 8] [--repeat 10] [--window 20] [--nodes]

1. stacks answer time, 8 ranks on one node (tests/launch_scripts/straggler.py: rank 2 sleeps
   before each all_reduce, the others wait in it): the wall time of `gpuwarden stacks --json`
   (a fresh CLI process each time, its interpreter start included) and the launcher's own
   time to answer (``after_s``), medians of --repeat; beside it py-spy, what users run by hand
   today: `py-spy dump --pid P` for every rank, one after the other (when py-spy is installed).
2. CPU used by the ranks while nobody asks, and while `gpuwarden status` refreshes every
   second (and `stacks` every second): 4 ranks of benchmarks/scripts/idle_rank.py (joined,
   then sleeping: any CPU is the launcher's doing), each rank's CPU time in nanoseconds from
   /proc/PID/task/*/schedstat over --window seconds, as a share of one core; torchrun's ranks
   (no sampling thread) are the baseline.
3. with --nodes (root, network namespaces): the same answer time for 2 nodes x 4 ranks (node 1's
   ranks through the job's c10d store), and the ranks' idle CPU there (local rank 0 of each
   node relays stacks from its store watch's poll).
4. the rank side alone, precisely: the CPU one answer of the sampling thread costs (in this
   process, torch imported, 4 other threads; the thread's own schedstat over 2000 answers), and
   one `add(key, 0)` round trip on a TCPStore client (what the relay adds to each 0.5 s poll of
   local rank 0), as shares of a core at their rates.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
STRAGGLER = ROOT / "tests" / "launch_scripts" / "straggler.py"
IDLE = ROOT / "benchmarks" / "scripts" / "idle_rank.py"
BIN = Path(sys.executable).parent
GPUWARDEN, TORCHRUN = str(BIN / "gpuwarden"), str(BIN / "torchrun")
PYSPY = shutil.which("py-spy") or (str(BIN / "py-spy") if (BIN / "py-spy").exists() else None)


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid``, in nanoseconds (schedstat: finer than /proc/stat's
    10 ms ticks, which a 0.1 % share over 20 s would round away)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def wait_for(paths: list[Path], procs: list[subprocess.Popen[bytes]], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise SystemExit("the job did not start")
        time.sleep(0.2)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def time_stacks(job: str, repeat: int, cmd: list[str] | None = None) -> tuple[float, float, list[int]]:
    walls, inner, ranks = [], [], []
    for _ in range(repeat):
        t = time.monotonic()
        r = subprocess.run([*(cmd or []), GPUWARDEN, "stacks", "--json", job], capture_output=True,
                           text=True, timeout=30)
        walls.append(time.monotonic() - t)
        doc = json.loads(r.stdout)
        inner.append(doc["after_s"])
        ranks = [x["pid"] for x in doc["ranks"]]
        time.sleep(0.3)
    return med(walls), med(inner), ranks


def time_pyspy(pids: list[int], repeat: int) -> float | None:
    if PYSPY is None:
        return None
    walls = []
    for _ in range(repeat):
        t = time.monotonic()
        for pid in pids:
            subprocess.run([PYSPY, "dump", "--pid", str(pid)], capture_output=True, timeout=60)
        walls.append(time.monotonic() - t)
    return med(walls)


def stacks_8_ranks(n: int, repeat: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "SLOW_RANK": "2", "SLOW_DELAY_S": "1", "STOP_FILE": f"{d}/stop",
               "STAMP_DIR": d}
        job = subprocess.Popen([GPUWARDEN, "launch", "-n", str(n), "--cpu", str(STRAGGLER)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                               start_new_session=True)
        try:
            wait_for([Path(d) / "first_step"], [job])
            wall, inner, pids = time_stacks(str(job.pid), repeat)
            spy = time_pyspy(pids, max(1, repeat // 3))
        finally:
            Path(d, "stop").touch()
            stop([job])
    print(f"\n1. stacks, {n} ranks on one node (medians of {repeat})")
    print("| what | gpuwarden stacks | py-spy dump, each rank in turn | ratio |")
    print("|---|---|---|---|")
    spy_text = f"{spy:.2f} s" if spy is not None else "py-spy not installed"
    ratio = f"{wall / spy:.2f}x" if spy else "-"
    print(f"| wall time, CLI start included | {wall:.2f} s (launcher's answer {inner:.3f} s) "
          f"| {spy_text} | {ratio} |")


def idle_cpu(window_s: float, n: int) -> None:
    rows = []
    for launcher in ("torchrun", "gpuwarden"):
        with tempfile.TemporaryDirectory() as d:
            env = {**os.environ, "STAMP_DIR": d}
            argv = [TORCHRUN, "--standalone", "--nproc-per-node", str(n), str(IDLE)] \
                if launcher == "torchrun" else [GPUWARDEN, "launch", "-n", str(n), "--cpu", str(IDLE)]
            job = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   env=env, start_new_session=True)
            try:
                stamps = [Path(d) / f"ready{r}" for r in range(n)]
                wait_for(stamps, [job])
                pids = [int(p.read_text()) for p in stamps]
                time.sleep(2)  # past the first samples' start-up
                modes = ["nobody asks"] if launcher == "torchrun" else \
                    ["nobody asks", "status every 1 s", "stacks every 1 s"]
                for mode in modes:
                    before = {p: cpu_ns(p) for p in pids}
                    t0 = time.monotonic()
                    while time.monotonic() - t0 < window_s:
                        if mode.startswith("status"):
                            subprocess.run([GPUWARDEN, "status", "--once"], capture_output=True)
                        elif mode.startswith("stacks"):
                            subprocess.run([GPUWARDEN, "stacks", str(job.pid)], capture_output=True)
                        time.sleep(1.0)
                    elapsed = time.monotonic() - t0
                    shares = [(cpu_ns(p) - before[p]) / 1e9 / elapsed * 100 for p in pids]
                    rows.append((launcher, mode, med(shares), max(shares)))
            finally:
                stop([job])
    print(f"\n2. CPU of each rank (joined, then sleeping), {n} ranks, {window_s:g} s windows")
    print("| launcher | while | median rank | busiest rank |")
    print("|---|---|---|---|")
    for launcher, mode, m, mx in rows:
        print(f"| {launcher} | {mode} | {m:.4f} % of a core | {mx:.4f} % |")


def two_nodes(repeat: int, window_s: float) -> None:
    from _netns import make_hosts, remove_hosts

    hosts = make_hosts(2)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(2):
            hosts.write_hosts(i, [f"{hosts.addrs[i]} {os.uname().nodename}"])
        rows = []
        for script in (STRAGGLER, IDLE):
            with tempfile.TemporaryDirectory() as d:
                env = {**os.environ, "SLOW_RANK": "2", "SLOW_DELAY_S": "1", "STAMP_DIR": d,
                       "STOP_FILE": f"{d}/stop"}
                procs = []
                for node in range(2):
                    argv = [GPUWARDEN, "launch", "--nnodes", "2", "--node-rank", str(node),
                            "--master-addr", hosts.addrs[0], "--master-port", "29741", "-n", "4",
                            "--cpu", str(script)]
                    procs.append(subprocess.Popen(hosts.cmd(node, argv), stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL, env=env,
                                                  start_new_session=True))
                try:
                    if script == STRAGGLER:
                        wait_for([Path(d) / "first_step"], procs)
                        wall, inner, _ = time_stacks(str(procs[0].pid), repeat, hosts.cmd(0, []))
                        print(f"\n3. stacks, 2 nodes x 4 ranks (node 1 through the job's store; "
                              f"medians of {repeat})")
                        print(f"wall time, CLI start included: {wall:.2f} s; the launcher's "
                              f"answer: {inner:.3f} s")
                    else:
                        stamps = [Path(d) / f"ready{r}" for r in range(8)]
                        wait_for(stamps, procs)
                        pids = {r: int(Path(d, f"ready{r}").read_text()) for r in range(8)}
                        time.sleep(3)
                        before = {r: cpu_ns(p) for r, p in pids.items()}
                        t0 = time.monotonic()
                        time.sleep(window_s)
                        el = time.monotonic() - t0
                        shares = {r: (cpu_ns(p) - before[r]) / 1e9 / el * 100 for r, p in pids.items()}
                        relays = [shares[0], shares[4]]
                        others = [s for r, s in shares.items() if r not in (0, 4)]
                        rows.append(("local rank 0 (store watch + stacks relay)", med(relays)))
                        rows.append(("other ranks", med(others)))
                finally:
                    Path(d, "stop").touch()
                    stop(procs)
        print(f"idle CPU per rank, {window_s:g} s, nobody asking:")
        for what, share in rows:
            print(f"  {what}: {share:.4f} % of a core")
    finally:
        remove_hosts(hosts)


def rank_side(n: int = 2000) -> None:
    import _thread
    import threading
    from datetime import timedelta

    import torch  # noqa: F401  (a rank's process: torch's modules and threads)
    from torch.distributed import TCPStore

    from gpuwarden.launch.ranks._bootstrap import _sampling_loop

    stop = threading.Event()
    for _ in range(4):
        threading.Thread(target=stop.wait, daemon=True).start()
    with tempfile.TemporaryDirectory() as d:
        fifo, sample, query = f"{d}/req", f"{d}/sample", f"{d}/query"
        os.mkfifo(fifo, 0o600)
        before = set(os.listdir("/proc/self/task"))
        _thread.start_new_thread(_sampling_loop, (fifo, sample, query))
        time.sleep(0.2)
        [tid] = set(os.listdir("/proc/self/task")) - before
        fd = os.open(fifo, os.O_WRONLY)
        stat = f"/proc/self/task/{tid}/schedstat"
        cpu0 = int(Path(stat).read_text().split()[0])
        for _ in range(n):
            last = os.stat(sample).st_mtime_ns if os.path.exists(sample) else 0
            os.write(fd, b"s")
            while not os.path.exists(sample) or os.stat(sample).st_mtime_ns == last:
                time.sleep(0.0002)
        per_answer_us = (int(Path(stat).read_text().split()[0]) - cpu0) / n / 1000
        os.close(fd)
    stop.set()
    server = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10),
                      wait_for_workers=False)
    t0 = time.thread_time()
    for _ in range(n):
        client.add("gpuwarden/stacks/seq", 0)
    per_add_us = (time.thread_time() - t0) / n * 1e6
    print(f"\n4. the rank side alone ({n} times each)")
    print(f"one answer of the sampling thread: {per_answer_us:.0f} us of CPU; at the default "
          f"sample every 2 s: {per_answer_us / 2e6 * 100:.4f} % of a core")
    print(f"one add(key, 0) round trip (the relay's poll, local rank 0 of each node): "
          f"{per_add_us:.0f} us of CPU; every 0.5 s: {per_add_us / 0.5e6 * 100:.4f} % of a core")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--cpu-ranks", type=int, default=4)
    ap.add_argument("--nodes", action="store_true", help="also 2 namespace hosts (root)")
    ap.add_argument("--only-rank-side", action="store_true", help="only part 4")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    if args.only_rank_side:
        rank_side()
        return 0
    os.environ.setdefault("GPUWARDEN_RUNTIME_DIR", tempfile.mkdtemp(prefix="gpuwarden-bench-run-"))
    # A CLI start as users have it: with bytecode caches (this machine's environment sets
    # PYTHONDONTWRITEBYTECODE, which makes every start compile gpuwarden's modules again).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([GPUWARDEN, "--version"], capture_output=True)
    stacks_8_ranks(args.ranks, args.repeat)
    idle_cpu(args.window, args.cpu_ranks)
    if args.nodes:
        two_nodes(args.repeat, args.window)
    rank_side()
    return 0


if __name__ == "__main__":
    sys.exit(main())
