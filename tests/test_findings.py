"""One finding type: errors, doctor checks, launch reports and explain render and serialize alike."""

from __future__ import annotations

import io
import re
from typing import Any

from gpuwarden.doctor.model import Status, check
from gpuwarden.errors import LaunchError, UsageError, WorkerDiedError
from gpuwarden.explain import explain_text
from gpuwarden.findings import (
    EvidenceLine,
    Finding,
    Row,
    Section,
    Severity,
    emit,
    render_one_line,
    render_plain,
    render_rich,
)
from gpuwarden.launch.report import LaunchReport

COMMON_KEYS = {"code", "severity", "what", "why", "fix", "evidence", "details", "next", "sections",
               "fields"}
OOM = ("[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has "
       "a total capacity of 79.11 GiB of which 1.06 GiB is free. Process 4242 has 61.20 GiB memory "
       "in use.")


def _finding(**kw: Any) -> Finding:
    base: dict[str, Any] = {"code": "RDZV_DNS", "what": "rank 1 cannot resolve MASTER_ADDR 'x'",
                            "why": "unknown to the resolver", "fix": "set MASTER_ADDR",
                            "evidence": ["node b, rank 1"]}
    return Finding(**{**base, **kw})


def test_plain_rendering_is_the_four_part_report_in_reading_order() -> None:
    f = _finding(details=["rank 1: MASTER_ADDR was 'x'"], next="getent hosts x",
                 sections=[Section("stack of rank 1", ["a.py:3 in main"])],
                 fields={"rank": 1, "host": "x"})
    assert render_plain(f) == "\n".join([
        "error[RDZV_DNS]: rank 1 cannot resolve MASTER_ADDR 'x'",
        "  why: unknown to the resolver",
        "  fix: set MASTER_ADDR",
        "  look at: rank 1: MASTER_ADDR was 'x'",
        "  next: getent hosts x",
        "  evidence: node b, rank 1",
        "  stack of rank 1:",
        "    a.py:3 in main",
    ])
    assert render_one_line(f) == ("error[RDZV_DNS]: rank 1 cannot resolve MASTER_ADDR 'x' "
                                  "(unknown to the resolver); fix: set MASTER_ADDR")


def test_severity_names_the_head_and_an_ok_finding_shows_only_its_evidence() -> None:
    assert render_plain(_finding(severity=Severity.WARNING)).startswith("warning[RDZV_DNS]: ")
    ok = _finding(severity=Severity.OK, evidence=["port 29500 free"])
    assert render_plain(ok) == "gpuwarden: rank 1 cannot resolve MASTER_ADDR 'x'\n  evidence: port 29500 free"
    # a checklist layout: own head, bullets, a deeper indent
    text = render_plain(ok, head="[  ok] port", indent="    ", bullets=True,
                        extra=[Row("also", "more")])
    assert text == "[  ok] port\n    - port 29500 free\n    also: more"


def test_log_evidence_names_its_source_and_line_and_serializes_as_data() -> None:
    f = _finding(evidence=[EvidenceLine(12, "gai error -2"), "node b"])
    assert "  evidence: train.log:12: gai error -2" in render_plain(f, source="train.log")
    d = f.to_dict()
    assert set(d) == COMMON_KEYS
    assert d["evidence"] == [{"line": 12, "text": "gai error -2"}, "node b"]
    assert d["severity"] == "error"


def test_rich_rendering_says_the_same_words_and_emit_is_plain_when_piped() -> None:
    f = _finding(details=["look here"], sections=[Section("tail", ["[1] line"])])

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    emit(f, tty)
    rich_text = tty.getvalue()
    assert "\x1b[" in rich_text  # colours on a terminal
    plain_of_rich = re.sub(r"\x1b\[[0-9;]*m", "", rich_text).rstrip("\n")
    assert plain_of_rich == render_plain(f)  # markup-like text ("[1]") is escaped, not eaten
    piped = io.StringIO()
    emit(f, piped)
    assert piped.getvalue() == render_plain(f) + "\n"
    out = io.StringIO()
    render_rich(f, out)  # a non-terminal file gets no colour codes from rich
    assert "error[RDZV_DNS]" in out.getvalue()


