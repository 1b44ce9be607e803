"""CPython's own test_concurrent_futures, the executor tests that apply to a process executor,
run against GPUPool: ``python run_executor_tests.py PATH START_METHOD``.

PATH is the installed test module (Debian ships it in libpython3.11-testsuite); it is
imported by name from its directory, never copied. Its own ``create_executor_tests`` builds
the test classes with a mixin that makes the executor a GPUPool (``executor_type``) on the
given start method, exactly as it does for ProcessPoolExecutor's fork/forkserver/spawn
mixins. Tests that read ProcessPoolExecutor's internals, construct ProcessPoolExecutor
itself, or use an argument GPUPool does not have are skipped, each with its reason below.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import unittest
from pathlib import Path
from typing import Any

from gpuwarden.pool import GPUPool

INTERNALS = "reads ProcessPoolExecutor's internals ({})"
NOT_APPLICABLE: dict[str, str] = {
    "test_interpreter_shutdown": "runs a script that imports the executor from "
    "concurrent.futures by its name (GPUPool at interpreter exit: test_pool.py)",
    "test_submit_after_interpreter_shutdown": "the same: a script importing the executor "
    "from concurrent.futures",
    "test_hang_gh83386": "the same: a script importing the executor from concurrent.futures",
    "test_processes_terminate": INTERNALS.format("_processes"),
    "test_context_manager_shutdown": "constructs futures.ProcessPoolExecutor, not the executor "
    "under test",
    "test_del_shutdown": "constructs futures.ProcessPoolExecutor, not the executor under test",
    "test_shutdown_no_wait": "constructs futures.ProcessPoolExecutor, not the executor under "
    "test",
    "test_killed_child": INTERNALS.format("_processes") + "; and a GPUPool is not broken by a "
    "worker's death, only that task fails (test_pool_faults.py)",
    "test_saturation": INTERNALS.format("_processes, _max_workers"),
    "test_idle_process_reuse_one": INTERNALS.format("_processes"),
    "test_idle_process_reuse_multiple": INTERNALS.format("_processes"),
    "test_max_tasks_per_child": "max_tasks_per_child: an argument GPUPool does not have",
    "test_max_tasks_per_child_defaults_to_spawn_context": "max_tasks_per_child: an argument "
    "GPUPool does not have",
    "test_max_tasks_early_shutdown": "max_tasks_per_child: an argument GPUPool does not have",
    "test_shutdown_deadlock_pickle": INTERNALS.format("_executor_manager_thread"),
    # FailingInitializerMixin's test (the generated class names it test_initializer too).
    "FailingInitializer.test_initializer": "passes a multiprocessing.Queue to the initializer, "
    "which multiprocessing lets a child have only at Process.start(); GPUPool pickles "
    "initializer arguments as task arguments (a failing initializer: test_pool.py)",
}
SUITES = ("InitializerMixin", "FailingInitializerMixin", "ProcessPoolShutdownTest", "WaitTests",
          "AsCompletedTests", "ProcessPoolExecutorTest", "ExecutorDeadlockTest")


def gpupool_type(start_method: str) -> type:
    class GPUPoolExecutor(GPUPool):
        """GPUPool with ProcessPoolExecutor's constructor arguments."""

        def __init__(self, max_workers: int | None = None, mp_context: Any = None,
                     initializer: Any = None, initargs: tuple[Any, ...] = ()) -> None:
            super().__init__(workers_per_gpu=None, max_workers=max_workers,
                             initializer=initializer, initargs=initargs,
                             start_method=start_method, preload=())

    return GPUPoolExecutor


def main(argv: list[str]) -> int:
    path, start_method = Path(argv[0]), argv[1]
    # Last on the path: the module's own imports (test.support) come from this interpreter.
    sys.path.append(str(path.parent))
    import test_concurrent_futures as cf  # type: ignore[import-not-found]

    class GPUPoolMixin(cf.ExecutorMixin):  # type: ignore[misc,name-defined]
        executor_type = gpupool_type(start_method)
        ctx = start_method

    # The classes the module's create_executor_tests() would make with this mixin, made here
    # (in __main__): a test that submits one of its own methods (test_traceback) pickles the
    # class, by value from __main__, which a worker's import of the module would not have.
    classes = [type(f"GPUPool{start_method.capitalize()}{name}",
                    (getattr(cf, name), GPUPoolMixin, cf.BaseTestCase), {})
               for name in SUITES]
    for cls in classes:
        for attr in dir(cls):
            reason = NOT_APPLICABLE.get(attr)
            if "FailingInitializer" in cls.__name__ and attr == "test_initializer":
                reason = NOT_APPLICABLE["FailingInitializer.test_initializer"]
            if reason and attr.startswith("test_"):
                setattr(cls, attr, unittest.skip(reason)(getattr(cls, attr)))
    loader = unittest.TestLoader()
    suite = unittest.TestSuite(loader.loadTestsFromTestCase(c) for c in classes)
    # setUpModule's cleanups (multiprocessing's test cleanup, thread checks) as unittest does.
    cf.setUpModule()
    try:
        result = unittest.TextTestRunner(verbosity=1, stream=sys.stdout).run(suite)
    finally:
        unittest.case.doModuleCleanups()
    print(f"RAN {result.testsRun} SKIPPED {len(result.skipped)} "
          f"FAILED {len(result.failures) + len(result.errors)}", flush=True)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    mp.set_start_method("spawn" if sys.argv[2] == "spawn" else "forkserver", force=True)
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    sys.exit(main(sys.argv[1:]))
