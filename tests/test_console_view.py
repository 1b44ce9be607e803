"""The terminal's view of several ranks (launch/ranks/terminal.py) driven as the relay drives
it, without processes: a clock, a console that keeps what it is given, feed() as reads come,
accepts() after each as the relay asks it, tick() after each round of reads."""

from __future__ import annotations

from gpuwarden.launch.ranks.terminal import TerminalView

WINDOW = 0.05


class Screen:
    """What the view wrote, in order."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write_direct(self, data: bytes) -> None:
        self.data += data

    def winsize(self) -> bytes | None:
        return None


def test_a_line_cut_by_a_read_is_no_prompt_while_its_rank_is_not_read() -> None:
    """Rank 0's lines wait for rank 1 and fill its queue: the relay stops reading rank 0 with
    half a line read. That half is not shown as a prompt when the window passes: the rest is
    unread, and the line comes whole once rank 0 is read again."""
    now = [0.0]
    screen = Screen()
    view = TerminalView(screen, window_s=WINDOW, clock=lambda: now[0], size=lambda: (200, 50))
    rank0 = view.stream(0, False, b"[rank0]: ", b"[rank0]:")
    view.stream(1, False, b"[rank1]: ", b"[rank1]:")
    assert view.collapser is not None
    view.collapser.queue_bytes = 100  # (a few lines: as a full one of 1 MiB)
    rank0.feed(b"".join(b"step %d loss 0.1234 lr 3e-4\n" % i for i in range(4)) + b"ste")
    view.tick()
    assert not rank0.accepts()  # the relay pauses it
    for _ in range(3):  # its lines leave at their window, rank 1 silent: the relay asks again
        due = view.next_due()
        assert due is not None
        now[0] = due
        view.tick()
        if rank0.accepts():
            break
    assert b"step 3 loss" in screen.data and b"ste" not in screen.data.split(b"step 3 loss")[1]
    now[0] += 0.001
    rank0.feed(b"p 4 loss 0.1234 lr 3e-4\n")
    view.tick()
    view.close()
    lines = bytes(screen.data).split(b"\n")
    assert b"[rank0]: step 4 loss 0.1234 lr 3e-4" in lines
    assert not [line for line in lines if line.endswith(b"ste")]
