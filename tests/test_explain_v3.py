"""explain v3: the six codes added, and the root cause over echoes in the harder cases.

The texts are real (the thread is named beside each) or cut down from real ones; the whole
logs are cases of tests/explain_corpus/.
"""

from __future__ import annotations

import pytest

from gpuwarden.errors import KnowledgeBaseError
from gpuwarden.explain import NONE_CODE, explain_text, load_knowledge
from gpuwarden.explain.knowledge import parse_knowledge

WATCHDOG = ("[rank1]:[E1121 10:59:01.1 ProcessGroupNCCL.cpp:607] [Rank 1] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum=88, OpType=ALLREDUCE, NumelIn=1, "
            "NumelOut=1, Timeout(ms)=600000) ran for 600013 milliseconds before timing out.\n")


def code(text: str) -> str:
    return explain_text(text).primary.code


# -- the six codes ----------------------------------------------------------------------------

def test_a_collective_mismatch_is_named_whichever_library_caught_it() -> None:
    # c10d's ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL), pytorch/pytorch/issues/100214
    detail = ("RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running "
              "collective: CollectiveFingerPrint(SequenceNumber=9, OpType=ALLREDUCE, "
              "TensorShape=[20, 10]), but Rank 1 is running collective: CollectiveFingerPrint("
              "SequenceNumber=9, OpType=BROADCAST, TensorShape=[20]).\n")
    diag = explain_text(detail)
    assert diag.primary.code == "COLLECTIVE_MISMATCH"
    assert "rank 0 was running ALLREDUCE" in diag.primary.details
    assert "rank 1 was running BROADCAST" in diag.primary.details
    # gloo's size check, which is no connection failure (GLOO_CONNECT_FAILED)
    gloo = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
            "  what():  [enforce fail at ../third_party/gloo/gloo/transport/tcp/pair.cc:446] "
            "op.preamble.length <= op.nbytes. 1046204 vs 1040256\n")
    diag = explain_text(gloo)
    assert diag.primary.code == "COLLECTIVE_MISMATCH"
    assert "GLOO_CONNECT_FAILED" not in [f.code for f in diag.others]
    # NCCL's socket transport inside a collective; at bootstrap it is a version mismatch
    assert code("hvd1:2918:3333 [0] transport/net_socket.cc:200 NCCL WARN NET/Socket : message "
                "truncated : receiving 696320 bytes instead of 32768\n") == "COLLECTIVE_MISMATCH"
    assert code("node1:1:1 [0] bootstrap.cc:120 NCCL WARN Message truncated : received 1024 "
                "bytes instead of 256\n") == "NCCL_VERSION_MISMATCH"


def test_nccl_remote_error_is_the_cause_only_when_no_rank_failed_first() -> None:
    remote = ("[rank3]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:"
              "3763, remote process exited or there was a network error, NCCL version 2.28.8\n"
              "[rank3]: ncclRemoteError: A call failed possibly due to a network error or a "
              "remote process exiting prematurely.\n"
              "[rank3]: NET/OFI Request 0x7f14 completed with error. RC: 113. Error: 2 "
              "(UNDELIVERABLE). Completed length: 0\n")
    diag = explain_text(WATCHDOG + remote)
    assert (diag.primary.code, diag.primary.first_rank) == ("NCCL_REMOTE_ERROR", 3)
    assert [f.echo for f in diag.others] == [True]  # the watchdog is its echo
    # a rank that died first (its own exception) is the cause; the remote error its echo
    crashed = "[rank5]: KeyError: 'label'\n"
    assert explain_text(crashed + remote).primary.code == "RANK_FAILED"
    oom_killed = ("torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) "
                  "local_rank: 5 (pid: 4242) of binary: /usr/bin/python\n")
    assert code(remote + oom_killed) == "HOST_OOM_KILL"
    # NCCL's stock text for ncclSystemError mentions a remote peer: that alone is no remote error
    assert code("ncclSystemError: System call (e.g. socket, malloc) or external library call "
                "failed or device error. It can be also caused by unexpected exit of a remote "
                "peer, you can check NCCL warnings for failure information on this rank.\n") != \
        "NCCL_REMOTE_ERROR"


