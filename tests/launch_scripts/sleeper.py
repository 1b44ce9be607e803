"""Sleep forever with a child of its own; write both pids."""
import os
import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(os.path.join(os.environ["PIDDIR"], f"rank{os.environ['RANK']}.pids"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}\n")
time.sleep(120)
