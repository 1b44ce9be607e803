"""``gpuwarden launch``: a torchrun-compatible launcher, layered as torch.distributed.elastic is.

The top level reads as the flow of one launch; the rooms below it each hold one role::

    config.py      LaunchConfig: what the user asked for, validated once
    preflight.py   the checks that touch the host before anything starts (GPUs, MASTER_PORT)
    plan.py        PURE: config + GPUs + port -> one RankSpec (argv, env, GPU) per rank
    supervisor.py  runs one plan: composes ranks/ and watch/, passes signals on, stops
    report.py      PURE: the outcome -> the one report (root-cause rank, cause, failure code)
    runner.py      launch(): the above, attempt after attempt (restart/), node by node
    outcome.py     the data they share, at the bottom: a rank's exit, a run's outcome, the
                   report, a failure and the decision on it

    ranks/      the ranks of one node: process context, output relay, the bootstrap each rank
                runs under (``python -m gpuwarden.launch.ranks._bootstrap SCRIPT``), what a
                rank leaves when it ends
    watch/      what the launcher sees of its ranks while they run: their phase record,
                sampled stacks and CPU, the stall and straggler decisions (PURE), NCCL's
                flight recorder, ranks on another rank's GPU
    restart/    --max-restarts: the policy (PURE) and the attempt loop
    multinode/  several nodes: rendezvous, the node agent (torch's c10d rendezvous in a helper
                process: the launcher imports no torch), the job's store, Slurm, and the
                ranks' side of the workers' store; imported only for several nodes
    observer/   what ``gpuwarden status`` and ``gpuwarden stacks`` reach: the control
                endpoint and registry, and its answers (imported at the first request)

Who may import whom: docs/architecture.md (tests/test_import_layers.py holds it). Importing
this package is cheap and never imports torch: the supervisor must start fast and must never
touch CUDA.
"""

from __future__ import annotations
