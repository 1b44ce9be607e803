"""The real failures and their fixes, on a real GPU (skipped without one)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def run(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as a script file, as users run theirs: a spawned child (a DataLoader worker
    with the spawn context) re-imports the main module by its path, which ``python -c`` has
    not (the first real-GPU run failed on that: "Can't get attribute 'OnGPU' on <module
    '__main__' (built-in)>")."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(textwrap.dedent(code))
        return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=240)


DATASET = """
    import torch
    from torch.utils.data import DataLoader, Dataset
    class OnGPU(Dataset):
        def __len__(self): return 4
        def __getitem__(self, i): return torch.full((2,), i, device="cuda").sum().cpu()
"""


def test_fork_loader_breaks_after_is_available_and_loader_kwargs_fixes_it() -> None:
    broken = run(DATASET + """
    if __name__ == "__main__":
        torch.cuda.is_available()
        list(DataLoader(OnGPU(), num_workers=2, multiprocessing_context="fork"))
    """)
    assert broken.returncode != 0
    assert "Cannot re-initialize CUDA in forked subprocess" in broken.stderr
    fixed = run(DATASET + """
    from gpuwarden.data import loader_kwargs
    if __name__ == "__main__":
        torch.cuda.is_available()
        kw = loader_kwargs(2, device="cuda", uses_cuda_in_workers=True)
        print(sorted(int(b) for b in DataLoader(OnGPU(), **kw)))
    """)
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.strip() == "[0, 2, 4, 6]"


def test_joblib_four_workers_on_one_gpu_with_memory_fraction() -> None:
    out = run("""
    import gpuwarden
    from joblib import Parallel, delayed, parallel_config
    def probe(i):
        import torch
        x = torch.ones(1024, device="cuda")
        props = torch.cuda.get_device_properties(0)
        return (torch.cuda.device_count(), torch.cuda.current_device(),
                round(torch.cuda.get_per_process_memory_fraction(0), 2), x.device.type)
    if __name__ == "__main__":
        with parallel_config(backend="gpuwarden", n_jobs=4, gpus=1, workers_per_gpu=4,
                             memory_fraction=0.2, allow_shared=True):
            print(set(Parallel()(delayed(probe)(i) for i in range(8))))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{(1, 0, 0.2, 'cuda')}"


def test_cuda_tensors_refused_as_arguments_and_returned_on_cpu() -> None:
    out = run("""
    import torch
    from gpuwarden.errors import CudaTensorArgumentError
    from gpuwarden.pool import GPUPool
    def make(): return {"w": torch.ones(3, device="cuda")}
    if __name__ == "__main__":
        with GPUPool(gpus=1, allow_shared=True) as pool:
            print(pool.submit(make).result()["w"].device)
            try:
                pool.submit(sum, torch.ones(2, device="cuda")).result()
            except CudaTensorArgumentError as exc:
                print(exc.code)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "POOL_CUDA_ARGUMENT"]


def test_device_prefetcher_gives_the_same_batches_on_the_gpu() -> None:
    out = run("""
    import torch, time
    from gpuwarden.data import DevicePrefetcher
    batches = [(torch.randn(256, 1024), {"y": torch.arange(256)}) for _ in range(20)]
    got = list(DevicePrefetcher(batches, "cuda"))
    ok = all(torch.equal(g[0].cpu(), b[0]) and torch.equal(g[1]["y"].cpu(), b[1]["y"])
             and g[0].is_cuda for g, b in zip(got, batches))
    w = torch.randn(1024, 1024, device="cuda")
    def loop(it):
        torch.cuda.synchronize(); t = time.perf_counter()
        for x, _ in it:
            for _ in range(20): x = x.to("cuda", non_blocking=True) @ w
        torch.cuda.synchronize(); return time.perf_counter() - t
    big = [(torch.randn(4096, 1024).pin_memory(), {}) for _ in range(30)]
    loop(DevicePrefetcher(big, "cuda"))
    plain, pre = loop(big), loop(DevicePrefetcher(big, "cuda"))
    print(ok, f"plain {plain*1e3:.1f} ms, prefetched {pre*1e3:.1f} ms")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True"), out.stdout
    print(out.stdout)


def test_memory_mapped_array_goes_to_the_workers_gpu_and_comes_back_on_cpu() -> None:
    out = run("""
    import numpy as np
    import gpuwarden
    from joblib import Parallel, delayed
    def on_gpu(a):
        import torch
        t = torch.from_numpy(np.array(a)).to("cuda")  # a read-only memmap: copy, then move
        return type(a).__name__, (t * 2).sum()        # a CUDA tensor: returned on the CPU
    if __name__ == "__main__":
        big = np.ones(2_000_000, dtype=np.float32)    # 8 MB, above max_nbytes
        out = Parallel(backend="gpuwarden", n_jobs=2, gpus=1, allow_shared=True,
                       max_nbytes="1M")(delayed(on_gpu)(big) for _ in range(4))
        print(sorted({(kind, float(s), s.device.type) for kind, s in out}))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[('memmap', 4000000.0, 'cpu')]"