def test_a_lost_store_is_named_and_yields_to_what_killed_the_store() -> None:
    # torch 2.6's heartbeat monitor (xorbitsai/inference/issues/4421)
    lost = ('[rank1]:[W1229 22:06:38.480071392 ProcessGroupNCCL.cpp:1662] [PG ID 0 PG GUID 0 '
            'Rank 1] Failed to check the "should dump" flag on TCPStore, (maybe TCPStore server '
            'has shut down too early), with error: Broken pipe\n')
    diag = explain_text(lost)
    assert (diag.primary.code, diag.primary.first_rank) == ("RDZV_STORE_LOST", 1)
    assert code("[W514 18:33:36.536327028 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed "
                "on SocketImpl(fd=3, addr=[localhost]:34658, remote=[localhost]:1234): Failed to "
                "recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown "
                "or crash?\n") == "RDZV_STORE_LOST"
    # the store's rank ran out of GPU memory first: that is the answer
    oom = "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n"
    assert code(oom + lost) == "CUDA_OOM"
    # the watchdog of the others is an echo of the lost store
    assert code(lost + WATCHDOG) == "RDZV_STORE_LOST"


def test_a_native_crash_is_the_segfault_and_an_abort_yields_to_the_error_it_aborted_on() -> None:
    segv = ("E1119 08:26:02.715000 28705 site-packages/torch/distributed/elastic/multiprocessing/"
            "api.py:882] failed (exitcode: -11) local_rank: 0 (pid: 28773) of binary: /usr/bin/"
            "python3.12\n")
    diag = explain_text(segv)
    assert diag.primary.code == "RANK_NATIVE_CRASH"
    assert diag.primary.fields["exitcode"] == -11 and diag.primary.fields["pid"] == 28773
    # a segmentation fault is the rank's own crash, not an echo of the others' timeouts
    assert code(WATCHDOG + segv) == "RANK_NATIVE_CRASH"
    # SIGABRT from the watchdog's std::terminate: the timeout is the answer
    abort = ("terminate called after throwing an instance of 'c10::DistBackendError'\n"
             + WATCHDOG +
             "failed (exitcode: -6) local_rank: 1 (pid: 99) of binary: /usr/bin/python\n")
    diag = explain_text(abort)
    assert diag.primary.code == "NCCL_WATCHDOG_TIMEOUT"
    assert [f.code for f in diag.others] == ["RANK_NATIVE_CRASH"]
    # an abort alone still says something; a rank's own exception says more
    alone = "failed (exitcode: -6) local_rank: 1 (pid: 99) of binary: /usr/bin/python\n"
    assert code(alone) == "RANK_NATIVE_CRASH"
    assert code("[rank0]: ValueError: bad batch\n" + alone) == "RANK_FAILED"
    # mp.spawn's report of a signal (yzhang-0/MPSENet/issues/7)
    assert code("torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated with "
                "signal SIGSEGV\n") == "RANK_NATIVE_CRASH"
    # failure-codes v4: a single script dying by its own native signal gets the code too; the
    # kernel's SIGKILL of one script (no launcher: no rank) stays unknown
    assert code("Segmentation fault (core dumped)\n") == "RANK_NATIVE_CRASH"
    assert code("Process finished with exit code 137 (interrupted by signal 9: SIGKILL)\n") == NONE_CODE


