"""Story 3, the naive way (GPU only): run the job on GPU 0 of a busy host.

    python naive.py

hog.py, the "other user", fills the first GPU but 6 GiB (in its own process group, killed at the
end); job.py then asks for 16 GiB on ``cuda`` — GPU 0, like most scripts — and gets PyTorch's
allocator OOM. Its message lists the other processes by pid only; whose they are, and whether
another GPU had room, it does not say.

Exit code: 1 when the OOM happened, 0 if the job got its memory, 77 without a GPU (the OOM
needs one; oom.log is what it prints on the busy host of busy-host.json).
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

from gpuwarden.inventory import real_gpu_present as has_gpu

HERE = Path(__file__).resolve().parent
SKIP_EXIT = 77


def main() -> int:
    if not has_gpu():
        print("story 3 naive: skipped, the OOM needs a real GPU (NVML reports none here); "
              "oom.log shows what it prints on the busy host of busy-host.json", file=sys.stderr)
        return SKIP_EXIT
    hog = subprocess.Popen([sys.executable, str(HERE / "hog.py"), "--leave-gib", "6"],
                           stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert hog.stdout is not None
        print(f"other user: pid {hog.pid} {hog.stdout.readline().strip()}", flush=True)
        print("$ python job.py --need-gib 16", flush=True)
        job = subprocess.run([sys.executable, str(HERE / "job.py"), "--need-gib", "16"], check=False)
        return 1 if job.returncode != 0 else 0
    finally:
        os.killpg(hog.pid, signal.SIGKILL)
        hog.wait()


if __name__ == "__main__":
    sys.exit(main())
