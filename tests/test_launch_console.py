"""The ranks' output on a terminal, readable (issue 37): real ``gpuwarden launch`` processes on
a real pseudo-terminal (``os.openpty``), what they wrote interpreted as a terminal shows it
(pyte, a VT100 screen emulator in the test dependencies). The screen is taller than anything
printed, so its lines are the whole scrollback.

Identical lines are said once when the ranks print them within the collapse window of each
other. The ranks print after a barrier of files, within milliseconds; on a loaded machine the
relay may still read one of them later than the default 50 ms, so the tests that count
collapsed lines pass ``--collapse-window 2s`` (the most allowed): what they check is the
collapsing, not how the box is scheduled; the hold itself is measured by bench_relay.py.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuwarden.launch.ranks.relay import rank_outputs
from tests.conftest import SCENARIOS

pyte = pytest.importorskip("pyte")
pytest.importorskip("tqdm")

SCRIPT = str(Path(__file__).parent / "launch_scripts" / "console.py")
GPUWARDEN = str(Path(sys.executable).parent / "gpuwarden")
COLUMNS, ROWS = 120, 400


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("PET_", "TORCHELASTIC_", "SLURM_", "GPUWARDEN_"))
         and k not in ("CUDA_VISIBLE_DEVICES", "NO_COLOR")}
    e["GPUWARDEN_SIMULATE"] = str(SCENARIOS / "nogpu.json")
    e["GPUWARDEN_LEASE_DIR"] = str(tmp_path)
    e["TMPDIR"] = str(tmp_path)
    e["TERM"] = "xterm-256color"
    return e


def on_terminal(args: list[str], env: dict[str, str], cwd: Path, timeout_s: float = 150, *,
                controlling: bool = False,
                watch: Callable[[int, bytes], None] | None = None) -> tuple[int, bytes]:
    """``gpuwarden launch --cpu ARGS`` on a pseudo-terminal of its own (stdin, stdout, stderr),
    as a shell starts it; its exit code and every byte it wrote there, read to the end.
    ``controlling``: the terminal is its controlling one, as a shell's job's (the kernel's
    SIGWINCH reaches it). ``watch(master, written so far)`` is called before each read."""

    def take_the_terminal() -> None:  # after setsid (start_new_session)
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
    proc = subprocess.Popen([GPUWARDEN, "launch", "--cpu", *args], stdin=slave, stdout=slave,
                            stderr=slave, env=env, cwd=cwd, start_new_session=True,
                            preexec_fn=take_the_terminal if controlling else None)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            assert time.monotonic() < deadline, out.decode(errors="replace")
            if watch is not None:
                watch(master, bytes(out))
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every holder of the terminal's other end has exited
                break
            if not data:
                break
            out += data
        return proc.wait(30), bytes(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def screen(data: bytes) -> list[str]:
    """The lines a terminal shows after ``data`` (trailing blanks cut, empty rows left out)."""
    s = pyte.Screen(COLUMNS, ROWS)
    pyte.ByteStream(s).feed(data)
    lines = [line.rstrip() for line in s.display]
    assert not lines[-1], "the screen is full: lines may have scrolled off"
    return [line for line in lines if line]


def ranks_of(line: str) -> list[int]:
    """The ranks a line's tag names: ``[rank0-2,5]: ...`` -> 0, 1, 2, 5."""
    m = re.match(r"\[rank([0-9,-]+)\]: ", line)
    assert m is not None, line
    ranks = []
    for part in m.group(1).split(","):
        low, _, high = part.partition("-")
        ranks += range(int(low), int(high or low) + 1)
    return ranks


def bar_lines(lines: list[str], rank: int) -> list[str]:
    """The lines showing rank ``rank``'s tqdm bar (``rank 3: 40%|####  | 12/30 ...``)."""
    return [line for line in lines if re.search(rf"rank {rank}: +\d+%\|", line)]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.parametrize("nproc", [2, 8])