def test_a_gpu_without_kernels_and_the_cpu_only_build_each_say_their_own_fix() -> None:
    new_gpu = ("NVIDIA GeForce RTX 5090 with CUDA capability sm_120 is not compatible with the "
               "current PyTorch installation.\nThe current PyTorch install supports CUDA "
               "capabilities sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90.\n"
               "RuntimeError: CUDA error: no kernel image is available for execution on the "
               "device\n")
    diag = explain_text(new_gpu)
    assert diag.primary.code == "CUDA_NO_KERNEL_IMAGE"
    assert "sm_120" in diag.primary.why and "TORCH_CUDA_ARCH_LIST" in diag.primary.fix
    assert "NVIDIA GeForce RTX 5090 is sm_120" in diag.primary.details
    # the CPU-only wheel (the examples' docstring commands on a CPU machine, issue 29)
    cpu = ('  File "torch/cuda/__init__.py", line 522, in _lazy_init\n'
           '    raise AssertionError("Torch not compiled with CUDA enabled")\n'
           "AssertionError: Torch not compiled with CUDA enabled\n")
    diag = explain_text(cpu)
    assert diag.primary.code == "CUDA_NO_KERNEL_IMAGE"
    assert "CPU-only build" in diag.primary.why and "sm_120" not in diag.primary.why
    assert "download.pytorch.org/whl/cu" in diag.primary.fix and "mps" in diag.primary.fix
    kb = load_knowledge()
    assert kb.entry("CUDA_NO_KERNEL_IMAGE").why not in (diag.primary.why,)


def test_a_device_side_assert_is_named_by_its_kernel_line_alone() -> None:
    line = ("/opt/conda/conda-bld/pytorch_1720538643151/work/aten/src/ATen/native/cuda/Indexing.cu"
            ":1231: indexSelectSmallIndex: block: [31,0,0], thread: [116,0,0] Assertion "
            "`srcIndex < srcSelectDimSize` failed.\n")
    diag = explain_text(line)
    assert diag.primary.code == "CUDA_DEVICE_ASSERT"
    assert "the failed check: srcIndex < srcSelectDimSize" in diag.primary.details
    assert code("RuntimeError: CUDA error: device-side assert triggered\n") == "CUDA_DEVICE_ASSERT"
    # a markdown rendering ate the backticks
    assert code("Indexing.cu:1231: indexSelectSmallIndex: block: [31,0,0], thread: [116,0,0] "
                "Assertion srcIndex < srcSelectDimSize failed.\n") == "CUDA_DEVICE_ASSERT"
    # glibc's assert of a C program is no CUDA kernel
    assert code("python: malloc.c:2379: sysmalloc: Assertion `(old_top == initial_top (av) && "
                "old_size == 0)' failed.\n") == NONE_CODE


# -- root cause over echo: the harder cases ---------------------------------------------------

def test_a_desync_report_that_failed_itself_still_names_the_timeout() -> None:
    # pytorch/pytorch/issues/105287: the timeout line is cut off, the report's own assert remains
    text = ('[I ProcessGroupNCCL.cpp:854] [Rank 0] NCCL watchdog thread terminated with exception: '
            'traceMap[thisSeq][myRank].second == kEventStart INTERNAL ASSERT FAILED at "/opt/'
            'pytorch/pytorch/torch/csrc/distributed/c10d/TraceUtils.h":237, please report a bug '
            'to PyTorch.\nException raised from retrieveDesyncReport at /opt/pytorch/pytorch/torch/'
            'csrc/distributed/c10d/TraceUtils.h:237 (most recent call first):\n')
    assert code(text) == "NCCL_WATCHDOG_TIMEOUT"
    # the flight recorder's wait on timeout (hiyouga/LlamaFactory/issues/8261)
    assert code("[rank3]:[W602 11:18:52.489301002 ProcessGroupNCCL.cpp:2111] [PG ID 1 PG GUID 1 "
                "Rank 3] timed out after waiting for 60000ms flight recorder dumps to finish.\n"
                ) == "NCCL_WATCHDOG_TIMEOUT"


