"""The torchrun idioms that pick a rank's GPU by LOCAL_RANK, as third-party scripts write them.

    python idioms.py to|ddp|accelerator|map_location

Prints ``IDIOM {json}``: the rank, LOCAL_RANK, CUDA_VISIBLE_DEVICES, the ordinal the idiom used
and the physical GPU it names (CUDA_DEVICE_ORDER=PCI_BUS_ID: entry ``ordinal`` of
CUDA_VISIBLE_DEVICES). With a GPU the idiom really runs (an invalid ordinal fails the rank);
without one (a simulated host) only the ordinal is computed, and torch is not imported.
"""
import json
import os
import sys
import tempfile

idiom = sys.argv[1]
local_rank = int(os.environ["LOCAL_RANK"])
visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
ordinal = local_rank
if os.environ.get("GPUWARDEN_DEVICE") == "cuda" and not os.environ.get("GPUWARDEN_SIMULATE"):
    import torch
    import torch.distributed as dist

    if idiom == "to":  # pytorch/examples: model.to(local_rank)
        model = torch.nn.Linear(4, 4).to(local_rank)
        ordinal = next(model.parameters()).device.index
    elif idiom == "ddp":  # DDP(model, device_ids=[local_rank]) after set_device(local_rank)
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        model = DDP(torch.nn.Linear(4, 4).to(local_rank), device_ids=[local_rank])
        model(torch.ones(2, 4, device=local_rank)).sum().backward()
        ordinal = next(model.parameters()).device.index
        dist.destroy_process_group()
    elif idiom == "accelerator":  # torch.accelerator.set_device_index(local_rank)
        torch.accelerator.set_device_index(local_rank)
        ordinal = torch.ones(1, device="cuda").device.index
    elif idiom == "map_location":  # torch.load(..., map_location=f"cuda:{local_rank}")
        path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        torch.save({"w": torch.ones(2)}, path)
        ordinal = torch.load(path, map_location=f"cuda:{local_rank}")["w"].device.index
    else:
        sys.exit(f"unknown idiom {idiom}")
print("IDIOM " + json.dumps({
    "rank": int(os.environ["RANK"]), "local_rank": local_rank, "visible": visible,
    "ordinal": ordinal, "gpu": visible[ordinal] if ordinal < len(visible) else None}))
