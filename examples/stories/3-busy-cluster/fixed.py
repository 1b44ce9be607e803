"""Story 3, the gpuwarden way: choose a GPU with reasons, wait in line, explain the OOM by name.

    python fixed.py               # a real GPU host if NVML shows one, else the simulated host
    python fixed.py --simulated   # busy-host.json: 4 GPUs full of other users (runs on CPU)

Simulated host (CPU): `gpuwarden ls`; `gpuwarden select` refusing every GPU with its reason, then
accepting the shared one; `gpuwarden explain oom.log` joined with the inventory, so the OOM names
the users and commands holding the memory; two jobs asking for the one usable GPU through
`gpuwarden run --wait`, the second waiting in line until the first is done.

Real GPU: hog.py (the "other user", in its own process group) fills GPU 0 but 6 GiB; the job
run the naive way OOMs and explain + NVML name the hog; `gpuwarden select` refuses the GPU;
`gpuwarden run --wait` waits in line until the hog ends (killed after a few seconds: the other
user's job finished), then the job gets its 16 GiB.

Exit code: 0 when every step ended as the story says; 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gpuwarden.inventory import real_gpu_present as has_gpu

HERE = Path(__file__).resolve().parent
GPUWARDEN = [sys.executable, "-m", "gpuwarden"]


def show(title: str, argv: list[str], env: dict[str, str], expect_exit: set[int]) -> tuple[bool, str]:
    """Run a command as the user would and show it; True when its exit code is expected."""
    shown = " ".join("gpuwarden" if a == "-m" else a for a in argv[2:]) if argv[:3] == GPUWARDEN \
        else " ".join(argv)
    print(f"\n## {title}\n$ {shown}", flush=True)
    start = time.monotonic()
    proc = subprocess.run(argv, env=env, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, check=False)
    print(proc.stdout.rstrip())
    ok = proc.returncode in expect_exit
    print(f"-> exit {proc.returncode} after {time.monotonic() - start:.1f} s"
          f"{'' if ok else f' (expected {sorted(expect_exit)})'}", flush=True)
    return ok, proc.stdout


def holders(oom_text: str, env: dict[str, str]) -> tuple[str, list[str]]:
    """explain's code for an OOM message, and whose processes its 'Process P has M' lines are."""
    from gpuwarden.inventory import read_host
    from gpuwarden.units import format_bytes

    host = read_host(env)  # now, while the holders still run
    from gpuwarden.explain import explain_text

    primary = explain_text(oom_text).primary
    by_pid = {p.pid: (gpu.index, p) for gpu in host.gpus for p in gpu.processes}
    lines = []
    # explain's typed evidence: one record per process the OOM message names
    for record in primary.fields.get("processes", []):
        pid, mem = record["pid"], format_bytes(record.get("bytes"))
        if pid in by_pid:
            index, proc = by_pid[pid]
            lines.append(f"pid {pid} holds {mem} on GPU {index}: user {proc.user or '?'}, "
                         f"{proc.command or '?'}")
        else:
            lines.append(f"pid {pid} holds {mem}: not in NVML's process list now (ended, or "
                         "another PID namespace)")
    return str(primary.code), lines


def explain_step(oom_text: str, env: dict[str, str]) -> bool:
    print("\n## the OOM, explained and joined with the inventory (who holds the memory)")
    code, lines = holders(oom_text, env)
    print(f"explain: {code}")
    for line in lines:
        print(f"  {line}")
    return code == "CUDA_OOM"


