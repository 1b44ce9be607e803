"""explain v2: evidence as typed fields, the rank that failed first, numeric and cross-line
conditions of signatures, and the wordings the first knowledge base missed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpuwarden.errors import KnowledgeBaseError
from gpuwarden.explain import Explainer, explain_text, load_knowledge
from gpuwarden.explain.engine import field_value
from gpuwarden.explain.knowledge import parse_knowledge

GIB = 1024**3
MIB = 1024**2

OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
       "total capacity of 79.15 GiB of which 30.75 MiB is free. Process 4242 has 61.20 GiB "
       "memory in use. Process 5151 has 512.00 MiB memory in use. Including non-PyTorch "
       "memory, this process has 17.90 GiB memory in use.")
WATCHDOG = ("[rank{r}]:[E1121 10:51:02.112 ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum=242, OpType=ALLREDUCE, NumelIn=1, "
            "NumelOut=1, Timeout(ms)=600000) ran for 600008 milliseconds before timing out.")
TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/job/train.py", line 201, in <module>',
    "    main()",
    '  File "/job/data.py", line 88, in __getitem__',
    "    label = self.labels[key]",
    "KeyError: 'img_00412'",
]


def test_oom_evidence_is_typed_fields_one_record_per_process() -> None:
    primary = explain_text(OOM).primary
    assert primary.code == "CUDA_OOM"
    f = primary.fields
    assert f["processes"] == [{"pid": 4242, "bytes": int(61.20 * GIB)},
                              {"pid": 5151, "bytes": 512 * MIB}]
    assert (f["gpu"], f["requested_bytes"], f["free_bytes"]) == (0, 2 * GIB, int(30.75 * MIB))
    assert f["total_bytes"] == int(79.15 * GIB) and f["self_bytes"] == int(17.90 * GIB)
    # `explain --json` prints Diagnosis.to_dict(): the fields are there, as JSON
    as_json = json.loads(json.dumps(explain_text(OOM).to_dict()))
    assert as_json["primary"]["fields"]["processes"][0] == {"pid": 4242, "bytes": int(61.20 * GIB)}


def test_fields_survive_a_log_fed_in_pieces() -> None:
    text = f"noise\n[rank3]: {OOM}\nmore noise\n".encode()
    ex = Explainer(load_knowledge())
    for i in range(0, len(text), 7):
        ex.feed_bytes(text[i:i + 7])
    primary = ex.result().primary
    assert primary.fields["rank"] == 3 and primary.fields["processes"][1]["pid"] == 5151


@pytest.mark.parametrize(("name", "raw", "value"), [
    ("pid", " 4242 ", 4242), ("port", "29500", 29500), ("bytes", "1.5 GiB", int(1.5 * GIB)),
    ("free_bytes", "30.75 MiB", int(30.75 * MIB)), ("bytes", "lots", "lots"),
    ("host", "node-a", "node-a"), ("rank", "x", "x"),
])
def test_field_values_are_numbers_sizes_or_text(name: str, raw: str, value: Any) -> None:
    assert field_value(name, raw) == value


def test_a_single_process_traceback_is_not_a_rank_failure() -> None:
    assert explain_text("\n".join(TRACEBACK)).primary.code == "NONE"


def test_a_ranks_own_exception_names_the_rank_the_exception_and_the_frame() -> None:
    log = "\n".join(["[rank0]: step 120 loss 1.9", *(f"[rank1]: {line}" for line in TRACEBACK),
                     WATCHDOG.format(r=0), WATCHDOG.format(r=2)])
    diag = explain_text(log)
    p = diag.primary
    assert (p.code, p.first_rank) == ("RANK_FAILED", 1)
    assert p.fields["exception"] == "KeyError"
    assert p.fields["frame"] == "/job/data.py:88 in __getitem__"
    assert [(f.code, f.echo) for f in diag.others] == [("NCCL_WATCHDOG_TIMEOUT", True)]


def test_a_specific_code_beats_a_ranks_bare_exception_and_its_line_is_not_counted_twice() -> None:
    log = "\n".join([f"[rank3]: {OOM}", "[rank0]: RuntimeError: stopping, a peer died",
                     WATCHDOG.format(r=0)])
    diag = explain_text(log)
    assert diag.primary.code == "CUDA_OOM" and diag.primary.first_rank == 3
    rank_failed = [f for f in diag.others if f.code == "RANK_FAILED"]
    assert rank_failed and rank_failed[0].first_rank == 0  # only rank 0's line, not the OOM's


def test_torchrun_root_cause_block_names_the_root_cause_rank_not_the_first_listed() -> None:
    log = "\n".join([
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        "train.py FAILED", "Failures:", "[1]:", "  host      : node-b",
        "  rank      : 1 (local_rank: 1)", "  exitcode  : 1 (pid: 711)",
        "Root Cause (first observed failure):", "[0]:", "  host      : node-a",
        "  rank      : 0 (local_rank: 0)", "  exitcode  : 1 (pid: 707)",
    ])
    p = explain_text(log).primary
    assert (p.code, p.first_rank, p.fields["exitcode"]) == ("RANK_FAILED", 0, 1)


@pytest.mark.parametrize(("line", "code", "fields"), [
    ("E0325 20:57:27.620000 2606 torch/distributed/elastic/multiprocessing/api.py:869] failed "
     "(exitcode: -9) local_rank: 5 (pid: 2630) of binary: /usr/bin/python", "HOST_OOM_KILL",
     {"local_rank": 5, "pid": 2630, "rank": 5}),
    ("slurmstepd: error: Detected 1 oom_kill event in StepId=8812.0. Some of the step tasks "
     "have been OOM Killed.", "HOST_OOM_KILL", {}),
    ("E0801 13:23:20.000000 32974 torch/distributed/elastic/multiprocessing/api.py:874] failed "
     "(exitcode: 1) local_rank: 3 (pid: 33054) of binary: /usr/bin/python3", "RANK_FAILED",
     {"exitcode": 1, "rank": 3}),
])
def test_an_exit_status_of_the_elastic_agent(line: str, code: str, fields: dict[str, Any]) -> None:
    p = explain_text(line).primary
    assert p.code == code
    assert {k: p.fields[k] for k in fields} == fields


@pytest.mark.parametrize(("ws", "wc", "code"), [(4, 8, "RDZV_STALE_STORE"),
                                                (8, 7, "RDZV_WORKERS_MISSING"),
                                                (4, 4, "NONE")])
def test_store_barrier_counts_compare_as_numbers(ws: int, wc: int, code: str) -> None:
    line = ("Waiting in store based barrier to initialize process group for rank: 0, key: "
            f"store_based_barrier_key:1 (world_size={ws}, worker_count={wc}, timeout=0:30:00)")
    assert explain_text(line).primary.code == code


def test_different_nccl_versions_across_ranks_are_a_mismatch_one_version_is_not() -> None:
    same = "NCCL version 2.18.1+cuda12.1\nNCCL version 2.18.1+cuda12.1\n"
    assert explain_text(same).primary.code == "NONE"
    mixed = "NCCL version 2.18.1+cuda12.1\nnode2: NCCL version 2.14.3+cuda11.7\n"
    assert explain_text(mixed).primary.code == "NCCL_VERSION_MISMATCH"


@pytest.mark.parametrize(("log", "code"), [
    # NCCL 2.19+ (misc/socket.cc) and its ncclRemoteError summary, no "NCCL" on the line
    ("[2025-05-16 10:49:23] node:10209:10243 [1] misc/socket.cc:544 NCCL WARN "
     "socketPollConnect: connect returned Connection refused, exceeded error retry count (35)",
     "RDZV_CONN_REFUSED"),
    ("ncclRemoteError: connect to 10.67.10.124<36085> returned Connection refused, exceeded "
     "error retry count after 35 attempts", "RDZV_CONN_REFUSED"),
    ("RuntimeError: No route to host", "RDZV_CONN_REFUSED"),
    # the watchdog's abort lines alone
    ("[rank2]:[E220 01:25:08.728702337 ProcessGroupNCCL.cpp:681] [Rank 2] Some NCCL operations "
     "have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU "
     "operations might run on corrupted/incomplete data.", "NCCL_WATCHDOG_TIMEOUT"),
    ("include/socket.h:344 WARN Socket creation failed : Address family not supported by "
     "protocol", "NCCL_NO_INTERFACE"),
    ("RuntimeError: unable to write to file </torch_15769_1517813162>", "DATALOADER_SHM"),
    # gloo's interface lookup (device.cc lookupAddrForIface) against its hostname lookup
    ("RuntimeError: [enforce fail at device.cc:84] ifa != nullptr. Unable to find address for: "
     "ens5", "NCCL_NO_INTERFACE"),
    ("RuntimeError: Unable to find address for: eth0", "NCCL_NO_INTERFACE"),
    ("RuntimeError: [enforce fail at device.cc:127] rp != nullptr. Unable to find address for: "
     "dgx-1.ai", "RDZV_DNS"),
    # errno 13 is a privileged port, not one in use
    ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
     "network address. The server socket has failed to bind to [::]:98 (errno: 13 - Permission "
     "denied).", "RDZV_PORT_PERMISSION"),
    ("[W socket.cpp:426] [c10d] The server socket has failed to bind to [::]:97 (errno: 13 - "
     "Permission denied).\n[E socket.cpp:462] [c10d] The server socket has failed to listen on "
     "any local network address.", "RDZV_PORT_PERMISSION"),
    ("[W socket.cpp:401] [c10d] The server socket has failed to bind to [::]:22 (errno: 98 - "
     "Address already in use).\n[E socket.cpp:435] [c10d] The server socket has failed to "
     "listen on any local network address.", "RDZV_PORT_IN_USE"),
])
def test_wordings_the_first_knowledge_base_missed(log: str, code: str) -> None:
    assert explain_text(log).primary.code == code


def test_nccls_summary_errors_defer_to_the_cause_its_last_error_line_names() -> None:
    log = ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1275, "
           "internal error, NCCL version 2.14.3\nncclInternalError: Internal check failed.\n"
           "Last error:\nNet : Call to recv from 10.58.226.18<38309> failed : Connection refused")
    assert explain_text(log).primary.code == "RDZV_CONN_REFUSED"
    oom = ("NCCL WARN Cuda failure 'out of memory'\n"
           "RuntimeError: NCCL Error 1: unhandled cuda error")
    assert explain_text(oom).primary.code == "CUDA_OOM"


def _kb(sig: dict[str, Any], detail: dict[str, Any] | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"code": "X", "title": "t", "why": "w", "fix": "f",
                             "keywords": ["x"], "signatures": [sig]}
    if detail is not None:
        entry["details"] = [detail]
    return {"schema_version": 1, "codes": [entry]}


@pytest.mark.parametrize(("sig", "detail", "problem"), [
    ({"pattern": "x(?P<a>\\d)", "greater": ["a", "b"]}, None, "greater"),
    ({"pattern": "x(?P<a>\\d)", "greater": "a"}, None, "greater"),
    ({"pattern": "x", "distinct": "v"}, None, "distinct"),
    ({"pattern": "x"}, {"pattern": "x(?P<a>\\d)", "say": "{a}", "collect": ""}, "collect"),
])
def test_malformed_v2_signature_options_are_refused_by_name(sig: dict[str, Any],
                                                            detail: dict[str, Any] | None,
                                                            problem: str) -> None:
    with pytest.raises(KnowledgeBaseError, match=problem):
        parse_knowledge(_kb(sig, detail))
