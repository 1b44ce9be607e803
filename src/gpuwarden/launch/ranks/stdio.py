"""A rank's stdout and stderr as the rank gets them: a pseudo-terminal for a stream that goes to
a terminal console (torchrun's rank writes to that terminal itself), a pipe for every other one
(launch/ranks/relay.py reads and relays what comes out of them).

Moved out of relay.py with issue 37 (the terminal's size now follows SIGWINCH): relay.py keeps
what is done with the bytes, this module what the rank writes them into.
"""

from __future__ import annotations

import contextlib
import os
import struct
from typing import Protocol


class Terminal(Protocol):
    """The console a pseudo-terminal mirrors (relay.Console on a terminal)."""

    def winsize(self) -> bytes | None: ...  # struct winsize, None when unknown


class RankStdio:
    """The descriptors one rank's stdout and stderr are made of, and the ends the supervisor
    reads: a pseudo-terminal for a stream that goes to a terminal console (torchrun's rank
    writes to that terminal itself), a pipe for every other one.

    ``child_out``/``child_err`` are given to the rank and closed here once it started
    (:meth:`started`), so that the rank's exit ends the stream; ``reads`` are ``(fd, is_err)``,
    non-blocking, closed by :meth:`close`. A pseudo-terminal passes bytes unchanged (no
    ``\\n`` to ``\\r\\n``), has the console's size less the prefix's width (a progress bar
    fits one line), follows the console's size when it changes (:meth:`resize`), and is no
    controlling terminal of the rank (its own session), as under torchrun, where ranks run in
    sessions of their own too.
    """

    def __init__(self, tty_out: Terminal | None, tty_err: Terminal | None, prefix_width: int) -> None:
        self.reads: list[tuple[int, bool]] = []
        self._child: list[int] = []
        self._ptys: list[tuple[int, Terminal]] = []  # (our end, the console it mirrors)
        self.prefix_width = prefix_width
        try:
            self.child_out = self._open(False, tty_out, prefix_width)
            self.child_err = self._open(True, tty_err, prefix_width)
        except OSError:
            self.started()
            self.close()
            raise

    def _open(self, is_err: bool, tty: Terminal | None, prefix_width: int) -> int:
        if tty is None:
            read, write = os.pipe()
        else:
            read, write = os.openpty()
            _raw_output(write, tty.winsize(), prefix_width)
            self._ptys.append((read, tty))
        os.set_blocking(read, False)
        self.reads.append((read, is_err))
        self._child.append(write)
        return write

    def resize(self) -> None:
        """The console's size changed (SIGWINCH): the rank's pseudo-terminals take it, less the
        prefix, as a rank under torchrun reads the terminal's new size when it asks."""
        for fd, tty in self._ptys:
            size = _rank_size(tty.winsize(), self.prefix_width)
            if size is not None:
                import fcntl
                import termios

                with contextlib.suppress(OSError):
                    fcntl.ioctl(fd, termios.TIOCSWINSZ, size)

    def started(self) -> None:
        """The rank holds its own copies now (or never will): close the parent's."""
        for fd in self._child:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._child.clear()

    def close(self) -> None:
        for fd, _ in self.reads:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.reads.clear()
        self._ptys.clear()


def _raw_output(slave: int, winsize: bytes | None, prefix_width: int) -> None:
    import fcntl
    import termios

    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST  # oflag: what the rank writes arrives unchanged
    attrs[3] &= ~termios.ECHO  # lflag: nothing is typed into it (stdin is the launcher's)
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    size = _rank_size(winsize, prefix_width)
    if size is not None:
        with contextlib.suppress(OSError):
            fcntl.ioctl(slave, termios.TIOCSWINSZ, size)


def _rank_size(winsize: bytes | None, prefix_width: int) -> bytes | None:
    if winsize is None:
        return None
    rows, cols, xpix, ypix = struct.unpack("HHHH", winsize)
    cols = max(20, cols - prefix_width) if cols else cols
    return struct.pack("HHHH", rows, cols, xpix, ypix)
