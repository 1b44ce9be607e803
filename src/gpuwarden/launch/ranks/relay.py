"""The output relay: each rank's stdout and stderr to the console with a ``[rankN]:`` prefix,
to torchrun's log files (``--tee``/``--redirects`` under ``--log-dir``), and into the report's
stderr tail.

Cost: every byte a rank writes is looked at a constant number of times, in C (``rfind``,
``replace``, ``rsplit`` on whole chunks), never once per line in Python, and each chunk read
from a pipe is written to the console in one call. A rank's unfinished line is held only up to
:data:`MAX_LINE_BYTES`; a longer line is passed on in pieces of that size, each on its own
prefixed console line (the log file gets the bytes unchanged). So the relay is linear in the
bytes relayed and its memory per rank is bounded, whatever a rank writes.

A rank's stream shown on a console that is a terminal is a pseudo-terminal of its own (and its
stdin is the launcher's, inherited as torchrun's ranks inherit it): ``isatty()`` is true in the
rank as under torchrun, progress bars and colours work, and what the rank writes is passed on at
once, an unfinished line (a ``(Pdb) `` prompt) included, with the prefix at each line's start
(:meth:`StreamRelay._tty_write`). Every other stream is a pipe, as a torchrun rank's is a file
when tee'd or redirected.

A console whose reader went away (``gpuwarden launch ... | head -1``) is silenced, not fatal:
the ranks' pipes are still drained (a rank never blocks on a full pipe), the log files and the
report's tail still get everything, and no ``BrokenPipeError`` traceback is printed. Likewise a
log file that cannot be written (a full disk, a quota, an I/O error) is a one-line warning on
gpuwarden's stderr and is no longer written; the job goes on, its console output too.

Log files, as torchrun's ``DefaultLogsSpecs`` lays them out (``LOG_DIR`` is ``--log-dir``)::

    LOG_DIR/<run id>_<random>/attempt_0/<local rank>/stdout.log   (-r/-t with 1 or 3)
    LOG_DIR/<run id>_<random>/attempt_0/<local rank>/stderr.log   (-r/-t with 2 or 3)
    LOG_DIR/<run id>_<random>/attempt_0/<local rank>/error.json   (TORCHELASTIC_ERROR_FILE)
    LOG_DIR/<run id>_<random>/attempt_0/filtered_stdout.log       (--duplicate-stdout-filters)
    LOG_DIR/<run id>_<random>/attempt_0/filtered_stderr.log       (--duplicate-stderr-filters)

A tee'd stream (``-t``) is tagged as torchrun's TailLog tags it (``[default0]:``) on the console
and in the filtered files, which, as torchrun's, only tee'd streams feed.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import select
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Protocol, TextIO

from gpuwarden.launch.config import STD_ERR, STD_OUT, parse_std_spec, std_for
from gpuwarden.launch.ranks.stdio import RankStdio

if TYPE_CHECKING:
    from gpuwarden.launch.ranks.terminal import TerminalView, _Stream

MAX_LINE_BYTES = 64 * 1024  # a longer line is relayed in pieces of this size
STDERR_TAIL_LINES = 40  # the last stderr lines of a rank kept for the report
TAIL_LINE_CHARS = 2000  # a tail line is cut here: the report quotes it, it does not archive it

@dataclass(frozen=True)
class RankOutputs:
    """Where one rank's two streams go (pure data: tests check it without starting a rank)."""

    prefix: bytes  # b"[rank3]: " on the console, b"" for none
    console_out: bool
    console_err: bool
    stdout_file: str | None
    stderr_file: str | None
    # A tee'd stream (-t) is tagged as torchrun tags it, b"[default0]:", on the console and in
    # the filtered-lines files, which only tee'd streams feed (torchrun tails the tee'd files)
    tee_prefix: bytes = b""
    tee_out: bool = False
    tee_err: bool = False
    # On a terminal with several nodes the node is named too, b"[node1 rank5]: ", as `gpuwarden
    # status` and `stacks` name it; piped output keeps b"[rank5]: " (byte for byte as before).
    terminal_prefix: bytes = b""

    def prefix_of(self, is_err: bool) -> bytes:
        return self.tee_prefix if (self.tee_err if is_err else self.tee_out) else self.prefix

    @property
    def torch_tag(self) -> bytes:
        """What torch itself starts a rank's lines with (its excepthook, its logs)."""
        return self.prefix.rstrip(b" ")


