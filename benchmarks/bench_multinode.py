"""Multi-node: gpuwarden launch beside torchrun, the same command lines (not a test).

    sudo python benchmarks/bench_multinode.py [--part contract|stalls|all] [--repeat 3] [--cap 60]

Hosts made of network namespaces (root + iproute2 + nftables, addresses in 198.18.0.0/15), each
with its own host name, one rank per node (gloo on CPU).

**contract** (torchrun's multi-node command line, the same on every node:
``--nnodes=N --nproc-per-node=1 --rdzv-id=... --rdzv-backend=c10d --rdzv-endpoint=n0:PORT``;
tests/launch_scripts/mn_steps.py and mn_allreduce.py under both launchers):

1. rendezvous -> first step, 2 and 3 hosts: every launcher started at once; until the last node
   prints its first step (an all_reduce of every rank);
2. node failure -> every node stopped: rank 1 (host 1) raises after init while rank 0 sleeps
   outside any collective; from the exception to the last launcher's exit;
3. failure -> restarted first step (--max-restarts 1): rank 1 SIGKILLs itself at step 3; from the
   kill to the restarted attempt's first step on every node.

Ratios are torchrun's time over gpuwarden's (above 1: gpuwarden is faster); "-" where torchrun
never got there within --cap. Each number is the median of --repeat runs.

**stalls** (static command line, time to a named diagnosis):

1. wrong MASTER_ADDR (does not resolve) on node 1;
2. a firewall on node 0 dropping MASTER_PORT, node 0 and node 1 started;
3. node 1 never started (node 0 alone).

"Named diagnosis": the first line of the launcher's output that names the cause (the patterns
below, from failure-codes.md); for gpuwarden, its error report or its as-it-happens preflight
line. torchrun is stopped at --cap seconds: "no diagnosis within N s" when nothing named the
cause by then. gpuwarden runs with --rdzv-timeout 10s and --stall-timeout 10s.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _netns import Hosts, hosts_of, unavailable_reason  # noqa: E402

BIN = Path(sys.executable).parent
SCRIPTS = Path(__file__).resolve().parents[1] / "tests" / "launch_scripts"
SCRIPT = str(SCRIPTS / "mn_allreduce.py")
STEPS = str(SCRIPTS / "mn_steps.py")

CASES = {
    "wrong MASTER_ADDR": re.compile(r"RDZV_DNS|Name or service not known|gai error|"
                                    r"cannot be retrieved|Temporary failure in name resolution"),
    "firewall drops the port": re.compile(r"packets dropped|RDZV_CONNECT_TIMEOUT|timed out|"
                                          r"Socket Timeout"),
    "node 1 never started": re.compile(r"RDZV_WORKERS_MISSING|clients joined|missing: node 1|"
                                       r"waiting for (?:workers|clients)"),
}


def _argv(tool: str, node: int, addr: str, port: int) -> list[str]:
    if tool == "gpuwarden":
        return [str(BIN / "gpuwarden"), "launch", "--nnodes", "2", "--node-rank", str(node),
                "--master-addr", addr, "--master-port", str(port), "-n", "1", "--cpu",
                "--rdzv-timeout", "10s", "--stall-timeout", "10s", SCRIPT]
    return [str(BIN / "torchrun"), "--nnodes", "2", "--node-rank", str(node), "--master-addr", addr,
            "--master-port", str(port), "--nproc-per-node", "1", SCRIPT]


def _watch(h: Hosts, starts: list[tuple[int, list[str]]], pattern: re.Pattern[str],
           watched: int, cap: float) -> tuple[float | None, str]:
    """Start every (node, argv); return when node ``watched``'s output matches, or at ``cap``."""
    procs: dict[int, subprocess.Popen[bytes]] = {}
    for node, argv in starts:
        procs[node] = subprocess.Popen(h.cmd(node, argv), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.monotonic()
    found: float | None = None
    line = ""
    proc = procs[watched]
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    buf = ""
    while time.monotonic() - t0 < cap:
        try:
            chunk = os.read(proc.stdout.fileno(), 65536).decode(errors="replace")
        except BlockingIOError:
            chunk = ""
        buf += chunk
        m = pattern.search(buf)
        if m:
            found = time.monotonic() - t0
            line = buf[buf.rfind("\n", 0, m.start()) + 1:].split("\n")[0][:110]
            break
        if proc.poll() is not None and not chunk:
            break
        time.sleep(0.05)
    for p in procs.values():
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        p.wait()
    return found, line


# ---- contract: the c10d command line ---------------------------------------------------------


def _c10d(tool: str, h: Hosts, nnodes: int, port: int, script: str, *extra: str) -> list[str]:
    line = [f"--nnodes={nnodes}", "--nproc-per-node=1", f"--rdzv-id=bench{port}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={h.hostnames[0]}:{port}", *extra, script]
    return ([str(BIN / "gpuwarden"), "launch", *line] if tool == "gpuwarden"
            else [str(BIN / "torchrun"), *line])


class _Run:
    """Launchers on several hosts, their merged output read as it comes."""

    def __init__(self, h: Hosts, argvs: dict[int, list[str]], env: dict[str, str]) -> None:
        self.h = h
        self.procs = {n: subprocess.Popen(h.cmd(n, argv), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, **env})
                      for n, argv in argvs.items()}
        self.text = {n: "" for n in argvs}
        self.ended: dict[int, float] = {}
        for p in self.procs.values():
            assert p.stdout is not None
            os.set_blocking(p.stdout.fileno(), False)

    def pump(self) -> None:
        for n, p in self.procs.items():
            assert p.stdout is not None
            try:
                chunk = os.read(p.stdout.fileno(), 65536).decode(errors="replace")
            except BlockingIOError:
                chunk = ""
            self.text[n] += chunk
            if n not in self.ended and p.poll() is not None and not chunk:
                self.ended[n] = time.monotonic()

    def until(self, done, cap: float) -> bool:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + cap
        while time.monotonic() < deadline:
            self.pump()
            if done():
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        for pid in self.h.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for p in self.procs.values():
            p.wait()


