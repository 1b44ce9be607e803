"""Registers the "gpuwarden" joblib backend without importing joblib.

``import gpuwarden`` calls :func:`install`. When ``joblib.parallel`` is already imported,
the backend is registered at once; otherwise a finder on ``sys.meta_path`` waits for
``joblib.parallel`` to be imported (whenever the user imports joblib, before or after
gpuwarden) and registers right after that module has run. The finder answers no other
module, costs one string comparison per import, and removes itself once done.

joblib has no entry points for backends (only ``register_parallel_backend``), so the backend
exists in an interpreter once ``gpuwarden`` is imported there. What is registered is a factory
(joblib's documented form: a callable returning a ``ParallelBackendBase``) that loads the
backend's module on the first use of the name, which then registers its class in its place:
importing joblib with gpuwarden costs no backend import (~14 ms; paid by every process that
imports both, the pool's own process server and workers among them); the pool itself loads on
the first ``Parallel`` call.
"""

from __future__ import annotations

import sys
from types import ModuleType

TYPE_CHECKING = False  # typing is not imported here at run time: see gpuwarden/__init__.py
if TYPE_CHECKING:
    from typing import Any

_TARGET = "joblib.parallel"


def make_backend(**kwargs: Any) -> Any:
    """joblib's factory for the backend until its module is loaded (see the top)."""
    from gpuwarden.pool.joblib_backend import GpuwardenBackend

    return GpuwardenBackend(**kwargs)


def register(parallel_module: ModuleType | None = None) -> None:
    """Register the backend with joblib (imports joblib if it is not imported yet)."""
    if parallel_module is None:
        import joblib.parallel

        parallel_module = joblib.parallel
    from gpuwarden.pool import BACKEND_NAME

    backend_module = sys.modules.get("gpuwarden.pool.joblib_backend")
    if backend_module is None:
        parallel_module.register_parallel_backend(BACKEND_NAME, make_backend)
    elif hasattr(backend_module, "GpuwardenBackend"):
        parallel_module.register_parallel_backend(BACKEND_NAME, backend_module.GpuwardenBackend)
    # else: that module's own import of joblib got here: it registers its class when it is done


class _AfterImportFinder:
    """Meta-path finder that lets the normal finders find joblib.parallel, then hooks it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            _remove()
            register(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_finder = _AfterImportFinder()


def _remove() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def hand_over() -> None:
    """For ``gpuwarden launch``'s rank bootstrap, which imports gpuwarden before the script
    runs: take the finder away again (the script may never ask for gpuwarden) and forget the
    package, so that the script's own ``import gpuwarden`` runs the package's ``__init__`` —
    and registers the backend — exactly as it does under torchrun. Submodules the bootstrap
    loaded stay loaded (the package finds them again, see ``gpuwarden.__getattr__``)."""
    _remove()
    for name in ("gpuwarden", __name__):
        sys.modules.pop(name, None)


def install() -> None:
    """Register now if joblib.parallel is loaded, else as soon as it is."""
    module = sys.modules.get(_TARGET)
    if module is not None:
        register(module)
    elif _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