def wait_in_line(env: dict[str, str], constraints: list[str], job_args: list[str],
                 while_waiting: object = None) -> bool:
    """`gpuwarden run --wait` behind a holder; ``while_waiting()`` frees the GPU (real host)."""
    run = [*GPUWARDEN, "run", "-n", "1", *constraints]
    first: subprocess.Popen[str] | None = None
    if while_waiting is None:  # simulated: the first job in line holds the only usable GPU 3 s
        print("\n## two jobs want the one usable GPU: the second waits in line")
        print(f"$ gpuwarden run -n 1 {' '.join(constraints)} -- python job.py "
              f"{' '.join(job_args)} --hold-s 3 &", flush=True)
        first = subprocess.Popen([*run, "--", sys.executable, "job.py", *job_args, "--hold-s", "3"],
                                 env=env, cwd=HERE, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
        assert first.stdout is not None
        for line in first.stdout:  # until it holds its lease
            print(f"[first] {line.rstrip()}", flush=True)
            if "leased GPU" in line:
                break
    else:
        print("\n## wait in line until the GPU has room, instead of crashing")
    argv = [*run, "--wait", "120s", "--", sys.executable, "job.py", *job_args]
    print(f"$ gpuwarden run -n 1 {' '.join(constraints)} --wait 120s -- python job.py "
          f"{' '.join(job_args)}", flush=True)
    start = time.monotonic()
    second = subprocess.Popen(argv, env=env, cwd=HERE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    if callable(while_waiting):
        threading.Timer(3.0, while_waiting).start()
    try:
        out, _ = second.communicate(timeout=150)
        print(out.rstrip())
        if first is not None:
            rest, _ = first.communicate(timeout=30)
            for line in rest.splitlines():
                print(f"[first] {line}")
    finally:
        for proc in (first, second):
            if proc is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
    waited = "in line" in out or "waiting" in out.lower()
    ok = second.returncode == 0 and waited and (first is None or first.returncode == 0)
    print(f"-> exit {second.returncode} after {time.monotonic() - start:.1f} s, "
          f"{'waited in line' if waited else 'did not wait'}", flush=True)
    return ok


def simulated() -> list[bool]:
    lease_dir = tempfile.mkdtemp(prefix="story3-leases-")
    env = {**os.environ, "GPUWARDEN_SIMULATE": str(HERE / "busy-host.json"),
           "GPUWARDEN_LEASE_DIR": lease_dir}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    print(f"(simulated host: GPUWARDEN_SIMULATE={HERE / 'busy-host.json'})")
    results = [
        show("the host", [*GPUWARDEN, "ls"], env, {0})[0],
        show("30 GiB on a GPU nobody else uses: none, and why", [*GPUWARDEN, "select", "-n", "1",
             "--min-free", "30GiB", "-v"], env, {4})[0],
        show("accept sharing a GPU in the default compute mode", [*GPUWARDEN, "select", "-n", "1",
             "--min-free", "30GiB", "--allow-shared", "-v"], env, {0})[0],
    ]
    ok, _ = show("the OOM a job got on GPU 0 (oom.log)", [*GPUWARDEN, "explain", "oom.log"],
                 env, {0})
    results += [ok, explain_step((HERE / "oom.log").read_text(), env)]
    results.append(wait_in_line(env, ["--min-free", "30GiB", "--allow-shared"],
                                ["--need-gib", "30"]))
    return results


def real() -> list[bool]:
    env = dict(os.environ)
    env.pop("GPUWARDEN_SIMULATE", None)
    # The hog fills one GPU; every step of the story looks at that GPU alone, so on a host with
    # several GPUs the job cannot simply land on another one and "not wait".
    env.update(CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
               CUDA_DEVICE_ORDER="PCI_BUS_ID")
    hog = subprocess.Popen([sys.executable, "hog.py", "--leave-gib", "6"], cwd=HERE, env=env,
                           stdout=subprocess.PIPE, text=True, start_new_session=True)

    def end_hog() -> None:
        try:
            os.killpg(hog.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    try:
        assert hog.stdout is not None
        print(f"(the other user: pid {hog.pid}, {hog.stdout.readline().strip()})", flush=True)
        results = [show("the host", [*GPUWARDEN, "ls"], env, {0})[0],
                   show("16 GiB on a GPU: refused, with the reason",
                        [*GPUWARDEN, "select", "-n", "1", "--min-free", "16GiB", "-v"], env, {0, 4})[0]]
        ok, out = show("the job the naive way (GPU 0, no check)",
                       [sys.executable, "job.py", "--need-gib", "16"], env, {1})
        results += [ok, explain_step(out, env)]
        results.append(wait_in_line(env, ["--min-free", "16GiB"], ["--need-gib", "16"],
                                    while_waiting=end_hog))
        return results
    finally:
        end_hog()
        hog.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--simulated", action="store_true", help="use busy-host.json even with a GPU")
    args = parser.parse_args()
    results = simulated() if args.simulated or not has_gpu() else real()
    ok = all(results)
    print(f"\n{'ok' if ok else 'FAILED'}: {sum(results)} of {len(results)} step(s) as expected")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
