"""gpuwarden.fork_safe(): whether a child forked now could use CUDA.

Every case runs in a fresh interpreter, because poisoning torch's fork state is
permanent for a process. What each test proves:

- without torch imported the answer needs no fork, and asking does not import torch;
- on this CPU build, ``torch.cuda.is_available()`` returns before registering the at-fork
  handler (``_is_compiled()`` is False), so forking stays safe — and a real child agrees;
- torch's own at-fork registration (the C++ ``pthread_atfork`` handler that torch's device
  lazy-init installs; reached on a CPU build through ``torch._C._mtia_init``, the same
  mechanism ``_cuda_getDeviceCount``/``_cuda_init`` use for CUDA) is detected by the probe,
  and a real forked child then fails with torch's "Cannot re-initialize ... in forked
  subprocess" error: the prediction matches what happens;
- a child of a poisoned process is answered without a fork, the timeout path kills and
  reaps a stuck probe child;
- on a GPU host (``gpu`` marker): ``is_available()`` alone poisons fork while
  ``is_initialized()`` stays False, ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` avoids it, and a
  CUDA tensor is reported as initialized CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

# A child importing torch took over 50 s at load average 20: generous caps, spent only on a hang.
pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leftover_processes")]

# Runs at the end of every script: no probe child may be left (reaped, not a zombie).
_NO_CHILDREN = textwrap.dedent("""
    import psutil
    out["children"] = [p.pid for p in psutil.Process().children(recursive=True)]
    print(json.dumps(out))
""")


def run_py(body: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    code = "import json, os, sys\nout = {}\n" + textwrap.dedent(body) + _NO_CHILDREN
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=150, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.pop("children") == []
    return result


def test_without_torch_answers_without_forking_or_importing_torch() -> None:
    out = run_py("""
        import gpuwarden
        s = gpuwarden.fork_safety()
        out.update(safe=s.safe, probed=s.probed, safe2=gpuwarden.fork_safe(),
                   torch_loaded="torch" in sys.modules)
    """)
    assert out == {"safe": True, "probed": False, "safe2": True, "torch_loaded": False}


@pytest.mark.slow
def test_cpu_torch_is_available_leaves_fork_safe_and_a_real_child_agrees() -> None:
    out = run_py("""
        import torch, gpuwarden
        out["compiled"] = torch.cuda._is_compiled()
        out["available"] = torch.cuda.is_available()
        torch.cuda.device_count()
        s = gpuwarden.fork_safety()
        out.update(safe=s.safe, probed=s.probed, poisoned=list(s.poisoned))
        # A real forked child: does CUDA's lazy init get past the bad-fork check?
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                torch.cuda._lazy_init()
                msg = "initialized"
            except BaseException as exc:
                msg = str(exc)
            os.write(w, msg.encode()[:500]); os._exit(0)
        os.close(w); os.waitpid(pid, 0)
        out["child"] = os.read(r, 1000).decode()
    """)
    if out["compiled"]:
        pytest.skip("this torch is a CUDA build: covered by the gpu tests")
    assert out["available"] is False
    assert out["safe"] is True and out["probed"] is True and out["poisoned"] == []
    assert "forked subprocess" not in out["child"]
    assert "not compiled with CUDA" in out["child"]


@pytest.mark.slow
def test_torch_at_fork_registration_is_detected_and_matches_a_real_child() -> None:
    out = run_py("""
        import torch, gpuwarden
        if not hasattr(torch._C, "_mtia_init"):
            print(json.dumps({"skip": True, "children": []})); sys.exit(0)
        out["before"] = gpuwarden.fork_safe()
        torch._C._mtia_init()   # torch's own pthread_atfork registration (device lazy init)
        out["parent_flag"] = torch.mtia._is_in_bad_fork()
        s = gpuwarden.fork_safety()
        out.update(safe=s.safe, probed=s.probed, poisoned=list(s.poisoned), reason=s.reason)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                torch.mtia._lazy_init()
                msg = "initialized"
            except BaseException as exc:
                msg = str(exc)
            # The grandchild question, asked inside the poisoned child: no fork needed.
            g = gpuwarden.fork_safety()
            os.write(w, json.dumps([msg, g.safe, g.probed, list(g.poisoned)]).encode())
            os._exit(0)
        os.close(w); os.waitpid(pid, 0)
        out["child"] = json.loads(os.read(r, 4000).decode())
    """)
    if out.get("skip"):
        pytest.skip("this torch has no torch._C._mtia_init to register the at-fork handler")
    assert out["before"] is True
    assert out["parent_flag"] is False  # the parent itself is fine; only children are marked
    assert out["safe"] is False and out["probed"] is True and out["poisoned"] == ["mtia"]
    assert "at-fork handler" in out["reason"]
    child_error, grandchild_safe, grandchild_probed, grandchild_poisoned = out["child"]
    assert "Cannot re-initialize MTIA in forked subprocess" in child_error
    assert (grandchild_safe, grandchild_probed, grandchild_poisoned) == (False, False, ["mtia"])


@pytest.mark.slow
def test_stuck_probe_child_is_killed_and_reaped_within_the_timeout() -> None:
    out = run_py("""
        import time, torch
        from gpuwarden import forksafe
        parent = os.getpid()
        # Hang in the probe child only (the parent reads its own flags first).
        forksafe._bad_fork_flags = lambda torch: (os.getpid() != parent and time.sleep(30)) or ()
        t = time.monotonic()
        s = forksafe.fork_safety(timeout_s=0.5)
        out.update(safe=s.safe, reason=s.reason, elapsed=time.monotonic() - t)
    """)
    assert out["safe"] is False
    assert "did not answer" in out["reason"]
    assert out["elapsed"] < 5.0


@pytest.mark.gpu
def test_gpu_is_available_alone_poisons_fork() -> None:
    out = run_py("""
        import torch, gpuwarden
        out["available"] = torch.cuda.is_available()
        out["initialized"] = torch.cuda.is_initialized()
        out["safe"] = gpuwarden.fork_safe()
    """, env={"PYTORCH_NVML_BASED_CUDA_CHECK": ""})
    assert out == {"available": True, "initialized": False, "safe": False}


# The parent forks; the child makes a CUDA tensor and reports "ok" or its error in out["child"].
FORKED_CHILD_USES_CUDA = """
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                torch.zeros(1, device="cuda"); msg = "ok"
            except BaseException as exc:
                msg = str(exc)
            os.write(w, msg.encode()[:500]); os._exit(0)
        os.close(w); os.waitpid(pid, 0)
        out["child"] = os.read(r, 1000).decode()
