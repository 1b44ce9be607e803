"""``gpuwarden launch``: a torchrun-compatible launcher, layered as torch.distributed.elastic is.

    config.py      LaunchConfig: what the user asked for, validated once
    preflight.py   the checks that touch the host before anything starts (GPUs, MASTER_PORT)
    plan.py        PURE: config + GPUs + port -> one RankSpec (argv, env, GPU) per rank
    supervisor.py  runs one plan: composes the parts below, passes signals on, multi-node stops
    rendezvous.py  multi-node: the preflight and the named join; slurm.py: Slurm's variables
    node_agent.py  multi-node: the launcher's side of the node agent (torch's c10d rendezvous
                   runs in ``_node_agent.py``, a helper process: the launcher imports no torch)
    job_store.py   multi-node: one first failure and one restart decision for the whole job
    attempts.py    --max-restarts: attempt after attempt; restart.py decides (PURE)
    pcontext.py    the process context: start, signal groups, bounded stop and reap, subreaper
    relay.py       the output relay: [rankN]: prefixes, torchrun's log files, the report's tail
    sampler.py     where each rank is, from outside: sampled stacks, CPU time
    stall.py       PURE: frames -> what a rank waits in; decide_stall(observations, now)
    flight_recorder.py  NCCL's flight recorder: turned on for GPU ranks, read into reports
    placement.py   PURE judgement: ranks whose CUDA context sits on another rank's GPU
    status.py      the bootstrap's started/finished/failed record (an mmap'd file)
    report.py      the one report: root-cause rank, its cause, the failure code

Rank side (run inside each rank, standard library only, nothing of torch replaced):

    _bootstrap.py    ``python -m gpuwarden.launch.ranks._bootstrap SCRIPT``: runs it as python does
    _store_watch.py  multi-node: arrivals and abort on the workers' c10d TCPStore

Importing this package is cheap and never imports torch: the supervisor must start fast and
must never touch CUDA.
"""

from __future__ import annotations
