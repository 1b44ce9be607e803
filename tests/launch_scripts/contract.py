"""torchrun's contract inside a rank, per argv[1]:

torch    nothing of torch replaced (no import hook, no wrapped function), no extra thread in
         threading.enumerate(), a collective and a clean exit
thread   a non-daemon thread writes a file well after the main body ended: it must not be lost
daemon   the rank double-forks a setsid daemon (pid to $PIDDIR/daemon.pid) and exits 0
record   torch's @record (elastic's error handler re-enables faulthandler on stderr), then a
         segfault: the crash stack must still reach the report
"""
import os
import sys
import threading
import time

mode = sys.argv[1]
if mode == "torch":
    import torch
    import torch.distributed as dist

    replaced = []
    for mod in (dist, dist.distributed_c10d, torch.cuda, torch):
        for name in dir(mod):
            fn = getattr(mod, name, None)
            if callable(fn) and str(getattr(fn, "__module__", "")).startswith("gpuwarden"):
                replaced.append(f"{mod.__name__}.{name}")
    hooks = [type(f).__module__ for f in sys.meta_path if "gpuwarden" in type(f).__module__]
    print("REPLACED", replaced, "HOOKS", hooks, flush=True)
    print("ORIGINAL", dist.all_reduce is dist.distributed_c10d.all_reduce
          and dist.all_reduce.__code__.co_filename.startswith(os.path.dirname(torch.__file__)),
          flush=True)
    print("THREADS", [t.name for t in threading.enumerate()], flush=True)
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"SUM {t.item():g}", flush=True)
    dist.destroy_process_group()
elif mode == "thread":
    def late_write() -> None:
        time.sleep(1.0)
        with open(os.path.join(os.environ["PIDDIR"], f"late{os.environ['RANK']}.txt"), "w") as f:
            f.write("written after main\n")

    threading.Thread(target=late_write).start()  # not a daemon: the interpreter joins it
elif mode == "daemon":
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            with open(os.path.join(os.environ["PIDDIR"], f"daemon{os.environ['RANK']}.pid"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(300)
        os._exit(0)
    os.wait()
    time.sleep(0.5)
elif mode == "record":
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main() -> None:
        if os.environ["RANK"] == "1":
            import ctypes

            ctypes.string_at(0)
        time.sleep(60)

    main()