def _first_step_times(text: str, restart: str) -> list[float]:
    return [float(t) for t in re.findall(rf"step 0 sum \S+ restart {restart} node \d+ "
                                          r"at=([\d.]+)", text)]


def first_step(tool: str, h: Hosts, nnodes: int, port: int, cap: float) -> float | None:
    run = _Run(h, {n: _c10d(tool, h, nnodes, port, STEPS) for n in range(nnodes)},
               {"STEPS": "3", "STEP_S": "0"})
    t0 = time.monotonic()
    try:
        ok = run.until(lambda: len(_first_step_times("".join(run.text.values()), "0")) >= nnodes,
                       cap)
        return max(_first_step_times("".join(run.text.values()), "0")) - t0 if ok else None
    finally:
        run.stop()


def failure_stops_all(tool: str, h: Hosts, port: int, cap: float) -> float | None:
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "crash")
        run = _Run(h, {n: _c10d(tool, h, 2, port, SCRIPT) for n in range(2)},
                   {"CRASH_RANK": "1", "CRASH_STAMP": stamp})
        try:
            ok = run.until(lambda: len(run.ended) == 2, cap)
            if not ok or not os.path.exists(stamp):
                return None
            with open(stamp) as f:
                return max(run.ended.values()) - float(f.read())
        finally:
            run.stop()


def restarted_first_step(tool: str, h: Hosts, port: int, cap: float) -> float | None:
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "kill")
        extra = ["--max-restarts=1"]
        run = _Run(h, {n: _c10d(tool, h, 2, port, STEPS, *extra) for n in range(2)},
                   {"STEPS": "40", "STEP_S": "0.05", "STEPS_AFTER_RESTART": "3",
                    "KILL_AT_STEP": "3", "KILL_STAMP": stamp})
        try:
            ok = run.until(lambda: len(_first_step_times("".join(run.text.values()), "1")) >= 2,
                           cap)
            if not ok or not os.path.exists(stamp):
                return None
            with open(stamp) as f:
                killed = float(f.read())
            return max(_first_step_times("".join(run.text.values()), "1")) - killed
        finally:
            run.stop()


