"""What ranks print on a terminal (tests/test_launch_console.py). No torch: starts in ~50 ms.

    console.py tqdm STEPS [DIR]       a real tqdm bar of STEPS redraws on stderr, then "epoch 1 done"
                                      (after a barrier of every rank when DIR is given)
    console.py rich STEPS             a rich progress bar (rich.progress.track) on stdout
    console.py keras STEPS            a Keras-style bar on stdout: backspaces, "\\r", then the line
    console.py same DIR               after a barrier of every rank (files in DIR): "epoch 1 done"
    console.py traceback DIR RANK     the others print "step 1", then RANK raises among them
    console.py mixed                  a few lines, a bar, an unfinished last line (piped output)
    console.py prompt                 rank 1 writes "name? " and waits for a line on stdin
    console.py resize DIR STEPS       a tqdm bar (dynamic width) that stops half way (DIR/half.<rank>)
                                      until its terminal's width changes, then ends; then
                                      "columns BEFORE -> AFTER"

The barrier is files: each rank writes DIR/ready.<rank> and waits (1 ms polls) until every rank
of the world has; so the ranks print their line within milliseconds of each other.
"""

import os
import sys
import time

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def barrier(directory: str, name: str, ranks: range | list[int] | None = None) -> None:
    open(os.path.join(directory, f"{name}.{RANK}"), "w").close()
    want = [os.path.join(directory, f"{name}.{r}") for r in (ranks or range(WORLD))]
    deadline = time.monotonic() + 120
    while not all(os.path.exists(p) for p in want):
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {RANK}: barrier {name} never filled")
        time.sleep(0.001)


mode = sys.argv[1]
if mode == "tqdm":
    from tqdm import tqdm

    for _ in tqdm(range(int(sys.argv[2])), desc=f"rank {RANK}", mininterval=0, miniters=1):
        time.sleep(0.01)
    if len(sys.argv) > 3:
        barrier(sys.argv[3], "done")
    print("epoch 1 done", flush=True)
elif mode == "rich":
    from rich.progress import track

    for _ in track(range(int(sys.argv[2])), description=f"rank {RANK}", refresh_per_second=50):
        time.sleep(0.01)
elif mode == "keras":
    steps = int(sys.argv[2])
    width = 0
    for i in range(1, steps + 1):
        line = f"{i}/{steps} [" + "=" * i + "." * (steps - i) + "] - loss: 0.5"
        sys.stdout.write("\b" * width + "\r" + line)
        sys.stdout.flush()
        width = len(line)
        time.sleep(0.01)
    sys.stdout.write("\n")
elif mode == "same":
    barrier(sys.argv[2], "ready")
    print("epoch 1 done", flush=True)
elif mode == "traceback":
    directory, failing = sys.argv[2], int(sys.argv[3])
    barrier(directory, "ready")
    others = [r for r in range(WORLD) if r != failing]
    if failing != RANK:
        print("step 1", flush=True)
        barrier(directory, "said", others)
        print("step 2", flush=True)
        barrier(directory, "never")  # the failing rank never comes: stopped by the launcher
    else:
        barrier(directory, "said", others)  # the others' "step 1" is in the relay already

        def inner() -> None:
            raise ValueError(f"rank {RANK} gives up")

        inner()
elif mode == "mixed":
    print(f"hello from {RANK}")
    print("same line")
    sys.stdout.write("\r 10%|#\r 50%|#####\r100%|##########|\n")
    print(f"[rank{RANK}]: tagged by torch")
    sys.stderr.write(f"warning {RANK}\n")
    sys.stdout.write("no newline at the end")
    sys.stdout.flush()
elif mode == "prompt":
    if RANK == 1:
        sys.stdout.write("name? ")
        sys.stdout.flush()
        print(f"hello {sys.stdin.readline().strip()}")
elif mode == "resize":
    from tqdm import tqdm

    directory, steps = sys.argv[2], int(sys.argv[3])
    before = os.get_terminal_size(2).columns
    bar = tqdm(range(steps), desc=f"rank {RANK}", mininterval=0, miniters=1, dynamic_ncols=True)
    for i in bar:
        if i == steps // 2:
            open(os.path.join(directory, f"half.{RANK}"), "w").close()
            deadline = time.monotonic() + 120
            while os.get_terminal_size(2).columns == before:  # the launcher passes it on
                if time.monotonic() > deadline:
                    raise SystemExit(f"rank {RANK}: the terminal's width never changed")
                time.sleep(0.005)
        time.sleep(0.01)
    bar.close()
    print(f"columns {before} -> {os.get_terminal_size(2).columns}", flush=True)
else:
    raise SystemExit(f"unknown mode {mode}")