def rank_outputs(*, rank: int, local_rank: int, redirects: str, tee: str,
                 local_ranks_filter: frozenset[int] | None, quiet: bool,
                 attempt_dir: str | None, role: str = "default",
                 prefix_template: str | None = None,
                 ranks_filter: frozenset[int] | None = None,
                 node: int | None = None) -> RankOutputs:
    """torchrun's rules: a redirected stream goes to its file only, a tee'd one to its file and
    the console, tagged ``[<role><local rank>]:`` (or TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE with
    ``${role_name}``, ``${rank}``, ``${local_rank}``); ``--local-ranks-filter`` hides other local
    ranks from the console (their files are still written, none tee'd); gpuwarden's
    ``--ranks-filter`` does the same by global rank, and ``--quiet`` shows global rank 0 only.
    ``node``: this node's rank when there are several, named in the terminal's prefix."""
    red = std_for(parse_std_spec(redirects, what="--redirects"), local_rank)
    tees = std_for(parse_std_spec(tee, what="--tee"), local_rank)
    listed = (local_ranks_filter is None or local_rank in local_ranks_filter) and (
        ranks_filter is None or rank in ranks_filter)
    shown = listed and (not quiet or rank == 0)

    def route(bit: int, name: str) -> tuple[bool, str | None]:
        to_file = bool((red | tees) & bit) and attempt_dir is not None
        console = shown and (not red & bit or bool(tees & bit))
        return console, os.path.join(attempt_dir, str(local_rank), name) if to_file and attempt_dir else None

    console_out, out_file = route(STD_OUT, "stdout.log")
    console_err, err_file = route(STD_ERR, "stderr.log")
    tag = f"[{role}{local_rank}]:"
    if prefix_template:
        from string import Template

        tag = Template(prefix_template).safe_substitute(role_name=role, rank=rank,
                                                        local_rank=local_rank)
    teed = attempt_dir is not None and listed
    prefix = f"[rank{rank}]: ".encode()
    return RankOutputs(prefix, console_out, console_err, out_file, err_file,
                       tag.encode(), teed and bool(tees & STD_OUT),
                       teed and bool(tees & STD_ERR),
                       prefix if node is None else f"[node{node} rank{rank}]: ".encode())


class Console:
    """One of gpuwarden's own streams (stdout or stderr), written in bytes when it has a
    binary buffer (no decoding: a rank's bytes pass unchanged), text otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.raw: IO[bytes] | None = getattr(stream, "buffer", None)
        self.closed = False
        self.isatty = _isatty(stream)
        # On a terminal: which rank's stream has written a line without its newline yet (a
        # prompt); shared by the two consoles when both are the terminal (JobRelay).
        self.line = _OpenLine()
        # On a terminal shared by several ranks' bars (terminal.py): what is written here by
        # anything but the view goes above its live region (TerminalView.external).
        self.view: TerminalView | None = None
        with contextlib.suppress(OSError, ValueError):
            stream.flush()  # what gpuwarden printed itself comes first

    def winsize(self) -> bytes | None:
        """The terminal's size (``struct winsize``), None when it is not a terminal."""
        if not self.isatty:
            return None
        import fcntl
        import termios

        try:
            return fcntl.ioctl(self.stream.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
        except (OSError, ValueError):
            return None

    def write(self, data: bytes) -> None:
        if self.view is not None and data:
            self.view.external(data)
        else:
            self.write_direct(data)

    def write_direct(self, data: bytes) -> None:
        if self.closed or not data:
            return
        try:
            if self.raw is not None:
                _write_all(self.raw, data)
                self.raw.flush()
            else:
                self.stream.write(data.decode("utf-8", errors="replace"))
                self.stream.flush()
        except BrokenPipeError:
            self._reader_gone()
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                raise
            self._reader_gone()

    def _reader_gone(self) -> None:
        # `| head -1`: the reader is gone. Point the descriptor at /dev/null so that nothing
        # written later (the --json report, Python's final flush at exit) raises or prints
        # "Exception ignored ... BrokenPipeError"; the ranks go on, their pipes drained.
        self.closed = True
        with contextlib.suppress(OSError, ValueError, AttributeError):
            fd = self.stream.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)


def _write_all(out: IO[bytes], data: bytes) -> None:
    """Write all of ``data``. Under PYTHONUNBUFFERED=1 (set in many container images) a
    stream's ``buffer`` is the raw file: one write to a full pipe that a signal interrupts
    (SIGCHLD as a rank exits) writes part and says how much, and the rest was lost (a test
    under load saw 15 of 2,000 tee'd lines missing; 2 MB through a slow pipe with a timer
    signal arrived as 209 KB). A non-blocking descriptor that is full (None) is waited on."""
    view = memoryview(data)
    while view:
        written = out.write(view)
        if written is None:  # a non-blocking descriptor, full: wait until it takes more
            select.select([], [out.fileno()], [])
            continue
        view = view[written:]


