"""`gpuwarden status` / `stacks` on real GPUs (NCCL): GPU memory per rank from NVML, and each
rank's last collective with its sequence number from NCCL's flight recorder. Skipped where NVML
reports fewer than two GPUs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import real_gpu_count

SCRIPT = str(Path(__file__).parent / "launch_scripts" / "nccl_stalls.py")
GPUWARDEN = str(Path(sys.executable).parent / "gpuwarden")
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("real_host"), pytest.mark.timeout(240)]


def test_stacks_carry_the_flight_recorders_sequence_numbers_and_status_the_gpu_memory() -> None:
    if real_gpu_count() < 2:
        pytest.skip("needs two GPUs")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")}
    # rank 1 sleeps after two all_reduces while rank 0 waits in barrier (no stall report:
    # the default --stall-timeout is minutes)
    job = subprocess.Popen([GPUWARDEN, "launch", "-n", "2", "--gpus", "2", SCRIPT, "barrier"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            r = subprocess.run([GPUWARDEN, "status", "--json", str(job.pid)], capture_output=True,
                               text=True, timeout=30)
            launch = json.loads(r.stdout)["jobs"][0]["launch"] if r.returncode == 0 else None
            rows = {row["rank"]: row for row in (launch or {}).get("ranks", [])}
            if rows.get(0, {}).get("op") == "barrier":
                break
            assert time.monotonic() < deadline and job.poll() is None, r.stdout + r.stderr
            time.sleep(1)
        assert all(isinstance(rows[k]["gpu_memory_bytes"], int) and rows[k]["gpu_memory_bytes"] > 0
                   for k in (0, 1)), rows
        doc = json.loads(subprocess.run([GPUWARDEN, "stacks", "--json", str(job.pid)],
                                        capture_output=True, text=True, timeout=30).stdout)
        by_rank = {r["rank"]: r for r in doc["ranks"]}
        for rank in (0, 1):
            records = by_rank[rank].get("flight_recorder")
            assert records and max(fr["seq"] for fr in records) >= 2, by_rank[rank]
        assert [(g["ranks"], g["odd"]) for g in doc["groups"]] in (
            [([0], False), ([1], True)],)  # the waiting rank is the reference on a tie
        assert doc["after_s"] < 5.0  # the flight recorder's dumps take up to a second
    finally:
        os.killpg(job.pid, signal.SIGINT)
        job.communicate(timeout=60)
