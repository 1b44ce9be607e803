"""No torch: measures the launcher's own cost."""
import os

print("hello from rank", os.environ["RANK"])
