"""Worker liveness in the job queue: heartbeats, and whether a worker will compute a
queued sample.

Workers heartbeat into the queue's ``heartbeats`` table (:meth:`WorkerLiveness.
heartbeat`); a supervisor (``spcache serve``) announces a worker it is restarting
(:meth:`~WorkerLiveness.announce_restart`). Read-through waiters ask
:meth:`~WorkerLiveness.worker_expected` before they wait, so a miss with nobody to
compute it fails at once (``NoWorkerAlive``) instead of timing out. A heartbeat counts
while it is recent, not marked stopped, and, on this host, while its process exists and
is not a zombie. Part of :class:`cache_store.jobs.queue.JobQueue`.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from cache_store.jobs.db import QueueAccess, column_json, write_txn
from cache_store.processes import pid_alive

__all__ = ["WORKER_STALE_S", "WorkerLiveness"]

#: A worker whose last heartbeat is older is taken for dead (unless its own heartbeat
#: period is longer: :meth:`WorkerLiveness.live_workers`).
WORKER_STALE_S = 90.0

_HEARTBEAT_KEEP_S = 7 * 24 * 3600  # forget workers silent for a week


class WorkerLiveness(QueueAccess):
    """The queue's heartbeat methods (a part of :class:`~cache_store.jobs.queue.JobQueue`)."""

    def live_workers(self, *, stale_s: float = WORKER_STALE_S) -> list[dict[str, Any]]:
        """Workers that look alive: a heartbeat within ``stale_s`` (or three of the
        worker's own heartbeat periods, if longer), not marked stopped, and, for a worker
        on this host, a process that still exists and is not a zombie."""
        now = self.clock()
        alive = []
        for beat in self.heartbeats():
            info = beat["info"]
            window = max(stale_s, 3.0 * float(info.get("heartbeat_s") or 0.0))
            if info.get("stopped") or beat["seen"] < now - window:
                continue
            if not _process_alive(beat):
                continue
            alive.append(beat)
        return alive

    def worker_expected(self, *, stale_s: float = WORKER_STALE_S) -> bool:
        """Whether a read-through miss will be computed: a worker is alive
        (:meth:`live_workers`), or a live supervisor announced, within its restart window,
        that it is starting one again (:meth:`announce_restart`)."""
        if self.live_workers(stale_s=stale_s):
            return True
        now = self.clock()
        for beat in self._beats():
            info = beat["info"]
            if (
                info.get("supervisor")
                and not info.get("stopped")
                and now - beat["seen"] <= float(info.get("restart_within_s") or 0.0)
                and _process_alive(beat)
            ):
                return True
        return False

    def announce_restart(self, supervisor_id: str, within_s: float) -> None:
        """Say, from the process that supervises this cache's worker (``spcache serve``),
        that the worker died and a new one will heartbeat within ``within_s``: waiters
        wait for it (:meth:`worker_expected`) instead of failing with ``NoWorkerAlive``."""
        self.heartbeat(supervisor_id, {"supervisor": True, "restart_within_s": float(within_s)})

    def end_restarts(self, supervisor_id: str) -> None:
        """The supervisor stops: no worker is on its way any more."""
        self.heartbeat(supervisor_id, {"supervisor": True, "stopped": True})

    def heartbeat(self, worker_id: str, info: dict[str, Any] | None = None) -> None:
        """Say this worker is alive (the service reports the age of the newest)."""
        conn = self.connection()
        with write_txn(conn):
            conn.execute(
                "INSERT INTO heartbeats (worker_id, pid, seen, info) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(worker_id) DO UPDATE SET pid = excluded.pid, "
                "seen = excluded.seen, info = excluded.info",
                (
                    worker_id,
                    os.getpid(),
                    self.clock(),
                    column_json({**(info or {}), "host": socket.gethostname()}),
                ),
            )
            conn.execute(
                "DELETE FROM heartbeats WHERE seen < ?", (self.clock() - _HEARTBEAT_KEEP_S,)
            )

    def heartbeats(self) -> list[dict[str, Any]]:
        """The workers' heartbeats, newest first (a supervisor's announcements left out)."""
        return [b for b in self._beats() if not b["info"].get("supervisor")]

    def _beats(self) -> list[dict[str, Any]]:
        rows = self.connection().execute("SELECT * FROM heartbeats ORDER BY seen DESC").fetchall()
        return [
            {
                "worker_id": r["worker_id"],
                "pid": r["pid"],
                "seen": r["seen"],
                "info": json.loads(r["info"]),
            }
            for r in rows
        ]


def _process_alive(beat: dict[str, Any]) -> bool:
    """Whether the process that wrote a heartbeat still runs; one on another host is
    taken for alive (its heartbeat's age is all there is to go on)."""
    if beat["info"].get("host") != socket.gethostname():
        return True
    return pid_alive(int(beat["pid"]))
