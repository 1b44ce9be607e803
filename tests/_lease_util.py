"""Helpers for lease tests: forked holder processes that record when they held what."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import struct
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

F_OFD_SETLK = 37  # <fcntl.h>; Python's fcntl module has no name for it


def fork_child(body: Callable[[], None], *, gate: tuple[int, int] | None = None) -> int:
    """Run ``body`` in a forked child that exits 0, or 1 with a traceback on stderr.

    ``gate``: a pipe (read, write); the child blocks on it until the parent closes the
    write end, so that many children start contending at the same moment.
    """
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        if gate is not None:
            os.close(gate[1])
            os.read(gate[0], 1)
        body()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def hold_and_record(out: Path, *, n: int = 1, slots_per_gpu: int = 1, slots_each: int = 1,
                    hold_s: float = 0.02, wait: float = 60.0, tag: str = "") -> Callable[[], None]:
    """A child body: lease, record the interval it held which slots, release."""

    def body() -> None:
        from gpuwarden.lease import acquire

        asked = time.monotonic()
        grant = acquire(n, slots_per_gpu=slots_per_gpu, slots_each=slots_each, wait=wait,
                        label=tag or f"worker {os.getpid()}")
        start = time.monotonic()
        time.sleep(hold_s)
        end = time.monotonic()
        claims = [[c.uuid, c.slots_per_gpu, list(c.slots)] for c in grant.claims]
        grant.release()
        line = json.dumps({"pid": os.getpid(), "tag": tag, "asked": asked, "start": start,
                           "end": end, "claims": claims, "n": n})
        with open(out, "a") as f:  # one short O_APPEND write per line: lines never mix
            f.write(line + "\n")

    return body


def wait_all(pids: list[int], timeout_s: float) -> dict[int, int]:
    """Exit codes of ``pids``; kills what is still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    codes: dict[int, int] = {}
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    for pid in pids:
        if pid not in codes:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            codes[pid] = -9
    return codes


def read_records(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def overlaps(records: list[dict[str, Any]]) -> list[str]:
    """Every pair of holders that held one GPU at the same time in a way leases forbid:
    the same slot, or different slot counts (a GPU is split one way at a time)."""
    per_gpu: dict[str, list[tuple[float, float, int, set[int], int]]] = {}
    for r in records:
        for uuid, k, slots in r["claims"]:
            per_gpu.setdefault(uuid, []).append((r["start"], r["end"], k, set(slots), r["pid"]))
    bad = []
    for uuid, items in per_gpu.items():
        items.sort()
        for i, (s1, e1, k1, sl1, p1) in enumerate(items):
            for s2, e2, k2, sl2, p2 in items[i + 1:]:
                if s2 >= e1:
                    break
                if k1 != k2 or sl1 & sl2:
                    bad.append(f"{uuid}: pid {p1} [{s1:.4f},{e1:.4f}] k={k1} slots {sorted(sl1)}"
                               f" overlaps pid {p2} [{s2:.4f},{e2:.4f}] k={k2} slots {sorted(sl2)}")
    return bad


@contextlib.contextmanager
def kept_in_child(setup: Callable[[], Any]) -> Iterator[int]:
    """Run ``setup`` in a forked child that keeps what it opened (locks, a lease) until the
    block ends; yields the child's pid."""
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(ready_r)
            os.close(stop_w)
            kept = setup()  # noqa: F841 (kept alive: its descriptors hold the locks)
            os.write(ready_w, b"1")
            os.read(stop_r, 1)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(stop_r)
    try:
        assert os.read(ready_r, 1) == b"1", "the child's set-up failed (see stderr)"
        yield pid
    finally:
        os.close(stop_w)
        os.close(ready_r)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        wait_all([pid], timeout_s=30)


def hold_record_lock(path: Path, *, start: int = 0, length: int = 0, write: bool = True,
                     ofd: bool = False, content: bytes | None = None
                     ) -> contextlib.AbstractContextManager[int]:
    """A forked child holds a record lock on ``path`` (a POSIX lock, or an open-file-description
    one with ``ofd``) until the block ends; yields the child's pid.

    In another process because a process never conflicts with its own POSIX locks, and any
    close of the file in this process would drop them."""
    def lock() -> int:
        if content is not None:
            path.write_bytes(content)
        fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
        kind = fcntl.F_WRLCK if write else fcntl.F_RDLCK
        cmd = F_OFD_SETLK if ofd else fcntl.F_SETLK
        fcntl.fcntl(fd, cmd, struct.pack("hhqqi4x", kind, 0, start, length, 0))
        return fd

    return kept_in_child(lock)
