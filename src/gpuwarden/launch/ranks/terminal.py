"""The ranks' output on a terminal, readable: progress bars in place, identical lines said once.

Used when two or more ranks are shown on the launcher's terminal (with one rank the plain relay
already keeps a bar in place); what a rank writes is only *shown* differently: the rank still
writes to a pseudo-terminal of its own (``isatty()`` true, as under torchrun), its log files and
the report's tail get its bytes unchanged, and piped or redirected output never comes here.

::

    rank 0 pty --feed--> _Stream: complete lines ----> Collapser (collapse.py, PURE) --+
    rank 1 pty --feed--> _Stream: the unfinished line                                  |
                          | redrawn (\\r) or styled: the live region                      v
                          | plain (a prompt): shown after the window, as an open line  one write:
                          +--------------------------------------------------------->  erase region,
                                                                                        scrolled lines,
                                                                                        region again

The screen, bottom up: the **live region** holds one line per stream whose unfinished line is
being redrawn (tqdm, rich, Keras, pip: a ``\\r`` or an escape sequence in it), each cut to the
terminal's width so that none wraps, the cursor at the end of its last line; above it the
output scrolls. To print lines, the region is erased (cursor up to its first line, erase to the
end of the screen), the lines written, the region drawn again. A bar that ends (its ``\\n``)
leaves the region when its last state is printed as an ordinary line, with its rank's prefix.
The region is redrawn at most every :data:`REDRAW_S` for redraws alone; its height is capped
below the terminal's so that the cursor never has to climb off the screen.

A line that stays unfinished without a ``\\r`` (``(Pdb) ``, ``Password: ``) is a prompt: after
the window (counted while the relay reads the rank: one paused because its lines wait for the
other ranks' may have the rest of the line unread) it is written where the cursor is, as the
plain relay writes it, and the region stays off the screen until that line is ended (the
terminal echoes what the user types after it, which no redraw may overwrite). Escape sequences
that move the cursor or erase (``\\x1b[A``, ``\\x1b[2K``) are taken out of the ranks' lines here:
they would move it in the shared screen, not in the rank's line (colours, ``\\x1b[...m``, pass).

Limits: a terminal that re-wraps lines when it is made narrower (VTE, iTerm2) may leave a piece
of a bar wider than the new width above the region once; the region itself is redrawn at the new
width (the ranks' pseudo-terminals take the new size too, see :meth:`TerminalView.resized`).
"""

from __future__ import annotations

import contextlib
import re
import time
import unicodedata
from collections.abc import Callable, Iterator
from typing import Protocol

from gpuwarden.launch.ranks.collapse import Collapser, bits, label, rank_set, traceback_start

REDRAW_S = 0.05  # the live region is redrawn at most this often for redraws alone
OPEN_LINE_KEEP = 1024  # bytes of an open line kept to erase it when it turns into a bar
OPEN_AFTER_BYTES = 64 * 1024  # an unfinished line this long passes on at once, as an open line
TRIM_PARTIAL = 8192  # a redrawn line's older states are dropped past this size
DEFAULT_SIZE = (80, 24)

# CSI sequences that move the cursor, erase or scroll (not SGR colours, not modes), and the
# two-byte ones that do the same (save/restore cursor, index, reverse index, next line).
_MOTION = re.compile(rb"\x1b\[[0-?]*[ -/]*[A-HJKSTfnsu]|\x1b[78DEM]")
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]")
_SGR = re.compile(r"\x1b\[[0-9;:]*m")


def strip_motion(data: bytes) -> bytes:
    return _MOTION.sub(b"", data) if b"\x1b" in data else data


def visible_width(text: bytes) -> int:
    """Columns ``text`` takes on a terminal: escape sequences none, wide characters two."""
    s = text.decode("utf-8", errors="replace")
    if "\x1b" in s:
        s = _ESCAPES.sub("", s)
    if s.isascii():
        return sum(1 for c in s if c >= " " and c != "\x7f")
    return sum(_char_width(c) for c in s)


def _char_width(c: str) -> int:
    if c < " " or c == "\x7f" or unicodedata.combining(c):
        return 0
    return 2 if unicodedata.east_asian_width(c) in "WF" else 1