class _OpenLine:
    """The stream whose line is open on a terminal (None: the cursor is at a line start)."""

    owner: object | None = None


def _isatty(stream: TextIO) -> bool:
    try:
        return os.isatty(stream.fileno())
    except (AttributeError, OSError, ValueError):  # StringIO, pytest's capture: not a terminal
        return False


class _Writable(Protocol):
    def write(self, data: bytes, /) -> object: ...


class LogFile:
    """A log file of ``--log-dir``: a write error (ENOSPC, EDQUOT, EIO) is a warning, said once
    through ``warn``, and the file is not written again; it never stops the job."""

    def __init__(self, path: str, warn: Callable[[str], None]) -> None:
        self.path = path
        self._warn = warn
        self._file: IO[bytes] | None = None
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # Unbuffered: a `tail -f` of the file sees what the console sees, when it sees it.
            self._file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed by close()
        except OSError as exc:
            self._failed(exc, "created")

    def write(self, data: bytes) -> None:
        if self._file is None:
            return
        try:
            # Unbuffered: a write that fills the disk writes part and says so; the rest is
            # written again, which raises ENOSPC and warns (the part was dropped unsaid).
            _write_all(self._file, data)
        except OSError as exc:
            self._failed(exc, "written")

    def _failed(self, exc: OSError, verb: str) -> None:
        self.close()
        self._warn(f"gpuwarden: warning: the log file {self.path} cannot be {verb} "
                   f"({exc.strerror or exc}); it is not written further, the job goes on")

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


