"""Story 5, the gpuwarden way: the same sweep on the "gpuwarden" joblib backend (CPU or GPU).

    python fixed.py

``import gpuwarden`` registers the backend. Each worker gets its own GPU through
CUDA_VISIBLE_DEVICES before it imports torch (inside, the GPU is ``cuda:0``), at most
``workers_per_gpu=2`` workers share one GPU, and ``memory_fraction=0.45`` caps each worker's
allocator, so two trials of 30 % fit and a runaway one fails alone with a plain OOM. The parent
may touch CUDA as much as it likes: workers are started by a fork server, never forked from it.
Without a GPU the workers run on the CPU.

Exit code: 0 when every trial ran.
"""

import sys

from joblib import Parallel, delayed, parallel_config
from tasks import train_trial

import gpuwarden  # noqa: F401 - registers the "gpuwarden" joblib backend


def main() -> int:
    import torch

    print(f"parent: torch.cuda.is_available() = {torch.cuda.is_available()}", flush=True)
    with parallel_config(backend="gpuwarden", n_jobs=-1, workers_per_gpu=2, memory_fraction=0.45):
        results = Parallel()(delayed(train_trial)(t) for t in range(4))
    for line in results:
        print(line)
    ok = len(results) == 4
    print("ok: 4 trials ran" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
