"""Identical lines of several ranks said once (launch/ranks/collapse.py), driven as the relay
drives it, without processes: blocks of lines in at given times, take() at every event and at
every deadline it names. What a user relies on: each line shown once per rank that said it, a
rank's lines in the order it wrote them (its two streams together), no line held longer than
the window, a traceback whole and its rank's own."""

from __future__ import annotations

import random

import pytest

from gpuwarden.launch.ranks.collapse import (
    RECENT_LINES,
    Collapser,
    bits,
    label,
    rank_set,
    traceback_start,
)

WINDOW = 0.05


class Driver:
    """The collapser and a clock; what left, when."""

    def __init__(self, ranks: int, streams: tuple[bool, ...] = (False,),
                 window_s: float = WINDOW) -> None:
        self.c = Collapser(window_s)
        self.now = 0.0
        self.out: list[tuple[float, bool, int, bytes]] = []  # (when, is_err, mask, lines)
        self.read_at: dict[tuple[int, bool], list[float]] = {}  # when each line was added
        for r in range(ranks):
            for is_err in streams:
                self.c.open(r, is_err)
                self.read_at[r, is_err] = []

    def add(self, rank: int, block: bytes, is_err: bool = False, token: object = None) -> None:
        self.c.add(rank, is_err, block, self.now, traceback_start(block), token)
        self.read_at[rank, is_err] += [self.now] * block.count(b"\n")
        self.take()

    def take(self, everything: bool = False) -> None:
        for is_err, mask, lines in self.c.take(self.now, everything):
            self.out.append((self.now, is_err, mask, lines))
        self.c.validate()

    def advance(self, to: float) -> None:
        """Time passes: take() at every deadline on the way, as the supervisor's loop wakes."""
        while True:
            due = self.c.next_due()
            if due is None or due > to:
                break
            self.now = max(self.now, due)
            self.take()
        self.now = to
        self.take()

    def close(self, rank: int, is_err: bool = False) -> None:
        self.c.close(rank, is_err)
        self.take()

    def screen(self) -> list[str]:
        lines = []
        for _, _, mask, block in self.out:
            tag = label(bits(mask)).decode() if mask >= 0 else f"[rank{-1 - mask}]:"
            lines += [f"{tag} {line}" for line in block.decode().splitlines()]
        return lines

    def said_by(self, rank: int, is_err: bool = False) -> list[tuple[float, bytes]]:
        """The lines shown for ``rank`` on a stream, with when each was shown."""
        got = []
        for when, err, mask, block in self.out:
            if err == is_err and (mask == -1 - rank or (mask >= 0 and mask >> rank & 1)):
                got += [(when, line) for line in block.splitlines()]
        return got


def test_ranks_in_step_say_each_line_once_whatever_the_chunks() -> None:
    d = Driver(8)
    data = b"".join(b"step %d loss 0.5\n" % i for i in range(2000))
    cuts = {r: sorted(random.Random(r).sample(range(1, len(data)), 40)) for r in range(8)}
    pos = dict.fromkeys(range(8), 0)
    for n in range(41):
        for r in range(8):
            end = cuts[r][n] if n < 40 else len(data)
            end = data.rfind(b"\n", 0, end) + 1 if n < 40 else end  # whole lines, as the view feeds
            if end > pos[r]:
                d.add(r, data[pos[r]:end])
                pos[r] = end
        d.advance(d.now + 0.001)
    d.advance(d.now + 1)
    assert d.screen() == [f"[rank0-7]: step {i} loss 0.5" for i in range(2000)]
    assert len(d.out) < 200  # runs of lines, not one entry per line


def test_a_line_waits_for_a_silent_rank_at_most_the_window() -> None:
    d = Driver(3)
    d.add(0, b"epoch 1 done\n")
    d.advance(0.02)
    d.add(1, b"epoch 1 done\n")
    assert d.out == []  # rank 2 said nothing yet
    d.advance(0.2)
    assert d.out == [(WINDOW, False, 0b011, b"epoch 1 done\n")]  # left at its deadline
    d.add(2, b"epoch 1 done\n")
    d.advance(0.4)
    assert d.screen() == ["[rank0-1]: epoch 1 done", "[rank2]: epoch 1 done"]
    assert d.c.max_wait_s == pytest.approx(WINDOW)


def test_a_line_every_rank_said_leaves_at_once() -> None:
    d = Driver(4)
    for r in range(4):
        d.add(r, b"epoch 1 done\n")
        d.now += 0.001
    assert d.screen() == ["[rank0-3]: epoch 1 done"]
    assert d.out[0][0] == pytest.approx(0.003)


