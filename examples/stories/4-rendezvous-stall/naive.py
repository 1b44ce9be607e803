"""Story 4, the naive way: ranks started by hand with torch's environment variables.

    python naive.py wrong-addr     # MASTER_ADDR is a name that does not resolve (a typo)
    python naive.py port-in-use    # MASTER_PORT is held by a process from an earlier run
    python naive.py missing-rank   # WORLD_SIZE=2, but rank 1 was never started

This is what `torchrun` does per rank, and what tutorials do in two terminals: set MASTER_ADDR,
MASTER_PORT, RANK and WORLD_SIZE and call init_process_group. PyTorch's own timeout is 30 min
for gloo (10 for NCCL); the ranks get --timeout-s (default 4 s) instead, and a rank still
running --give-up-s (default 20 s) after init_process_group began is killed, so the story ends
in seconds. Every rank's output is printed (prefixed like torchrun's --tee), then how each ended.

Exit code: 1 when the failure was reproduced (a rank failed or had to be killed), 0 if the job
worked after all.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = ("wrong-addr", "port-in-use", "missing-rank")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_lines(proc: subprocess.Popen[str], into: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        into.append(line.rstrip("\n"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=CASES)
    parser.add_argument("--timeout-s", type=float, default=4.0,
                        help="init_process_group timeout given to the ranks (PyTorch's default: 1800)")
    parser.add_argument("--give-up-s", type=float, default=20.0,
                        help="kill ranks still running after this long (a person would wait longer)")
    args = parser.parse_args()

    port = free_port()
    addr = "127.0.0.1"
    ranks_to_start = [0, 1]
    holder: subprocess.Popen[bytes] | None = None
    if args.case == "wrong-addr":
        addr = "node-0.cluster.invalid"  # the name of rank 0's host, mistyped
    elif args.case == "missing-rank":
        ranks_to_start = [0]  # the second terminal, the second node's job: never started
    procs: dict[int, subprocess.Popen[str]] = {}
    try:
        if args.case == "port-in-use":
            holder = subprocess.Popen([sys.executable, str(HERE / "port_holder.py"), str(port)],
                                      stdout=subprocess.PIPE, start_new_session=True)
            assert holder.stdout is not None
            holder.stdout.readline()  # listening now
        print(f"$ MASTER_ADDR={addr} MASTER_PORT={port} WORLD_SIZE=2 RANK=r python train.py"
              f"  # for RANK in {ranks_to_start}", flush=True)
        start = time.monotonic()
        for rank in ranks_to_start:
            env = {**os.environ, "MASTER_ADDR": addr, "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "PYTHONUNBUFFERED": "1"}
            procs[rank] = subprocess.Popen(
                [sys.executable, str(HERE / "train.py"), "--timeout-s", str(args.timeout_s)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True)
        lines: dict[int, list[str]] = {rank: [] for rank in procs}
        readers = [threading.Thread(target=read_lines, args=(proc, lines[rank]), daemon=True)
                   for rank, proc in procs.items()]
        for reader in readers:
            reader.start()
        # --give-up-s counts from when every rank is in init_process_group (torch's import
        # takes seconds on a loaded machine); a rank that never gets there is bounded too.
        ended: dict[int, float] = {}
        in_init_at: float | None = None
        while len(ended) < len(procs):
            now = time.monotonic()
            for rank, proc in procs.items():
                if rank not in ended and proc.poll() is not None:
                    ended[rank] = now - start
            if in_init_at is None and all(
                    rank in ended or any("init_process_group" in ln for ln in lines[rank])
                    for rank in procs):
                in_init_at = now
            if (in_init_at is not None and now - in_init_at > args.give_up_s) or \
                    now - start > args.give_up_s + 60:
                break
            time.sleep(0.1)
        for rank, proc in procs.items():
            if rank not in ended:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for reader in readers:
            reader.join(timeout=5)
        for rank in procs:
            for line in lines[rank]:
                print(f"[rank{rank}]:{line}")
        print("---")
        failed = False
        for rank, proc in procs.items():
            if rank in ended:
                print(f"rank {rank}: exit code {proc.returncode} after {ended[rank]:.1f} s")
                failed |= proc.returncode != 0
            else:
                print(f"rank {rank}: still waiting {args.give_up_s:.0f} s after init_process_group "
                      f"began (its timeout was {args.timeout_s:g} s), killed")
                failed = True
        for rank in sorted({0, 1} - set(ranks_to_start)):
            print(f"rank {rank}: never started (nothing above names it)")
        return 1 if failed else 0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if holder is not None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()


if __name__ == "__main__":
    sys.exit(main())
