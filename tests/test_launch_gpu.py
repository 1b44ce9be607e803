"""gpuwarden launch on real GPUs (NCCL). Skipped where NVML reports no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwarden.cli import main
from tests.conftest import real_gpu_count

SCRIPTS = Path(__file__).parent / "launch_scripts"
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("real_host", "no_leftover_processes")]


@pytest.fixture(autouse=True)
def unclosed_log_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """init_allreduce.py writes a file it never closes there (test_launch_procs reads it); the
    first run on a real GPU found these tests without it: every rank died of a KeyError."""
    monkeypatch.setenv("UNCLOSED_LOG_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.timeout(180)
def test_one_rank_nccl_with_init(capsys: pytest.CaptureFixture[str], unclosed_log_dir: Path
                                 ) -> None:
    code = main(["launch", "-n", "1", "--min-free", "1GiB", str(SCRIPTS / "init_allreduce.py")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "[rank0]: rank 0/1 local 0 cuda:0 nccl launcher=gpuwarden sum=1" in out
    assert (unclosed_log_dir / "rank0.txt").read_text() == "written without close\n"


@pytest.mark.timeout(180)
def test_set_device_local_rank_works_as_under_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    n = min(2, real_gpu_count())
    code = main(["launch", "-n", str(n), "--min-free", "1GiB",
                 str(SCRIPTS / "nccl_set_device.py")])
    out, err = capsys.readouterr()
    assert code == 0, err
    for rank in range(n):  # every rank sees the job's n GPUs; cuda:LOCAL_RANK is its own
        assert f"[rank{rank}]: rank {rank} current_device={rank} count={n} sum={n * (n + 1) // 2}" in out
    code = main(["launch", "-n", str(n), "--bind", "rank", "--min-free", "1GiB",
                 str(SCRIPTS / "nccl_set_device.py")])
    out, err = capsys.readouterr()
    assert code == 0, err
    for rank in range(n):  # --virtual-local-rank: LOCAL_RANK=0, the one visible GPU
        assert f"[rank{rank}]: rank {rank} current_device=0 count=1 sum={n * (n + 1) // 2}" in out


@pytest.mark.timeout(180)
def test_share_gives_each_rank_its_gpu_as_cuda_0_with_local_rank_0(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--share implies --bind rank (torchrun's --virtual-local-rank): LOCAL_RANK=0 and the one
    visible GPU, so set_device(LOCAL_RANK) lands on it. Both ranks on GPU 0: any GPU host."""
    code = main(["launch", "--share", "-n", "2", "--gpus", "1", str(SCRIPTS / "nccl_set_device.py"),
                 "--no-collective"])
    out, err = capsys.readouterr()
    assert code == 0, err
    for rank in (0, 1):
        assert f"[rank{rank}]: rank {rank} local 0 current_device=0 count=1" in out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("idiom", ["to", "ddp", "accelerator", "map_location"])
def test_torchrun_idioms_land_each_rank_on_its_own_gpu(capsys: pytest.CaptureFixture[str],
                                                       idiom: str) -> None:
    """The scripts of pytorch/examples and friends, unchanged: no 'invalid device ordinal', and
    every rank on a different GPU (the one gpuwarden leased for it)."""
    import json

    n = min(2, real_gpu_count())
    code = main(["launch", "-n", str(n), "--min-free", "1GiB", str(SCRIPTS / "idioms.py"), idiom])
    out, err = capsys.readouterr()
    assert code == 0, err
    seen = [json.loads(line.split("IDIOM ", 1)[1]) for line in out.splitlines() if "IDIOM " in line]
    assert len(seen) == n
    assert all(s["ordinal"] == s["local_rank"] == s["rank"] for s in seen)
    assert len({s["gpu"] for s in seen}) == n and None not in {s["gpu"] for s in seen}


@pytest.mark.timeout(180)
def test_more_ranks_than_gpus_refused_and_share_uses_gloo(capsys: pytest.CaptureFixture[str]) -> None:
    n = real_gpu_count() + 1
    code = main(["launch", "-n", str(n), str(SCRIPTS / "init_allreduce.py")])
    out, err = capsys.readouterr()
    assert code == 4 and "[rank" not in out
    assert f"{n} rank(s) need {n} GPU(s)" in err and "Duplicate GPU detected" in err
    code = main(["launch", "-n", "2", "--gpus", "1", "--share", str(SCRIPTS / "init_allreduce.py")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "share GPU" in err and "cuda:0 gloo" in out