def test_a_watchdog_timeout_printed_before_the_ranks_own_error_is_its_echo() -> None:
    own = ("[rank0]: Traceback (most recent call last):\n"
           '[rank0]:   File "/job/train.py", line 41, in <module>\n'
           "[rank0]: KeyError: 'lr'\n")
    diag = explain_text(WATCHDOG + own)
    assert (diag.primary.code, diag.primary.first_rank) == ("RANK_FAILED", 0)
    assert diag.primary.fields["frame"] == "/job/train.py:41 in <module>"
    assert diag.others[0].code == "NCCL_WATCHDOG_TIMEOUT" and diag.others[0].echo


def test_a_retry_warning_is_the_answer_only_when_it_is_the_only_trace() -> None:
    # pytorch/pytorch/issues/73114: nothing ever listened at the port, the job was killed
    retry = ("[W socket.cpp:701] The server socket on [jean-zay-iam01-ib0]:55035 is not yet "
             "listening (errno: 111 - Connection refused), will retry\n")
    diag = explain_text(retry)
    assert diag.primary.code == "RDZV_CONN_REFUSED" and diag.primary.confidence < 0.7
    # rank 0 was only starting: what failed later is the answer
    assert code(retry + WATCHDOG) == "NCCL_WATCHDOG_TIMEOUT"
    assert code(retry + "[rank2]: ValueError: bad batch\n") == "RANK_FAILED"
    assert code(retry + "RuntimeError: CUDA error: invalid device ordinal\n") == \
        "CUDA_INVALID_ORDINAL"


def test_nvml_unknown_error_is_a_gpu_fault_only_after_the_driver_reported_one() -> None:
    after_xid = ("[ 8112.337] NVRM: Xid (PCI:0000:3b:00): 62, pid=2117, 0000(0000) 00000000\n"
                 "Unable to determine the device handle for GPU 0000:3B:00.0: Unknown Error\n")
    assert code(after_xid) == "GPU_HARDWARE_FAULT"
    pcie = ("pcieport 0000:00:02.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction"
            " Layer\nRuntimeError: CUDA error: unknown error\n")
    assert code(pcie) == "GPU_HARDWARE_FAULT"
    # alone: often a container that lost its device nodes, not the hardware
    assert code("Unable to determine the device handle for GPU 0000:3B:00.0: Unknown Error\n") \
        == NONE_CODE
    assert code("Failed to initialize NVML: Unknown Error\n") == NONE_CODE
    assert code("RuntimeError: CUDA error: unknown error\n") == NONE_CODE
    # NVML's own word for it needs no context (dmlc/gluon-cv style "GPU is lost")
    assert code("Unable to determine the device handle for GPU 0000:02:00.0: GPU is lost. Reboot "
                "the system to recover this GPU\n") == "GPU_HARDWARE_FAULT"


def test_windows_port_in_use_in_any_language_and_its_harmless_10049_warning() -> None:
    dist = "torch.distributed.init_process_group(backend='gloo')\n"
    assert code(dist + "RuntimeError: [WinError 10048] 通常每个套接字地址(协议/网络地址/端口)只允许"
                       "使用一次。\n") == "RDZV_PORT_IN_USE"
    assert code(dist + "RuntimeError: The server socket has failed to listen on any local network "
                       "address. (system error: 10048 - Only one usage of each socket address "
                       "(protocol/network address/port) is normally permitted.)\n") == \
        "RDZV_PORT_IN_USE"
    assert code("[W socket.cpp:697] [c10d] The client socket has failed to connect to "
                "[kubernetes.docker.internal]:29500 (system error: 10049 - The requested address "
                "is not valid in its context.).\n") == NONE_CODE


# -- the wordings the held-back measurements missed (fixed after them, see docs/explain.md) ------