def test_each_rank_s_redrawn_bar_leaves_one_line(nproc: int, env: dict[str, str],
                                                 tmp_path: Path) -> None:
    """tqdm in every rank, 30 redraws each: one line per rank in the scrollback (its last
    state, 30/30, with its prefix), not one per redraw; the line after it scrolls normally."""
    code, out = on_terminal(["-n", str(nproc), SCRIPT, "tqdm", "30"], env, tmp_path)
    lines = screen(out)
    assert code == 0, "\n".join(lines)
    for rank in range(nproc):
        bars = bar_lines(lines, rank)
        assert len(bars) == 1, "\n".join(lines)
        assert bars[0].startswith(f"[rank{rank}]: rank {rank}: 100%|") and "30/30" in bars[0]
    said = [ranks_of(line) for line in lines if line.endswith("]: epoch 1 done")]
    assert sorted(r for ranks in said for r in ranks) == list(range(nproc)), "\n".join(lines)
    # the bars were shown while they ran (a live region drawn, then erased), not only at the end
    assert b"\x1b[J" in out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("no_leftover_processes")
def test_a_resize_reaches_the_ranks_and_the_bars_end_drawn_at_the_new_width(
        env: dict[str, str], tmp_path: Path) -> None:
    """The terminal is made narrower (120 -> 70 columns) while 2 ranks' bars stand half way, as
    a user drags a window: the kernel's SIGWINCH reaches the launcher (the terminal is its
    controlling one, as a shell's job), each rank's terminal takes the new width less the
    prefix (the rank waits for that before going on), and the bars end one line each, drawn
    at the new width, with no piece of a wider state left above them."""
    narrow, steps = 70, 40
    s = pyte.Screen(COLUMNS, ROWS)
    stream = pyte.ByteStream(s)
    fed = 0
    half = f"{steps // 2}/{steps}"
    resized = False

    def watch(master: int, out: bytes) -> None:
        nonlocal fed, resized
        stream.feed(out[fed:])
        fed = len(out)
        if not resized and all(any(f"rank {r}:" in line and half in line for line in s.display)
                               for r in range(2)):
            # Both bars are drawn half way and their ranks wait: nothing is written now
            # until the width changes, so the screen and the terminal change it together.
            fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, narrow, 0, 0))
            s.resize(ROWS, narrow)
            resized = True

    code, out = on_terminal(["-n", "2", SCRIPT, "resize", str(tmp_path), str(steps)], env,
                            tmp_path, controlling=True, watch=watch)
    stream.feed(out[fed:])
    lines = [line.rstrip() for line in s.display if line.strip()]
    assert resized and code == 0, "\n".join(lines)
    for rank in range(2):
        bars = bar_lines(lines, rank)
        assert len(bars) == 1, "\n".join(lines)
        assert bars[0].startswith(f"[rank{rank}]: rank {rank}: 100%|"), "\n".join(lines)
        assert f"{steps}/{steps}" in bars[0], "\n".join(lines)
    # each rank's width is the terminal's less the room its prefix takes, before and after
    said = [(ranks_of(line), COLUMNS - int(m[1]), narrow - int(m[2])) for line in lines
            if (m := re.search(r"\]: columns (\d+) -> (\d+)$", line))]
    assert sorted(r for ranks, _, _ in said for r in ranks) == [0, 1], "\n".join(lines)
    assert all(0 < room == after < 20 for _, room, after in said), said


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.parametrize(("mode", "final"), [
    ("rich", r"rank {r} ━+ 100% 0:00:00"),
    ("keras", r"30/30 \[=+\] - loss: 0\.5")])
