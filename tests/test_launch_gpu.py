"""gpuwarden launch on real GPUs (NCCL). Skipped where NVML reports no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwarden.cli import main

SCRIPTS = Path(__file__).parent / "launch_scripts"
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_leftover_processes")]


def gpu_count() -> int:
    from gpuwarden.inventory.nvml import NvmlBackend

    return len(NvmlBackend().read_host().gpus)


@pytest.fixture(autouse=True)
def _real_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUWARDEN_SIMULATE", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.timeout(180)
def test_one_rank_nccl_with_init(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["launch", "-n", "1", "--min-free", "1GiB", str(SCRIPTS / "init_allreduce.py")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "[rank0]: rank 0/1 local 0 cuda:0 nccl launcher=gpuwarden sum=1" in out


@pytest.mark.timeout(180)
def test_set_device_local_rank_works_when_each_rank_sees_one_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    n = min(2, gpu_count())
    code = main(["launch", "-n", str(n), "--min-free", "1GiB",
                 str(SCRIPTS / "nccl_set_device.py")])
    out, err = capsys.readouterr()
    assert code == 0, err
    for rank in range(n):
        assert f"[rank{rank}]: rank {rank} current_device=0 count=1 sum={n * (n + 1) // 2}" in out


@pytest.mark.timeout(180)
def test_set_device_local_rank_maps_to_the_ranks_own_gpu_on_one_gpu(
        capsys: pytest.CaptureFixture[str]) -> None:
    """LOCAL_RANK 1 on a host with one GPU: set_device(1) must land on the rank's GPU (cuda:0),
    not fail as an invalid ordinal. --share puts both ranks on GPU 0, so this runs on any GPU host."""
    code = main(["launch", "--share", "-n", "2", "--gpus", "1", str(SCRIPTS / "nccl_set_device.py"),
                 "--no-collective"])
    out, err = capsys.readouterr()
    assert code == 0, err
    for rank in (0, 1):
        assert f"[rank{rank}]: rank {rank} local {rank} current_device=0 count=1" in out


@pytest.mark.timeout(180)
def test_more_ranks_than_gpus_refused_and_share_uses_gloo(capsys: pytest.CaptureFixture[str]) -> None:
    n = gpu_count() + 1
    code = main(["launch", "-n", str(n), str(SCRIPTS / "init_allreduce.py")])
    out, err = capsys.readouterr()
    assert code == 4 and "[rank" not in out
    assert f"{n} rank(s) need {n} GPU(s)" in err and "Duplicate GPU detected" in err
    code = main(["launch", "-n", "2", "--gpus", "1", "--share", str(SCRIPTS / "init_allreduce.py")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "share GPU" in err and "cuda:0 gloo" in out
