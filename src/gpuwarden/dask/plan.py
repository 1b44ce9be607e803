"""The Dask workers of one host, a pure function: leased GPUs -> one spec per worker.

The environment of each worker is the local pool's (``pool.plan.plan_slots``: its own
``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, thread limits), so a worker
behaves the same whether a GPUPool or a Dask scheduler sends it the task.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpuwarden.inventory.snapshot import GPUSnapshot
from gpuwarden.pool.plan import plan_slots

# The resource a task asks for to run on a GPU worker: client.submit(f, resources={"GPU": 1}).
GPU_RESOURCE = "GPU"


@dataclass(frozen=True)
class WorkerSpec:
    """One Dask worker: its name, its environment, its resources and what to call its device."""

    name: str
    host: str
    gpu: GPUSnapshot | None
    env: Mapping[str, str] = field(default_factory=dict)
    resources: Mapping[str, float] = field(default_factory=dict)

    @property
    def device_label(self) -> str:
        return self.gpu.label if self.gpu is not None else "CPU"

    @property
    def cuda_visible_devices(self) -> str:
        return self.env.get("CUDA_VISIBLE_DEVICES", "")


def plan_workers(host: str, gpus: Sequence[GPUSnapshot], workers_per_gpu: int, *,
                 cpu_workers: int = 1, parent_env: Mapping[str, str] | None = None,
                 cpu_count: int | None = None,
                 name_prefix: str | None = None) -> tuple[WorkerSpec, ...]:
    """``workers_per_gpu`` workers per GPU (``cpu_workers`` CPU workers when ``gpus`` is empty).

    Names say where a worker runs: ``box-a/GPU1/0`` is the first worker on GPU 1 of box-a,
    ``box-a/CPU/2`` a CPU worker; Dask shows them in its dashboard, logs and errors;
    ``name_prefix`` replaces the host's name in them (``--name``: two hosts of one name). Each GPU
    worker offers ``GPU=1`` (a task with ``resources={"GPU": 1}`` holds one worker of a GPU,
    never two tasks in one worker); CPU workers offer no GPU resource.
    """
    slots = plan_slots(gpus, workers_per_gpu, cpu_workers=cpu_workers, parent_env=parent_env,
                       cpu_count=cpu_count)
    specs = []
    per_device: dict[str, int] = {}
    for slot in slots:
        device = f"GPU{slot.gpu.index}" if slot.gpu is not None else "CPU"
        if slot.gpu is not None and slot.gpu.is_mig_instance:
            device += f"-{slot.gpu.uuid}"
        k = per_device.get(device, 0)
        per_device[device] = k + 1
        resources = {GPU_RESOURCE: 1.0} if slot.gpu is not None else {}
        specs.append(WorkerSpec(f"{name_prefix or host}/{device}/{k}", host, slot.gpu, dict(slot.env),
                                resources))
    return tuple(specs)
