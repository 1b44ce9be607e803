"""What a rank sees and leaves, for the tests that compare gpuwarden launch with torchrun.

    rank_io.py tty DIR        each rank writes DIR/tty.<rank>: isatty() of stdin, stdout, stderr
    rank_io.py pdb            rank 1 stops in breakpoint(), then prints 'rank 1 goes on'
    rank_io.py distpdb        gloo; torch.distributed.breakpoint(rank=1); a barrier; 'done'
    rank_io.py stdin          rank 0 prints the first line of its stdin
    rank_io.py record         torch's @record on main(): rank 1 raises KeyError('lr')
    rank_io.py exit7          rank 1 records KeyError('lr') with torch's error handler, exits 7
    rank_io.py gloo_raise     gloo, an all_reduce, then rank 1 raises ValueError (torch's
                              excepthook prefixes it) and rank 0 ends; each rank prints two
                              lines of its own on stderr
    rank_io.py raise_abort    rank 0 raises ValueError, then abort()s as the interpreter exits
                              (what a gloo/NCCL thread of a process group never destroyed does:
                              "terminate called without an active exception")
    rank_io.py finish_abort   rank 0 prints a line and returns, then abort()s as the
                              interpreter exits (the same, after a script that succeeded)

Ranks that do not need torch do not import it (a rank then starts in ~50 ms).
"""
import json
import os
import sys
import time

mode = sys.argv[1]
RANK = int(os.environ["RANK"])  # `p RANK` in pdb


def train() -> float:
    config: dict[str, float] = {}
    return config["lr"]


if mode == "tty":
    with open(os.path.join(sys.argv[2], f"tty.{RANK}"), "w") as f:
        json.dump([s.isatty() for s in (sys.stdin, sys.stdout, sys.stderr)], f)
elif mode == "pdb":
    if RANK == 1:
        breakpoint()
        print("rank 1 goes on")
elif mode == "distpdb":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.breakpoint(rank=1)
    dist.barrier()
    print(f"rank {RANK} done")
    dist.destroy_process_group()
elif mode == "stdin":
    if RANK == 0:
        print(f"rank 0 read {sys.stdin.readline().strip()!r}")
elif mode in ("record", "exit7"):
    if RANK != 1:
        time.sleep(30)  # stopped by the launcher when rank 1 fails
        sys.exit(0)
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

    if mode == "record":
        record(train)()
    else:
        try:
            train()
        except KeyError as exc:
            get_error_handler().record_exception(exc)
            sys.exit(7)
elif mode == "gloo_raise":
    import torch
    import torch.distributed as dist

    print(f"rank {RANK} starts", file=sys.stderr, flush=True)
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"rank {RANK} all_reduce {t.item():g}", file=sys.stderr, flush=True)
    # Each rank ends its process group first: torch 2.13 sometimes aborts at interpreter exit
    # with one still up ("terminate called without an active exception", SIGABRT: exit 134
    # instead of 1), under torchrun too, more often on a loaded machine. torch's excepthook,
    # which prefixes the traceback below, stays installed.
    dist.destroy_process_group()
    if RANK == 1:
        raise ValueError("rank 1 gives up")
elif mode == "raise_abort":
    import atexit

    atexit.register(os.abort)
    raise ValueError("rank 0 gives up")
elif mode == "finish_abort":
    import atexit

    atexit.register(os.abort)
    print("rank 0 done", flush=True)
else:
    sys.exit(f"unknown mode {mode}")