def test_an_error_is_a_finding_with_its_exit_code() -> None:
    exc = LaunchError("rank 0 failed", why="w", fix="f", evidence="e", code="CUDA_OOM",
                      fields={"rank": 0, "pid": 42})
    assert exc.finding == Finding(code="CUDA_OOM", what="rank 0 failed", why="w", fix="f",
                                  evidence=("e",), fields={"rank": 0, "pid": 42})
    assert exc.render() == render_plain(exc.finding)
    assert exc.to_dict() == {**exc.finding.to_dict(), "exit_code": 1}
    usage = UsageError("--gpus 'x' is neither a number nor 'all'", fix="--gpus 2")
    assert usage.render() == "error[USAGE]: --gpus 'x' is neither a number nor 'all'; fix: --gpus 2"
    for err in (exc, usage):  # what the CLI prints on stderr when piped
        piped = io.StringIO()
        err.emit(piped)
        assert piped.getvalue() == err.render() + "\n"
    died = WorkerDiedError("worker 1 died", worker="w1", gpu="GPU 3", exit_status="SIGKILL(-9)",
                           task="f(1)", fields={"pid": 77})
    assert died.to_dict()["fields"] == {"pid": 77, "worker": "w1", "gpu": "GPU 3",
                                        "exit": "SIGKILL(-9)", "task": "f(1)"}


def test_a_doctor_check_is_a_finding_with_its_id_and_status() -> None:
    c = check("nproc", "NCCL_DUPLICATE_GPU", Status.FAIL, "3 ranks, 2 GPUs", why="w", fix="f",
              evidence=["GPU 0: ok"])
    assert isinstance(c, Finding) and c.severity is Severity.ERROR
    d = c.to_dict()
    assert set(d) == COMMON_KEYS | {"id", "status"}
    assert (d["id"], d["status"], d["severity"], d["evidence"]) == ("nproc", "fail", "error",
                                                                     ["GPU 0: ok"])
    assert check("x", "CUDA_OOM", Status.WARN, "w").severity is Severity.WARNING
    skipped = check("x", "CUDA_OOM", Status.SKIP, "no GPU", why="not shown")
    assert render_plain(skipped) == "gpuwarden: no GPU"  # an ok or skipped check hides why/fix


def test_a_launch_report_is_rendered_and_serialized_as_its_finding() -> None:
    report = LaunchReport(1, "RANK_STALL", "rank(s) 0 waited", "why", "fix", ["rank 0: pid 5"],
                          [("stack of rank 1 (innermost first)", ["x.py:1"])], None, {"rank": 1})
    assert report.render() == render_plain(report.finding)
    assert report.render().endswith("  stack of rank 1 (innermost first):\n    x.py:1")
    d = report.to_dict()
    assert set(d) == COMMON_KEYS | {"ok", "exit_code", "root_rank"}
    assert d["sections"] == [{"heading": "stack of rank 1 (innermost first)", "lines": ["x.py:1"]}]
    assert (d["ok"], d["code"], d["fields"]) == (False, "RANK_STALL", {"rank": 1})
    done = LaunchReport(0, None, "2 rank(s) finished in 1.0 s")
    assert done.render() == "gpuwarden: 2 rank(s) finished in 1.0 s"
    assert (done.to_dict()["code"], done.to_dict()["severity"]) == (None, "ok")


def test_an_explain_diagnosis_is_a_finding_with_where_it_was_seen() -> None:
    p = explain_text(OOM).primary
    assert isinstance(p, Finding) and p.title == p.what
    d = p.to_dict()
    assert set(d) == COMMON_KEYS | {"title", "confidence", "first_line", "first_rank", "ranks",
                                    "matches", "echo"}
    assert list(d)[:3] == ["code", "title", "confidence"]
    assert d["evidence"][0]["line"] == 1 and d["first_rank"] == 1
    none = explain_text("all good\n").primary
    assert none.severity is Severity.UNKNOWN and render_plain(none).startswith("unknown[NONE]: ")
