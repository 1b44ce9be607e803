"""pytest plugin for running joblib's own test_parallel.py with "gpuwarden" as a process backend.

Copied next to this file by tests/test_pool_joblib_suite.py, with "gpuwarden" added to the
copy's PROCESS_BACKENDS. Importing gpuwarden here registers the backend before the test
module builds its lists of backends from joblib's registry.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import gpuwarden  # noqa: F401 - registers the "gpuwarden" joblib backend
from gpuwarden.pool.joblib_backend import shutdown_reusable_pool

# Tests that run a script in a second Python process: that process is another job on this
# host and needs the GPUs that this process's warm pool keeps leased while it waits for the
# next Parallel call (idle_worker_timeout). Release them first, as a user would.
OTHER_PROCESS_TESTS = ("test_parallel_with_interactively_defined_functions",
                       "test_parallel_with_unpicklable_functions_in_args")


@pytest.fixture(autouse=True)
def _gpus_free_for_other_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.name.startswith(OTHER_PROCESS_TESTS):
        shutdown_reusable_pool()
    yield


def pytest_sessionfinish() -> None:
    # The warm pool would otherwise live until its idle timeout or interpreter exit.
    shutdown_reusable_pool()
