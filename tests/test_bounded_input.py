"""Bad input never hangs gpuwarden, fills its memory or ends in a traceback: each case below
gives one line `error[CODE]: ...` and exit 2, within 1 s of CPU and 100 MB, measured in a child
(and within 10 s of wall time: a hang never ends, and a loaded machine stretches wall time)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpuwarden.boundedio import InputRefused, open_stream, read_regular
from gpuwarden.distributed import detect_world
from gpuwarden.errors import UsageError
from gpuwarden.select import Constraints

# The child runs the CLI's main() and reports the CPU time and the wall time main() took and
# its peak memory (interpreter start-up excluded: it is not gpuwarden's to bound). The work
# bound is CPU time: on a 2-core machine shared with other test suites, wall time went past 1 s
# for the same few milliseconds of work.
# Peak memory is VmHWM of the child's own address space: getrusage's ru_maxrss would also
# count the pytest process it was forked from (Linux keeps the high-water mark across exec).
_CHILD = """
import sys, time
from gpuwarden.cli import main
start, cpu = time.monotonic(), time.process_time()
code = main(sys.argv[1:])
took, cpu = time.monotonic() - start, time.process_time() - cpu
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
sys.stderr.write(f"\\n@@ {cpu:.3f} {took:.3f} {int(hwm) / 1024:.1f}\\n")
sys.exit(code)
"""


WALL_BOUND_S = 10.0


def run_cli(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, float, float]:
    """(exit code, stderr, CPU seconds of main(), peak MB); main() must end within WALL_BOUND_S."""
    child_env = {k: v for k, v in os.environ.items() if k != "GPUWARDEN_SIMULATE"}
    child_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True,
                          env=child_env, timeout=60, stdin=subprocess.DEVNULL)
    err, _, stats = proc.stderr.rpartition("\n@@ ")
    cpu, took, rss_mb = (float(x) for x in stats.split())
    assert took < WALL_BOUND_S, (args, took)
    return proc.returncode, err.strip(), cpu, rss_mb


def scenario_file(tmp_path: Path, content: bytes) -> str:
    path = tmp_path / "scenario.json"
    path.write_bytes(content)
    return str(path)


def fifo(tmp_path: Path) -> str:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return str(path)


GOOD_GPU = {"index": 0, "uuid": "GPU-0", "memory_total_mib": 1000, "memory_used_mib": 0}

CASES = {
    "scenario /dev/zero": (lambda tmp: "/dev/zero", "SCENARIO_INVALID",
                           "is a character device, not a regular file"),
    "scenario FIFO without writer": (fifo, "SCENARIO_INVALID", "is a FIFO (named pipe), not a regular"),
    "scenario directory": (lambda tmp: str(tmp), "SCENARIO_INVALID", "is a directory"),
    "scenario 5 MiB": (lambda tmp: scenario_file(tmp, b" " * (5 << 20)), "SCENARIO_INVALID",
                       "is larger than 4 MiB"),
    "scenario 10^400": (lambda tmp: scenario_file(tmp, json.dumps(
        {"gpus": [{**GOOD_GPU, "memory_total_mib": "@"}]}).replace('"@"', "1" + "0" * 400).encode()),
        "SCENARIO_INVALID", "an integer of 401 digits"),
    "scenario 1e400": (lambda tmp: scenario_file(tmp, b'{"gpus": [], "x": 1e400}'),
                       "SCENARIO_INVALID", "out of range"),
    "scenario NaN": (lambda tmp: scenario_file(tmp, b'{"gpus": [], "x": NaN}'),
                     "SCENARIO_INVALID", "NaN is not a JSON number"),
    "scenario nested 1M deep": (lambda tmp: scenario_file(tmp, b"[" * 1_000_000),
                                "SCENARIO_INVALID", "nested too deeply"),
    "scenario invalid UTF-8": (lambda tmp: scenario_file(tmp, b'{"hostname": "\xff\xfe", "gpus": []}'),
                               "SCENARIO_INVALID", "is not UTF-8 text (byte 0xff at offset 14, line 1)"),
    "scenario huge string field": (lambda tmp: scenario_file(tmp, json.dumps(
        {"gpus": [{**GOOD_GPU, "compute_mode": "x" * 3_000_000}]}).encode()),
        "SCENARIO_INVALID", "'xxxxxxxxxx"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_scenario_is_one_line_exit_2(case: str, tmp_path: Path) -> None:
    make, code, message = CASES[case]
    code_, err, took, rss_mb = run_cli(["ls"], {"GPUWARDEN_SIMULATE": make(tmp_path)})
    assert code_ == 2, err
    assert err.startswith(f"error[{code}]: ") and message in err and err.count("\n") == 0, err
    assert len(err) < 400  # the offending value is cut, not echoed in full
    assert took < 1.0 and rss_mb < 100, (took, rss_mb)


@pytest.mark.parametrize(("args", "code", "message"), [
    (["explain", "--knowledge", "/dev/zero", "/dev/null"], "KB_INVALID",
     "/dev/zero: it is a character device, not a regular file"),
    (["select", "--include", "0,,x"], "USAGE", "--include '0,,x': an empty GPU id"),
    (["select", "--include", "0,x"], "USAGE", "--include '0,x': 'x' is not a GPU id"),
    (["select", "--exclude", "GPU-"], "USAGE", "--exclude 'GPU-': 'GPU-' is not a GPU id"),
])
def test_bad_cli_input_is_one_line_exit_2(args: list[str], code: str, message: str,
                                          tmp_path: Path) -> None:
    scenario = Path(__file__).parent / "scenarios" / "example.json"
    code_, err, took, rss_mb = run_cli(args, {"GPUWARDEN_SIMULATE": str(scenario)})
    assert code_ == 2 and err.startswith(f"error[{code}]: ") and message in err, err
    assert err.count("\n") == 0 and took < 1.0 and rss_mb < 100, (err, took, rss_mb)


def test_explain_of_a_fifo_nobody_writes_gives_up_in_time(tmp_path: Path) -> None:
    code, err, took, rss_mb = run_cli(["explain", fifo(tmp_path)])
    assert code == 2 and err.startswith("error[INPUT_UNREADABLE]: ")
    assert "no process opened for writing within 0.5 s" in err and err.count("\n") == 0
    assert took < 1.0 and rss_mb < 100, (took, rss_mb)


def test_explain_of_a_device_is_refused(tmp_path: Path) -> None:
    code, err, took, _ = run_cli(["explain", "/dev/zero"])
    assert code == 2 and "is a character device, not a log file" in err and took < 1.0


def test_explain_reads_a_fifo_whose_writer_comes(tmp_path: Path) -> None:
    # A writer that opens the FIFO after gpuwarden but within the wait, and writes late.
    path = fifo(tmp_path)
    writer = subprocess.Popen(["sh", "-c", f"sleep 0.2; exec 3>'{path}'; sleep 0.6; "
                               f"echo 'RuntimeError: CUDA error: out of memory' >&3"])
    try:
        code, err, _, _ = run_cli(["explain", path])
    finally:
        writer.wait(10)
    assert code == 0, err


def test_bounded_reads_directly(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    assert read_regular(big, max_bytes=101) == b"x" * 101
    with pytest.raises(InputRefused, match="larger than 100 B"):
        read_regular(big, max_bytes=100)
    link = tmp_path / "link"
    link.symlink_to(big)
    with pytest.raises(OSError):
        read_regular(link, nofollow=True)
    sock_path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(OSError):
        s.bind(str(sock_path))
        open_stream(sock_path)  # Linux refuses to open a socket: ENXIO, mapped by callers
    with open_stream(big) as stream:
        assert stream.read() == b"x" * 101


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
     "MASTER_PORT=70000 is not a TCP port"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "0"},
     "MASTER_PORT=0 is not a TCP port"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "RANK=2 is outside 0..1"),
    ({"RANK": "0", "WORLD_SIZE": "0", "MASTER_ADDR": "h"}, "WORLD_SIZE=0: a job has at least"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "-1", "MASTER_ADDR": "h"},
     "LOCAL_RANK=-1 is negative"),
    ({"MASTER_PORT": "9" * 5000}, "is not a number"),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"},
     "SLURM_PROCID=5 is outside 0..1"),
])
def test_distributed_env_out_of_range_is_a_usage_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError, match=message) as err:
        detect_world(env)
    assert err.value.exit_code == 2 and "\n" not in err.value.render()


def test_constraints_refuse_malformed_ids_from_the_library() -> None:
    with pytest.raises(UsageError, match="is not a GPU id"):
        Constraints(include=("x",))
    with pytest.raises(UsageError, match="an empty GPU id"):
        Constraints(exclude=("",))
    assert Constraints(include=("0", "GPU-1f0e8c52", "MIG-1f0e8c52-aaaa")).include


@pytest.mark.slow
def test_planted_fifos_and_devices_in_the_lease_dir_block_nothing(tmp_path: Path) -> None:
    # Any local user can create files in the shared lease directory: a FIFO under a record's,
    # the mutex's or a temporary file's name, a record that links to /dev/zero, a deep JSON.
    lease_dir = tmp_path / "leases"
    lease_dir.mkdir(mode=0o1777)
    lease_dir.chmod(0o1777)
    for name in ("holder.fifo.json", "ticket.fifo.json", ".x.tmp"):
        os.mkfifo(lease_dir / name)
    (lease_dir / "holder.zero.json").symlink_to("/dev/zero")
    (lease_dir / "holder.deep.json").write_bytes(b"[" * 2_000_000)
    scenario = str(Path(__file__).parent / "scenarios" / "example.json")
    env = {"GPUWARDEN_LEASE_DIR": str(lease_dir), "GPUWARDEN_SIMULATE": scenario}
    for args in (["leases"], ["run", "--gpus", "1", "--", "true"]):
        code, err, took, rss_mb = run_cli(args, env)
        assert code == 0, err
        assert took < 1.0 and rss_mb < 100, (args, took, rss_mb)
    # A FIFO in place of the directory's mutex cannot be worked around: a one-line refusal, fast.
    (lease_dir / "mutex.lock").unlink()
    os.mkfifo(lease_dir / "mutex.lock")
    code, err, took, rss_mb = run_cli(["run", "--gpus", "1", "--", "true"], env)
    assert code == 2 and "error[LEASE_DIR]" in err and "is a FIFO" in err, err
    assert took < 1.0 and rss_mb < 100, (took, rss_mb)


def _write_later(path: str, delay_s: float, data: bytes, *, open_first: bool = False
                 ) -> threading.Thread:
    """A writer thread: opens the FIFO (blocking until a reader comes), waits, writes."""

    def write() -> None:
        if open_first:
            with open(path, "wb") as w:
                time.sleep(delay_s)
                w.write(data)
        else:
            time.sleep(delay_s)
            with open(path, "wb") as w:
                w.write(data)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def test_fifo_writers_in_process(tmp_path: Path) -> None:
    path = fifo(tmp_path)
    # A writer already waiting in its open, which writes only later: it is accepted at once.
    writer = _write_later(path, 0.3, b"late\n", open_first=True)
    time.sleep(0.05)
    with open_stream(path) as stream:
        assert stream.read() == b"late\n"
    writer.join(5)
    # A writer that wrote everything and closed before the reader looked: data is read.
    writer = _write_later(path, 0.0, b"all at once\n")
    time.sleep(0.05)
    with open_stream(path, fifo_open_timeout_s=2) as stream:
        assert stream.read() == b"all at once\n"
    writer.join(5)
    # A writer arriving within the wait.
    writer = _write_later(path, 0.1, b"soon\n")
    with open_stream(path, fifo_open_timeout_s=2) as stream:
        assert stream.read() == b"soon\n"
    writer.join(5)
    # Nobody: refused after the wait, and no thread or descriptor is left behind.
    before = len(os.listdir("/proc/self/fd"))
    threads = threading.active_count()
    start = time.monotonic()
    with pytest.raises(InputRefused, match="no process opened for writing within 0.1 s"):
        open_stream(path, fifo_open_timeout_s=0.1)
    assert time.monotonic() - start < 1.5
    assert len(os.listdir("/proc/self/fd")) == before and threading.active_count() == threads


def test_unreadable_and_undecodable_scenarios_in_process(tmp_path: Path) -> None:
    from gpuwarden.errors import ScenarioError
    from gpuwarden.inventory.simulated import SimulatedBackend

    (tmp_path / "file").write_text("")
    with pytest.raises(ScenarioError, match="cannot be read"):  # ENOTDIR
        SimulatedBackend(tmp_path / "file" / "x").read_host()
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"gpus": []}\n\n\xc3(')
    with pytest.raises(ScenarioError, match="byte 0xc3 at offset 14, line 3"):
        SimulatedBackend(bad).read_host()