def test_rich_and_keras_bars_stay_one_line_with_their_prefix(
        mode: str, final: str, env: dict[str, str], tmp_path: Path) -> None:
    """rich (escape sequences: hides the cursor, erases its line) and a Keras-style bar
    (backspaces and ``\\r``): one line per rank, its last state, with its ranks' prefix."""
    code, out = on_terminal(["-n", "2", SCRIPT, mode, "30"], env, tmp_path)
    lines = screen(out)
    assert code == 0, "\n".join(lines)
    for r in range(2):
        # the final states of Keras's bars are the same line: said once, [rank0-1]
        mine = [line for line in lines if line.startswith("[rank") and r in ranks_of(line)]
        assert len(mine) == 1, "\n".join(lines)
        assert re.fullmatch(r"\[rank[0-9,-]+\]: " + final.format(r=r), mine[0]), mine[0]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("no_leftover_processes")
def test_a_line_all_8_ranks_print_is_shown_once(env: dict[str, str], tmp_path: Path) -> None:
    code, out = on_terminal(["-n", "8", "--collapse-window", "2s", SCRIPT, "same",
                             str(tmp_path)], env, tmp_path)
    lines = screen(out)
    assert code == 0, "\n".join(lines)
    assert [line for line in lines if "epoch 1 done" in line] == ["[rank0-7]: epoch 1 done"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("no_leftover_processes")
def test_a_traceback_among_identical_lines_is_whole_and_its_rank_s_own(
        env: dict[str, str], tmp_path: Path) -> None:
    """Rank 3 fails while the 7 others print the same lines: theirs are said once; rank 3's
    traceback comes whole, every line with its own prefix, none merged or interleaved."""
    code, out = on_terminal(["-n", "8", "--collapse-window", "2s", SCRIPT, "traceback",
                             str(tmp_path), "3"], env, tmp_path)
    lines = screen(out)
    assert code == 1, "\n".join(lines)
    assert lines.count("[rank0-2,4-7]: step 1") == 1, "\n".join(lines)
    start = lines.index("[rank3]: Traceback (most recent call last):")
    block = lines[start:start + 6]
    assert all(line.startswith("[rank3]: ") for line in block), "\n".join(lines)
    assert block[-1] == "[rank3]: ValueError: rank 3 gives up", "\n".join(lines)
    assert sum("Traceback (most recent call last):" in line and line.startswith("[rank")
               for line in lines) == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.parametrize("how", ["--plain-console", "GPUWARDEN_PLAIN_CONSOLE=1", "NO_COLOR=1",
                                 "TERM=dumb"])
def test_the_view_is_turned_off_by_a_flag_a_variable_no_color_and_a_dumb_terminal(
        how: str, env: dict[str, str], tmp_path: Path) -> None:
    """The plain relay, as before: every rank's line as it comes, nothing drawn (no cursor
    moved up, nothing erased), identical lines not collapsed."""
    args = ["-n", "8"]
    if how.startswith("--"):
        args.append(how)
    else:
        name, value = how.split("=")
        env[name] = value
    code, out = on_terminal([*args, SCRIPT, "same", str(tmp_path)], env, tmp_path)
    assert code == 0, out.decode(errors="replace")
    assert b"\x1b[J" not in out and not re.search(rb"\x1b\[\d*A", out)
    lines = screen(out)
    assert sorted(line for line in lines if "epoch 1 done" in line) == [
        f"[rank{r}]: epoch 1 done" for r in range(8)]


def _piped(args: list[str], env: dict[str, str], cwd: Path) -> tuple[bytes, bytes]:
    proc = subprocess.run([GPUWARDEN, "launch", "--cpu", *args], stdin=subprocess.DEVNULL,
                          capture_output=True, env=env, cwd=cwd, timeout=150)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return proc.stdout, proc.stderr


def _by_rank(data: bytes, ranks: int) -> dict[int, bytes]:
    """Each rank's lines as the relay wrote them (ranks interleave line by line)."""
    got = {r: b"" for r in range(ranks)}
    for line in data.splitlines(keepends=True):
        m = re.match(rb"\[rank(\d+)\]: ", line)
        if m is not None:
            got[int(m.group(1))] += line
    return got


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("no_leftover_processes")
def test_piped_output_is_byte_for_byte_what_the_relay_wrote_before(
        env: dict[str, str], tmp_path: Path) -> None:
    """Redirected, nothing changes: each line of each rank with its ``[rankN]: `` prefix
    (none doubled where torch already wrote one), each of a bar's ``\\r`` states prefixed, an
    unfinished last line ended, identical lines of several ranks written by each. The expected
    bytes are those the relay wrote before issue 37 (checked against main's sources)."""
    env["NO_COLOR"] = ""
    out, err = _piped(["-n", "3", SCRIPT, "mixed"], env, tmp_path)
    expected = {r: (f"[rank{r}]: hello from {r}\n[rank{r}]: same line\n"
                    f"[rank{r}]: \r[rank{r}]:  10%|#\r[rank{r}]:  50%|#####\r"
                    f"[rank{r}]: 100%|##########|\n"
                    f"[rank{r}]: tagged by torch\n"
                    f"[rank{r}]: no newline at the end\n").encode() for r in range(3)}
    assert _by_rank(out, 3) == expected
    assert len(out) == sum(len(v) for v in expected.values())  # nothing else, nothing drawn
    assert sorted(line for line in err.splitlines() if line.startswith(b"[rank")) == [
        b"[rank%d]: warning %d" % (r, r) for r in range(3)]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("no_leftover_processes")
def test_ranks_filter_shows_the_global_ranks_named(env: dict[str, str], tmp_path: Path) -> None:
    out, _ = _piped(["-n", "4", "--ranks-filter", "1,3", "--log-dir", str(tmp_path / "logs"),
                     "--redirects", "0", SCRIPT, "mixed"], env, tmp_path)
    assert sorted(set(re.findall(rb"\[rank(\d+)\]: ", out))) == [b"1", b"3"]


def test_a_collapse_window_past_the_bound_is_refused(tmp_path: Path) -> None:
    from gpuwarden.cli import main

    assert main(["launch", "--cpu", "-n", "2", "--collapse-window", "5s", SCRIPT, "same",
                 str(tmp_path)]) == 2


def test_the_node_is_named_on_a_terminal_with_several_nodes_and_nowhere_else() -> None:
    """``[node1 rank5]:`` on the terminal (node 1, as `gpuwarden status` and `stacks` number
    nodes); piped output and log files keep torchrun's ``[rank5]:``."""
    one = rank_outputs(rank=5, local_rank=1, redirects="0", tee="0", local_ranks_filter=None,
                       quiet=False, attempt_dir=None)
    several = rank_outputs(rank=5, local_rank=1, redirects="0", tee="0",
                           local_ranks_filter=None, quiet=False, attempt_dir=None, node=1)
    assert one.terminal_prefix == one.prefix == b"[rank5]: "
    assert several.prefix == b"[rank5]: " and several.terminal_prefix == b"[node1 rank5]: "
    hidden = rank_outputs(rank=5, local_rank=1, redirects="0", tee="0", local_ranks_filter=None,
                          quiet=False, attempt_dir=None, ranks_filter=frozenset({0, 8}))
    assert not hidden.console_out and not hidden.console_err



@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("no_leftover_processes")
def test_log_files_keep_every_rank_s_own_lines_while_the_terminal_collapses(
        env: dict[str, str], tmp_path: Path) -> None:
    """``-r 2`` sends stderr to the files only, stdout stays on the terminal (collapsed there):
    each rank's stderr.log has its own lines, unprefixed, whatever the console showed."""
    logs = tmp_path / "logs"
    code, out = on_terminal(["-n", "4", "--collapse-window", "2s", "--log-dir", str(logs),
                             "-r", "2", SCRIPT, "tqdm", "5", str(tmp_path)], env, tmp_path)
    lines = screen(out)
    assert code == 0, "\n".join(lines)
    assert [line for line in lines if "epoch 1 done" in line] == ["[rank0-3]: epoch 1 done"]
    for r in range(4):
        (err,) = logs.glob(f"*/attempt_0/{r}/stderr.log")
        assert f"rank {r}: 100%|".encode() in err.read_bytes()
