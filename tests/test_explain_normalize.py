"""The normalizer of explain: each hard form of a real log, one test.

Every message below is real: a line of a tests/explain_corpus/ case (its thread named beside
it) or, for a prefix no corpus case carries, a real message under the prefix that the tool
writes (syslog, journald, CRI, docker compose, Lightning). The rich tracebacks are rendered by
rich itself (a dependency of gpuwarden) from a real exception text, then mangled the ways
consoles mangle UTF-8.
"""

from __future__ import annotations

import io

import pytest

from gpuwarden.explain import explain_text
from gpuwarden.explain.normalize import clean, normalize, peel

# -- one line each: what is removed, what stays, the rank read ------------------------------

FORMS = [
    # dmesg, dmesg -H, dmesg -T (github.com/wilicc/gpu-burn/issues/1, NVIDIA/NVSentinel/issues/155)
    ("[74785.660380] pcieport 0000:00:02.0: PCIe Bus Error: severity=Corrected",
     "pcieport 0000:00:02.0: PCIe Bus Error: severity=Corrected", None),
    ("[  +0.000003] NVRM: Xid (PCI:0000:b3:00): 79, pid=1, GPU has fallen off the bus.",
     "NVRM: Xid (PCI:0000:b3:00): 79, pid=1, GPU has fallen off the bus.", None),
    ("[Mon Jun  2 13:13:04 2025] NVRM: fallen off the bus and is not responding to commands.",
     "NVRM: fallen off the bus and is not responding to commands.", None),
    # journald / syslog (the kernel's own line), and a CI runner's time without host
    ("Jun 02 13:13:04 gpu-node-3 kernel: NVRM: Xid (PCI:0000:b3:00): 79, pid=1",
     "NVRM: Xid (PCI:0000:b3:00): 79, pid=1", None),
    ("Oct 16 02:07:00 RuntimeError: CUDA error: device-side assert triggered",
     "RuntimeError: CUDA error: device-side assert triggered", None),
    # python logging, an ISO time, the CRI log format of Kubernetes, a bracketed time and level
    ("2024-05-01 12:34:56,789 - trainer - ERROR - torch.OutOfMemoryError: CUDA out of memory.",
     "torch.OutOfMemoryError: CUDA out of memory.", None),
    ("2024-05-01T12:34:56.123456789Z stderr F [rank3]: RuntimeError: CUDA error: an illegal "
     "memory access was encountered",
     "[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered", 3),
    ("ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -11) local_rank: 0 "
     "(pid: 2128869) of binary: /usr/bin/python",
     "failed (exitcode: -11) local_rank: 0 (pid: 2128869) of binary: /usr/bin/python", None),
    # a log viewer's line numbers before torch's rank prefix (hiyouga/LlamaFactory/issues/8261)
    ("[1830] [rank3]:[W602 11:18:52.489301002 ProcessGroupNCCL.cpp:2111] [PG ID 1 PG GUID 1 "
     "Rank 3] timed out after waiting for 60000ms flight recorder dumps to finish.",
     "[rank3]: [W602 11:18:52.489301002 ProcessGroupNCCL.cpp:2111] [PG ID 1 PG GUID 1 Rank 3] "
     "timed out after waiting for 60000ms flight recorder dumps to finish.", 3),
    # Ray's actor prefix (vllm-project/vllm/issues/798)
    ("(LLMEngine pid=2347640, ip=10.58.226.15) ncclInternalError: Internal check failed.",
     "ncclInternalError: Internal check failed.", None),
    # docker compose's service column
    ("trainer-1  | torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1275",
     "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1275", None),
    # pdsh / DeepSpeed's multi-node launcher: the host, then torch's rank
    ("worker-1: [rank8]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
     "[rank8]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", 8),
    # srun -l before torch's rank: the torch rank wins (pytorch/pytorch/issues/135486)
    ("0: [rank8]: Fatal Python error: Segmentation fault", "[rank8]: Fatal Python error: "
     "Segmentation fault", 8),
    ("0: Fatal Python error: Segmentation fault", "0: Fatal Python error: Segmentation fault", 0),
    # horovodrun, mpirun --tag-output (pytorch/ignite/pull/3466, horovod/horovod/issues/2365)
    ("[1]<stderr>:RuntimeError: ncclCommInitRank failed: unhandled cuda error",
     "[rank1]: RuntimeError: ncclCommInitRank failed: unhandled cuda error", 1),
    ("[1,25]<stderr>:  what():  cudaEventQuery failed: an illegal memory access was encountered",
     "[1,25]<stderr>: what():  cudaEventQuery failed: an illegal memory access was encountered",
     25),
    # torchx's role/replica prefix (ofsoundof/GRL-Image-Restoration/issues/27) and a trainer's
    # "[trainerPID|rank]:" (pytorch/pytorch/pull/129985), torchrun --tee, Lightning
    ("trainer/0 [1]:[W socket.cpp:558] [c10d] The client socket has failed to connect to "
     "[::ffff:0.0.0.5]:40323 (errno: 110 - Connection timed out).",
     "[rank1]: [W socket.cpp:558] [c10d] The client socket has failed to connect to "
     "[::ffff:0.0.0.5]:40323 (errno: 110 - Connection timed out).", 1),
    ("[trainer85612|12]:W0701 13:41:43.421574  4776 TCPStore.cpp:182] [c10d] recvValue failed",
     "[rank12]: W0701 13:41:43.421574  4776 TCPStore.cpp:182] [c10d] recvValue failed", 12),
    ("[default3]:RuntimeError: CUDA error: invalid device ordinal",
     "[rank3]: RuntimeError: CUDA error: invalid device ordinal", 3),
    ("[rank: 1] RuntimeError: Expected to mark a variable ready only once.",
     "[rank1]: RuntimeError: Expected to mark a variable ready only once.", 1),
    # ANSI colours, and what is left of them when the escape byte is lost in a paste
    # (FoNDUE-HTR/Documentation/issues/13)
    ("\x1b[1;91mRuntimeError: \x1b[0mDataLoader worker (pid 164244) is killed by signal: Killed.",
     "RuntimeError: DataLoader worker (pid 164244) is killed by signal: Killed.", None),
    ("[1;91mRuntimeError: [0mDataLoader worker (pid 164244) is killed by signal: Killed.",
     "RuntimeError: DataLoader worker (pid 164244) is killed by signal: Killed.", None),
    ("^[[1;91mRuntimeError: ^[[0mDataLoader worker (pid 164244) is killed by signal: Killed.",
     "RuntimeError: DataLoader worker (pid 164244) is killed by signal: Killed.", None),
    # markdown around a pasted line: a quote, emphasis, code
    ("> **RuntimeError: Expected to mark a variable ready only once.**",
     "RuntimeError: Expected to mark a variable ready only once.", None),
    ("`RuntimeError: CUDA error: device-side assert triggered`",
     "RuntimeError: CUDA error: device-side assert triggered", None),
    # typographic quotes a forum substituted
    ("NCCL WARN Cuda failure \u2018out of memory\u2019", "NCCL WARN Cuda failure 'out of memory'",
     None),
    # rich's log handler: the time column, the level, the source at the right edge
    # (huggingface/accelerate/issues/613)
    ("[20:42:05] WARNING  Sending process 361008 closing signal SIGTERM          api.py:698",
     "Sending process 361008 closing signal SIGTERM", None),
    ("           ERROR    failed (exitcode: 1) local_rank: 1 (pid: 361009) of binary: "
     "/opt/conda/bin/python   api.py:699",
     "failed (exitcode: 1) local_rank: 1 (pid: 361009) of binary: /opt/conda/bin/python", None),
    # v4: a pasted line kept as a comment, then the rank prefix under it
    ("#   exitcode  : -9 (pid: 31337)", "exitcode  : -9 (pid: 31337)", None),
    ("# [rank1]: RuntimeError: CUDA error: out of memory",
     "[rank1]: RuntimeError: CUDA error: out of memory", 1),
    # a quote or a stray backtick opening the paste (CGCL-codes/pFedSD/issues/3,
    # ollama/ollama/issues/9031)
    ('"Process Process-4:', "Process Process-4:", None),
    ("`11T03:16:37.327Z level=DEBUG source=gpu.go:592 msg=\"cudart init failure: 802\"",
     "11T03:16:37.327Z level=DEBUG source=gpu.go:592 msg=\"cudart init failure: 802\"", None),
]


