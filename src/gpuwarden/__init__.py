"""gpuwarden: CUDA that works across processes in PyTorch.

Importing this package is cheap: it imports neither torch nor NVML. The public
API lives in submodules (``gpuwarden.inventory``, ``gpuwarden.select``, ...) and
the most used names are re-exported lazily below.
"""

from __future__ import annotations

import importlib
import sys

# Not ``from typing import TYPE_CHECKING``: typing is not imported at run time here, nor in
# the other modules a rank's bootstrap imports before the script runs (procs.py,
# launch/watch/status.py, launch/ranks/_bootstrap.py): a script that never imports typing
# does not pay for it under ``gpuwarden launch`` (mypy reads every name TYPE_CHECKING as true).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"

# name -> submodule that defines it; imported on first access (PEP 562).
_LAZY = {
    "fork_safe": "gpuwarden.forksafe",
    "fork_safety": "gpuwarden.forksafe",
    "ForkSafety": "gpuwarden.forksafe",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        # A submodule loaded before this package object existed (a `gpuwarden launch` rank:
        # the bootstrap hands `import gpuwarden` over to the script, _joblib_hook.hand_over).
        loaded = sys.modules.get(f"{__name__}.{name}")
        if loaded is not None:
            return loaded
        raise AttributeError(f"module 'gpuwarden' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# The "gpuwarden" joblib backend: registered when joblib.parallel is (or gets) imported,
# without importing joblib here. See gpuwarden/_joblib_hook.py.
from gpuwarden import _joblib_hook  # noqa: E402

_joblib_hook.install()