def fit(text: bytes, columns: int, keep_end: bool = False) -> bytes:
    """``text`` cut to ``columns`` columns (its start, or its end for an open line), escape
    sequences kept, colours reset after a cut."""
    if columns <= 0:
        return b""
    if visible_width(text) <= columns:
        return text
    s = text.decode("utf-8", errors="replace")
    pieces: list[tuple[str, int]] = []  # (piece, its width): escapes take none
    pos = 0
    while pos < len(s):
        if s[pos] == "\x1b":
            m = _ESCAPES.match(s, pos)
            if m is not None:
                pieces.append((m.group(), 0))
                pos = m.end()
                continue
        pieces.append((s[pos], _char_width(s[pos])))
        pos += 1
    if keep_end:
        pieces.reverse()
    out: list[str] = []
    used = 0
    room = columns - 1  # one column for the ellipsis
    for piece, width in pieces:
        if width and used + width > room:
            continue  # a character past the room (escapes, of no width, are kept)
        used += width
        out.append(piece)
    if keep_end:
        out.reverse()
        body = "…" + "".join(out)
    else:
        body = "".join(out) + "…"
    if _SGR.search(s):
        body += "\x1b[0m"
    return body.encode()


def final_text(line: bytes) -> bytes:
    """What a terminal shows of a redrawn line: its last state with something visible in it
    (the last ``\\r``-separated piece that is not blank)."""
    if b"\r" not in line:
        return line
    for piece in reversed(line.split(b"\r")):
        if piece.strip() and (b"\x1b" not in piece or visible_width(piece.strip()) > 0):
            return piece
    return b""


class Terminal(Protocol):
    """What the view writes to (relay.py's Console on a terminal)."""

    def write_direct(self, data: bytes) -> None: ...
    def winsize(self) -> bytes | None: ...  # struct winsize, None when unknown


class _Stream:
    """One rank's stdout or stderr shown on the terminal (what ``StreamRelay`` feeds)."""

    def __init__(self, view: TerminalView, rank: int, is_err: bool, prefix: bytes,
                 torch_tag: bytes) -> None:
        self.view = view
        self.rank = rank
        self.is_err = is_err
        self.prefix = prefix
        self.torch_tag = torch_tag  # "[rank3]:" that torch's excepthook and logs write
        self._tag_re = re.compile(rb"(?m)^" + re.escape(torch_tag) + rb" ?")
        self.partial = bytearray()  # the unfinished line, not on the screen yet (or live)
        self.held_since: float | None = None  # a plain unfinished line waits from then
        self.unread = False  # the relay does not read it for now (TerminalView.accepts)
        self.live = False  # the unfinished line is in the live region
        self.gen = 0  # which live line of this stream the region shows
        self.shown = False  # the unfinished line was written as an open line (a prompt)
        self.open_text = bytearray()  # ... its first bytes (to erase it if it turns into a bar)
        self.closed = False

    def feed(self, data: bytes) -> None:
        self.view.feed(self, data)

    def finish(self) -> None:
        self.view.finish(self)

    def accepts(self) -> bool:
        return self.view.accepts(self)

    def untag(self, block: bytes) -> bytes:
        return self._tag_re.sub(b"", block) if self.torch_tag in block else block


