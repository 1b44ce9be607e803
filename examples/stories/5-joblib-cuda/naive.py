"""Story 5, the naive way (GPU only): a joblib sweep whose tasks use CUDA.

    python naive.py fork    # backend="multiprocessing" after the parent asked torch.cuda
    python naive.py oom     # the default loky backend: 4 workers, all on cuda:0

fork: the parent calls ``torch.cuda.is_available()``; the multiprocessing backend forks its
workers; the first task touching CUDA fails with CUDA_FORK_REINIT.
oom: loky starts fresh processes (no fork problem), but every worker's ``cuda`` is GPU 0: four
trials that each need 30 % of a GPU overflow it (CUDA_OOM), however many GPUs the host has.

Exit code: 1 when the sweep failed, 0 if it ran, 77 without a GPU.
"""

import sys
import traceback

from joblib import Parallel, delayed
from tasks import train_trial

from gpuwarden.inventory import real_gpu_present as has_gpu

SKIP_EXIT = 77


def main() -> int:
    case = sys.argv[1] if len(sys.argv) > 1 else "oom"
    if case not in ("fork", "oom"):
        print("usage: python naive.py fork|oom", file=sys.stderr)
        return 2
    if not has_gpu():
        print(f"story 5 naive ({case}): skipped, {'CUDA_FORK_REINIT' if case == 'fork' else 'CUDA_OOM'} "
              "needs a real GPU (NVML reports none here)", file=sys.stderr)
        return SKIP_EXIT
    import torch

    print(f"parent: torch.cuda.is_available() = {torch.cuda.is_available()}", flush=True)
    try:
        if case == "fork":
            results = Parallel(n_jobs=2, backend="multiprocessing")(
                delayed(train_trial)(t, 0.05, 0.5) for t in range(4))
        else:
            results = Parallel(n_jobs=4, batch_size=1, pre_dispatch="all")(
                delayed(train_trial)(t) for t in range(4))
    except Exception:
        traceback.print_exc()
        return 1
    for line in results:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
