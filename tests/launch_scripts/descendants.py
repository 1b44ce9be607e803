"""Leave descendants every way a rank can: a child in the rank's group, a child in a session of
its own (start_new_session=True), and a daemon (double fork, setsid) that later moves to a
group of its own again. Write every pid, then sleep."""
import os
import subprocess
import sys
import time

piddir = os.environ["PIDDIR"]
in_group = subprocess.Popen(["sleep", "300"])
own_session = subprocess.Popen(["sleep", "300"], start_new_session=True)
if os.fork() == 0:  # the daemon: its parent exits at once, so it is re-parented
    os.setsid()
    if os.fork() == 0:
        with open(os.path.join(piddir, "daemon.pids"), "w") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.5)  # adopted by now, and known with its group at the time
        os.setsid()  # a group (and session) of its own again
        with open(os.path.join(piddir, "daemon.moved"), "w") as f:
            f.write("moved\n")
        time.sleep(300)
        os._exit(0)
    os._exit(0)
with open(os.path.join(piddir, f"rank{os.environ['RANK']}.pids"), "w") as f:
    f.write(f"{os.getpid()} {in_group.pid} {own_session.pid}\n")
sys.stdout.flush()
time.sleep(300)
