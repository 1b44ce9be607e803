"""Write the pid, say one line, then sleep (the supervisor must stop it)."""
import os
import time

with open(os.path.join(os.environ["PIDDIR"], f"rank{os.environ['RANK']}.pids"), "w") as f:
    f.write(f"{os.getpid()}\n")
print("hello", flush=True)
time.sleep(120)