@pytest.mark.parametrize("line, body, rank", FORMS, ids=[f[0][:28] for f in FORMS])
def test_each_form_is_reduced_to_the_programs_own_line(line: str, body: str,
                                                       rank: int | None) -> None:
    assert normalize(line) == [(body, rank)]


def test_a_line_without_any_form_comes_back_as_it_is() -> None:
    for line in ("RuntimeError: CUDA error: out of memory",
                 "node023:10214:10303 [0] NCCL WARN NET/IB : Got completion from peer",
                 "srun: error: node1: task 3: Segmentation fault",
                 "torch._C._distributed_c10d.DistNetworkError: Broken pipe",
                 "E0909 14:03:50.013000 225 torch/distributed/elastic/multiprocessing/api.py:833] "
                 "failed (exitcode: -11)",
                 "Assertion `srcIndex < srcSelectDimSize` failed.",
                 # a debugger's frame number is no comment marker
                 "#1  0x00007fffe9076f17 in call_init (env=0x7fffffffde78) at dl-init.c:72"):
        assert normalize(line) == [(line, None)], line


def test_windows_paths_keep_their_backslashes() -> None:
    line = r'  File "D:\apps\new\nvidia\train.py", line 12, in <module>'
    assert normalize(line) == [(line.strip(), None)]


