"""The same sweep as sweep_joblib.py, over the GPU workers of several hosts (Dask distributed).

On each host: ``gpuwarden worker tcp://SCHEDULER:8786 --workers-per-gpu 2`` (after
``dask scheduler`` somewhere). Then, anywhere that reaches the scheduler:

    python examples/sweep_dask.py tcp://SCHEDULER:8786

joblib's own ``dask`` backend sends each call to a worker; each worker sees only its GPU (as
cuda:0). Without an address it starts a one-host cluster (gpuwarden.dask.local_cluster).
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any

from distributed import Client, get_worker
from joblib import Parallel, delayed, parallel_config


def train(lr: float, hidden: int, epochs: int = 30) -> dict[str, Any]:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 256, device=device).unsqueeze(1)
    y = torch.sin(3 * x) + 0.1 * torch.randn_like(x)
    model = torch.nn.Sequential(torch.nn.Linear(1, hidden), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, 1)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    return {"lr": lr, "hidden": hidden, "loss": loss.item(),
            "where": f"{get_worker().name} on {device} (CUDA_VISIBLE_DEVICES="
                     f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}, pid {os.getpid()})"}


def sweep(address: str) -> None:
    grid = list(itertools.product([1e-3, 1e-2, 3e-2], [16, 64]))
    with Client(address), parallel_config(backend="dask"):
        results = Parallel()(delayed(train)(lr, hidden) for lr, hidden in grid)
    for r in sorted(results, key=lambda r: r["loss"]):
        print(f"lr={r['lr']:<6} hidden={r['hidden']:<3} loss={r['loss']:.4f}  {r['where']}")


def main() -> None:
    if len(sys.argv) > 1:
        sweep(sys.argv[1])
        return
    from gpuwarden.dask import local_cluster

    with local_cluster(workers_per_gpu=2) as cluster:
        sweep(cluster.scheduler_address)


if __name__ == "__main__":  # Dask's workers are spawned: they re-import this module
    main()
