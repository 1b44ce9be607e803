"""pytest plugin for running joblib's own test_parallel.py with "gpuwarden" as a process backend.

Copied next to this file by tests/test_pool_joblib_suite.py, with "gpuwarden" added to the
copy's PROCESS_BACKENDS. Importing gpuwarden here registers the backend before the test
module builds its lists of backends from joblib's registry. Nothing else: the warm pool is
not shut down between tests (a child process that joblib's tests start is a job step of its
lease and uses its GPUs), nor at the end (the interpreter's exit does it).
"""

import gpuwarden  # noqa: F401 - registers the "gpuwarden" joblib backend
