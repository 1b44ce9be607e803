"""The matcher: rank prefixes, echo ordering, contexts, streaming in bounded memory, the data KB."""

from __future__ import annotations

import io
import re
import re._parser as sre_parse  # type: ignore[import-not-found]
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.errors import InputUnreadableError, KnowledgeBaseError
from gpuwarden.explain import (
    Explainer,
    explain_lines,
    explain_stream,
    explain_text,
    load_knowledge,
    rank_of,
)
from gpuwarden.explain.knowledge import parse_knowledge

OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
       "total capacity of 79.15 GiB of which 30.75 MiB is free. Process 4242 has 61.20 GiB "
       "memory in use. Including non-PyTorch memory, this process has 17.90 GiB memory in use.")
WATCHDOG = ("[E ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
            "Timeout(ms)=600000) ran for 600013 milliseconds before timing out.")


@pytest.mark.parametrize(("line", "rank"), [
    ("[rank3]: Traceback (most recent call last):", 3),
    ("[rank1]:[E321 02:07:08.408 ProcessGroupNCCL.cpp:607] [Rank 1] Watchdog", 1),
    ("[default0]:RuntimeError: CUDA error: invalid device ordinal", 0),
    ("12: RuntimeError: CUDA error: out of memory", 12),
    ("[1,5]<stderr>:NCCL WARN Duplicate GPU detected", 5),
    ("[80746] [rank4]:[E321 02:07:08] message", 4),
    ("[E ProcessGroupNCCL.cpp:737] [Rank 6] Watchdog caught", 6),
    ("[PG 1 Rank 2] Exception (either an error or timeout)", 2),
    ("RuntimeError: CUDA error: out of memory", None),
    ("Epoch 3: 12: loss", None),
])
def test_rank_prefixes_of_torch_torchrun_srun_and_mpirun(line: str, rank: int | None) -> None:
    assert rank_of(line) == rank


def test_a_ranks_own_error_is_the_root_cause_and_the_others_watchdogs_are_echoes() -> None:
    log = "\n".join([
        "[rank0]: step 100 loss 2.31",
        f"[rank1]: {OOM}",
        "[rank0]:" + WATCHDOG.format(r=0),
        "[rank2]:" + WATCHDOG.format(r=2),
    ])
    diag = explain_text(log)
    assert diag.primary.code == "CUDA_OOM"
    assert (diag.primary.first_line, diag.primary.first_rank) == (2, 1)
    assert [(f.code, f.echo, f.ranks) for f in diag.others] == [
        ("NCCL_WATCHDOG_TIMEOUT", True, [0, 2])]
    # what to look at next: the process named in the message, per rank
    assert "rank 1: process 4242 has 61.20 GiB in use on that GPU" in diag.primary.details


def test_the_root_cause_wins_even_when_its_rank_prints_it_after_the_echoes() -> None:
    # rank 0 reports the missing rank first; rank 1's crash comes later in the merged log
    log = "\n".join([
        "0: torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. "
        "1/2 clients joined.",
        "1: RuntimeError: CUDA error: invalid device ordinal",
    ])
    diag = explain_text(log)
    assert diag.primary.code == "CUDA_INVALID_ORDINAL"
    assert diag.primary.first_rank == 1
    assert diag.others[0].code == "RDZV_WORKERS_MISSING" and diag.others[0].echo
    assert "rank 0: 1 of 2 ranks reached the rendezvous" in diag.others[0].details


def test_between_two_root_causes_the_earliest_line_wins() -> None:
    log = ("[rank1]: RuntimeError: CUDA error: invalid device ordinal\n"
           "[rank0]: " + OOM + "\n")
    diag = explain_text(log)
    assert diag.primary.code == "CUDA_INVALID_ORDINAL"
    assert [(f.code, f.echo) for f in diag.others] == [("CUDA_OOM", False)]


def test_shm_bus_error_beats_the_generic_worker_exit_and_plain_killed_does_not() -> None:
    shm = explain_text(
        "RuntimeError: DataLoader worker (pid 77) is killed by signal: Bus error.\n"
        "RuntimeError: DataLoader worker (pid(s) 77) exited unexpectedly\n")
    assert shm.primary.code == "DATALOADER_SHM"
    killed = explain_text(
        "RuntimeError: DataLoader worker (pid 77) is killed by signal: Killed.\n"
        "RuntimeError: DataLoader worker (pid(s) 77) exited unexpectedly\n")
    assert killed.primary.code == "DATALOADER_WORKER_KILLED"
    assert "worker pid 77 was killed by signal Killed" in killed.primary.details


