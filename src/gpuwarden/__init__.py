"""gpuwarden: CUDA that works across processes in PyTorch.

Importing this package is cheap: it imports neither torch nor NVML. The public
API lives in submodules (``gpuwarden.inventory``, ``gpuwarden.select``, ...) and
the most used names are re-exported lazily below.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]

# The "gpuwarden" joblib backend: registered when joblib.parallel is (or gets) imported,
# without importing joblib here. See gpuwarden/_joblib_hook.py.
from gpuwarden import _joblib_hook  # noqa: E402

_joblib_hook.install()
