"""No torch. Rank 1 fails as argv[1] says; every other rank survives in a loop that ignores SIGTERM
(so only SIGKILL after --grace ends it) and keeps a child of its own (which must die too)."""
import os
import signal
import subprocess
import sys
import time

rank = int(os.environ["RANK"])
piddir = os.environ["PIDDIR"]
mode = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(os.path.join(piddir, f"rank{rank}.pids"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}\n")
if rank != 1:
    def note_sigterm(signum, frame):  # and go on: only SIGKILL ends this rank
        with open(os.path.join(piddir, f"term_at{rank}"), "w") as f:
            f.write(repr(time.monotonic()))

    signal.signal(signal.SIGTERM, note_sigterm)
    while True:
        time.sleep(0.1)
time.sleep(0.5)  # let the others start
with open(os.path.join(piddir, "failed_at"), "w") as f:
    f.write(repr(time.monotonic()))
print("rank 1 about to fail", flush=True)
if mode == "raise":
    raise ValueError("bad batch 17")
if mode == "exit3":
    sys.exit(3)
if mode == "segv":
    import ctypes

    ctypes.string_at(0)
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "fpe":  # what an integer division by zero in native code raises
    os.kill(os.getpid(), signal.SIGFPE)
