"""What a waiting request is blocked by, as data, one line, and a live terminal display."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from gpuwarden.safetext import escape_untrusted
from gpuwarden.units import format_bytes, format_duration


@dataclass(frozen=True)
class GpuState:
    """One GPU as a lease request sees it: usable now, or what blocks it."""

    index: int
    uuid: str
    label: str  # "GPU 2"
    reason: str  # "leased by pid 812 (alice, train.py) for 3m", "exclusive_process mode, ..."
    kind: str  # "free" | "leased" | "queued" | "refused" (NVML, constraints, bad slot file)
    #          | "unknown" (the directory mutex could not be had: nothing was judged)
    # Ids of the lease records that block it: what changes when a blocker changes
    # (the reason's "for 3m" changes every second).
    blocker_ids: tuple[str, ...] = ()

    @property
    def free(self) -> bool:
        """Could be granted to this request now."""
        return self.kind == "free"

    def line(self) -> str:
        # Lease and queue reasons already say what they are ("leased by ...", "held back ...").
        prefix = "refused: " if self.kind == "refused" else ""
        # Reasons quote other users' labels and other processes' command lines.
        return escape_untrusted(f"{self.label}: {prefix}{self.reason}")

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "free": self.free, "kind": self.kind,
                "reason": self.reason}


@dataclass(frozen=True)
class WaitStatus:
    """Passed to ``on_wait`` after every attempt that did not serve the request."""

    request: str  # "2 GPUs with >= 20.0 GiB free"
    waited_s: float
    gpus: tuple[GpuState, ...]
    ahead: int  # earlier requests in line that compete for the same GPUs
    deadline_s: float | None  # seconds left, None when waiting without limit
    # What kept the attempt from judging any GPU (the directory mutex held too long, by whom).
    directory_blocker: str = ""

    def key(self) -> tuple[object, ...]:
        """Equal for two statuses blocked by the same things (durations aside)."""
        return (self.directory_blocker,) + tuple(
            (g.uuid, g.kind, g.blocker_ids, g.reason if g.kind == "refused" else "")
            for g in self.gpus)

    def blockers(self) -> str:
        """What blocks the request, one line; every quoted string escaped (other users'
        labels, other processes' command lines)."""
        if self.directory_blocker:
            return escape_untrusted(self.directory_blocker)
        blocked = [g for g in self.gpus if not g.free]
        return escape_untrusted("; ".join(f"{g.label.replace(' ', '')} {g.reason}"
                                          for g in blocked) or "not enough GPUs are visible")

    def headline(self) -> str:
        """'waiting for 2 GPUs with >= 20.0 GiB free (1 of 4 free now): GPU0 leased by pid 812
        (alice, train.py) for 3m; ...'"""
        free = sum(1 for g in self.gpus if g.free)
        return f"waiting for {self.request} ({free} of {len(self.gpus)} free now): {self.blockers()}"

    def line(self) -> str:
        """The headline with the time waited and the place in line: what piped output prints."""
        extra = [f"{format_duration(self.waited_s)} waited"]
        if self.ahead:
            extra.append(f"{self.ahead} earlier request(s) ahead")
        if self.deadline_s is not None:
            extra.append(f"gives up in {format_duration(max(0.0, self.deadline_s))}")
        return f"{self.headline()} [{', '.join(extra)}]"

    def to_dict(self) -> dict[str, Any]:
        return {"request": self.request, "waited_s": round(self.waited_s, 3), "ahead": self.ahead,
                "gpus": [g.to_dict() for g in self.gpus]}


def describe_request(n: int, min_free_bytes: int, slots_per_gpu: int, slots_each: int, *,
                     every_usable: bool = False, memory_bytes: int = 0) -> str:
    what = "every usable GPU (at least 1)" if every_usable else f"{n} GPU{'s' if n != 1 else ''}"
    if memory_bytes:
        what = f"{format_bytes(memory_bytes)} on " + ("each of " + what if n != 1 or every_usable
                                                       else what)
    if slots_per_gpu > 1:
        what += f" ({slots_each} of {slots_per_gpu} slots each)"
    if min_free_bytes:
        what += f" with >= {format_bytes(min_free_bytes)} free"
    return what


class StatusPrinter:
    """An ``on_wait`` callback: a live line on a terminal (rich), plain lines when piped.

    Piped output gets a line when what blocks the request changes, and otherwise at most
    one every ``repeat_s`` seconds, so a log does not fill with identical lines.
    Call :meth:`close` (or use it as a context manager) to end the live display.
    """

    def __init__(self, stream: TextIO | None = None, *, repeat_s: float = 30.0,
                 live: bool | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.repeat_s = repeat_s
        if live is None:
            from gpuwarden.cli._output import is_terminal

            live = is_terminal(self.stream)
        self.live = live
        self._last_key: Any = None
        self._last_print = 0.0
        self._live_display: Any = None

    def __call__(self, status: WaitStatus) -> None:
        if self.live:
            self._show_live(status)
            return
        key = status.key()
        now = time.monotonic()
        if key != self._last_key or now - self._last_print >= self.repeat_s:
            self.stream.write(f"gpuwarden: {status.line()}\n")
            self.stream.flush()
            self._last_key, self._last_print = key, now

    def _show_live(self, status: WaitStatus) -> None:
        from rich.console import Console, Group
        from rich.live import Live
        from rich.text import Text

        head = Text(f"gpuwarden: {status.line()}")  # Text: never read as markup
        rows = [Text(f"  {g.line()}", style="green" if g.free else "yellow") for g in status.gpus]
        body = Group(head, *rows)
        if self._live_display is None:
            self._live_display = Live(body, console=Console(file=self.stream),
                                      refresh_per_second=4, transient=True)
            self._live_display.start()
        else:
            self._live_display.update(body)

    def close(self) -> None:
        if self._live_display is not None:
            self._live_display.stop()
            self._live_display = None

    def __enter__(self) -> StatusPrinter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


OnWait = Callable[[WaitStatus], None]
