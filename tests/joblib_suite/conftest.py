"""pytest plugin for running joblib's own test_parallel.py with "gpuwarden" as a process backend.

Copied next to this file by tests/test_pool_joblib_suite.py, with "gpuwarden" added to the
copy's PROCESS_BACKENDS. Importing gpuwarden here registers the backend before the test
module builds its lists of backends from joblib's registry. Nothing else: the warm pool is
not shut down between tests (a child process that joblib's tests start is a job step of its
lease and uses its GPUs), nor at the end (the interpreter's exit does it). And one thing
more: the hang guard of joblib's subprocess tests is longer (below).
"""

import joblib.testing

import gpuwarden  # noqa: F401 - registers the "gpuwarden" joblib backend

# joblib's tests that start a Python child give it 10-15 s before SIGTERM, a guard against a
# deadlock clogging CI; on a 2-core machine running other suites beside this one, a child that
# imports joblib, gpuwarden and numpy and starts a pool took longer than that (SIGTERM, exit
# -15, the expected output already printed). The guard stays, six times as long: the test
# module imports the function from here, after this plugin is loaded.
HANG_GUARD_FACTOR = 6
_check_subprocess_call = joblib.testing.check_subprocess_call


def _check_subprocess_call_load_tolerant(cmd, timeout=5, stdout_regex=None, stderr_regex=None):
    return _check_subprocess_call(cmd, None if timeout is None else timeout * HANG_GUARD_FACTOR,
                                  stdout_regex, stderr_regex)


joblib.testing.check_subprocess_call = _check_subprocess_call_load_tolerant