def test_box_borders_and_their_mojibake_are_removed() -> None:
    body = "/workspace/train.py:41 in main"
    for left, right in (("│", "│"), ("┃", "┃"), ("Γöé", "Γöé"), ("â”‚", "â”‚"),
                        ("\ufffd\ufffd\ufffd", "\ufffd\ufffd\ufffd"), ("\ufffd", "\ufffd"),
                        ("│ │", "│ │")):
        assert clean(f"{left} {body}                 {right}") == body, left
    assert clean("╭──────── Traceback (most recent call last) ────────╮").strip() == \
        "Traceback (most recent call last)"
    assert clean("Γò¡ΓöÇΓöÇΓöÇΓöÇ Traceback (most recent call last) ΓöÇΓöÇΓöÇΓöÇΓò«").strip() == \
        "Traceback (most recent call last)"


def test_a_json_error_record_is_split_into_its_lines() -> None:
    # the elastic agent's error file printed by Ray (meta-pytorch/torchx/issues/540)
    line = ('(CommandActor pid=552, ip=10.130.6.168)       "py_callstack": "Traceback (most '
            'recent call last):\\n  File \\"/home/ray/anaconda3/lib/python3.9/site-packages/'
            'torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py\\", line 113, in '
            '_call_store\\n    return getattr(self._store, store_op)(*args, **kwargs)\\n'
            'RuntimeError: Broken pipe\\n\\nThe above exception was the direct cause')
    texts = [t for t, _ in normalize(line)]
    assert "RuntimeError: Broken pipe" in texts
    assert any(t.startswith('File "/home/ray/') and t.endswith("in _call_store") for t in texts)


def test_ranks_run_into_one_line_are_split_with_their_ranks() -> None:
    line = ("[rank1]:[E ProcessGroupNCCL.cpp:1316] Watchdog caught collective operation timeout "
            "[rank0]: torch.OutOfMemoryError: CUDA out of memory.")
    assert normalize(line) == [
        ("[rank1]: [E ProcessGroupNCCL.cpp:1316] Watchdog caught collective operation timeout", 1),
        ("[rank0]: torch.OutOfMemoryError: CUDA out of memory.", 0)]


def test_peel_gives_the_prefix_the_body_and_the_rank() -> None:
    assert peel("[1,3]<stdout>:ValueError: x") == ("[1,3]<stdout>: ", "ValueError: x", 3)
    assert peel("plain text") == ("", "plain text", None)


