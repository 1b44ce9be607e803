"""The nanny of one gpuwarden Dask worker: distributed's own Nanny, plus two messages.

It announces its worker to the scheduler plugin when the worker is up (host, GPU, pid), and
when the worker process dies on its own it reports how (the signal or exit code) and which
tasks the worker was executing (read from the record ``_worker_plugin`` keeps). Everything
else — starting the worker process with its environment, restarting it after a death,
closing it when the scheduler goes away — is Dask's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from distributed import Nanny
from distributed.core import Status
from distributed.protocol.pickle import dumps

from gpuwarden.dask._worker_plugin import read_executing
from gpuwarden.procs import describe_exit

log = logging.getLogger("gpuwarden.dask")

NOTIFY_TIMEOUT_S = 5.0
# The announcement is tried again for this long: a scheduler busy on a loaded host can miss a
# 5 s reply, and a worker the plugin does not know has its tasks retried by Dask instead of
# failed with its death (seen beside a 2-core CPU hog).
ANNOUNCE_FOR_S = 120.0
_ASKED_TO_STOP = (Status.closing, Status.closed, Status.closing_gracefully, Status.failed)


class GPUNanny(Nanny):
    """``Nanny(..., gpuwarden_info={host, device, cuda_visible_devices}, record_path=...)``."""

    def __init__(self, *args: Any, gpuwarden_info: dict[str, str], record_path: str,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gpuwarden_info = dict(gpuwarden_info, name=str(kwargs.get("name", "")))
        self.record_path = record_path
        self._running: dict[str, Any] | None = None  # address and pid of the live worker
        self._background: set[asyncio.Task[Any]] = set()
        self.deaths: list[dict[str, Any]] = []  # what this nanny reported, for its supervisor
        # Set by the supervisor when the scheduler is gone: no message is sent any more (each
        # would wait for a connection that cannot be made).
        self.scheduler_gone = False

    async def instantiate(self) -> Status:
        status: Status = await super().instantiate()
        if status == Status.running and self.worker_address:
            self._running = {"address": self.worker_address, "pid": self.pid}
            info = {**self.gpuwarden_info, **self._running}
            if not await self._tell("gpuwarden_worker_up", info=info):
                self._in_background(self._announce_again(info))
        return status

    async def _announce_again(self, info: dict[str, Any]) -> None:
        deadline = asyncio.get_running_loop().time() + ANNOUNCE_FOR_S
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.5)
            if self._running is None or self._running["address"] != info["address"]:
                return  # that worker is gone; its successor announces itself
            if await self._tell("gpuwarden_worker_up", info=info):
                return
        log.warning("gpuwarden: the scheduler did not take the announcement of %s within %.0f s: "
                    "a death of this worker is retried by Dask, not reported", info["name"],
                    ANNOUNCE_FOR_S)

    async def close(self, *args: Any, **kwargs: Any) -> Any:
        # Say first that this worker leaves on purpose: its tasks then go elsewhere at once.
        if self._running is not None and self.status not in _ASKED_TO_STOP:
            await self._tell("gpuwarden_worker_leaving", address=self._running["address"])
        for task in list(self._background):
            task.cancel()  # a death report still waiting for a scheduler that is gone
        return await super().close(*args, **kwargs)

    def _on_worker_exit_sync(self, exitcode: int) -> None:
        running, self._running = self._running, None
        if running is not None and exitcode != 0 and self.status not in _ASKED_TO_STOP:
            report = {"address": running["address"], "exit_status": describe_exit(exitcode),
                      "executing": read_executing(self.record_path)}
            self.deaths.append({**self.gpuwarden_info, **running, **report})
            log.warning("gpuwarden: Dask worker %s (pid %s, %s on %s) died with %s%s",
                        self.gpuwarden_info["name"], running["pid"],
                        self.gpuwarden_info["device"], self.gpuwarden_info["host"],
                        report["exit_status"],
                        f" while running {report['executing']}" if report["executing"] else "")
            self._in_background(self._tell(
                "gpuwarden_worker_died", address=report["address"],
                exit_status=report["exit_status"], executing=dumps(report["executing"]),
                info={**self.gpuwarden_info, **running}))
        super()._on_worker_exit_sync(exitcode)

    def _in_background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _tell(self, op: str, **msg: Any) -> bool:
        """Send one message to the scheduler plugin; whether it was taken (a scheduler without
        the plugin just says no)."""
        if self.scheduler_gone:
            return True  # nobody to tell: nothing to try again
        try:
            await asyncio.wait_for(getattr(self.scheduler, op)(**msg), NOTIFY_TIMEOUT_S)
            return True
        except Exception as exc:  # noqa: BLE001 - without the plugin Dask's own handling stays
            log.debug("gpuwarden: %s to the scheduler failed: %r", op, exc)
            return False
