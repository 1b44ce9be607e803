"""gpuwarden's Dask workers on a real GPU (skipped without one)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
pytest.importorskip("distributed")


def test_local_cluster_workers_each_see_their_leased_gpu_with_memory_fraction() -> None:
    code = """
    from distributed import Client
    from joblib import Parallel, delayed, parallel_config
    from gpuwarden.dask import local_cluster
    def probe(i):
        import torch
        x = torch.ones(1024, device="cuda")
        props = torch.cuda.get_device_properties(0)
        return (torch.cuda.device_count(), torch.cuda.current_device(),
                round(torch.cuda.get_per_process_memory_fraction(0), 2), x.device.type,
                str(props.uuid).lower())
    if __name__ == "__main__":
        with local_cluster(gpus=1, workers_per_gpu=2, memory_fraction=0.3,
                           allow_shared=True) as cluster:
            leased = cluster.gpus[0].uuid.lower()
            with Client(cluster.scheduler_address), parallel_config(backend="dask"):
                seen = set(Parallel()(delayed(probe)(i) for i in range(8)))
        print(sorted({s[:4] for s in seen}))
        print(all(leased.endswith(s[4].removeprefix("gpu-")) for s in seen))
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[(1, 0, 0.3, 'cuda')]", "True"], out.stdout
