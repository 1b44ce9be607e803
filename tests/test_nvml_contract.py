"""The real NVML backend meets the same contract as the simulated one (runs only on a GPU)."""

import os
import subprocess
import sys

import pytest

from gpuwarden.inventory.nvml import NvmlBackend
from gpuwarden.inventory.snapshot import ComputeMode

pytestmark = pytest.mark.gpu


def test_nvml_snapshot_contract() -> None:
    host = NvmlBackend().read_host()
    assert host.source == "nvml" and host.driver_version
    assert host.gpus, "NVML reports a GPU, so the snapshot must have one"
    for i, gpu in enumerate(host.gpus):
        assert gpu.index == i
        assert gpu.uuid.startswith("GPU-")
        assert 0 < gpu.memory_used_bytes <= gpu.memory_total_bytes
        assert gpu.memory_free_bytes == gpu.memory_total_bytes - gpu.memory_used_bytes
        assert isinstance(gpu.compute_mode, ComputeMode)
        assert gpu.pci_bus_id
        for p in gpu.processes:
            assert p.pid > 0


def test_reading_nvml_creates_no_cuda_context() -> None:
    # Our own pid must not show up as a compute process after a read.
    code = ("import os; from gpuwarden.inventory.nvml import NvmlBackend; h = NvmlBackend().read_host(); "
            "print(any(p.pid == os.getpid() for g in h.gpus for p in g.processes))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != "GPUWARDEN_SIMULATE"})
    assert out.stdout.strip() == "False"


def test_cli_ls_json_on_real_gpu(capsys, monkeypatch) -> None:
    import json

    from gpuwarden.cli import main

    monkeypatch.delenv("GPUWARDEN_SIMULATE", raising=False)
    assert main(["ls", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["host"]["source"] == "nvml" and data["gpus"]
    print(json.dumps(data, indent=1))  # shown with -s in the GPU verification run
