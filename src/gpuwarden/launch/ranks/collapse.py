"""Identical lines of several ranks said once on a terminal (PURE: lines in, console lines out).

::

    rank 0's stdout lines --add()--> queue (0, out)  \\
    rank 0's stderr lines --add()--> queue (0, err)   \\
    rank 1's stdout lines --add()--> queue (1, out)    >--take(now)--> (stream, ranks, lines)
    ...                                               /                to print, in order

Each stream of each rank has a queue of its pending complete lines, as bytes (its *lane*:
stdout's lines are said once among stdout's, stderr's among stderr's). :meth:`Collapser.take`
looks at the oldest line waiting anywhere (a queue's head) and the queues of its lane whose
heads are the same line:

- **every shown rank has that line next** (ranks in lockstep): it leaves at once as one line
  ``[rank0-7]: ...``, and with it every following line they all have in common, found with
  C-level comparisons of the queues (``startswith``), not line by line;
- **a rank has it a few lines further on** (it printed a line of its own first): that rank's
  head goes first, so the line can still be said once;
- **some rank has said nothing yet, or is behind** (its next line is one these ranks said
  already): the line waits for it, at most ``window_s``, then leaves with the ranks that said
  it; meanwhile the ranks ahead are not read (:meth:`accepts`), so the one behind catches up
  (a stream that *floods*, below, does not wait for a rank that said nothing yet);
- otherwise (every other rank has a different line next) it leaves at once with its ranks. A
  line no other rank has takes along the lines after it that have no twin either among the
  other ranks' next lines (a *run*, found with C-level splits and set operations, not line by
  line).

Lines that leave without every rank are remembered with the ranks that said them, to tell a
rank behind: the latest :data:`RECENT_LINES` of each lane to twice that (fewer if they pass
:data:`RECENT_BYTES`), in two generations (one C-level dict update per run; a line said again
is merged with the ranks that said it before).

**Floods.** A stream whose last :data:`FLOOD_LINES` lines all left without a twin, and whose
queue is full (its rank would be paused for room), floods: its lines stop waiting for ranks that
said nothing yet, so its rank writes at its own pace instead of a queue per window. It still
shares a line that another rank has queued, and still waits for a rank behind it; from its first
line said with another rank, or a rank found behind it, its lines wait again. A rank writing
slower than a queue per window (20 MB/s: any rate a person reads) never floods.

**Order.** A rank's lines leave in the order the relay read them, its two streams together: a
head leaves only after every older line of the same rank, and a run (of common lines, or of a
rank's own) stops before a line of the other stream that came in between; a rank's own run also
stops before what it wrote after another rank's next line (the screen keeps the order the relay
read the ranks in, where no line waits). A line waits at most ``window_s`` after the relay read
it (the oldest line is always the first to be due), plus the time until the next :meth:`take`
(the supervisor's loop wakes at :meth:`next_due`). A queue holds at most about ``queue_bytes``
(:meth:`accepts`): the relay stops reading a stream whose lines wait, as a terminal's flow
control would, so memory stays bounded, and ranks that print the same lines as fast as they can
come back into step (a rank that started 100 ms later is caught up, not shown a second time
forever, unless the rank ahead floods: more than a queue per window of lines no rank said).

**A traceback is a rank's own.** From a line that starts one (``Traceback (most recent call
last):``, a fatal-signal dump, a ``SyntaxError``'s ``  File``) until its stream has been quiet
for ``window_s``, a rank's lines go into a block of their own that waits, while it grows, until
the rank's stream ends or the window of its first line passes, and then leaves whole: never
merged with another rank's lines, never interleaved with them.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable

from gpuwarden.units import rank_runs

# A stream's pending bytes before the relay stops reading it: large enough that a rank whose
# lines wait for silent ranks is not slowed (1 MiB per window is 20 MB/s; faster, it floods),
# bounded for all ranks.
QUEUE_BYTES = 1 << 20
MIN_QUEUE_BYTES = 64 * 1024
ALL_QUEUES_BYTES = 64 << 20
LOOKAHEAD_BYTES = 2048  # how far into a rank's queue a line is looked for (a few lines)
RECENT_LINES = 16384  # lines said without every rank, remembered to tell a rank behind ...
RECENT_BYTES = 4 << 20  # ... (each of two generations of a lane at most that many or bytes)
RUN_BYTES = 256 * 1024  # the most of a stream's lines without a twin that leave in one piece
# A stream whose last FLOOD_LINES lines found no twin, and whose queue is full of lines waiting
# for ranks that said nothing yet, floods (a rank writing its own lines faster than a queue per
# window): its lines stop waiting for silent ranks until one of them has a twin again.
FLOOD_LINES = 1000
LABEL_CHARS = 40  # a longer rank set is cut: "[rank0,2,4,...,62 (32 ranks)]"

# The start of what Python (or faulthandler) prints when something fails, at a line's start.
_TRACEBACK_START = re.compile(
    rb"^(?:Traceback \(most recent call last\):|Fatal Python error: |Exception in thread |"
    rb"Current thread 0x|Thread 0x|  File \")", re.MULTILINE)


# Pieces of those starts, looked for first (C-level ``in``, many times faster than the regex,
# which tries its alternatives at every line of every block the view is fed)
_TRACEBACK_MARKS = (b"Traceback (", b"Fatal Python error: ", b"Exception in thread ", b"hread 0x",
                    b'  File "')


def traceback_start(block: bytes) -> int | None:
    """The offset in ``block`` of the first line that starts a traceback, None when none does."""
    if not any(map(block.__contains__, _TRACEBACK_MARKS)):
        return None
    found = _TRACEBACK_START.search(block)
    return None if found is None else found.start()


class _Queue:
    """One stream of one rank: its pending lines."""

    __slots__ = ("rank", "is_err", "bit", "buf", "base", "chunks", "tokens", "solo",
                 "solo_bytes", "solo_first", "solo_order", "solo_until", "solo_tokens", "closed", "ahead",
                 "other", "streak", "flooding")

    def __init__(self, rank: int, is_err: bool) -> None:
        self.rank = rank
        self.is_err = is_err
        self.bit = 1 << rank
        self.buf = bytearray()  # complete lines, each ending in a newline
        self.base = 0  # the offset of buf[0] in everything this rank wrote on the stream
        # (end offset, read at, arrival number) of each block added: when each line came
        self.chunks: collections.deque[tuple[int, float, int]] = collections.deque()
        self.tokens: collections.deque[tuple[int, object]] = collections.deque()  # (end, token)
        # a traceback, after buf: the rank's lines on either stream from its start until the
        # rank is quiet, as (is_err, lines) in the order they came (kept by the stream where it
        # started: the other stream's later lines join it, so none overtakes it)
        self.solo: list[tuple[bool, bytearray]] | None = None
        self.solo_bytes = 0
        self.solo_first = 0.0
        self.solo_order = 0
        self.solo_until = 0.0  # traceback mode until then
        self.solo_tokens: list[object] = []
        self.closed = False
        self.ahead = False  # its next line waits for ranks behind it: not read meanwhile
        self.other: _Queue | None = None  # the rank's other stream
        self.streak = 0  # lines in a row that left without a twin
        self.flooding = False  # its lines do not wait for silent ranks (FLOOD_LINES)

    def head_time(self) -> float:
        return self.chunks[0][1] if self.buf else self.solo_first

    def head_order(self) -> int:
        return self.chunks[0][2] if self.buf else self.solo_order

    def busy(self) -> bool:
        return bool(self.buf) or self.solo is not None

    def head(self) -> bytes:
        """Its next line, with its newline (buf is not empty)."""
        return bytes(self.buf[:self.buf.index(b"\n") + 1])

    def blocked(self) -> bool:
        """An older line of the same rank waits on its other stream: this one waits too."""
        other = self.other
        return other is not None and other.busy() and other.head_order() < self.head_order()

    def before(self, order: int) -> int:
        """How many bytes of buf came before arrival number ``order`` (whole lines)."""
        start = self.base
        for end, _, n in self.chunks:
            if n > order:
                return start - self.base
            start = end
        return len(self.buf)

    def due(self, now: float, window_s: float) -> int:
        """How many bytes of buf have waited ``window_s`` at ``now`` (whole lines)."""
        start = self.base
        for end, at, _ in self.chunks:
            if at + window_s > now:  # as Collapser.next_due computes it
                break
            start = end
        return start - self.base

    def advance(self, n: int, dropped: list[object]) -> None:
        del self.buf[:n]
        self.base += n
        base = self.base
        chunks = self.chunks
        while chunks and chunks[0][0] <= base:
            chunks.popleft()
        tokens = self.tokens
        while tokens and tokens[0][0] <= base:
            dropped.append(tokens.popleft()[1])


class Collapser:
    """The lines of every shown rank's streams, waiting to be said once.

    :meth:`take` returns ``(is_err, mask, lines)``: ``mask`` the ranks as bits, ``lines`` one
    or more complete lines they all said on that stream; a traceback comes as
    ``(is_err, -1 - rank, lines)``."""

    def __init__(self, window_s: float, queue_bytes: int = QUEUE_BYTES) -> None:
        self.window_s = window_s
        self.queue_bytes = queue_bytes
        self._queues: dict[tuple[int, bool], _Queue] = {}
        self._busy: dict[tuple[int, bool], _Queue] = {}  # the queues holding something
        self._expected = [0, 0]  # the ranks whose stdout / stderr is open
        self._arrivals = 0
        self.dropped: list[object] = []  # tokens of lines that left (the caller's marks)
        # lines that left without every rank (without their newline) -> the ranks that said
        # them, per lane: the newer generation, then the older (_remember)
        self._recent: tuple[list[dict[bytes, int]], list[dict[bytes, int]]] = ([{}, {}],
                                                                              [{}, {}])
        self._recent_bytes = [0, 0]
        self.max_wait_s = 0.0  # the longest a line waited here (measured, for the docs)

    # ---- streams ---------------------------------------------------------------------------

    def open(self, rank: int, is_err: bool) -> None:
        q = self._queues[rank, is_err] = _Queue(rank, is_err)
        other = self._queues.get((rank, not is_err))
        if other is not None:
            q.other, other.other = other, q
        self._expected[is_err] |= q.bit
        # many streams: less each, ALL_QUEUES_BYTES in all
        self.queue_bytes = max(MIN_QUEUE_BYTES, min(self.queue_bytes,
                                                    ALL_QUEUES_BYTES // len(self._queues)))

    def close(self, rank: int, is_err: bool) -> None:
        """The stream ended: nothing waits for it any more; its traceback may leave."""
        q = self._queues[rank, is_err]
        q.closed = True
        self._expected[is_err] &= ~q.bit

    def accepts(self, rank: int, is_err: bool) -> bool:
        """Whether the relay should read more of the stream now (its queue is not full, its
        lines do not wait for ranks behind)."""
        q = self._queues[rank, is_err]
        return not q.ahead and len(q.buf) + q.solo_bytes < self.queue_bytes

    # ---- lines -----------------------------------------------------------------------------

    def add(self, rank: int, is_err: bool, block: bytes, now: float,
            traceback_at: int | None = None, token: object = None) -> None:
        """Complete lines (``block`` ends with a newline) that ``rank`` wrote on a stream, read
        at ``now``; ``traceback_at``: the offset of a line that starts a traceback; ``token``
        goes with the first line and is handed back in :attr:`dropped` when it has left."""
        q = self._queues[rank, is_err]
        self._arrivals += 1
        owner = _solo_owner(q, now)
        if owner is not None:
            # in a traceback until the rank is quiet; what follows one waiting comes after it
            self._solo(owner, is_err, block, now, token)
            return
        if traceback_at is not None:
            if traceback_at > 0:
                self._append(q, block[:traceback_at], now, token)
                token = None
                self._arrivals += 1
            self._solo(q, is_err, block[traceback_at:], now, token)
            return
        self._append(q, block, now, token)

    def _append(self, q: _Queue, block: bytes, now: float, token: object) -> None:
        self._busy[q.rank, q.is_err] = q
        start = q.base + len(q.buf)
        q.buf += block
        q.chunks.append((start + len(block), now, self._arrivals))
        if token is not None:
            q.tokens.append((start + block.index(b"\n") + 1, token))

    def _solo(self, q: _Queue, is_err: bool, block: bytes, now: float, token: object) -> None:
        if q.solo is None:
            q.solo = []
            q.solo_first = now
            q.solo_order = self._arrivals
            self._busy[q.rank, q.is_err] = q
        if q.solo and q.solo[-1][0] == is_err:
            q.solo[-1][1].extend(block)
        else:
            q.solo.append((is_err, bytearray(block)))
        q.solo_bytes += len(block)
        q.solo_until = now + self.window_s
        if token is not None:
            q.solo_tokens.append(token)

    def next_due(self) -> float | None:
        """When the oldest line must leave (None: nothing waits)."""
        if not self._busy:
            return None
        return min(q.head_time() for q in self._busy.values()) + self.window_s

    def take(self, now: float, everything: bool = False) -> list[tuple[bool, int, bytes]]:
        """What leaves now, in the order to print it."""
        out: list[tuple[bool, int, bytes]] = []
        busy = self._busy
        while busy:
            for first in sorted(busy.values(), key=_Queue.head_order):
                if not first.blocked() and self._leaves(first, now, everything, out):
                    break  # the queues changed: look again from the oldest
            else:
                break  # every head waits
        return out

    def _leaves(self, first: _Queue, now: float, everything: bool,
                out: list[tuple[bool, int, bytes]], nested: bool = False) -> bool:
        """Whether ``first``'s head (or, to keep order, another rank's before it) left now."""
        due = everything or first.head_time() + self.window_s <= now  # as next_due computes it
        if not first.buf:  # its next is a traceback: whole, once it ended or is due
            if not (due or first.closed):
                return False
            out += [(is_err, -1 - first.rank, bytes(lines)) for is_err, lines in first.solo or ()]
            self.dropped += first.solo_tokens
            t0 = first.head_time()
            first.solo, first.solo_tokens, first.solo_bytes = None, [], 0
            self._settle(first, now, t0)
            return True
        is_err = first.is_err
        lane = [q for q in self._busy.values() if q.is_err == is_err and q.buf]
        line = first.head()
        same = [q for q in lane if q.buf.startswith(line) and (q is first or not q.blocked())]
        if due and not nested:
            # a rank with this line too, held back by an older line of its other stream that is
            # due as well: that line goes first, so that this one can still be said once
            for q in lane:
                other = q.other
                if q is not first and other is not None and q.buf.startswith(line) \
                        and q.blocked() and other.head_time() + self.window_s <= now:
                    return self._leaves(other, now, everything, out, nested=True)
        mask = 0
        for q in same:
            mask |= q.bit
        # a rank with the line a few lines on: its own lines before it go first
        needle = b"\n" + line
        later = [q for q in lane if not q.bit & mask and not q.blocked()
                 and q.buf.find(needle, 0, LOOKAHEAD_BYTES) >= 0]
        if later:
            q = min(later, key=_Queue.head_order)
            head = q.head()
            ranks = [p for p in lane if p.buf.startswith(head) and (p is q or not p.blocked())]
            self._go(out, q, ranks, lane, head, now, None)
            return True
        expected = self._expected[is_err]
        if not due and self._holds(first, lane, line, same, mask):
            return False
        if not expected & ~mask and len(same) > 1:
            # ranks in step: everything they have in common, up to a line of their other
            # stream that came in between
            lines = _common_lines(same)
            limit = len(lines)
            for q in same:
                other = q.other
                if other is not None and other.busy():
                    limit = min(limit, q.before(other.head_order()))
            if limit < len(lines):
                lines = lines[:max(lines.rfind(b"\n", 0, limit) + 1, len(line))]
            self._say(out, same, lines, now)
            return True
        # a line due leaves with the lines after it that are due too: the others may still wait
        self._go(out, first, same, lane, line, now, now if due and not everything else None)
        return True

    def _holds(self, first: _Queue, lane: list[_Queue], line: bytes, same: list[_Queue],
               mask: int) -> bool:
        """Whether ``first``'s head (``line``, which the ranks of ``same``, ``mask``, have next)
        waits for the other ranks that may say it next: those that said nothing yet
        (unless ``first`` floods and has no twin), those with the line held back by their
        other stream, and those behind (their next line is one these ranks said already),
        while which the ranks ahead are not read (they catch up meanwhile)."""
        others = silent = self._expected[first.is_err] & ~mask
        newer, older = self._recent[first.is_err]
        held = behind = False
        for q in lane:
            if others & q.bit:
                silent &= ~q.bit
                head = q.head()
                if head == line:
                    held = True  # the same line, held back by its rank's other stream
                elif (newer.get(head[:-1], 0) | older.get(head[:-1], 0)) & mask:
                    behind = True  # these ranks said its next line already
                # else: its next line is another, it has moved past
        for q in self._busy.values():
            if q.is_err == first.is_err and not q.buf:
                silent &= ~q.bit  # in a traceback
        if behind:
            for q in same:
                q.ahead = True
                q.flooding = False  # its lines have twins after all, late ones
            return True
        if held or not silent or len(same) > 1:
            return held or bool(silent)
        if not first.flooding and first.streak >= FLOOD_LINES \
                and len(first.buf) + first.solo_bytes >= self.queue_bytes:
            first.flooding = True  # holding it would pause its rank: it would not catch up
        return not first.flooding

    def _go(self, out: list[tuple[bool, int, bytes]], first: _Queue, same: list[_Queue],
            lane: list[_Queue], line: bytes, now: float, due_at: float | None) -> None:
        """``line``, ``first``'s next, leaves with the ranks of ``same``; a line without a
        twin takes the lines of its rank that follow it along (:meth:`_run`)."""
        if len(same) == 1:
            line, texts = self._run(first, lane, line, due_at)
        else:
            texts = [line[:-1]]
        mask = sum(q.bit for q in same)
        if self._expected[first.is_err] & ~mask:
            self._remember(first.is_err, texts, len(line), mask)
        self._say(out, same, line, now)

    def _remember(self, is_err: bool, texts: list[bytes], size: int, mask: int) -> None:
        """Lines (``texts``, without their newlines, ``size`` bytes with them) that the ranks of
        ``mask`` said without every rank: a rank that says them later is behind (_holds)."""
        generations = self._recent[is_err]
        newer = generations[0]
        # said lately by other ranks too (a rank catching up): their bits are kept; a loop over
        # those lines only, the others in one C-level update
        again = {text: newer[text] | mask for text in newer.keys() & texts} if newer else None
        newer.update(dict.fromkeys(texts, mask))
        if again:
            newer.update(again)
        self._recent_bytes[is_err] += size
        if len(newer) >= RECENT_LINES or self._recent_bytes[is_err] >= RECENT_BYTES:
            generations[1], generations[0] = newer, {}
            self._recent_bytes[is_err] = 0

    def _run(self, q: _Queue, lane: list[_Queue], line: bytes,
             due_at: float | None) -> tuple[bytes, list[bytes]]:
        """``line``, ``q``'s next, has no twin: with it go the lines of ``q`` after it that
        have none either among the next lines of the other ranks (as :meth:`_leaves` looks
        for one), read before the next line of every other rank that is after it (the screen
        keeps the order the relay read the ranks in) and of its other stream, and (``due_at``
        given) those due then; at most :data:`RUN_BYTES`, found with C-level splits and set
        operations, not line by line. Returns them, and them split (without newlines)."""
        buf = q.buf
        end = min(len(buf), RUN_BYTES)
        order = q.head_order()
        for p in lane:
            if p is not q and p.head_order() > order:
                end = min(end, q.before(p.head_order()))
        other = q.other
        if other is not None and other.busy():
            end = min(end, q.before(other.head_order()))
        if due_at is not None:
            end = min(end, q.due(due_at, self.window_s))
        end = buf.rfind(b"\n", 0, end) + 1
        if end <= len(line):
            return line, [line[:-1]]
        run = bytes(buf[:end])
        lines = run[:-1].split(b"\n")
        twins: set[bytes] = set()
        for p in lane:
            if p is not q:
                twins.add(p.head()[:-1])
                ahead = bytes(p.buf[:LOOKAHEAD_BYTES]).split(b"\n")
                ahead.pop()  # cut by the bound (or empty): not a line
                twins.update(ahead)
        if not twins.isdisjoint(lines):
            for n in range(1, len(lines)):
                if lines[n] in twins:
                    del lines[n:]
                    run = b"\n".join(lines) + b"\n"
                    break
        return run, lines

    def _say(self, out: list[tuple[bool, int, bytes]], same: list[_Queue], lines: bytes,
             now: float) -> None:
        mask = 0
        n = len(lines)
        for q in same:
            mask |= q.bit
            t0 = q.head_time()
            q.ahead = False
            q.advance(n, self.dropped)
            self._settle(q, now, t0)
        if len(same) == 1:
            same[0].streak += lines.count(b"\n")
        else:  # a twin: the ranks' lines are worth holding for one again
            for q in same:
                q.streak = 0
                q.flooding = False
        out.append((same[0].is_err, mask, lines))

    def _settle(self, q: _Queue, now: float, t0: float) -> None:
        if now - t0 > self.max_wait_s:
            self.max_wait_s = now - t0
        if not q.busy():
            self._busy.pop((q.rank, q.is_err), None)

    def pending(self, rank: int, is_err: bool) -> int:
        q = self._queues[rank, is_err]
        return len(q.buf) + q.solo_bytes

    def validate(self) -> None:
        """The invariants (tests): arrival in order, every queue of lines ends a line."""
        for key, q in self._queues.items():
            assert not q.buf or q.buf.endswith(b"\n"), q.buf
            orders = [n for _, _, n in q.chunks]
            assert orders == sorted(orders), orders
            assert not q.buf or (q.chunks and q.chunks[-1][0] == q.base + len(q.buf))
            assert (key in self._busy) == q.busy(), key


def _solo_owner(q: _Queue, now: float) -> _Queue | None:
    """The stream of ``q``'s rank whose traceback block takes ``q``'s new lines (None: the rank
    is in no traceback): one waiting first, else one whose rank has not been quiet since."""
    other = q.other
    for candidate in (q, other):
        if candidate is not None and candidate.solo is not None:
            return candidate
    for candidate in (q, other):
        if candidate is not None and now < candidate.solo_until:
            return candidate
    return None


def _common_lines(queues: list[_Queue]) -> bytes:
    """The longest run of whole lines at the head of every queue (C-level comparisons)."""
    bufs = [q.buf for q in queues]
    end = min(len(b) for b in bufs)
    first = bufs[0]
    good = first.index(b"\n") + 1  # every queue starts with this line
    if all(b.startswith(first[:end]) for b in bufs[1:]):
        good = end
    else:
        low, high = good, end  # the common prefix is at least low and less than high
        while high - low > 1:
            mid = (low + high) // 2
            probe = first[:mid]
            if all(b.startswith(probe) for b in bufs[1:]):
                low = mid
            else:
                high = mid
        good = low
    return bytes(first[:first.rfind(b"\n", 0, good) + 1])


def bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def rank_set(ranks: Iterable[int]) -> str:
    """``0-7``, ``0,2,5``, ``0-3,8-11``: runs of consecutive ranks as ranges (as ``gpuwarden
    stacks`` writes them, without its spaces); a set longer than :data:`LABEL_CHARS` is cut and
    counted: ``0,2,4,6,8,...,62 (32 ranks)``."""
    unique = set(ranks)
    parts = rank_runs(unique)
    text = ",".join(parts)
    if len(text) <= LABEL_CHARS:
        return text
    kept: list[str] = []
    for part in parts[:-1]:
        if len(",".join([*kept, part])) > LABEL_CHARS - 8:
            break
        kept.append(part)
    return f"{','.join(kept)},...,{parts[-1]} ({len(unique)} ranks)"


def label(ranks: Iterable[int], node: int | None = None) -> bytes:
    """The console's tag of a line said by ``ranks``: ``[rank0-7]:``, ``[node1 rank8-15]:``."""
    where = f"node{node} " if node is not None else ""
    return f"[{where}rank{rank_set(ranks)}]:".encode()