class StreamRelay:
    """One stream of one rank: feed it what was read from the pipe, in any chunk sizes."""

    def __init__(self, prefix: bytes, console: Console | None, file: _Writable | None,
                 tail: collections.deque[str] | None = None,
                 filters: Sequence[bytes] = (), filtered: _Writable | None = None,
                 tty: Console | None = None, view: _Stream | None = None,
                 torch_tag: bytes | None = None) -> None:
        self.prefix = prefix
        self.console = console
        self.tty = tty  # a terminal console: everything passed on at once (_tty_write)
        self.view = view  # ... or shown by the terminal's view of several ranks (terminal.py)
        # torch's own excepthook and logs already start lines with "[rankN]:": not twice
        tag = prefix.rstrip(b" ")
        torch_tag = tag if torch_tag is None else torch_tag
        self._twice = (prefix + torch_tag, tag) if tag else None
        self.file = file
        self.tail = tail
        self.filters = tuple(filters)
        self.filtered = filtered
        self._newline_prefix = b"\n" + prefix
        self._pending = bytearray()  # the unfinished line, at most MAX_LINE_BYTES
        # whether anything takes the stream's lines (a stream shown on a terminal and kept
        # nowhere else need not be cut into lines here: the view or _tty_write do what it needs)
        self._cut = (console is not None or file is not None or tail is not None
                     or bool(self.filters and filtered is not None))

    def feed(self, data: bytes) -> None:
        if self.view is not None:
            self.view.feed(data)
        elif self.tty is not None:
            self._tty_write(data)
        if not self._cut:
            return
        # Slices of at most MAX_LINE_BYTES: a whole line inside one slice is then shorter than
        # the bound, and only the line that continues the pending one can be longer.
        for start in range(0, len(data), MAX_LINE_BYTES):
            piece = data[start:start + MAX_LINE_BYTES]
            self._feed(piece)
            if b"\r" in piece and self._pending:
                self._redraws()

    def _redraws(self) -> None:
        """A progress bar (tqdm) redraws its line after each carriage return and ends it only
        when done: pass on what precedes the last ``\r`` now, each state prefixed and ending
        in ``\r``, so a terminal shows the bar as it moves (not once it reaches 64 KiB)."""
        cut = self._pending.rfind(b"\r")
        if cut < 0:
            return
        done = bytes(self._pending[: cut + 1])
        del self._pending[: cut + 1]
        if self.file is not None:
            self.file.write(done)
        if self.console is not None:
            self.console.write(self.prefix + done[:-1].replace(b"\r", b"\r" + self.prefix) + b"\r")

    def _feed(self, data: bytes) -> None:
        first = data.find(b"\n")
        if self._pending and len(self._pending) + (first if first >= 0 else len(data)) >= MAX_LINE_BYTES:
            # The pending line grows past the bound: pass it on in pieces up to its end.
            self._pending += data if first < 0 else data[:first]
            self._cut_long_line()
            if first < 0:
                return
            self._lines(bytes(self._pending) + b"\n")
            self._pending.clear()
            data = data[first + 1:]
        last = data.rfind(b"\n")
        if last < 0:
            self._pending += data
            self._cut_long_line()
            return
        if self._pending:
            block = bytes(self._pending) + data[: last + 1]
            self._pending.clear()
        else:
            block = data[: last + 1]
        self._lines(block)
        if last + 1 < len(data):
            self._pending += data[last + 1:]
            self._cut_long_line()

    def _tty_write(self, data: bytes) -> None:
        """A terminal gets everything now, an unfinished line too (a ``(Pdb) `` prompt, a
        progress bar's redraw), the prefix at the start of each line: a constant number of C
        passes over the chunk. A line left open by another stream is ended first."""
        assert self.tty is not None
        line = self.tty.line
        head = b""
        if line.owner is not self:
            if line.owner is not None:
                head = b"\n"  # another rank's unfinished line: end it, ours starts afresh
            head += self.prefix
        body = data
        if self.prefix:
            body = body.replace(b"\n", self._newline_prefix)
            if b"\r" in body:
                body = body.replace(b"\r", b"\r" + self.prefix).replace(
                    b"\r" + self.prefix + self._newline_prefix, b"\r" + self._newline_prefix)
            if body.endswith(self._newline_prefix):
                body = body[: -len(self.prefix)]  # the next line may be another rank's
            body = head + body
            if self._twice is not None and self._twice[1] in body:
                body = body.replace(*self._twice)
        else:
            body = head + body
        line.owner = None if body.endswith(b"\n") else self
        self.tty.write(body)

    def finish(self) -> None:
        """End of the stream: an unfinished last line is passed on as a line."""
        if self.view is not None:
            self.view.finish()
        elif self.tty is not None and self.tty.line.owner is self:
            self.tty.line.owner = None
            self.tty.write(b"\n")
        if self._pending:
            rest = bytes(self._pending)
            self._pending.clear()
            self._piece(rest)

    def _cut_long_line(self) -> None:
        while len(self._pending) >= MAX_LINE_BYTES:
            piece = bytes(self._pending[:MAX_LINE_BYTES])
            del self._pending[:MAX_LINE_BYTES]
            self._piece(piece)

    def _piece(self, piece: bytes) -> None:
        """A part of a line without its newline: unchanged in the file, a line of its own on the
        console (so the next prefix starts a line)."""
        if self.file is not None:
            self.file.write(piece)
        if self.console is not None:
            self.console.write(self.prefix + piece + b"\n")
        if self.tail is not None:
            self.tail.append(_tail_line(piece))
        if self.filters and self.filtered is not None and any(f in piece for f in self.filters):
            self.filtered.write(self.prefix + piece + b"\n")

    def _lines(self, block: bytes) -> None:
        """Whole lines (``block`` ends with a newline), all at once."""
        if self.file is not None:
            self.file.write(block)
        if self.console is not None:
            if self.prefix:
                body = self.prefix + block[:-1].replace(b"\n", self._newline_prefix)
                if b"\r" in body:  # a redrawn line keeps its prefix on a terminal
                    body = body.replace(b"\r", b"\r" + self.prefix)
                if self._twice is not None and self._twice[1] in body:
                    body = body.replace(*self._twice)
                self.console.write(body + b"\n")
            else:
                self.console.write(block)
        if self.tail is not None:
            for line in block[:-1].rsplit(b"\n", STDERR_TAIL_LINES)[-STDERR_TAIL_LINES:]:
                self.tail.append(_tail_line(line))
        if self.filters and self.filtered is not None and any(f in block for f in self.filters):
            for line in block.splitlines(keepends=True):
                if any(f in line for f in self.filters):
                    self.filtered.write(self.prefix + line)


def _tail_line(raw: bytes) -> str:
    return raw[:TAIL_LINE_CHARS * 4].decode("utf-8", errors="replace")[:TAIL_LINE_CHARS]


