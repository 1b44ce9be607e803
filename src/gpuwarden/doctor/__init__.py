"""``gpuwarden doctor``: find the cause of a failure before the job runs.

:func:`run_doctor` gathers facts through :class:`Probes` (NVML or a simulated
host, a torch subprocess, sockets and the resolver — concurrently, each bounded
in time) and turns them into :class:`Check` results with the failure code each
one guards against. The doctor's own process never creates a CUDA context.
"""

from __future__ import annotations

import platform
import sys
import time

from gpuwarden import __version__
from gpuwarden.doctor.gpu_checks import gpu_checks, visibility_of
from gpuwarden.doctor.host_checks import host_checks
from gpuwarden.doctor.model import Check, Report, Status
from gpuwarden.doctor.net_checks import net_checks
from gpuwarden.doctor.probes import Facts, Options, Probes, gather
from gpuwarden.visibility import Visibility

__all__ = ["Check", "Facts", "Options", "Probes", "Report", "Status", "evaluate", "run_doctor"]


def evaluate(facts: Facts, opts: Options) -> list[Check]:
    """Every check, in report order, from gathered facts (pure).

    CUDA_VISIBLE_DEVICES is parsed once here; the GPU and host checks share it.
    """
    vis = visibility_of(facts.host, facts.env) if facts.host is not None else None
    local_gpus = len(vis.gpus) if isinstance(vis, Visibility) else 0
    if opts.nproc is not None and local_gpus:
        local_gpus = min(local_gpus, opts.nproc)
    return [
        *gpu_checks(facts.host, facts.host_error, facts.torch, facts.env, opts.nproc, vis,
                    facts.cuda_driver, facts.mps),
        *host_checks(facts.shm, facts.nofile, facts.env, facts.torch, local_gpus),
        *net_checks(facts.hostname, facts.hostname_resolution, facts.rendezvous,
                    facts.interfaces, facts.env, opts.nnodes),
    ]


def run_doctor(opts: Options | None = None, probes: Probes | None = None) -> Report:
    """Run every check and return the report (never raises for what it finds)."""
    opts = opts or Options()
    start = time.monotonic()
    facts = gather(opts, probes or Probes())
    checks = evaluate(facts, opts)
    host = facts.host
    context = {
        "gpuwarden": __version__,
        "hostname": facts.hostname,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "gpu_source": host.source if host else None,
        "torch": facts.torch.version,
        "options": {"nproc": opts.nproc, "master_addr": opts.master_addr,
                    "master_port": opts.master_port, "nnodes": opts.nnodes},
    }
    return Report(tuple(checks), time.monotonic() - start, context)
