"""The supervisor's own line to the Dask scheduler: first contact, and noticing its loss.

``gpuwarden worker`` holds GPU leases for its workers, so it must know, quickly and every
time, when the scheduler is gone: Dask's own nannies do not always tell. A worker that a task
killed is restarted by its nanny, and a restarted worker whose scheduler then vanishes spends
its whole ``death_timeout`` (30 s) trying to connect, while its nanny cannot be closed before
that worker process has started (``WorkerProcess.kill`` waits for it); the GPUs stayed leased
all that time. So the supervisor keeps a connection of its own and asks for the scheduler's
identity every :data:`PING_S`; a closed connection, confirmed by a TCP connection refused (or
not accepted within :data:`CONFIRM_S`), is the scheduler's loss (:func:`watch_scheduler`), and the workers are then
stopped within a bound (``workers.py``).

First contact (:func:`first_contact`) does what can be checked before any worker starts, each
failure one line with its code and fix: an address without a port or with a bad one (exit 2);
a host name that does not resolve; a scheduler that does not answer, waited for up to
``--connect-timeout`` as ``dask worker`` waits, saying so within a second instead of silently;
worker names that the scheduler already has (two hosts with the same hostname, or two
``gpuwarden worker`` on one host), which Dask would refuse with "name taken".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

from gpuwarden.errors import SchedulerUnreachableError, UsageError, WorkerNameTakenError

PING_S = 0.5  # how often the supervisor asks the scheduler who it is
PING_REPLY_S = 30.0  # a scheduler busy for longer is slow, not gone
CONFIRM_S = 1.0  # a closed connection and no new one within this: the scheduler is gone
_NO_ANSWER = "no answer (packets dropped, or a slow scheduler)"
FIRST_TRY_S = 1.0  # first contact: how long one attempt waits before the wait is announced
_SCHEMES = ("tcp", "tls", "ws", "wss", "ucx", "inproc")
_FIX_ADDRESS = ("give the address `dask scheduler` prints as 'Scheduler at:', with its port: "
                "gpuwarden worker tcp://10.0.0.4:8786")


def check_address(address: str) -> str:
    """``address`` with Dask's default scheme added (``10.0.0.4:8786`` is ``tcp://...``), or a
    UsageError naming what is wrong with it."""
    from distributed.comm.addressing import parse_address, parse_host_port

    text = address.strip()
    if not text:
        raise UsageError("no scheduler address given", fix=_FIX_ADDRESS)
    scheme, loc = parse_address(text if "://" in text else f"tcp://{text}")
    if scheme not in _SCHEMES:
        raise UsageError(f"scheduler address {address!r}: unknown protocol {scheme!r}",
                         why=f"Dask speaks {', '.join(s + '://' for s in _SCHEMES)}",
                         fix=_FIX_ADDRESS)
    if scheme in ("tcp", "tls", "ws", "wss"):
        try:
            host, port = parse_host_port(loc)
        except ValueError as exc:
            why = "it has no port" if "missing port" in str(exc) else "its port is not a number"
            raise UsageError(f"scheduler address {address!r}: {why}", fix=_FIX_ADDRESS) from None
        if not host or not 0 <= port < 65536:
            raise UsageError(f"scheduler address {address!r}: "
                             + ("no host" if not host else f"port {port} is out of range"),
                             fix=_FIX_ADDRESS)
    return f"{scheme}://{loc}"


def _host_of(address: str) -> str | None:
    from distributed.comm.addressing import parse_address, parse_host_port

    scheme, loc = parse_address(address)
    if scheme not in ("tcp", "tls", "ws", "wss"):
        return None
    return parse_host_port(loc)[0].strip("[]")


async def first_contact(address: str, timeout_s: float,
                        on_wait: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The scheduler's identity (its workers, by address, with their names), waiting for it up
    to ``timeout_s``; ``on_wait`` gets one line when the first attempt did not connect within
    :data:`FIRST_TRY_S`. Raises SchedulerUnreachableError (DNS at once, no answer at the end)."""
    from distributed.comm import connect
    from distributed.core import send_recv

    from gpuwarden.net import resolve

    host = _host_of(address)
    announced = False
    if host is not None:
        lookup = asyncio.get_running_loop().run_in_executor(
            None, lambda: resolve(host, timeout_s=min(5.0, timeout_s)))
        try:
            names = await asyncio.wait_for(asyncio.shield(lookup), FIRST_TRY_S)
        except asyncio.TimeoutError:
            if on_wait is not None:
                on_wait(f"gpuwarden: resolving the Dask scheduler's host {host!r} (slow "
                        "resolver); up to 5 s")
            names = await lookup
        if not names.ok:
            raise SchedulerUnreachableError(
                f"the Dask scheduler's host {host!r} does not resolve",
                why=f"{host}: {names.error}", fix=_FIX_ADDRESS + " (a name or an IP address "
                "this host can resolve)")
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while True:
        left = deadline - time.monotonic()
        try:
            comm = await connect(address, timeout=max(0.1, min(FIRST_TRY_S, left)))
        except (OSError, asyncio.TimeoutError) as exc:
            last = exc
            if time.monotonic() >= deadline:
                break
            if not announced and on_wait is not None:
                announced = True
                on_wait(f"gpuwarden: waiting for the Dask scheduler at {address} "
                        f"({await _why_not(address, exc)}); up to {timeout_s:g} s "
                        "(--connect-timeout)")
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            continue
        try:
            identity: dict[str, Any] = await asyncio.wait_for(
                send_recv(comm, op="identity"), max(1.0, deadline - time.monotonic()))
            return identity
        except (OSError, asyncio.TimeoutError) as exc:
            last = exc
            if time.monotonic() >= deadline:
                break
        finally:
            comm.abort()
    raise SchedulerUnreachableError(
        f"the Dask scheduler at {address} does not answer",
        why=f"after {timeout_s:g} s: {await _why_not(address, last)}" if last else None,
        fix="start it first (`dask scheduler`), check the address and that its port is open "
        "from this host; --connect-timeout waits longer") from last


