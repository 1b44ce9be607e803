"""``gpuwarden ls``: every GPU with memory, utilization, compute mode, MIG and processes."""

from __future__ import annotations

import argparse
from typing import Any

from gpuwarden.cli._output import emit_json, emit_table, note
from gpuwarden.errors import VisibilityError
from gpuwarden.units import format_bytes


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "ls",
        help="list GPUs, their memory, utilization, compute mode and processes (NVML)",
        description="List every GPU of this host as NVML reports it, without creating a CUDA "
        "context. GPUs hidden by CUDA_VISIBLE_DEVICES or Slurm are listed and marked.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gpuwarden.cli import inventory_of
    from gpuwarden.visibility import parse_visibility

    inventory = inventory_of(args)
    host = inventory.read_host()
    try:
        vis = parse_visibility(host.gpus, inventory.env)
        ordinals = {g.uuid: i for i, g in enumerate(vis.gpus)}
        notes = vis.notes
    except VisibilityError as exc:  # still list the host; the variable is what's wrong
        ordinals = {}
        notes = (exc.render(),)
    if args.json:
        gpus = []
        for g in host.gpus:
            d = g.to_dict()
            d["cuda_ordinal"] = ordinals.get(g.uuid)
            for m in d["mig_devices"]:
                m["cuda_ordinal"] = ordinals.get(m["uuid"])
            gpus.append(d)
        emit_json({"host": host.to_dict(), "gpus": gpus, "notes": list(notes)})
        return 0
    for line in notes:
        note(line)
    # Show how CUDA will number the GPUs whenever that differs from NVML's order: some hidden,
    # reordered (CUDA_VISIBLE_DEVICES=3,2,1,0), or MIG instances in place of whole GPUs.
    restricted = list(ordinals) != [g.uuid for g in host.gpus]
    rows = []
    for g in host.gpus:
        procs = "; ".join(
            f"{p.describe()} {format_bytes(p.used_memory_bytes)}" for p in g.processes
        ) or "-"
        util = "?" if g.utilization_gpu_pct is None else f"{g.utilization_gpu_pct}%"
        row = [str(g.index), g.name,
               f"{format_bytes(g.memory_used_bytes)} / {format_bytes(g.memory_total_bytes)}",
               format_bytes(g.memory_free_bytes), util, g.compute_mode.value,
               "on" if g.mig_enabled else "off", procs]
        if g.error is not None:  # a lost GPU: what NVML said instead of made-up numbers
            row = [str(g.index), g.name, "?", "?", "?", "?", "?", f"unusable: {g.error}"]
        if restricted:
            ordinal = ordinals.get(g.uuid)
            row.insert(1, "-" if ordinal is None else f"cuda:{ordinal}")
        rows.append(row)
    columns = ["GPU", "name", "used / total", "free", "util", "mode", "MIG", "processes"]
    if restricted:
        columns.insert(1, "visible as")
    versions = f"driver {host.driver_version or '?'}, CUDA {host.cuda_driver_version or '?'}"
    emit_table(columns, rows, title=f"{host.hostname}: {len(host.gpus)} GPU(s), {versions}"
               + ("" if host.source == "nvml" else f" [{host.source}]"))
    return 0
