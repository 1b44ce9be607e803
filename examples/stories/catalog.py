"""Every runnable part of the five stories, for the tests and for ``scripts/verify-gpu``.

A :class:`StoryRun` is one command (a story's naive.py or fixed.py with arguments) and what it
must do: the exit code, and for a failure the code ``gpuwarden explain`` must give its output.
``run()`` executes one in its own process group, bounded in time, and kills the group after.

Conventions of the story scripts:

- exit 0: it worked (fixed), or the failure did not happen (naive);
- exit 1: the failure was reproduced (naive), or the fix did not hold (fixed);
- exit 77 (:data:`SKIP_EXIT`, automake's "skipped"): the part needs a GPU and this machine has
  none; the script says so on stderr.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Re-exported: the story tests and verify-gpu ask the catalog whether GPU parts can run.
from gpuwarden.inventory import real_gpu_present as has_gpu  # noqa: F401

STORIES_DIR = Path(__file__).resolve().parent
SKIP_EXIT = 77
INTERRUPT_GRACE_S = 5.0  # from SIGINT at the deadline to SIGKILL


@dataclass(frozen=True)
class StoryRun:
    story: str  # folder name, e.g. "4-rendezvous-stall"
    script: str  # "naive.py" or "fixed.py"
    args: tuple[str, ...] = ()
    expect_exit: int = 0
    expect_code: str | None = None  # explain's primary code of the output (naive failures)
    gpu_only: bool = False  # its point needs a real GPU; on CPU it exits SKIP_EXIT
    timeout_s: float = 60.0
    env: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return " ".join([f"{self.story}/{self.script}", *self.args])


@dataclass
class Outcome:
    run: StoryRun
    exit_code: int
    output: str
    seconds: float
    timed_out: bool = False


def run_in_session(argv: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float,
                   on_start: Callable[[int], None] | None = None,
                   on_end: Callable[[int], None] | None = None) -> tuple[int, str, float, bool]:
    """Run ``argv`` in its own session, bounded by ``timeout_s`` (then SIGINT, and after
    :data:`INTERRUPT_GRACE_S` the rest), and SIGKILL its process group after; return (exit
    code, stdout+stderr, seconds, timed out).

    Output goes to a temporary file, not a pipe: a grandchild that started a session of its own
    (story 3's memory hog, story 4's port holder) may keep the output open long after the story
    ended, and reading a pipe to its end would wait for it.
    """
    start = time.monotonic()
    timed_out = False
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        if on_start is not None:
            on_start(proc.pid)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            # SIGINT first, as Ctrl-C would: pytest then still writes what it has (its junit
            # file), a script its traceback; whatever is left a moment later is killed.
            try:
                os.killpg(proc.pid, signal.SIGINT)
                proc.wait(timeout=INTERRUPT_GRACE_S)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever it left in its group goes too
            except ProcessLookupError:
                pass
            proc.wait()
            if on_end is not None:
                on_end(proc.pid)
        out.seek(0)
        text = out.read().decode(errors="replace")
    return proc.returncode, text, time.monotonic() - start, timed_out


def run(story_run: StoryRun, extra_env: dict[str, str] | None = None) -> Outcome:
    """Run one story part; stdout and stderr together, as a user would see them."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **story_run.env, **(extra_env or {})}
    code, output, seconds, timed_out = run_in_session(
        [sys.executable, story_run.script, *story_run.args], cwd=STORIES_DIR / story_run.story,
        env=env, timeout_s=story_run.timeout_s)
    return Outcome(story_run, code, output, seconds, timed_out)

def explain_code(text: str) -> str:
    """``gpuwarden explain``'s primary failure code for ``text``."""
    from gpuwarden.explain import explain_text

    return str(explain_text(text).primary.code)


# Short timeouts so that CI waits seconds, not PyTorch's 30 minutes. Each run's timeout_s is a
# cap for a run that hangs, spent only then: a loaded 2-core machine took 60 s for story 3.
# The naive story 4 gives torch 30 s after init_process_group began to fail on its own 3 s
# timeout (10 s were not enough at load average 20: torch.distributed's imports come first).
STORY4 = "4-rendezvous-stall"
NAIVE4 = {
    case: StoryRun(STORY4, "naive.py", (case, "--timeout-s", "3", "--give-up-s", "30"),
                   expect_exit=1, expect_code=code, timeout_s=180)
    for case, code in (("wrong-addr", "RDZV_DNS"), ("port-in-use", "RDZV_PORT_IN_USE"),
                       ("missing-rank", "RDZV_WORKERS_MISSING"))
}
FIXED4 = {case: StoryRun(STORY4, "fixed.py", (case,), timeout_s=180)
          for case in ("wrong-addr", "port-in-use", "missing-rank")}

STORY3 = "3-busy-cluster"
NAIVE3 = StoryRun(STORY3, "naive.py", expect_exit=1, expect_code="CUDA_OOM", gpu_only=True,
                  timeout_s=120)
FIXED3_SIMULATED = StoryRun(STORY3, "fixed.py", ("--simulated",), timeout_s=180)
FIXED3_REAL = StoryRun(STORY3, "fixed.py", gpu_only=True, timeout_s=240)

STORY1 = "1-spawn-set-device"
NAIVE1 = {case: StoryRun(STORY1, "naive.py", (case,), expect_exit=1, expect_code=code, gpu_only=True,
                         timeout_s=90)
          for case, code in (("fork-after-cuda", "CUDA_FORK_REINIT"),
                             ("no-set-device", "NCCL_DUPLICATE_GPU"))}
FIXED1 = StoryRun(STORY1, "fixed.py", timeout_s=180)

STORY2 = "2-dataloader-fork"
NAIVE2 = StoryRun(STORY2, "naive.py", expect_exit=1, expect_code="CUDA_FORK_REINIT", gpu_only=True,
                  timeout_s=120)
FIXED2 = StoryRun(STORY2, "fixed.py", timeout_s=120)

STORY5 = "5-joblib-cuda"
NAIVE5 = {case: StoryRun(STORY5, "naive.py", (case,), expect_exit=1, expect_code=code, gpu_only=True,
                         timeout_s=90)
          for case, code in (("fork", "CUDA_FORK_REINIT"), ("oom", "CUDA_OOM"))}
FIXED5 = StoryRun(STORY5, "fixed.py", timeout_s=180)

NAIVE_GPU_ONLY = [*NAIVE1.values(), NAIVE2, NAIVE3, *NAIVE5.values()]
FIXED_CPU = [FIXED1, FIXED2, FIXED3_SIMULATED, *FIXED4.values(), FIXED5]

# In story order: what scripts/verify-gpu runs on a GPU host.
ALL: list[StoryRun] = [*NAIVE1.values(), FIXED1, NAIVE2, FIXED2, NAIVE3, FIXED3_SIMULATED,
                       FIXED3_REAL, *NAIVE4.values(), *FIXED4.values(), *NAIVE5.values(), FIXED5]
