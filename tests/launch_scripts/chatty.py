"""Write about 1 MB to stdout in 2000 lines, then DONE (a full --log-dir must not stop it)."""
import sys

for i in range(2000):
    sys.stdout.write(f"line {i} " + "x" * 500 + "\n")
sys.stdout.write("DONE\n")
sys.stdout.flush()
