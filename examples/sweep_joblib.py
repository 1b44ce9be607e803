"""A hyperparameter sweep fanned out over GPUs with joblib and gpuwarden.

Each joblib worker is pinned to one GPU (inside it, the GPU is cuda:0), two workers per GPU.
Without a GPU it runs on CPU workers and says so once. Run: python examples/sweep_joblib.py
"""

from __future__ import annotations

import itertools
import os

from joblib import Parallel, delayed, parallel_config

import gpuwarden  # noqa: F401 - registers the "gpuwarden" joblib backend


def train(lr: float, hidden: int, epochs: int = 30) -> dict[str, float | int | str]:
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
            "where": f"{device} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, "
                     f"pid {os.getpid()})"}


def main() -> None:
    grid = list(itertools.product([1e-3, 1e-2, 3e-2], [16, 64]))
    with parallel_config(backend="gpuwarden", n_jobs=-1, workers_per_gpu=2):
        results = Parallel()(delayed(train)(lr, hidden) for lr, hidden in grid)
    for r in sorted(results, key=lambda r: r["loss"]):
        print(f"lr={r['lr']:<6} hidden={r['hidden']:<3} loss={r['loss']:.4f}  on {r['where']}")


if __name__ == "__main__":
    main()