def test_nccl_unhandled_system_error_alone_is_ncclsystemerror_and_never_nccl_shm() -> None:
    bare = "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:410, unhandled system error\n"
    assert explain_text(bare).primary.code == "NCCL_SYSTEM_ERROR"
    with_cause = ("node:1:2 [0] include/shm.h:48 NCCL WARN Error while creating shared memory "
                  "segment nccl-shm-recv-b79-0-3-0 (size 4460544)\n" + bare)
    diag = explain_text(with_cause)
    assert diag.primary.code == "NCCL_SHM"
    assert [e.line for e in diag.primary.evidence] == [1, 2]  # the summary joins as evidence
    # the generic summary is the specific cause's echo, even when it comes first
    assert [(f.code, f.echo) for f in explain_text(bare + with_cause).others] == [
        ("NCCL_SYSTEM_ERROR", True)]


def test_words_shared_with_other_programs_need_a_torch_distributed_context() -> None:
    pip = ("WARNING: Retrying after connection broken by 'NewConnectionError(... Failed to "
           "establish a new connection: [Errno -2] Name or service not known')': /simple/x/\n"
           "requests.exceptions.ConnectionError: [Errno 111] Connection refused\n")
    assert explain_text(pip).primary.code == "NONE"
    dist = "Traceback: torch.distributed.init_process_group(backend='gloo')\n" + pip
    assert explain_text(dist).primary.code == "RDZV_DNS"


def test_nothing_known_gives_none_and_says_so() -> None:
    diag = explain_text("Traceback (most recent call last):\nKeyError: 'label'\n")
    assert not diag.found and diag.primary.code == "NONE" and diag.others == []
    assert "does not know" in diag.primary.why
    assert diag.lines_read == 2


def test_ansi_colours_and_carriage_returns_do_not_hide_a_signature() -> None:
    log = ("\x1b[1;31mRuntimeError: \x1b[0mCUDA error: CUDA-capable device(s) is/are busy or "
           "unavailable\r 10%|#   | 1/10\n")
    diag = explain_text(log)
    assert diag.primary.code == "CUDA_DEVICES_BUSY"
    assert "\x1b" not in diag.primary.evidence[0].text


def test_line_numbers_survive_any_chunking_of_the_input() -> None:
    lines = [f"step {i} loss 0.{i}" for i in range(3000)]
    lines[1234] = "[rank3]: RuntimeError: CUDA error: invalid device ordinal"
    lines[2999] = "RuntimeError: CUDA error: out of memory"   # last line, no trailing newline
    text = "\n".join(lines)
    whole = explain_text(text)
    ex = Explainer(load_knowledge())
    data = text.encode()
    for i in range(0, len(data), 7):      # pieces that cut lines anywhere
        ex.feed_bytes(data[i:i + 7])
    pieces = ex.result()
    by_lines = explain_lines(iter(lines))
    for diag in (whole, pieces, by_lines):
        assert diag.primary.code == "CUDA_INVALID_ORDINAL"
        assert diag.primary.evidence[0].line == 1235
        assert diag.others[0].evidence[0].line == 3000
        assert diag.lines_read == 3000