class RankRelay:
    """Both streams of one rank, and the files they own."""

    def __init__(self, outputs: RankOutputs, stdout: Console, stderr: Console,
                 filtered: tuple[LogFile | None, LogFile | None] = (None, None),
                 filters: tuple[Sequence[bytes], Sequence[bytes]] = ((), ()),
                 rank: int = 0) -> None:
        self.outputs = outputs
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._stderr = stderr
        self._files: list[LogFile] = []
        self.stdio: RankStdio | None = None
        # A stream shown on a terminal and written to no file: torchrun's rank would write to
        # the terminal itself, so this one gets a terminal too (RankStdio).
        self.tty_out = stdout if outputs.console_out and outputs.stdout_file is None \
            and stdout.isatty else None
        self.tty_err = stderr if outputs.console_err and outputs.stderr_file is None \
            and stderr.isatty else None
        prefix = outputs.terminal_prefix or outputs.prefix
        views = [tty.view.stream(rank, is_err, prefix, outputs.torch_tag)
                 if tty is not None and tty.view is not None else None
                 for is_err, tty in ((False, self.tty_out), (True, self.tty_err))]
        # the width a line's prefix takes on the terminal (and one column the view keeps free)
        self.prefix_width = len(prefix) + (1 if any(views) else 0)
        # torchrun's filters read the tee'd streams only
        self.out = StreamRelay(
            prefix if self.tty_out is not None else outputs.prefix_of(False),
            stdout if outputs.console_out and self.tty_out is None else None,
            self._open(outputs.stdout_file), None, filters[0] if outputs.tee_out else (),
            filtered[0], self.tty_out, views[0], outputs.torch_tag)
        self.err = StreamRelay(
            prefix if self.tty_err is not None else outputs.prefix_of(True),
            stderr if outputs.console_err and self.tty_err is None else None,
            self._open(outputs.stderr_file), self.stderr_tail,
            filters[1] if outputs.tee_err else (), filtered[1], self.tty_err, views[1],
            outputs.torch_tag)

    def open_stdio(self) -> RankStdio:
        """The rank's stdout and stderr, as :class:`RankStdio` decides them."""
        self.stdio = RankStdio(self.tty_out, self.tty_err, self.prefix_width)
        return self.stdio

    def _open(self, path: str | None) -> LogFile | None:
        if path is None:
            return None
        f = LogFile(path, _warner(self._stderr))
        self._files.append(f)
        return f

    def feed(self, is_err: bool, data: bytes) -> None:
        (self.err if is_err else self.out).feed(data)

    def viewed(self, is_err: bool) -> bool:
        """Whether the stream is shown by the terminal's view (terminal.py)."""
        return (self.err if is_err else self.out).view is not None

    def accepts(self, is_err: bool) -> bool:
        """Whether to read more of the stream now: the terminal's view pauses a rank whose
        lines wait for the other ranks' (at most its window), as a terminal's flow control."""
        view = (self.err if is_err else self.out).view
        return view is None or view.accepts()

    def finish(self, is_err: bool) -> None:
        (self.err if is_err else self.out).finish()

    def close(self) -> None:
        self.out.finish()
        self.err.finish()
        for f in self._files:
            f.close()


def _warner(console: Console) -> Callable[[str], None]:
    return lambda line: console.write(line.encode() + b"\n")


def terminal_view_allowed(env: Mapping[str, str]) -> bool:
    """Whether the terminal may be drawn on (a live region moved with cursor sequences):
    not under ``NO_COLOR`` (no-color.org: set and not empty) nor ``TERM=dumb`` (or unset),
    which get the plain relay, every line as it comes."""
    return not env.get("NO_COLOR") and env.get("TERM", "dumb") not in ("", "dumb", "unknown")