def test_lines_that_differ_leave_at_once_when_every_rank_has_moved_on() -> None:
    d = Driver(2)
    d.add(0, b"rank 0 loss 0.5\nrank 0 loss 0.4\n")
    assert d.out == []  # rank 1 might say it
    d.add(1, b"rank 1 loss 0.7\nrank 1 loss 0.6\n")
    # rank 1's next line is another: rank 0's both leave at once; rank 1's wait for rank 0,
    # which has said nothing after them yet
    assert d.screen() == ["[rank0]: rank 0 loss 0.5", "[rank0]: rank 0 loss 0.4"]
    assert d.out[-1][0] == 0
    d.add(0, b"rank 0 loss 0.3\n")
    assert d.screen()[2:] == ["[rank1]: rank 1 loss 0.7", "[rank1]: rank 1 loss 0.6"]


def test_a_rank_that_printed_a_line_of_its_own_first_still_shares_the_next() -> None:
    d = Driver(3)
    d.add(0, b"epoch 1 done\n")
    d.add(1, b"rank 1: saved shard\nepoch 1 done\n")
    d.add(2, b"epoch 1 done\n")
    assert d.screen() == ["[rank1]: rank 1: saved shard", "[rank0-2]: epoch 1 done"]


def test_a_rank_behind_catches_up_while_the_ranks_ahead_wait_unread() -> None:
    d = Driver(2)
    # rank 1 is late: rank 0's first lines leave alone once their window passed
    d.add(0, b"".join(b"step %d\n" % i for i in range(10)))
    d.advance(0.06)
    d.add(0, b"".join(b"step %d\n" % i for i in range(10, 20)))
    assert d.c.accepts(0, False)
    # rank 1 starts: its lines are ones rank 0 said already; rank 0's wait for it, unread
    d.add(1, b"".join(b"step %d\n" % i for i in range(5)))
    assert not d.c.accepts(0, False) and d.c.accepts(1, False)
    d.add(1, b"".join(b"step %d\n" % i for i in range(5, 20)))
    assert d.c.accepts(0, False)
    d.advance(1)
    assert d.screen() == ([f"[rank0]: step {i}" for i in range(10)]
                          + [f"[rank1]: step {i}" for i in range(10)]
                          + [f"[rank0-1]: step {i}" for i in range(10, 20)])


def test_a_rank_s_two_streams_keep_their_order() -> None:
    """tqdm's bar ends on stderr, then the script prints on stdout: never the other way round,
    even when the stderr line waits for the other ranks."""
    d = Driver(2, streams=(False, True))
    d.add(0, b"rank 0: 100%|####|\n", is_err=True)
    d.now += 0.001
    d.add(0, b"epoch 1 done\n")
    d.add(1, b"rank 1: 100%|####|\n", is_err=True)
    d.now += 0.001
    d.add(1, b"epoch 1 done\n")
    d.advance(1)
    assert d.screen() == ["[rank0]: rank 0: 100%|####|", "[rank1]: rank 1: 100%|####|",
                          "[rank0-1]: epoch 1 done"]


def test_a_traceback_is_its_rank_s_own_and_whole_among_identical_lines() -> None:
    d = Driver(4, streams=(False, True))
    tb = (b"Traceback (most recent call last):\n"
          b'  File "train.py", line 40, in <module>\n'
          b"    step()\n"
          b"ValueError: rank 3 gives up\n")
    for r in range(3):
        d.add(r, b"step 1\n")
    d.add(3, tb[:60], is_err=True)  # a traceback arrives in pieces, among the others' lines
    for r in range(3):
        d.add(r, b"step 2\n")
    d.add(3, tb[60:], is_err=True)
    d.close(3, is_err=True)
    d.close(3)
    d.advance(1)
    screen = d.screen()
    assert screen.count("[rank0-2]: step 1") == 1 and screen.count("[rank0-2]: step 2") == 1
    start = screen.index("[rank3]: Traceback (most recent call last):")
    assert screen[start:start + 4] == ["[rank3]: " + line for line in tb.decode().splitlines()]


def test_tracebacks_of_several_ranks_are_never_merged() -> None:
    d = Driver(2, streams=(True,))
    tb = b"Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'lr'\n"
    d.add(0, tb, is_err=True)
    d.add(1, tb, is_err=True)
    d.advance(1)
    assert d.screen() == [f"[rank{r}]: {line}" for r in (0, 1)
                          for line in tb.decode().splitlines()]