"""


@pytest.mark.gpu
def test_gpu_device_count_alone_leaves_a_forked_child_able_to_use_cuda() -> None:
    """torch counts GPUs through NVML when it can: no at-fork handler, the child's CUDA works
    (the first real-GPU run showed story 1's ranks reaching NCCL after device_count())."""
    out = run_py("""
        import torch, gpuwarden
        out["count"] = torch.cuda.device_count()
        out["safe"] = gpuwarden.fork_safe()
    """ + FORKED_CHILD_USES_CUDA + """
    """, env={"PYTORCH_NVML_BASED_CUDA_CHECK": ""})
    assert out["count"] >= 1 and out["safe"] is True and out["child"] == "ok", out


@pytest.mark.gpu
def test_gpu_nvml_based_check_keeps_fork_safe_until_cuda_is_used() -> None:
    out = run_py("""
        import torch, gpuwarden
        out["available"] = torch.cuda.is_available()
        out["safe_after_check"] = gpuwarden.fork_safe()
        torch.zeros(1, device="cuda")
        s = gpuwarden.fork_safety()
        out.update(safe_after_tensor=s.safe, reason=s.reason)
    """ + FORKED_CHILD_USES_CUDA + """
    """, env={"PYTORCH_NVML_BASED_CUDA_CHECK": "1"})
    assert out["available"] is True and out["safe_after_check"] is True
    assert out["safe_after_tensor"] is False and "initialized" in out["reason"]
    assert "Cannot re-initialize CUDA in forked subprocess" in out["child"]
