"""The sweep's task, shared by naive.py and fixed.py: it needs ``share`` of its GPU for a while.

Importable (not defined in ``__main__``) so that every joblib backend can pickle it by name.
"""

import os
import time


def train_trial(trial: int, share: float = 0.3, hold_s: float = 4.0) -> str:
    import torch

    if not torch.cuda.is_available():
        x = torch.ones(1024, 1024)  # the CPU path: a little work, no GPU
        return f"trial {trial}: cpu, pid {os.getpid()}, sum {float(x.sum()):g}"
    _free, total = torch.cuda.mem_get_info()
    weights = torch.empty(int(total * share), dtype=torch.uint8, device="cuda")
    weights.fill_(1)
    torch.cuda.synchronize()
    time.sleep(hold_s)  # "training": the memory stays in use
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    return (f"trial {trial}: {torch.cuda.get_device_name()} (CUDA_VISIBLE_DEVICES={visible}), "
            f"pid {os.getpid()}, {share:.0%} of its memory")