def test_a_bar_s_token_comes_back_when_its_last_state_left() -> None:
    d = Driver(2)
    d.add(0, b"100%|####|\n", token="bar0")
    assert d.c.dropped == []
    d.advance(1)
    assert d.c.dropped == ["bar0"]


def test_a_full_queue_is_not_read_until_it_drains() -> None:
    d = Driver(2)
    c = d.c
    while c.accepts(0, False):
        d.add(0, b"x" * 1000 + b"\n")
    assert c.pending(0, False) >= c.queue_bytes
    d.advance(1)
    assert c.accepts(0, False) and c.pending(0, False) == 0


def test_lines_of_each_rank_s_own_leave_in_runs_in_the_order_read() -> None:
    """Ranks printing lines no other rank says (their own losses, paths): each block read
    leaves as one run, not one entry per line, and the screen keeps the order the relay read
    the ranks in."""
    d = Driver(2)
    for n in range(20):
        for r in range(2):
            d.add(r, b"".join(b"rank %d step %d\n" % (r, i) for i in range(n * 100, n * 100 + 100)))
        d.advance(d.now + 0.001)
    d.advance(d.now + 1)
    for r in range(2):
        assert [line for _, line in d.said_by(r)] == [b"rank %d step %d" % (r, i)
                                                      for i in range(2000)]
    assert [mask for _, _, mask, _ in d.out] == [0b01, 0b10] * 20


def _rows(rank: int, start: int, n: int) -> bytes:
    return b"".join(b"rank %d row %06d loss 0.1234 lr 3e-4\n" % (rank, i)
                    for i in range(start, start + n))


def test_a_rank_flooding_lines_of_its_own_is_not_paused_for_a_silent_rank() -> None:
    """Rank 0 writes lines no other rank says faster than a queue per window (36 MB/s) while
    rank 1 says nothing: after its first window its lines stop waiting for rank 1, so the relay
    reads it whenever it has something and each line leaves as it is read; its first line
    shared with rank 1 makes its lines wait for rank 1 again."""
    d = Driver(2)
    refused = []  # when the relay could not read rank 0 (its queue full of waiting lines)
    written = 0
    while d.now < 0.3:
        if d.c.accepts(0, False):
            d.add(0, _rows(0, written, 1000))
            written += 1000
        else:
            refused.append(d.now)
        d.advance(d.now + 0.001)
    assert refused and max(refused) < 2 * WINDOW  # paused in its first window only
    shown = d.said_by(0)
    assert len(shown) == written
    late = [(when, read) for (when, _), read in zip(shown, d.read_at[0, False], strict=True)
            if read >= 2 * WINDOW]
    assert late and all(when == read for when, read in late)  # none waited
    # a line both ranks say: said once, and rank 0's lines wait for rank 1 again
    d.add(1, b"epoch 1 done\n")
    d.add(0, b"epoch 1 done\n")
    assert d.screen()[-1] == "[rank0-1]: epoch 1 done"
    d.add(0, b"rank 0: saved\n")
    assert d.screen()[-1] == "[rank0-1]: epoch 1 done"
    d.advance(d.now + 1)
    assert d.out[-1][0] == pytest.approx(d.read_at[0, False][-1] + WINDOW)


def test_a_rank_printing_its_own_lines_at_a_readable_pace_never_floods() -> None:
    """Thousands of lines no other rank says, but slower than a queue per window: each still
    waits the window for the silent rank (where it may say the same), as the first did."""
    d = Driver(2)
    for n in range(200):
        d.add(0, _rows(0, n * 20, 20))
        d.advance(d.now + 0.001)
    d.advance(d.now + 1)
    waits = [when - read for (when, _), read in zip(d.said_by(0), d.read_at[0, False],
                                                    strict=True)]
    assert len(waits) == 4000 and min(waits) >= WINDOW - 1e-9