class _GeneratedLog(io.RawIOBase):
    """A noisy log produced on the fly (never held whole): noise blocks, one OOM, one more block."""

    def __init__(self, total_bytes: int) -> None:
        noise = "".join(
            f"[2026-01-01 00:00:{i % 60:02d}] INFO step={i} loss=0.{i % 997:03d} lr=3e-4 "
            f"{i % 100:3d}%|{'#' * (i % 20):<20}| {i}/100000 [00:01<00:10, 9.9it/s]\n"
            for i in range(12000))
        self.block = noise.encode()
        repeats = max(1, total_bytes // len(self.block) - 1)
        self.lines_before_oom = repeats * self.block.count(b"\n")
        self._pieces = iter([self.block] * repeats + [("[rank5]: " + OOM + "\n").encode(),
                                                      self.block])
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        while not self._pending:
            piece = next(self._pieces, None)
            if piece is None:
                return 0
            self._pending = piece
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_large_log_streams_in_bounded_memory() -> None:
    total = 48 << 20
    stream = _GeneratedLog(total)
    reader = io.BufferedReader(stream, buffer_size=1 << 20)
    tracemalloc.start()
    t0 = time.perf_counter()
    diag = explain_stream(reader, source="generated")
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert diag.primary.code == "CUDA_OOM"
    assert diag.primary.first_rank == 5
    assert diag.primary.first_line == stream.lines_before_oom + 1
    assert diag.bytes_read >= total - 2 * len(stream.block)
    # blocks of a few MiB, never the whole input: generous margins for a shared CI machine
    assert peak < 40 << 20, f"peak {peak / 2**20:.1f} MiB for a {total >> 20} MiB log"
    assert elapsed < 60


def test_binary_data_is_refused() -> None:
    with pytest.raises(InputUnreadableError):
        explain_stream(io.BytesIO(b"\x7fELF\x02\x01\x01\x00\x00\x00" * 100))


KB_ONE_CODE = """
schema_version = 1
[contexts]
cluster = ["slurmstepd"]

[[codes]]
code = "SLURM_OOM"
title = "Slurm's cgroup killed the step for memory"
why = "the step used more host memory than its allocation"
fix = "ask for more --mem"
keywords = ["oom-kill", "out-of-memory"]
signatures = [
  { pattern = 'Detected \\d+ oom-kill event', confidence = 0.9, requires = "cluster" },
]
details = [
  { pattern = 'StepId=(?P<step>\\d+\\.\\d+)', say = "step {step}" },
]
"""


def test_a_new_code_is_data_only(tmp_path: Path) -> None:
    kb_file = tmp_path / "kb.toml"
    kb_file.write_text(KB_ONE_CODE)
    kb = load_knowledge(kb_file)
    log = "slurmstepd: error: Detected 1 oom-kill event(s) in StepId=4242.0. Some of your processes\n"
    diag = explain_text(log, kb)
    assert diag.primary.code == "SLURM_OOM"
    assert diag.primary.details == ["step 4242.0"]
    assert explain_text("Detected 1 oom-kill event(s)\n", kb).primary.code == "NONE"  # no context


@pytest.mark.parametrize(("mutation", "complaint"), [
    (lambda t: t.replace("keywords = [\"oom-kill\", \"out-of-memory\"]", "keywords = [\"OOM\"]"),
     "lower-case"),
    (lambda t: t.replace("'Detected \\d+ oom-kill event'", "'Detected ('"), "does not compile"),
    (lambda t: t.replace('requires = "cluster"', 'requires = "nowhere"'), "context"),
    (lambda t: t.replace('say = "step {step}"', 'say = "step {stpe}"'), "does not capture"),
    (lambda t: t.replace("schema_version = 1", "schema_version = 9"), "schema_version"),
])
def test_a_malformed_knowledge_base_is_refused_with_the_entry_named(mutation, complaint) -> None:  # type: ignore[no-untyped-def]
    import tomllib

    with pytest.raises(KnowledgeBaseError, match=complaint):
        parse_knowledge(tomllib.loads(mutation(KB_ONE_CODE)))


def test_shipped_knowledge_base_has_every_code_of_failure_codes_md() -> None:
    codes = set(load_knowledge().codes)
    assert codes == {
        "CUDA_FORK_REINIT", "MAIN_GUARD_MISSING", "CUDA_DEVICES_BUSY", "CUDA_OOM",
        "CUDA_NO_DEVICE", "CUDA_DRIVER_TOO_OLD", "CUDA_INVALID_ORDINAL", "NCCL_DUPLICATE_GPU",
        "NCCL_SHM", "NCCL_NO_INTERFACE", "NCCL_WATCHDOG_TIMEOUT", "DATALOADER_SHM",
        "DATALOADER_WORKER_KILLED", "RDZV_PORT_IN_USE", "RDZV_DNS", "RDZV_CONNECT_TIMEOUT",
        "RDZV_CONN_REFUSED", "RDZV_WORKERS_MISSING",
        # v2
        "RANK_FAILED", "HOST_OOM_KILL", "CUDA_ILLEGAL_ADDRESS", "GPU_HARDWARE_FAULT",
        "CUDA_INIT_ERROR", "NCCL_UNHANDLED_CUDA_ERROR", "NCCL_INTERNAL_ERROR",
        "NCCL_VERSION_MISMATCH", "NCCL_P2P_HANG", "NCCL_CPU_TENSOR", "DDP_UNUSED_PARAMETERS",
        "PG_NOT_INITIALIZED", "DATALOADER_FD_LIMIT", "RDZV_PORT_PERMISSION", "RDZV_STALE_STORE",
        "RDZV_STORE_MISMATCH", "GLOO_CONNECT_FAILED",
        # v3
        "COLLECTIVE_MISMATCH", "NCCL_REMOTE_ERROR", "RDZV_STORE_LOST", "RANK_NATIVE_CRASH",
        "CUDA_NO_KERNEL_IMAGE", "CUDA_DEVICE_ASSERT",
        # v4
        "CUDA_SYSTEM_NOT_READY", "NCCL_SYSTEM_ERROR", "GLOO_PEER_LOST",
    }


def _texts_of(pattern: re.Pattern[str], limit: int = 256) -> list[str]:
    """Lines ``pattern`` matches: every alternative, each optional part absent and present.

    Derived from the parsed regex (no hand-written example to drift from it): a
    class gives one of its members, a repeat its minimum (and one more when that is 0).
    """
    parsed = sre_parse.parse(pattern.pattern, pattern.flags)

    def seq(items: Any) -> list[str]:
        out = [""]
        for op, av in items:
            out = [a + b for a in out for b in node(op, av)][:limit]
        return out

    def node(op: Any, av: Any) -> list[str]:
        name = str(op)
        if name == "LITERAL":
            return [chr(av)]
        if name == "NOT_LITERAL":
            return ["x" if chr(av) != "x" else "y"]
        if name == "ANY":
            return ["x"]
        if name == "IN":
            if av and str(av[0][0]) == "NEGATE":  # [^...]: a character the class leaves out
                left_out = {chr(v) for k, v in av[1:] if str(k) == "LITERAL"}
                return [next(c for c in "xyz0 " if c not in left_out)]
            for kind, value in av:
                k = str(kind)
                if k == "LITERAL":
                    return [chr(value)]
                if k == "RANGE":
                    return [chr(value[0])]
                if k == "CATEGORY":
                    return [{"CATEGORY_DIGIT": "0", "CATEGORY_SPACE": " "}.get(str(value), "a")]
            return ["a"]
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, _, body = av
            once = seq(body)
            base = [t * max(low, 1) for t in once]
            return ([""] + base if low == 0 else base)[:limit]
        if name == "SUBPATTERN":
            return seq(av[-1])
        if name == "ATOMIC_GROUP":
            return seq(av)
        if name == "BRANCH":
            return [t for alt in av[1] for t in seq(alt)][:limit]
        if name == "CATEGORY":
            return [{"CATEGORY_DIGIT": "0", "CATEGORY_SPACE": " "}.get(str(av), "a")]
        if name in ("AT", "ASSERT", "ASSERT_NOT"):
            return [""]
        raise AssertionError(f"{pattern.pattern!r}: regex construct {name} not covered here")

    return seq(parsed)


def test_every_signature_is_reachable_through_its_codes_keywords() -> None:
    # The prefilter only sends a line to a code's signatures when the line holds one
    # of that code's keywords: a signature whose text holds none of them never fires.
    unreachable = []
    for entry in load_knowledge().entries:
        for sig in entry.signatures:
            for text in _texts_of(sig.pattern):
                assert sig.pattern.search(text), (entry.code, sig.pattern.pattern, text)
                if not any(kw in text.lower() for kw in entry.keywords):
                    unreachable.append((entry.code, sig.pattern.pattern, text))
    assert unreachable == []


def test_the_driver_api_spelling_of_out_of_memory_is_cuda_oom() -> None:
    diag = explain_text("RuntimeError: CUDA driver error: CUDA_ERROR_OUT_OF_MEMORY\n")
    assert diag.primary.code == "CUDA_OOM"