# -- whole logs: the answer survives the form --------------------------------------------------

ASSERT_TEXT = ("CUDA error: device-side assert triggered\nCUDA kernel errors might be "
               "asynchronously reported at some other API call, so the stacktrace below might be "
               "incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1")


def _rich_traceback(width: int) -> str:
    from rich.console import Console
    from rich.traceback import Traceback

    def forward(labels: list[int]) -> None:
        raise RuntimeError(ASSERT_TEXT)

    try:
        forward([3, 7])
    except RuntimeError:
        out = io.StringIO()
        Console(file=out, width=width, color_system=None).print(Traceback(show_locals=True))
        return out.getvalue()
    raise AssertionError("unreachable")


@pytest.mark.parametrize("mangle", ["utf-8", "cp437", "cp1252", "replace"])
def test_a_rich_traceback_and_its_mangled_forms_are_explained(mangle: str) -> None:
    text = _rich_traceback(width=72)
    assert "╭" in text and "│" in text  # really rich's box
    if mangle == "replace":
        text = text.encode().decode("ascii", "replace")
    elif mangle != "utf-8":
        text = text.encode().decode(mangle, "replace")
    assert explain_text(text).primary.code == "CUDA_DEVICE_ASSERT"


def test_a_message_a_terminal_wrapped_mid_word_is_still_recognised() -> None:
    # a Windows console at 80 columns (lllyasviel/stable-diffusion-webui-forge/issues/2524 wraps
    # the same way); the keyword itself is cut by the wrap
    text = ("Traceback (most recent call last):\n"
            '  File "C:\\sd\\venv\\lib\\site-packages\\torch\\cuda\\__init__.py", line 293, in _l\n'
            "azy_init\n"
            "RuntimeError: CUDA error: no kernel image is available for execution on the dev\n"
            "ice\n")
    assert explain_text(text).primary.code == "CUDA_NO_KERNEL_IMAGE"
    cut_keyword = ("RuntimeError: CUDA error: device-side assert trig\n"
                   "gered\n")
    assert explain_text(cut_keyword).primary.code == "CUDA_DEVICE_ASSERT"


def test_colours_inside_a_message_do_not_hide_it() -> None:
    for text in ("RuntimeError: CUDA error: \x1b[1mout of\x1b[0m memory\n",
                 "RuntimeError: CUDA error: [1mout of[0m memory\n"):  # the escape byte lost
        assert explain_text(text).primary.code == "CUDA_OOM", text


def test_a_driver_message_over_three_dmesg_lines_is_one_message() -> None:
    # NVIDIA/NVSentinel/issues/155, with dmesg -T's time instead of the seconds
    text = ("[Mon Jun  2 13:13:04 2025] NVRM: The NVIDIA GPU 0000:b3:00.0\n"
            "                           NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
            "                           NVRM: fallen off the bus and is not responding to\n"
            "                           NVRM: commands.\n")
    assert explain_text(text).primary.code == "GPU_HARDWARE_FAULT"


def test_a_prefixed_rank_exception_names_its_rank() -> None:
    text = ("2024-05-01T12:34:56.1Z stderr F W0501 12:34:56.000000 1 torch/distributed/elastic/"
            "multiprocessing/api.py:897] Sending process 12 closing signal SIGTERM\n"
            "2024-05-01T12:34:57.1Z stderr F [rank5]: KeyError: 'label'\n")
    diag = explain_text(text)
    assert (diag.primary.code, diag.primary.first_rank) == ("RANK_FAILED", 5)


def test_the_normalizer_can_be_turned_off_for_measuring() -> None:
    from gpuwarden.explain import load_knowledge
    from gpuwarden.explain.engine import Explainer

    text = b"Jun 02 13:13:04 host kernel: [rank2]: KeyError: 'x'\n"
    on = Explainer(load_knowledge())
    on.feed_bytes(text)
    off = Explainer(load_knowledge(), normalize_lines=False)
    off.feed_bytes(text)
    assert on.result().primary.code == "RANK_FAILED"
    assert off.result().primary.code == "NONE"