def test_a_rank_stalled_for_thousands_of_lines_is_caught_up() -> None:
    """Two ranks print lines of their own, then the same lines; rank 1 stalls while rank 0
    says RECENT_LINES lines alone (slower than a queue per window: rank 0 does not flood).
    When rank 1 goes on, rank 0 is read no further until rank 1 has caught up, and their lines
    are said once again (however many lines of its own rank 0 said before)."""
    d = Driver(2)
    for n in range(14):
        for r in range(2):
            d.add(r, b"".join(b"rank %d: setup %d\n" % (r, i) for i in range(n * 500, n * 500 + 500)))
        d.advance(d.now + 0.001)
    total = 500 + RECENT_LINES + 6000

    def block(start: int) -> bytes:
        return b"".join(b"step %d loss 0.5\n" % i for i in range(start, min(start + 500, total)))

    d.add(0, block(0))
    d.add(1, block(0))
    pos = [500, 500]
    while pos[0] < 500 + RECENT_LINES:  # rank 1 stalls
        d.add(0, block(pos[0]))
        pos[0] += 500
        d.advance(d.now + 0.001)
    d.advance(d.now + 2 * WINDOW)  # ... past the window: rank 0's lines left alone
    refused = 0
    while pos[1] < total:
        if d.c.accepts(0, False) and pos[0] < total:
            d.add(0, block(pos[0]))
            pos[0] += 500
        elif pos[0] < total:
            refused += 1
        d.add(1, block(pos[1]))
        pos[1] += 500
        d.advance(d.now + 0.001)
    d.advance(d.now + 1)
    assert refused > 0  # rank 0 waited for rank 1
    assert d.screen()[-3000:] == [f"[rank0-1]: step {i} loss 0.5" for i in range(total - 3000, total)]


@pytest.mark.parametrize("seed", range(100))
def test_random_ranks_streams_and_timing_keep_every_rule(seed: int) -> None:
    """Ranks printing lines from a small vocabulary (so lines repeat within and across ranks),
    on two streams, in random blocks at random times, some ending early: every line shown
    exactly once for each rank that said it, in each rank's order, none held past the window."""
    rnd = random.Random(seed)
    ranks = rnd.randint(2, 6)
    d = Driver(ranks, streams=(False, True))
    vocab = [b"epoch %d done" % i for i in range(4)] + [b"loss 0.5", b"", b"x"]
    written: dict[tuple[int, bool], list[bytes]] = {(r, e): [] for r in range(ranks)
                                                    for e in (False, True)}
    order: dict[int, list[tuple[float, bool, bytes]]] = {r: [] for r in range(ranks)}
    closed: set[tuple[int, bool]] = set()
    for _ in range(rnd.randint(20, 80)):
        d.advance(d.now + rnd.choice([0, 0.001, 0.01, 0.03, 0.2]))
        key = (rnd.randrange(ranks), rnd.random() < 0.3)
        if key in closed:
            continue
        if rnd.random() < 0.03:
            d.close(*key)
            closed.add(key)
            continue
        lines = [rnd.choice(vocab) for _ in range(rnd.randint(1, 5))]
        if rnd.random() < 0.05:
            lines = [b"Traceback (most recent call last):", b'  File "a.py", line 1',
                     b"ValueError: x"]
        written[key] += lines
        order[key[0]] += [(d.now, key[1], line) for line in lines]
        d.add(key[0], b"\n".join(lines) + b"\n", is_err=key[1])
    d.advance(d.now + 1)
    for key in written:
        if key not in closed:
            d.close(*key)
    d.take(everything=True)
    for (r, is_err), lines in written.items():
        shown = d.said_by(r, is_err)
        assert [line for _, line in shown] == lines, (r, is_err)
        for (when, _), read in zip(shown, d.read_at[r, is_err], strict=True):
            assert when - read <= WINDOW + 1e-9, (r, is_err, when, read)
    for r, events in order.items():  # both streams of a rank together, in order
        shown_at = []
        for is_err in (False, True):
            it = iter(d.said_by(r, is_err))
            shown_at += [(next(it)[0], n) for n, (_, e, _) in enumerate(events) if e == is_err]
        shown_at.sort(key=lambda x: x[1])
        times = [t for t, _ in shown_at]
        assert times == sorted(times), r


def test_rank_sets_read_as_stacks_writes_them() -> None:
    assert rank_set(range(8)) == "0-7"
    assert rank_set([0, 2, 5]) == "0,2,5"
    assert rank_set([0, 1, 2, 3, 8, 9, 10, 11]) == "0-3,8-11"
    assert rank_set([0, 1]) == "0-1"
    long = rank_set(range(0, 64, 2))
    assert long.endswith(",...,62 (32 ranks)") and len(long) <= 60
    assert label([8, 9, 10], node=1) == b"[node1 rank8-10]:"
    assert label([3]) == b"[rank3]:"


def test_the_start_of_a_traceback_is_found_where_python_prints_one() -> None:
    block = b"step 1\nTraceback (most recent call last):\n  File \"a\", line 1\n"
    assert traceback_start(block) == len(b"step 1\n")
    assert traceback_start(b"Fatal Python error: Segmentation fault\n") == 0
    assert traceback_start(b'  File "bad.py", line 2\n    def f(:\n') == 0  # SyntaxError
    assert traceback_start(b"no Traceback (most recent call last): here\n") is None
