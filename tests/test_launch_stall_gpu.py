"""Stalls on real GPUs (NCCL), with the flight recorder. Skipped where NVML reports fewer than
two GPUs. NCCL's own watchdog would wait 10 minutes; the stall timeout here is 10 s."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwarden.launch.config import LaunchConfig
from gpuwarden.launch.runner import launch
from tests.conftest import real_gpu_count

SCRIPT = str(Path(__file__).parent / "launch_scripts" / "nccl_stalls.py")
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("real_host", "no_leftover_processes")]


@pytest.fixture(autouse=True)
def _own_flight_recorder(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuwarden.launch.watch.flight_recorder import RECORDER_VARIABLES

    for var in RECORDER_VARIABLES:
        monkeypatch.delenv(var, raising=False)  # the user's own settings would win


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode, words", [
    ("barrier", "waited in barrier for more than 10 s"),
    ("mismatch", "ranks wait in different collectives"),
])
def test_nccl_stall_is_named_with_the_flight_recorder(mode: str, words: str) -> None:
    if real_gpu_count() < 2:
        pytest.skip("needs two GPUs")
    config = LaunchConfig(target=SCRIPT, args=(mode,), nproc=2, gpus=2, stall_timeout_s=10.0,
                          grace_s=2.0)
    report, outcome = launch(config)
    text = report.render()
    assert report.code == "RANK_STALL", text
    assert words in report.what, text
    assert outcome.stall is not None and outcome.stall.elsewhere == [1], text
    # both ranks answered the dump request: rank 1 never joined the collective rank 0 waits in
    # (barrier) or is in another one (mismatch); either way the recorder lists both ranks
    assert "NCCL flight recorder:" in text, text
    assert "rank 0: last collective #" in text and "rank 1: last collective #" in text, text
    if mode == "barrier":
        assert "rank(s) 1 never joined it" in text, text
