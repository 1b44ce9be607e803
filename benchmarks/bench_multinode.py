"""Multi-node stalls: time to a named diagnosis, gpuwarden launch vs torchrun (not a test).

    sudo python benchmarks/bench_multinode.py [--cap 60]

Two hosts made of network namespaces (root + iproute2 + nftables, addresses in 198.18.0.0/15),
one rank per node, the same script (tests/launch_scripts/mn_allreduce.py) under both launchers:

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
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _netns import Hosts, hosts_of, unavailable_reason  # noqa: E402

BIN = Path(sys.executable).parent
SCRIPT = str(Path(__file__).resolve().parents[1] / "tests" / "launch_scripts" / "mn_allreduce.py")

CASES = {
    "wrong MASTER_ADDR": re.compile(r"RDZV_DNS|Name or service not known|gai error|"
                                    r"cannot be retrieved|Temporary failure in name resolution"),
    "firewall drops the port": re.compile(r"packets dropped|RDZV_CONNECT_TIMEOUT|timed out|"
                                          r"Socket Timeout"),
    "node 1 never started": re.compile(r"RDZV_WORKERS_MISSING|clients joined|"
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=60.0)
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