def contract(args: argparse.Namespace) -> list[tuple[str, list[float | None], list[float | None]]]:
    rows = []
    port = 29900
    with hosts_of(3, named=True) as h:
        cases = [("rendezvous -> first step, 2 hosts", lambda t, p: first_step(t, h, 2, p, args.cap)),
                 ("rendezvous -> first step, 3 hosts", lambda t, p: first_step(t, h, 3, p, args.cap)),
                 ("rank failure on node 1 -> every node stopped",
                  lambda t, p: failure_stops_all(t, h, p, args.cap)),
                 ("rank killed -> restarted first step (--max-restarts 1)",
                  lambda t, p: restarted_first_step(t, h, p, args.cap))]
        for name, measure in cases:
            if args.only and args.only not in name:
                continue
            got: dict[str, list[float | None]] = {"gpuwarden": [], "torchrun": []}
            for _ in range(args.repeat):
                for tool in ("gpuwarden", "torchrun"):
                    port += 1
                    value = measure(tool, port)
                    got[tool].append(value)
                    shown = f"{value:.2f} s" if value is not None else f"not within {args.cap:g} s"
                    print(f"{name:<55} {tool:<10} {shown}", flush=True)
            rows.append((name, got["gpuwarden"], got["torchrun"]))
    return rows


def _median(values: list[float | None]) -> float | None:
    done = [v for v in values if v is not None]
    return statistics.median(done) if len(done) * 2 > len(values) else None


def print_contract(rows: list[tuple[str, list[float | None], list[float | None]]], cap: float,
                   repeat: int) -> None:
    print(f"\n| c10d command line (median of {repeat}) | gpuwarden launch | torchrun | "
          "torchrun / gpuwarden |\n|---|---|---|---|")
    for name, g, t in rows:
        gm, tm = _median(g), _median(t)
        gs = f"{gm:.2f} s" if gm is not None else f"not within {cap:g} s"
        ts = f"{tm:.2f} s" if tm is not None else f"not within {cap:g} s"
        misses = sum(v is None for v in t)
        if misses and tm is not None:
            ts += f" ({misses} of {len(t)} runs never got there)"
        ratio = f"{tm / gm:.2f}x" if gm and tm else (f">{cap / gm:.0f}x" if gm else "-")
        print(f"| {name} | {gs} | {ts} | {ratio} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=60.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--part", choices=("contract", "stalls", "all"), default="all")
    parser.add_argument("--only", default="", metavar="WORDS",
                        help="contract: only the cases whose name contains WORDS")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    if args.part in ("contract", "all"):
        print_contract(contract(args), args.cap, args.repeat)
    if args.part in ("stalls", "all"):
        stalls(args)
    return 0


def stalls(args: argparse.Namespace) -> None:
    rows = []
    port = 29801
    with hosts_of(2) as h:
        for i in range(2):
            h.write_hosts(i, [f"{h.addrs[i]} {os.uname().nodename}"])
        for case, pattern in CASES.items():
            for tool in ("gpuwarden", "torchrun"):
                port += 1
                if case == "wrong MASTER_ADDR":
                    starts = [(1, _argv(tool, 1, "node-zero.invalid", port))]
                    watched = 1
                elif case == "firewall drops the port":
                    h.nft(0, "add table inet gwbench",
                          "add chain inet gwbench input { type filter hook input priority 0 ; }",
                          f"add rule inet gwbench input tcp dport {port} drop")
                    starts = [(0, _argv(tool, 0, h.addrs[0], port)),
                              (1, _argv(tool, 1, h.addrs[0], port))]
                    watched = 1
                else:
                    starts = [(0, _argv(tool, 0, h.addrs[0], port))]
                    watched = 0
                try:
                    found, line = _watch(h, starts, pattern, watched, args.cap)
                finally:
                    if case == "firewall drops the port":
                        h.nft(0, "delete table inet gwbench")
                rows.append((case, tool, found, line))
                shown = f"{found:.1f} s" if found is not None else f"no diagnosis within {args.cap:g} s"
                print(f"{case:<24} {tool:<10} {shown:<26} {line}", flush=True)
    print("\n| stall | gpuwarden launch | torchrun | ratio |\n|---|---|---|---|")
    for case in CASES:
        g = next(r for r in rows if r[0] == case and r[1] == "gpuwarden")[2]
        t = next(r for r in rows if r[0] == case and r[1] == "torchrun")[2]
        gs = f"{g:.1f} s" if g is not None else f"none within {args.cap:g} s"
        ts = f"{t:.1f} s" if t is not None else f"no diagnosis within {args.cap:g} s"
        ratio = f"{t / g:.0f}x" if g and t else (f">{args.cap / g:.0f}x" if g else "-")
        print(f"| {case} | {gs} | {ts} | {ratio} |")


if __name__ == "__main__":
    sys.exit(main())
