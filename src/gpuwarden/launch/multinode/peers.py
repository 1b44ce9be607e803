"""What this node's ranks learned from the workers' store, read into the supervisor's PeerView.

Each rank's store watch (``_store_watch.py``, inside the rank) writes what it sees to its peers
file (``GPUWARDEN_PEERS_FILE``, replaced atomically): which ranks of the job arrived, whether it
reached the store, another node's abort record, whether this rank set the abort key, the store
lost. The supervisor reads the files that changed at every sample and decides what to do
(``supervisor.py``: stop on another node's abort, or on a lost store while ranks wait).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from gpuwarden.boundedio import read_json_object
from gpuwarden.launch.outcome import PeerView

if TYPE_CHECKING:
    from gpuwarden.launch.plan import LaunchPlan


class PeerFiles:
    """The peers files of one plan's ranks, folded into one :class:`PeerView`."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.view = PeerView()
        self._mtimes: dict[int, int] = {}
        self._states: dict[int, dict[str, Any]] = {}

    def read(self, now: float) -> PeerView:
        """The view with whatever the files say now (a file is read again only once changed)."""
        view = self.view
        for spec in self.plan.ranks:
            try:
                mtime = os.stat(spec.files.peers).st_mtime_ns
            except OSError:
                continue
            if self._mtimes.get(spec.rank) != mtime:
                data = read_json_object(spec.files.peers)
                if data is not None:
                    self._mtimes[spec.rank] = mtime
                    self._states[spec.rank] = data
        for rank, data in self._states.items():
            for key, rec in (data.get("arrived") or {}).items():
                if str(key).isdigit() and isinstance(rec, dict):
                    view.arrived[int(key)] = rec
            mine = self.plan.spec(rank)
            if data.get("connected") and mine is not None and mine.local_rank == 0:
                view.reader_connected = True
            view.abort_sent = view.abort_sent or bool(data.get("abort_sent"))
            if data.get("store_error") and view.store_error is None:
                view.store_error = str(data["store_error"])
            if isinstance(data.get("abort"), dict) and view.abort is None:
                view.abort = data["abort"]
            if data.get("store_lost") and view.store_lost is None:
                view.store_lost, view.store_lost_at = str(data["store_lost"]), now
        return view

    def late_abort(self) -> None:
        """After the last rank ended: another node's abort record that a rank's watch wrote
        after the supervisor stopped looking (a rank that failed on an echo ends the watch of
        the job early), for the restart policy to name that node's failure."""
        if self.view.abort is not None:
            return
        for spec in self.plan.ranks:
            data = read_json_object(spec.files.peers)
            if data is not None and isinstance(data.get("abort"), dict):
                self.view.abort = data["abort"]
                return
