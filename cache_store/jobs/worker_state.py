"""What a worker is doing, as its heartbeat says: the sample it is on, since when, and
whether it is stuck there. Written by the worker (:mod:`workers.worker_loop`), read by
the service (``/readyz``, the status page) and the worker's supervisor.

A worker's heartbeat ``info`` carries ``current``: the stage it runs in its own process
(``{"sample_id", "path", "stage", "since", "limit_s"}``, ``since`` in wall-clock
seconds), or nothing between samples. The worker writes a heartbeat every few seconds
and at once when a stage has run half its time limit (at most 30 s): from then on the
stage is *stuck* (:func:`describe_worker`). Past its limit the worker ends itself with
:data:`OVERRUN_EXIT` (:mod:`workers.time_limits`), and its supervisor starts a fresh one
at once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

__all__ = ["OVERRUN_EXIT", "STUCK_AFTER_S", "describe_worker", "stuck_after"]

#: The exit status of a worker that ended itself because a sample ran past its time
#: limit (``EX_TEMPFAIL``): its supervisor restarts it at once; not a crash.
OVERRUN_EXIT = 75
#: a stage is stuck after half its limit, at most this long
STUCK_AFTER_S = 30.0


def stuck_after(limit_s: float) -> float:
    """Seconds on one stage of one sample after which a worker is stuck on it."""
    return min(limit_s / 2.0, STUCK_AFTER_S)


def describe_worker(beats: Sequence[dict[str, Any]], now: float | None = None) -> dict[str, Any]:
    """What the newest of the live workers' heartbeats (``JobQueue.live_workers``) says:
    ``{"state": "none alive" | "idle" | "working" | "stuck", ...}``; while working or
    stuck, the sample (id, path, stage), ``since``, ``running_s`` and ``limit_s``."""
    if not beats:
        return {"state": "none alive"}
    now = time.time() if now is None else now
    beat = beats[0]
    info = beat.get("info") or {}
    out: dict[str, Any] = {"worker_id": beat.get("worker_id"), "state": "idle"}
    current = info.get("current")
    if not isinstance(current, dict):
        return out
    since = float(current.get("since") or now)
    limit = float(current.get("limit_s") or 0.0)
    running = max(0.0, now - since)
    out.update(
        state="stuck" if limit and running >= stuck_after(limit) else "working",
        sample_id=current.get("sample_id"),
        path=current.get("path"),
        stage=current.get("stage"),
        since=since,
        running_s=round(running, 1),
        limit_s=limit,
    )
    return out
