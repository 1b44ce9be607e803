"""Print the launcher's variables and whether torch got imported (it must not be, by the bootstrap)."""
import json
import os
import sys

keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
        "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}))
print("TORCH_IMPORTED", "torch" in sys.modules)
print("ARGV", json.dumps(sys.argv[1:]))
print("SYSPATH0", sys.path[0])
print("FILE", __file__)
print("ARGV0", sys.argv[0])
print(f"to stderr from {os.environ['RANK']}", file=sys.stderr)