@pytest.mark.parametrize("text, want", [
    # NCCL 2.14's IB size check: the request, tag and peer come before the words
    ("10.10.23.10: so-ucloud:1307367:1307586 [0] transport/net_ib.cc:1038 NCCL WARN NET/IB : req "
     "0/1 tag 0 peer 10.10.23.6<58683> collective mismatch error, local size 496640 remote size "
     "65536\n", "COLLECTIVE_MISMATCH"),
    # NCCL's "Last error:" names the peer that closed the socket: the internal error is its echo
    ("RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1275, internal error, NCCL version 2.14.3\n"
     "ncclInternalError: Internal check failed.\nLast error:\nNet : Connection closed by remote "
     "peer node1<43236>\n", "NCCL_REMOTE_ERROR"),
    # NCCL 2.2's socket.h prints WARN without the word NCCL
    ("gpu-144-103:18553:18611 [0] include/socket.h:360 WARN Call to connect failed : Connection "
     "timed out\n", "RDZV_CONNECT_TIMEOUT"),
    # torch 2.5+: the store never answered, the job was stopped while retrying
    ("[W106 01:32:36.793651000 socket.cpp:942] [c10d] The server socket on [::ffff:10.25.4.3]:55872"
     " has timed out, will retry.\n", "RDZV_CONNECT_TIMEOUT"),
    # NVML's own string, read by Slurm's step daemon
    ("slurmstepd: error: NVML: Failed to get usage(15): GPU is lost\n", "GPU_HARDWARE_FAULT"),
    # abseil's failure signal handler under a Ray prefix, after gloo's libuv check failed
    ("(RayTrainWorker pid=7315) [third_party/gloo/gloo/transport/uv/libuv.h:596] uv_accept: "
     "invalid argument\n(RayTrainWorker pid=7315) *** SIGABRT received at time=1734086759 ***\n",
     "RANK_NATIVE_CRASH"),
    # the elastic agent's store error, its message cut off
    ('  File "torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", line 119, in '
     '_call_store\n    raise RendezvousConnectionError(\n', "RDZV_STORE_LOST"),
    # found missing by the second batch: CUDA 8's wording of a missing kernel, another library's
    # wording of CUDA error 2
    ("torch.rand(2, 2).cuda().sum()\nRuntimeError: CUDA error: invalid device function\n",
     "CUDA_NO_KERNEL_IMAGE"),
    ("cuda failed with error 2 out of memory. use CUDA_LAUNCH_BLOCKING=1 to get correct "
     "traceback.\n", "CUDA_OOM"),
])
def test_wordings_found_missing_by_the_held_back_split(text: str, want: str) -> None:
    assert code(text) == want


# -- the knowledge base format ----------------------------------------------------------------

def _kb(sig: dict[str, object]) -> dict[str, object]:
    return {"schema_version": 1, "codes": [
        {"code": "A", "title": "a", "why": "w", "fix": "f", "keywords": ["x"],
         "signatures": [sig]}]}


def test_signature_options_are_validated() -> None:
    kb = parse_knowledge(_kb({"pattern": "x", "weak": True, "echo_of": ["*"], "why": "own",
                              "fix": "own fix"}))
    sig = kb.entries[0].signatures[0]
    assert sig.weak and sig.echo_of == frozenset({"*"}) and (sig.why, sig.fix) == ("own",
                                                                                  "own fix")
    for bad in ({"pattern": "x", "supporting": True, "weak": True},
                {"pattern": "x", "echo_of": "A"},
                {"pattern": "x", "echo_of": ["NOPE"]},
                {"pattern": "x", "why": ""}):
        with pytest.raises(KnowledgeBaseError):
            parse_knowledge(_kb(bad))


def test_torchruns_padded_report_names_the_crashed_rank() -> None:
    # NVIDIA/Megatron-LM/issues/1880: the root-cause box padded to a wide terminal
    box = ("  rank      : 0 (local_rank: 0)                                          \n"
           "  exitcode  : -11 (pid: 3304209)                                         \n"
           "  traceback : Signal 11 (SIGSEGV) received by PID 3304209                \n")
    diag = explain_text(box)
    assert (diag.primary.code, diag.primary.first_rank) == ("RANK_NATIVE_CRASH", 0)
