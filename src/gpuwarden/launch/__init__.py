"""``gpuwarden launch``: a torchrun-compatible launcher, layered as torch.distributed.elastic is.

    config.py      LaunchConfig: what the user asked for, validated once
    preflight.py   the checks that touch the host before anything starts (GPUs, MASTER_PORT)
    plan.py        PURE: config + GPUs + port -> one RankSpec (argv, env, GPU) per rank
    status.py      the progress record a rank shares with the supervisor (an mmap'd file)
    supervisor.py  the process context: start, poll, detect stalls, pass signals on, stop, reap
    relay.py       the output relay: [rankN]: prefixes, torchrun's log files, the report's tail
    placement.py   PURE judgement: ranks whose CUDA context sits on another rank's GPU
    report.py      the one report: root-cause rank, its cause, the failure code

Importing this package is cheap and never imports torch: the supervisor must start fast and
must never touch CUDA. The rank side is :mod:`gpuwarden._rank`.
"""

from __future__ import annotations