class JobRelay:
    """The relay of one launch: the two consoles, the filtered-lines files, one RankRelay per
    rank (opened as each rank starts); on a terminal showing two ranks or more, the terminal's
    view (terminal.py) unless ``plain_console``.

    ``layout``: every (rank, local rank) of this node, known before any starts (the view is
    chosen once, for all of them). ``node``: this node's rank when the job has several nodes.
    ``collapse_window_s``: how long a line may wait for the same line from other ranks on the
    terminal (0: identical lines are not collapsed; bars still stay in place)."""

    def __init__(self, stdout: TextIO, stderr: TextIO, *, redirects: str = "0", tee: str = "0",
                 local_ranks_filter: frozenset[int] | None = None, quiet: bool = False,
                 attempt_dir: str | None = None,
                 duplicate_stdout_filters: Sequence[str] = (),
                 duplicate_stderr_filters: Sequence[str] = (), role: str = "default",
                 prefix_template: str | None = None,
                 ranks_filter: frozenset[int] | None = None, node: int | None = None,
                 layout: Sequence[tuple[int, int]] = (), plain_console: bool = False,
                 collapse_window_s: float = 0.05,
                 env: Mapping[str, str] | None = None) -> None:
        self.stdout = Console(stdout)
        self.stderr = Console(stderr)
        if self.stdout.isatty and self.stderr.isatty:
            self.stderr.line = self.stdout.line  # one terminal: one cursor
        self.redirects, self.tee = redirects, tee
        self.local_ranks_filter, self.quiet = local_ranks_filter, quiet
        self.ranks_filter, self.node = ranks_filter, node
        self.attempt_dir = attempt_dir
        self.role, self.prefix_template = role, prefix_template
        self.filters = (tuple(f.encode() for f in duplicate_stdout_filters if f),
                        tuple(f.encode() for f in duplicate_stderr_filters if f))
        self._filtered: list[LogFile | None] = [None, None]
        if attempt_dir is not None:
            for i, name in enumerate(("filtered_stdout.log", "filtered_stderr.log")):
                if self.filters[i]:
                    self._filtered[i] = LogFile(os.path.join(attempt_dir, name),
                                                _warner(self.stderr))
        self.ranks: list[RankRelay] = []
        self.view: TerminalView | None = None
        if not plain_console and terminal_view_allowed(os.environ if env is None else env):
            self._choose_view(layout, collapse_window_s)

    def _outputs(self, rank: int, local_rank: int) -> RankOutputs:
        return rank_outputs(rank=rank, local_rank=local_rank, redirects=self.redirects,
                            tee=self.tee, local_ranks_filter=self.local_ranks_filter,
                            quiet=self.quiet, attempt_dir=self.attempt_dir,
                            role=self.role, prefix_template=self.prefix_template,
                            ranks_filter=self.ranks_filter, node=self.node)

    def _choose_view(self, layout: Sequence[tuple[int, int]], window_s: float) -> None:
        """The view draws on one terminal: stderr's (where progress bars go by default) or
        stdout's; the other console joins it when it is the same terminal. It is used when
        two ranks or more show a stream there (with one, the plain relay keeps a bar in place)."""
        consoles = [c for c in (self.stderr, self.stdout) if c.isatty]
        if not consoles:
            return
        term = consoles[0]
        shared = [c for c in consoles if c is term or _same_terminal(c, term)]
        shown = set()
        for rank, local_rank in layout:
            o = self._outputs(rank, local_rank)
            if (self.stdout in shared and o.console_out and o.stdout_file is None) or (
                    self.stderr in shared and o.console_err and o.stderr_file is None):
                shown.add(rank)
        if len(shown) < 2:
            return
        from gpuwarden.launch.ranks.terminal import TerminalView

        self.view = TerminalView(term, window_s=window_s, node=self.node)
        for c in shared:
            c.view = self.view

    def open_rank(self, rank: int, local_rank: int) -> RankRelay:
        relay = RankRelay(self._outputs(rank, local_rank), self.stdout, self.stderr,
                          (self._filtered[0], self._filtered[1]), self.filters, rank)
        self.ranks.append(relay)
        return relay

    # ---- the terminal's view: time, gpuwarden's own lines, resizes -----------------------

    def next_due(self) -> float | None:
        """When :meth:`tick` has something to do (monotonic time; None: nothing waits)."""
        return self.view.next_due() if self.view is not None else None

    def tick(self) -> None:
        """Say what the last reads brought and what has waited long enough (a line held for the
        same line of other ranks): after every round of reads."""
        if self.view is not None:
            self.view.tick()

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Around gpuwarden's own lines on its stdout/stderr while ranks run: on a terminal with
        the view, its live region leaves the screen first and comes back after."""
        if self.view is None:
            yield
            return
        with self.view.aside():
            yield

    def resized(self) -> None:
        """The terminal's size changed: the ranks' pseudo-terminals and the view follow."""
        for relay in self.ranks:
            if relay.stdio is not None:
                relay.stdio.resize()
        if self.view is not None:
            self.view.resized()

    def close(self) -> None:
        for relay in self.ranks:
            relay.close()
        if self.view is not None:
            self.view.close()
            for c in (self.stdout, self.stderr):
                c.view = None
        for f in self._filtered:
            if f is not None:
                f.close()


def _same_terminal(a: Console, b: Console) -> bool:
    try:
        return os.fstat(a.stream.fileno()).st_rdev == os.fstat(b.stream.fileno()).st_rdev
    except (AttributeError, OSError, ValueError):
        return True