class TerminalView:
    """The terminal's screen for the streams of every shown rank: one writer, one cursor.

    ``window_s``: how long a line may wait for the same line from other ranks (0: nothing is
    collapsed, lines pass at once). ``size`` gives (columns, rows); ``clock`` the time."""

    def __init__(self, console: Terminal, *, window_s: float, node: int | None = None,
                 size: Callable[[], tuple[int, int]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console
        self.node = node
        self.window_s = window_s
        self.collapser = Collapser(window_s) if window_s > 0 else None
        self._size = size or self._console_size
        self._clock = clock
        self._streams: dict[tuple[int, bool], _Stream] = {}
        self._labels: dict[int, bytes] = {}
        self._region: dict[_Stream, tuple[int, bytes]] = {}  # stream -> (gen, text)
        self._drawn = 0  # rows of the region on the screen
        self._open: _Stream | None = None  # whose open line the cursor is at the end of
        self._held: set[_Stream] = set()  # plain unfinished lines waiting for the window
        self._dirty = False
        self._last_draw = 0.0
        self._out: list[bytes] = []  # what the current step writes, in one write
        self._foreign = _Stream(self, -1, False, b"", b"[-]:")  # the owner of an external line

    # ---- streams ---------------------------------------------------------------------------

    def stream(self, rank: int, is_err: bool, prefix: bytes, torch_tag: bytes) -> _Stream:
        s = _Stream(self, rank, is_err, prefix, torch_tag)
        self._streams[rank, is_err] = s
        self._labels.setdefault(1 << rank, prefix)
        if self.collapser is not None:
            self.collapser.open(rank, is_err)
        return s

    def accepts(self, s: _Stream) -> bool:
        """Whether the relay should read more of ``s`` now: not while its lines wait for the
        other ranks' (a rank ahead of the others is paused, so that they catch up). Its
        unfinished line is no prompt meanwhile (the rest may be unread): its window starts
        again when it is read again."""
        ok = self.collapser is None or self.collapser.accepts(s.rank, s.is_err)
        if not ok:
            s.unread = True
        elif s.unread:
            s.unread = False
            if s.held_since is not None:
                s.held_since = self._clock()
        return ok

    def feed(self, s: _Stream, data: bytes) -> None:
        """What ``s`` wrote. Its complete lines are said at the next :meth:`tick` (the relay
        ticks after each round of reads): the lines of every stream read in the round leave
        in one look at the queues and one write, not one per stream."""
        now = self._clock()
        if s.shown:
            data = self._continue_open(s, data)
            if not data:
                self._step(now, say=False)
                return
        last = data.rfind(b"\n")
        if last >= 0:
            block = bytes(s.partial) + data[:last + 1] if s.partial else data[:last + 1]
            token = None
            if s.live:
                token = (s, s.gen)
                s.live = False
                s.gen += 1
            s.partial = bytearray(data[last + 1:])
            self._held.discard(s)
            s.held_since = None
            self._lines(s, block, now, token)
        else:
            s.partial += data
        if s.partial:
            self._unfinished(s, now)
        self._step(now, say=False)

    def finish(self, s: _Stream) -> None:
        """The stream ended: its unfinished line is a line; nothing waits for it any more."""
        if s.closed:
            return
        now = self._clock()
        if s.shown:
            if self._open is s:
                self._out.append(b"\n")
                self._open = None
                self._dirty = True
            s.shown = False
        if s.partial:
            self.feed(s, b"\n")
        s.closed = True
        self._held.discard(s)
        if self.collapser is not None:
            self.collapser.close(s.rank, s.is_err)
        self._step(now)

    # ---- time ------------------------------------------------------------------------------

    def next_due(self) -> float | None:
        """When :meth:`tick` has something to do (a line's window ends, a redraw is due)."""
        due = self.collapser.next_due() if self.collapser is not None else None
        for s in self._held:
            if s.held_since is not None and not s.unread:
                at = s.held_since + self.window_s
                due = at if due is None or at < due else due
        if self._dirty and self._region and self._open is None:
            at = self._last_draw + REDRAW_S
            due = at if due is None or at < due else due
        return due

    def tick(self) -> None:
        self._step(self._clock())

    def close(self) -> None:
        """The end: every stream finished, everything said, the region gone, the cursor at the
        start of a line."""
        for s in list(self._streams.values()):
            s.finish()
        if self.collapser is not None:
            self._say(self.collapser.take(self._clock(), everything=True))
        self._region.clear()
        self._write_region_off()
        if self._open is not None:
            self._out.append(b"\n")
            self._open = None
        self._flush()

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """gpuwarden's own lines (a note, a warning, a stall report) go where the cursor is: the
        region and an open line are taken off the screen first, and come back after."""
        self._write_region_off()
        if self._open is not None:
            self._out.append(b"\n")
            self._open = None
        self._flush()
        try:
            yield
        finally:
            self._dirty = True
            self._last_draw = 0.0

    def external(self, data: bytes) -> None:
        """Bytes that reach the terminal another way (a tee'd stream's line, a log file's
        warning): written above the region, which comes back after them."""
        self._write_region_off()
        if self._open is not None:
            self._out.append(b"\n")
        self._out.append(data)
        # not ended by a newline: the cursor is not at a line's start, as after an open line
        self._open = None if data.endswith(b"\n") else self._foreign
        self._flush()
        self._dirty = True
        self._last_draw = 0.0

    def resized(self) -> None:
        """The terminal's size changed: the region is drawn again at the new width now."""
        self._dirty = True
        self._last_draw = 0.0
        self._step(self._clock())

    # ---- lines -----------------------------------------------------------------------------

    def _lines(self, s: _Stream, block: bytes, now: float, token: object) -> None:
        """Complete lines of ``s`` (``block`` ends with a newline)."""
        if b"\x1b" in block:
            block = _MOTION.sub(b"", block)
        if b"\r" in block:
            block = b"\n".join(final_text(line) for line in block.split(b"\n"))
        block = s.untag(block)
        if b"\x1b" in block:
            # a line of escapes only (rich's "show the cursor" after its bar) shows nothing but
            # an empty prefix: it is left out
            lines = block.split(b"\n")
            lines.pop()
            kept = [line for line in lines if not line.startswith(b"\x1b")
                    or visible_width(line) > 0]
            if not kept:
                if token is not None:
                    self._drop_live(token)
                return
            if len(kept) < len(lines):
                block = b"\n".join(kept) + b"\n"
        if self.collapser is None:
            self._print(s.prefix, block)
            if token is not None:
                self._drop_live(token)
            return
        self.collapser.add(s.rank, s.is_err, block, now, traceback_start(block), token)

    def _unfinished(self, s: _Stream, now: float) -> None:
        """The unfinished line of ``s`` changed: a bar goes to the region, a plain line waits
        (a prompt, shown after the window), a line too long for either passes on now."""
        p = s.partial
        redrawn = b"\r" in p
        if redrawn and len(p) > TRIM_PARTIAL:
            _trim_states(p)
        if (redrawn or b"\x1b" in p) and len(p) < OPEN_AFTER_BYTES:
            text = final_text(strip_motion(bytes(p)))
            s.live = True
            self._held.discard(s)
            s.held_since = None
            if visible_width(text.strip()) > 0:
                self._region[s] = (s.gen, text)
            else:  # a bar cleared itself (tqdm's leave=False)
                self._region.pop(s, None)
            self._dirty = True
            return
        if self.collapser is None or len(p) >= OPEN_AFTER_BYTES:
            self._open_line(s)
            return
        if s.held_since is None:
            s.held_since = now
            self._held.add(s)

    def _open_line(self, s: _Stream) -> None:
        """Write the unfinished line of ``s`` where the cursor is (a prompt): the region leaves
        the screen until the line is ended."""
        self._write_region_off()
        if self._open is not None and self._open is not s:
            self._out.append(b"\n")
        if s.live:  # a bar too long for the region: its states pass as the plain relay's do
            s.live = False
            self._region.pop(s, None)
            s.gen += 1
        text = strip_motion(bytes(s.partial))
        self._out.append(s.prefix + text)
        s.open_text = bytearray(text[:OPEN_LINE_KEEP])
        s.partial.clear()
        s.shown = True
        s.held_since = None
        self._held.discard(s)
        self._open = s

    def _continue_open(self, s: _Stream, data: bytes) -> bytes:
        """More of a line already written as an open line: passed on at once up to its end;
        what follows its newline is returned. A ``\\r`` turns it into a bar: the open line is
        erased (when it is short and the cursor still at its end) or ended, and the region
        takes it."""
        nl = data.find(b"\n")
        head = data if nl < 0 else data[:nl + 1]
        if nl < 0 and b"\r" in head:
            if self._open is s:
                if len(s.open_text) < OPEN_LINE_KEEP:
                    columns, _ = self._size()
                    width = visible_width(s.prefix + bytes(s.open_text))
                    rows = max(1, -(-width // max(columns, 1)))
                    self._out.append(b"\r" + (b"\x1b[%dA" % (rows - 1) if rows > 1 else b"")
                                     + b"\x1b[J")
                    s.partial = bytearray(s.open_text)
                else:
                    self._out.append(b"\n")
                self._open = None
            s.shown = False
            s.open_text.clear()
            return data
        if self._open is not s:
            self._write_region_off()
            if self._open is not None:
                self._out.append(b"\n")
            self._out.append(s.prefix)
        self._out.append(strip_motion(head))
        if nl < 0:
            self._open = s
            if len(s.open_text) < OPEN_LINE_KEEP:
                s.open_text += head[:OPEN_LINE_KEEP]
            return b""
        self._open = None
        s.shown = False
        s.open_text.clear()
        self._dirty = True
        return data[nl + 1:]

    # ---- the screen ------------------------------------------------------------------------

    def _step(self, now: float, say: bool = True) -> None:
        """Everything due now, in one write: lines that leave the queue (unless not ``say``),
        prompts whose window ended, the region drawn again."""
        if self.collapser is not None and say:
            said = self.collapser.take(now)
            if said:
                self._say(said)
            if self.collapser.dropped:
                for token in self.collapser.dropped:
                    self._drop_live(token)
                self.collapser.dropped.clear()
        if self._held:
            for s in [s for s in self._held if s.held_since is not None and not s.unread
                      and s.held_since + self.window_s <= now]:
                self._open_line(s)
        if self._dirty and self._open is None and (
                self._drawn == 0 or now - self._last_draw >= REDRAW_S or not self._region):
            self._write_region_off()
        if self._drawn == 0 and self._region and self._open is None:
            self._draw(now)
        self._flush()

    def _say(self, said: list[tuple[bool, int, bytes]]) -> None:
        """Lines that leave the collapser: each run with its ranks' tag at every line's start."""
        parts: list[bytes] = []
        labels = self._labels
        for is_err, mask, lines in said:
            tag: bytes | None
            if mask < 0:  # a traceback: the rank's own prefix
                tag = self._streams[-1 - mask, is_err].prefix
            else:
                tag = labels.get(mask)
                if tag is None:
                    tag = labels[mask] = label(bits(mask), self.node) + b" "
            parts.append(tag + lines[:-1].replace(b"\n", b"\n" + tag) + b"\n")
        self._scroll(b"".join(parts))

    def _print(self, prefix: bytes, block: bytes) -> None:
        self._scroll(prefix + block[:-1].replace(b"\n", b"\n" + prefix) + b"\n")

    def _scroll(self, data: bytes) -> None:
        """Lines (each ending in a newline) into the scrolling output, above the region."""
        if self._open is not None:
            self._out.append(b"\n")  # an open line (a prompt) is ended first, as the plain relay does
            self._open = None
        self._write_region_off()
        self._out.append(data)

    def _drop_live(self, token: object) -> None:
        """A bar's last state was printed: it leaves the region (unless a newer bar of the
        same stream is there already)."""
        assert isinstance(token, tuple)
        stream, gen = token
        shown = self._region.get(stream)
        if shown is not None and shown[0] == gen:
            del self._region[stream]
            self._dirty = True

    def _write_region_off(self) -> None:
        """Erase the region: up to its first line, erase to the end of the screen."""
        if self._drawn:
            up = self._drawn - 1
            self._out.append(b"\r" + (b"\x1b[%dA" % up if up else b"") + b"\x1b[J")
            self._drawn = 0
            self._dirty = True

    def _draw(self, now: float) -> None:
        columns, rows = self._size()
        room = max(columns - 1, 10)
        streams = sorted(self._region, key=lambda s: (s.rank, s.is_err))
        most = max(1, rows - 2)
        lines = []
        for s in streams[:most if len(streams) <= most else most - 1]:
            prefix = s.prefix
            width = visible_width(prefix)
            lines.append(fit(prefix, room) + fit(self._region[s][1], room - width))
        if len(streams) > most:
            rest = streams[most - 1:]
            lines.append(fit(f"... and {len(rest)} more progress line(s): ranks "
                             f"{rank_set(s.rank for s in rest)}".encode(), room))
        self._out.append(b"\n".join(lines))
        self._drawn = len(lines)
        self._dirty = False
        self._last_draw = now

    def _flush(self) -> None:
        if self._out:
            data = b"".join(self._out)
            self._out.clear()
            self.console.write_direct(data)

    def _console_size(self) -> tuple[int, int]:
        import struct

        raw = self.console.winsize()
        if raw is None:
            return DEFAULT_SIZE
        rows, columns, _, _ = struct.unpack("HHHH", raw)
        return (columns or DEFAULT_SIZE[0], rows or DEFAULT_SIZE[1])


def _trim_states(partial: bytearray) -> None:
    """Keep a redrawn line's newest states only (tqdm never ends its line while it runs)."""
    cut = partial.rfind(b"\r", 0, len(partial) - 1)
    if cut > 0:
        earlier = partial.rfind(b"\r", 0, cut)
        del partial[:max(earlier, 0)]
