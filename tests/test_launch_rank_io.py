"""What a rank sees and leaves, as under torchrun (issue 24): stdin and the terminal, torch's
error file, nothing printed that torchrun's rank would not print, tracebacks as python prints
them.

Interactive behaviour runs under a real pseudo-terminal (Python's ``pty``), the launcher in it
as a shell would start it: ``breakpoint()`` in rank 1 driven by typing ``p RANK`` and ``c``,
``torch.distributed.breakpoint(rank=1)``, and ``isatty()`` in each rank compared with torchrun's
ranks on the same kind of terminal. torch's ``@record`` and ``record_exception`` run beside real
torchrun and the two reports are compared.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwarden.cli import main
from gpuwarden.launch.ranks.exit_records import parse_torch_error, read_torch_error
from gpuwarden.launch.ranks.relay import Console, StreamRelay
from gpuwarden.launch.watch import flight_recorder
from tests.conftest import SCENARIOS, small_tmpfs

pytestmark = [pytest.mark.slow]

SCRIPT = str(Path(__file__).parent / "launch_scripts" / "rank_io.py")
BIN = Path(sys.executable).parent
GPUWARDEN = str(BIN / "gpuwarden")
TORCHRUN = str(BIN / "torchrun")


@pytest.fixture
def cpu_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_", "SLURM_")) and k != "CUDA_VISIBLE_DEVICES"}
    env["GPUWARDEN_SIMULATE"] = str(SCENARIOS / "nogpu.json")
    env["GPUWARDEN_LEASE_DIR"] = str(tmp_path)
    # torchrun's and gpuwarden's /tmp/torchelastic_* directories land here, removed with it
    env["TMPDIR"] = str(tmp_path)
    return env


class Terminal:
    """A command on a pseudo-terminal of its own, its stdin, stdout and stderr, as a user's
    shell runs it; what it writes is collected, what the test types goes to its stdin."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        import fcntl
        import struct
        import termios

        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     cwd=cwd, start_new_session=True)
        os.close(slave)
        self.fd = master
        self.out = b""

    def _read(self, wait_s: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], wait_s)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: every holder of the terminal's other end has exited
            return False
        self.out += data
        return bool(data)

    def expect(self, token: bytes, count: int = 1, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while self.out.count(token) < count:
            assert time.monotonic() < deadline, self.out.decode(errors="replace")
            assert self._read(0.1), self.out.decode(errors="replace")

    def type(self, text: bytes) -> None:
        os.write(self.fd, text)

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:  # a failed test: stop the job as a user's Ctrl-C would
            self.proc.terminate()
            self.proc.wait(30)
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def finish(self, timeout_s: float = 60) -> int:
        deadline = time.monotonic() + timeout_s
        while self._read(0.1) or self.proc.poll() is None:
            assert time.monotonic() < deadline, self.out.decode(errors="replace")
        return self.proc.wait()


# ---- the terminal ----------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leftover_processes")
def test_breakpoint_in_rank_1_is_driven_from_the_terminal(tmp_path: Path,
                                                         cpu_env: dict[str, str]) -> None:
    with Terminal([GPUWARDEN, "launch", "-n", "2", SCRIPT, "pdb"], cpu_env, tmp_path) as term:
        term.expect(b"[rank1]: (Pdb) ")  # the prompt shows before any newline
        term.type(b"p RANK\n")
        term.expect(b"(Pdb) ", count=2)
        answer = term.out.rsplit(b"(Pdb) ", 2)[1]
        assert re.search(rb"\b1\r?\n", answer), term.out
        term.type(b"c\n")
        term.expect(b"[rank1]: rank 1 goes on")
        assert term.finish() == 0, term.out.decode(errors="replace")
    assert b"BdbQuit" not in term.out


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("no_leftover_processes")
def test_torch_distributed_breakpoint_stops_the_rank_it_names(tmp_path: Path,
                                                             cpu_env: dict[str, str]) -> None:
    with Terminal([GPUWARDEN, "launch", "-n", "2", SCRIPT, "distpdb"], cpu_env,
                  tmp_path) as term:
        term.expect(b"(Pdb) ", timeout_s=120)
        assert b"[rank1]: " in term.out.rsplit(b"(Pdb) ", 1)[0].rsplit(b"\n", 1)[-1]
        term.type(b"c\n")
        term.expect(b"rank 0 done")
        term.expect(b"rank 1 done")
        assert term.finish() == 0, term.out.decode(errors="replace")


@pytest.mark.timeout(240)
def test_isatty_in_each_rank_answers_as_under_torchrun(tmp_path: Path,
                                                      cpu_env: dict[str, str]) -> None:
    """On a terminal: stdin is the launcher's, stdout and stderr a terminal unless tee'd,
    redirected or filtered out (torchrun writes those to a file, or /dev/null). Plain, and with
    --tee 1 --local-ranks-filter 0, each under both launchers: the four at once."""
    runs: dict[tuple[str, str], tuple[Terminal, Path]] = {}
    with contextlib.ExitStack() as stack:
        for config, flags in (("plain", []), ("tee-filter", ["--tee", "1", "--local-ranks-filter",
                                                             "0", "--log-dir", "logs"])):
            args = ["--standalone", "--nproc-per-node", "2", *flags]
            for who, argv in (("ours", [GPUWARDEN, "launch", *args]), ("theirs", [TORCHRUN, *args])):
                out = tmp_path / f"{config}-{who}"
                out.mkdir()
                runs[config, who] = (stack.enter_context(Terminal(
                    [*argv, SCRIPT, "tty", str(out)], cpu_env, tmp_path)), out)
        for term, _ in runs.values():
            assert term.finish(200) == 0, term.out.decode(errors="replace")
    seen = {key: {int(p.suffix[1:]): json.loads(p.read_text()) for p in out.glob("tty.*")}
            for key, (_, out) in runs.items()}
    for config in ("plain", "tee-filter"):
        assert seen[config, "ours"] == seen[config, "theirs"], seen
    assert seen["plain", "ours"] == {0: [True, True, True], 1: [True, True, True]}
    assert seen["tee-filter", "ours"] == {0: [True, False, True], 1: [True, False, False]}


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_leftover_processes")
def test_stdin_piped_to_the_launcher_reaches_rank_0(tmp_path: Path,
                                                    cpu_env: dict[str, str]) -> None:
    done = subprocess.run([GPUWARDEN, "launch", "-n", "2", SCRIPT, "stdin"], input="hello\n",
                          capture_output=True, text=True, env=cpu_env, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "[rank0]: rank 0 read 'hello'" in done.stdout


# ---- torch's error file ---------------------------------------------------------------------

def _torchrun_failure(stderr: str) -> dict[str, str]:
    """The root-cause fields of torchrun's ChildFailedError."""
    block = stderr[stderr.index("Root Cause (first observed failure):"):]
    fields = dict(re.findall(r"^  (\w+)\s*: (.*)$", block, re.MULTILINE))
    fields["traceback_text"] = block[block.index("traceback :"):]
    return fields


@pytest.mark.timeout(240)
def test_torchs_error_file_is_reported_as_torchrun_reports_it(tmp_path: Path,
                                                              cpu_env: dict[str, str]) -> None:
    """``@record`` (the exception propagates) and ``record_exception`` + ``sys.exit(7)`` (it
    does not: the error file is the only trace), each under torchrun and gpuwarden launch,
    all four at once."""
    runs = {}
    for mode in ("record", "exit7"):
        runs[mode, "ours"] = subprocess.Popen(
            [GPUWARDEN, "launch", "--json", "-n", "2", SCRIPT, mode], env=cpu_env, cwd=tmp_path,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        runs[mode, "theirs"] = subprocess.Popen(
            [TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT, mode], env=cpu_env,
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    for key, proc in runs.items():
        out, err = proc.communicate(timeout=200)
        results[key] = (proc.returncode, out, err)
    for mode in ("record", "exit7"):
        code, out, err = results[mode, "ours"]
        report = json.loads(out)["report"]
        t_code, _, t_err = results[mode, "theirs"]
        theirs = _torchrun_failure(t_err)
        assert t_code == 1 and theirs["rank"].startswith("1 ") and "KeyError: 'lr'" in t_err
        assert theirs["exitcode"].split()[0] == ("7" if mode == "exit7" else "1")
        # the same rank, exit code, exception and traceback, and an error file kept where
        # torchrun keeps its own
        assert code == int(theirs["exitcode"].split()[0]), err
        assert report["root_rank"] == 1 and report["fields"]["exception"] == "KeyError"
        assert "KeyError: 'lr'" in report["what"], report
        error_file = Path(report["fields"]["error_file"])
        # torchrun's layout, in torchrun's place (tempfile's directory: TMPDIR here)
        assert error_file.is_file() and re.fullmatch(
            re.escape(str(tmp_path)) + r"/torchelastic_[^/]+/[^/]+/attempt_0/1/error\.json",
            str(error_file)), error_file
        assert Path(theirs["error_file"]).is_file()
        assert parse_torch_error(str(error_file), json.loads(error_file.read_text()))
        tb = next(s["lines"] for s in report["sections"] if "traceback" in s["heading"])
        for line in ('  File "' + SCRIPT, 'return config["lr"]', "KeyError: 'lr'"):
            assert line in "\n".join(tb) and line in theirs["traceback_text"], (line, tb)
        if mode == "exit7":  # nothing but torch's file said what happened
            assert any("torch's error file" in s["heading"] for s in report["sections"])
            assert any("torch's error file:" in e for e in report["evidence"])


@pytest.mark.usefixtures("no_leftover_processes")
def test_a_rank_that_raised_then_aborted_at_exit_failed_of_its_exception(
        tmp_path: Path, cpu_env: dict[str, str]) -> None:
    """A rank's uncaught exception, then SIGABRT while the interpreter goes down (torch's gloo
    threads do that, now and then, when the process group was not destroyed): the exception is
    the failure (RANK_FAILED, exit 1 as for any raise), not a native crash."""
    done = subprocess.run([GPUWARDEN, "launch", "-n", "1", "--cpu", SCRIPT, "raise_abort"],
                          env=cpu_env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "error[RANK_FAILED]: rank 0 failed first: ValueError: rank 0 gives up" in done.stderr
    assert "raised, then died as the interpreter exited (signal SIGABRT(-6)" in done.stderr
    assert "RANK_NATIVE_CRASH" not in done.stderr and "abort()" not in done.stderr


@pytest.mark.usefixtures("no_leftover_processes")
def test_a_rank_that_finished_then_aborted_at_exit_is_named_so(
        tmp_path: Path, cpu_env: dict[str, str]) -> None:
    """The same crash one step later: the script returned (its work done), then the rank died
    of SIGABRT as the interpreter went down (seen in the README's demo under load: torch's
    gloo threads). A failure, with the signal's exit code as torchrun's, but said as what it
    is: after the script, at the interpreter's exit."""
    done = subprocess.run([GPUWARDEN, "launch", "-n", "1", "--cpu", SCRIPT, "finish_abort"],
                          env=cpu_env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 134, done.stderr
    assert "rank 0 done" in done.stdout
    assert ("error[RANK_NATIVE_CRASH]: rank 0 finished its script, then was killed by "
            "SIGABRT(-6) as its interpreter exited") in done.stderr, done.stderr
    assert "why: the script had returned" in done.stderr, done.stderr


# ---- nothing a torchrun rank would not print -------------------------------------------------

@pytest.mark.timeout(180)
@pytest.mark.usefixtures("no_leftover_processes")
def test_gpu_ranks_print_nothing_but_the_scripts_own_lines(tmp_path: Path,
                                                          cpu_env: dict[str, str]) -> None:
    """A simulated GPU host: the ranks get the flight recorder's variables (under the names the
    installed torch reads, so torch prints no deprecation warning); torch's excepthook prefixes
    rank 1's traceback with [rank1]:, which the relay does not repeat."""
    env = {**cpu_env, "GPUWARDEN_SIMULATE": str(SCENARIOS / "two_gpu.json")}
    for name in flight_recorder.RECORDER_VARIABLES:
        env.pop(name, None)
    done = subprocess.run([GPUWARDEN, "launch", "-n", "2", SCRIPT, "gloo_raise"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=170)
    assert done.returncode == 1, done.stderr
    ranks = [line for line in done.stderr.splitlines() if line.startswith("[rank")]
    own = {"[rank0]: rank 0 starts", "[rank1]: rank 1 starts", "[rank0]: rank 0 all_reduce 2",
           "[rank1]: rank 1 all_reduce 2"}
    assert own <= set(ranks), done.stderr
    # Now and then torch's gloo threads abort rank 1 as its interpreter exits (the script does
    # not destroy its process group): that line is torch's own, printed as under torchrun.
    at_exit = "[rank1]: terminate called without an active exception"
    traceback = [line for line in ranks if line not in own and line != at_exit]
    assert traceback[0] == "[rank1]: Traceback (most recent call last):", done.stderr
    assert traceback[-1] == "[rank1]: ValueError: rank 1 gives up", done.stderr
    assert all(line.startswith("[rank1]: ") and not line.startswith("[rank1]: [rank1]:")
               for line in traceback), done.stderr
    assert "deprecated" not in done.stderr and "Warning" not in done.stderr, done.stderr


def test_the_recorder_variables_are_those_the_installed_torch_reads(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations
    header = Path(spec.submodule_search_locations[0], "include", "torch", "csrc", "distributed",
                  "c10d", "FlightRecorder.hpp").read_text()
    # the installed torch's own declaration: {"<read first>", "<deprecated>"}
    first = re.search(r'getCvarInt\(\s*\{"(\w+)"', header)
    assert first is not None
    names = flight_recorder.installed_recorder_names()
    assert names.buffer_size == first.group(1)
    env = flight_recorder.recorder_env(str(tmp_path), {})
    assert set(env) == {names.buffer_size, names.dump_file, names.pipe_file,
                        "TORCH_NCCL_DUMP_ON_TIMEOUT"}
    if names.buffer_size == "TORCH_FR_BUFFER_SIZE":
        assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env
    # an older torch's header (NCCLTraceBuffer, TORCH_NCCL_* only) and none at all
    old = tmp_path / "old" / "include" / "torch" / "csrc" / "distributed" / "c10d"
    old.mkdir(parents=True)
    (old / "ProcessGroupNCCL.hpp").write_text('getCvarString({"TORCH_NCCL_DEBUG_INFO_PIPE_FILE"}')
    assert flight_recorder.recorder_names_in([str(tmp_path / "old")]) == \
        flight_recorder.names_for(False)
    assert flight_recorder.recorder_names_in([str(tmp_path / "none")]) is None


# ---- tracebacks as python prints them --------------------------------------------------------

@pytest.mark.parametrize("target", [["bad.py"], ["job.sh"], ["-m", "nosuchmodule"],
                                    ["-m", "failing"]])
def test_a_ranks_traceback_reads_as_python_prints_it(
        target: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lease_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.py").write_text("x = 1\ndef f(:\n    pass\n")
    (tmp_path / "job.sh").write_text("#!/bin/sh\necho hi\n")
    (tmp_path / "failing.py").write_text("def g():\n    raise KeyError('lr')\ng()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPUWARDEN_SIMULATE", str(SCENARIOS / "nogpu.json"))
    python = subprocess.run([sys.executable, "-u", *target], capture_output=True, text=True,
                            cwd=tmp_path, timeout=30)
    code = main(["launch", "-n", "1", *target])
    err = capsys.readouterr().err
    rank = [line.removeprefix("[rank0]: ") for line in err.splitlines()
            if line.startswith("[rank0]: ")]
    assert code == python.returncode == 1
    assert rank == python.stderr.splitlines(), err
    assert "launch/ranks/_bootstrap.py" not in err and "in run_module" not in err
    if target == ["job.sh"]:
        assert "run it with --no-python" in err


# ---- the relay on a terminal, and torch's files, in-process ----------------------------------

def _tty_console(sink: io.BytesIO) -> Console:
    console = Console(io.TextIOWrapper(sink, write_through=True))  # type: ignore[arg-type]
    console.isatty = True
    return console


def test_on_a_terminal_output_passes_at_once_with_one_prefix_per_line() -> None:
    sink = io.BytesIO()
    console = _tty_console(sink)
    r0 = StreamRelay(b"[rank0]: ", None, None, tty=console)
    r1 = StreamRelay(b"[rank1]: ", None, None, tty=console)
    r1.feed(b"(Pdb) ")
    assert sink.getvalue() == b"[rank1]: (Pdb) "  # a prompt, before any newline
    r0.feed(b"hello\nwor")
    r0.feed(b"ld\n")
    r1.feed(b"1\n(Pdb) ")
    r1.feed(b"[rank1]: Traceback (most recent call last):\n")  # torch's excepthook prefix
    r0.feed(b"\r 10%|#\r 20%|##")
    r0.finish()
    assert sink.getvalue() == (
        b"[rank1]: (Pdb) \n[rank0]: hello\n[rank0]: world\n[rank1]: 1\n[rank1]: (Pdb) "
        b"[rank1]: Traceback (most recent call last):\n"
        b"[rank0]: \r[rank0]:  10%|#\r[rank0]:  20%|##\n")


def test_a_line_torch_already_prefixed_gets_no_second_prefix() -> None:
    sink = io.BytesIO()
    tail: collections.deque[str] = collections.deque(maxlen=10)
    relay = StreamRelay(b"[rank1]: ", Console(io.TextIOWrapper(sink, write_through=True)),  # type: ignore[arg-type]
                        None, tail)
    relay.feed(b"[rank1]: Traceback\n[rank1]:[W1203 Utils.hpp:137] x\nplain\n")
    assert sink.getvalue() == b"[rank1]: Traceback\n[rank1]:[W1203 Utils.hpp:137] x\n[rank1]: plain\n"
    assert list(tail)[-1] == "plain"


def test_torchs_error_file_layouts_are_read_and_anything_else_is_not(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": {"message": "KeyError: 'lr'", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\nKeyError: 'lr'\n",
        "timestamp": "1700000000"}}}))
    err = read_torch_error(str(path))
    assert err is not None and err.exception_type == "KeyError" and err.timestamp == 1700000000
    assert err.traceback is not None and err.traceback.endswith("KeyError: 'lr'\n")
    assert err.time_text is not None and err.time_text.startswith("2023-11-")
    path.write_text(json.dumps({"message": "Signal 9 (SIGKILL) received", "timestamp": 5}))
    assert read_torch_error(str(path)).message == "Signal 9 (SIGKILL) received"  # type: ignore[union-attr]
    for bad in ("[1, 2]", '{"message": 3}', "not json", "{" * 100_000):
        path.write_text(bad)
        assert read_torch_error(str(path)) is None
    path.write_bytes(b" " * (2 << 20))  # bounded: a padded file is refused, not read whole
    assert read_torch_error(str(path)) is None
    (tmp_path / "link.json").symlink_to(path)
    assert read_torch_error(str(tmp_path / "link.json")) is None
    assert read_torch_error(str(tmp_path / "missing.json")) is None


def test_every_byte_reaches_an_unbuffered_console_through_a_full_pipe_and_signals() -> None:
    """Under PYTHONUNBUFFERED=1 (many container images set it) the launcher's stdout buffer is
    the raw file, whose write to a full pipe is cut short by a signal (SIGCHLD as a rank exits)
    and says how much it wrote. The console writes the rest: a slow reader, a timer signal
    every 2 ms, 2 MB of lines, all arrive (before: 209 KB; in loaded runs of the suite, 2 and
    15 of the full-log-dir test's 2,000 tee'd lines were missing)."""
    import signal
    import threading

    r, w = os.pipe()
    raw = io.FileIO(w, "w", closefd=True)  # sys.stdout.buffer under PYTHONUNBUFFERED=1
    console = Console(io.TextIOWrapper(raw, write_through=True))
    assert console.raw is raw
    got = bytearray()

    def slow_reader() -> None:
        while chunk := os.read(r, 4096):
            got.extend(chunk)
            time.sleep(0.001)

    reader = threading.Thread(target=slow_reader)
    reader.start()
    old = signal.signal(signal.SIGALRM, lambda *_: None)
    block = b"".join(b"line %d " % i + b"x" * 500 + b"\n" for i in range(200))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
        for _ in range(10):
            console.write_direct(block)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        raw.close()
        reader.join(60)
        os.close(r)
    assert bytes(got) == block * 10


def test_a_log_file_that_fills_the_disk_in_one_write_warns(tmp_path: Path) -> None:
    """One write larger than the space left writes part and returns the count, without an
    error: the part was dropped and nobody was told. The log file writes the rest again,
    which fails with ENOSPC and warns, once (a real 64 KiB tmpfs)."""
    from gpuwarden.launch.ranks.relay import LogFile

    disk = tmp_path / "disk"
    disk.mkdir()
    warnings: list[str] = []
    with small_tmpfs(disk, "64k"):
        log = LogFile(str(disk / "stdout.log"), warnings.append)
        log.write(b"x" * 200_000)
        said_at_once = list(warnings)  # by this write, not only by a later one
        log.write(b"more\n")  # not written again, not warned again
        log.close()
    assert len(said_at_once) == 1 and "No space left on device" in said_at_once[0], warnings
    assert warnings == said_at_once
