"""``gpuwarden explain`` through ``main(argv)``: exit codes, --json schema, plain report, inputs."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gpuwarden.cli import main

CORPUS = Path(__file__).parent / "explain_corpus"


def test_found_code_exits_0_with_the_four_part_report(capsys: pytest.CaptureFixture[str]) -> None:
    log = CORPUS / "oom_rank_prefixed_with_watchdog_echo.log"
    assert main(["explain", str(log)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("error[CUDA_OOM]: the GPU ran out of memory")
    assert "rank 6" in lines[0]
    assert lines[1].startswith("  why: the GPU is full")
    assert lines[2].startswith("  fix: ")
    assert any(line.startswith(f"  evidence: {log}:4: [rank6]: torch.OutOfMemoryError")
               for line in lines)
    assert any(line.startswith("  echo: NCCL_WATCHDOG_TIMEOUT at line 5") for line in lines)
    assert "\x1b[" not in out  # plain when piped


def test_json_output_has_the_documented_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--json", str(CORPUS / "dup_gpu_megatron_barrier.log")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1
    p = doc["primary"]
    assert p["code"] == "NCCL_DUPLICATE_GPU"
    assert 0 < p["confidence"] <= 1
    assert isinstance(p["why"], str) and isinstance(p["fix"], str)
    assert p["evidence"][0] == {
        "line": 5, "text": "Duplicate GPU detected : rank 3 and rank 0 both on CUDA device f000"}
    assert "ranks 3 and 0 are both on the GPU with bus id f000" in p["details"]
    assert isinstance(doc["others"], list)


def test_unknown_failure_exits_1_and_says_it_does_not_know(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--json", str(CORPUS / "none_importerror_transformers.log")]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["primary"]["code"] == "NONE"
    assert doc["primary"]["evidence"] == [] and doc["others"] == []
    assert main(["explain", str(CORPUS / "none_importerror_transformers.log")]) == 1
    assert capsys.readouterr().out.startswith("unknown[NONE]: no known failure")


def test_unreadable_inputs_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(tmp_path / "missing.log")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["explain", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    core = tmp_path / "core"
    core.write_bytes(b"\x7fELF\x02\x01\x01" + b"\x00" * 4096)
    assert main(["explain", str(core)]) == 2
    assert "binary data" in capsys.readouterr().err


def test_gzip_logs_and_stdin_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    text = (CORPUS / "port_in_use_errno98.log").read_bytes()
    gz = tmp_path / "job.log.gz"
    gz.write_bytes(gzip.compress(text))
    assert main(["explain", str(gz)]) == 0
    assert capsys.readouterr().out.startswith("error[RDZV_PORT_IN_USE]")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text)))
    assert main(["explain"]) == 0
    assert "<stdin>:1:" in capsys.readouterr().out


@pytest.mark.timeout(30)
def test_a_fifo_is_read_without_seeking(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    # what `gpuwarden explain <(cat x.log)` hands over: a pipe that cannot seek
    text = (CORPUS / "port_in_use_errno98.log").read_bytes()
    fifo = tmp_path / "pipe.log"
    os.mkfifo(fifo)

    def write() -> None:
        with fifo.open("wb") as w:
            w.write(text)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    assert main(["explain", str(fifo)]) == 0
    writer.join(10)
    assert capsys.readouterr().out.startswith("error[RDZV_PORT_IN_USE]")


def test_a_corrupt_gzip_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    packed = bytearray(gzip.compress((CORPUS / "port_in_use_errno98.log").read_bytes()))
    packed[10:30] = b"\xff" * 20  # the deflate stream right after the 10-byte header
    bad = tmp_path / "job.log.gz"
    bad.write_bytes(bytes(packed))
    assert main(["explain", str(bad)]) == 2
    assert "reading failed" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_gzip_on_stdin_is_diagnosed() -> None:
    text = (CORPUS / "dns_torchrun_hostname_unresolved.log").read_bytes()
    proc = subprocess.run([sys.executable, "-c", "from gpuwarden.cli import console_main; console_main()",
                           "explain", "-"], input=gzip.compress(text),
                          capture_output=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().startswith("error[RDZV_DNS]")


def test_a_knowledge_base_of_ones_own_is_used(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    kb = tmp_path / "kb.toml"
    kb.write_text('schema_version = 1\n[[codes]]\ncode = "MY_CODE"\ntitle = "t"\nwhy = "w"\n'
                  'fix = "f"\nkeywords = ["frobnicate"]\n'
                  "signatures = [{ pattern = 'frobnicate failed' }]\n")
    log = tmp_path / "x.log"
    log.write_text("ok\nerror: frobnicate failed\n")
    assert main(["explain", "--knowledge", str(kb), str(log)]) == 0
    assert capsys.readouterr().out.startswith("error[MY_CODE]: t")
    kb.write_text("schema_version = 1\n[[codes]]\n")
    assert main(["explain", "--knowledge", str(kb), str(log)]) == 2


@pytest.mark.timeout(60)
def test_console_script_runs_as_a_pipe_filter() -> None:
    text = (CORPUS / "dns_torchrun_hostname_unresolved.log").read_bytes()
    proc = subprocess.run([sys.executable, "-c", "from gpuwarden.cli import console_main; console_main()",
                           "explain", "-"], input=text,
                          capture_output=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().startswith("error[RDZV_DNS]")


@pytest.mark.timeout(60)
def test_explain_on_a_terminal_without_a_file_says_it_reads_stdin_and_how_to_end() -> None:
    """`gpuwarden explain` typed alone showed a blank screen. On a terminal it now says that it
    reads standard input and that Ctrl-D ends it; Ctrl-D then gives the diagnosis."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    master, slave = os.openpty()
    exe = Path(sys.executable).with_name("gpuwarden")
    proc = subprocess.Popen([str(exe), "explain"], stdin=slave, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    os.close(slave)
    try:
        assert proc.stderr is not None
        assert b"Ctrl-D" in proc.stderr.readline()
        os.write(master, b"RuntimeError: CUDA error: out of memory\n\x04")
        out, _ = proc.communicate(timeout=30)
    finally:
        os.close(master)
    assert proc.returncode == 0 and b"CUDA_OOM" in out, out
