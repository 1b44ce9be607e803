"""GPU-aware worker pool (:class:`GPUPool`) and its joblib backend.

Each worker is pinned to one GPU by its own CUDA_VISIBLE_DEVICES before it runs any code,
so inside a task the GPU is ``cuda:0``. See docs/pool.md.

Importing this package is cheap (no torch, no joblib): the executor is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuwarden.pool.executor import CPUFallbackWarning, GPUPool, WorkerInfo

__all__ = ["CPUFallbackWarning", "GPUPool", "WorkerInfo"]

BACKEND_NAME = "gpuwarden"  # the joblib backend's: Parallel(backend="gpuwarden")


def __getattr__(name: str) -> Any:
    if name in __all__:
        from gpuwarden.pool import executor

        return getattr(executor, name)
    raise AttributeError(f"module 'gpuwarden.pool' has no attribute {name!r}")
