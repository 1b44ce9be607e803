"""The launcher's signals: what arrived, recorded by handlers that do nothing else, and a
wake-up of the supervisor's loop (a socket in its selector, ``signal.set_wakeup_fd``).

- a stop (SIGINT, SIGTERM, ...): the first names the interrupt and is what the ranks are sent;
  a second one hurries the stop (SIGKILL without the grace);
- a notice to pass on to the ranks (SIGUSR1/2: Slurm's preemption notice): passed on once,
  and not at all when its sender reached the ranks too (:meth:`LauncherSignals.pass_on`);
- SIGWINCH, when the console is a terminal: its new size goes to the ranks' terminals;
- SIGCHLD only wakes the loop: a rank's death is handled within milliseconds.

Handlers are installed from the main thread only; elsewhere the loop still polls.
"""

from __future__ import annotations

import contextlib
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from gpuwarden.launch.config import stop_signals

if TYPE_CHECKING:
    from gpuwarden.launch.ranks.pcontext import ProcessContext

# A signal to pass on to the ranks that the watcher does not hold (yet) is passed on after this:
# a sender that signals a whole process tree (Slurm's proctrack/linuxproc) does it one process
# after the other, and on a loaded machine may be scheduled out between two of them — 0.25 s
# was too short beside a CPU hog (load 12: the watcher's signal came later, the launcher passed
# it on too, every rank's handler ran twice). A notice that reaches the launcher alone
# (proctrack/pgid) reaches the ranks this much later: Slurm's `--signal=USR1@T` itself may come
# up to 60 s early, a preemption notice is not to the second.
NOTICE_SENDER_WAIT_S = 2.0


class LauncherSignals:
    """What the signals asked, for the loop to act on. ``wakeup_key`` marks the wake-up
    socket's key in the selector (its ``data`` is None)."""

    def __init__(self, sel: selectors.BaseSelector, forwarded: Iterable[signal.Signals], *,
                 watch_resize: bool) -> None:
        self._sel = sel
        self._forwarded = tuple(forwarded)
        self._watch_resize = watch_resize
        self.interrupt: str | None = None  # the first stop signal's name
        self.stop_signal = signal.SIGTERM  # what a stop sends the ranks: the one received
        self.hurry = False  # a second stop signal (Ctrl-C twice): SIGKILL without the grace
        self.notices: list[tuple[signal.Signals, float]] = []  # to pass on, with when they came
        self.resized = False  # SIGWINCH: the terminal's size changed
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup_fd: int | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers only work there; the loop still polls every interval
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._sel.register(self._wake_r.fileno(), selectors.EVENT_READ, None)
        self._old_wakeup_fd = signal.set_wakeup_fd(self._wake_w.fileno())

        def on_stop(signum: int, _frame: Any) -> None:
            if self.interrupt is None:
                self.interrupt = signal.Signals(signum).name
                self.stop_signal = signal.Signals(signum)
            else:
                self.hurry = True  # asked twice: the user will not wait out the grace

        def on_forward(signum: int, _frame: Any) -> None:
            self.notices.append((signal.Signals(signum), time.monotonic()))

        def on_resize(_signum: int, _frame: Any) -> None:
            self.resized = True  # the loop passes the new size on (relay.resized)

        handlers: list[tuple[signal.Signals, Any]] = [(signal.SIGCHLD, lambda *_: None)]
        if self._watch_resize:
            handlers.append((signal.SIGWINCH, on_resize))
        handlers += [(s, on_stop) for s in stop_signals()]
        handlers += [(s, on_forward) for s in self._forwarded]
        for sig, handler in handlers:
            self._old_handlers[sig] = signal.signal(sig, handler)

    def clear_wakeup(self) -> None:
        """Empty the wake-up socket (its key came ready in the selector)."""
        if self._wake_r is not None:
            with contextlib.suppress(OSError):
                self._wake_r.recv(4096)

    def take_resize(self) -> bool:
        resized, self.resized = self.resized, False
        return resized

    def pass_on(self, now: float, ctx: ProcessContext | None,
                send: Callable[[signal.Signals], None]) -> None:
        """Pass each notice received (SIGUSR1/2: Slurm's preemption notice) on to the ranks
        (``send``), once: not when its sender reached them too. Slurm signals every process of
        a step under proctrack/linuxproc and cgroup, the ranks included, and passing it on
        again ran their handler twice (issue 35); under proctrack/pgid it reaches this process
        only. The process context's watcher, placed as a rank is, tells which: it holds the
        signal pending when the sender reached it too. The sender signals one process after
        the other, so a signal the watcher does not hold yet is passed on only after
        :data:`NOTICE_SENDER_WAIT_S`."""
        keep = []
        for sig, since in self.notices:
            reached = ctx.signal_reached_ranks(sig) if ctx is not None else None
            if reached:
                continue
            if reached is None or now - since >= NOTICE_SENDER_WAIT_S:
                send(sig)
                continue
            keep.append((sig, since))
        self.notices = keep

    def restore(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        if self._wake_w is not None:
            signal.set_wakeup_fd(self._old_wakeup_fd if self._old_wakeup_fd is not None else -1)
            self._wake_w.close()
            assert self._wake_r is not None
            self._wake_r.close()