async def _why_not(address: str, exc: BaseException) -> str:
    """:func:`_reason`; when Dask's attempt only timed out (on a loaded host its own connect
    can run out of time before the kernel's answer is seen), one plain TCP connect says whether
    the port refuses, or takes connections and the scheduler is slow."""
    reason = _reason(exc)
    endpoint = _tcp_endpoint(address)
    if endpoint is None or reason != _NO_ANSWER:
        return reason
    answer = await _knock(*endpoint)
    if isinstance(answer, ConnectionRefusedError):
        return _reason(answer)
    if answer is None:
        return "its port accepts connections, but no Dask scheduler answered in time"
    return reason


def _reason(exc: BaseException | None) -> str:
    """'connection refused' and the like, from Dask's 'Timed out trying to connect' wrapper."""
    while exc is not None:
        if isinstance(exc, ConnectionRefusedError):
            return "connection refused: nothing listens at that address and port"
        if isinstance(exc, asyncio.TimeoutError):
            return _NO_ANSWER
        cause = exc.__cause__ or exc.__context__
        if cause is None:
            text = str(exc) or type(exc).__name__
            return text.replace("\n", " ")[:300]
        exc = cause
    return "no answer"


def check_names(identity: dict[str, Any], ours: Iterable[str], address: str) -> None:
    """WorkerNameTakenError when a worker the scheduler already has carries one of our names."""
    taken = {str(w.get("name")): a for a, w in (identity.get("workers") or {}).items()
             if isinstance(w, dict)}
    clash = [n for n in ours if n in taken]
    if clash:
        raise WorkerNameTakenError(
            f"the Dask scheduler at {address} already has a worker named {clash[0]!r}"
            + (f" (and {len(clash) - 1} more of this command's names)" if len(clash) > 1 else ""),
            why="worker names say host and GPU (box-a/GPU1/0): another `gpuwarden worker` with "
            "the same host name serves this scheduler (two machines or containers both called "
            "the same, or a second command on this host); Dask refuses a second worker of one "
            "name ('name taken')",
            fix="give this command's workers a prefix of their own: --name NAME (e.g. --name "
            "$(hostname)-2), or stop the other command",
            evidence=[f"{name}: already at {taken[name]}" for name in clash[:8]])


async def watch_scheduler(address: str, identity_s: float = PING_S) -> None:
    """Return once the scheduler at ``address`` is gone: the connection this keeps to it closed
    and a new one was refused (or not made) within :data:`CONFIRM_S`. A scheduler that is only
    slow to answer keeps it waiting (up to :data:`PING_REPLY_S` per answer, then it asks anew)."""
    from distributed.comm import connect
    from distributed.core import send_recv

    endpoint = _tcp_endpoint(address)
    while True:
        try:
            comm = await connect(address, timeout=CONFIRM_S)
        except (OSError, asyncio.TimeoutError):
            return
        try:
            while True:
                await asyncio.wait_for(send_recv(comm, op="identity", n_workers=0),
                                       PING_REPLY_S)
                await asyncio.sleep(identity_s)
        except asyncio.TimeoutError:
            continue  # slow, not gone: ask again on a fresh connection
        except OSError:  # CommClosedError is one: closed under us
            if endpoint is not None and await _knock(*endpoint) is not None:
                return  # and refused (or silent) at once: gone, without Dask's retries
        finally:
            comm.abort()


def _tcp_endpoint(address: str) -> tuple[str, int] | None:
    from distributed.comm.addressing import parse_address, parse_host_port

    scheme, loc = parse_address(address)
    if scheme not in ("tcp", "tls"):
        return None
    host, port = parse_host_port(loc)
    return host.strip("[]"), port


async def _knock(host: str, port: int) -> BaseException | None:
    """One plain TCP connect to ``host:port`` within :data:`CONFIRM_S`: None when something
    accepted it (closed at once, before any handshake: the scheduler logs that at debug level
    only), else the error (ConnectionRefusedError: nothing listens; a timeout: silence)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONFIRM_S)
    except (OSError, asyncio.TimeoutError) as exc:
        return exc
    writer.close()
    return None
