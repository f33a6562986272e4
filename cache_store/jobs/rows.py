"""The job queue's values: what callers submit to it and what it hands back.

Plain frozen dataclasses (no SQLite, no I/O): :class:`NewItem` (submitted),
:class:`ClaimedItem` (a worker's leased item), :class:`QueuedItem` (a read-through
caller's item), :class:`ItemError` and :class:`JobInfo` (a job's counts, progress and
errors, as listed by the service). :class:`cache_store.jobs.queue.JobQueue` builds them from its
rows; ``cache_store.jobs.queue`` re-exports each name, which is where callers import them from.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ITEM_STATUSES",
    "ClaimedItem",
    "ItemError",
    "JobInfo",
    "NewItem",
    "QueuedItem",
    "job_info_from_row",
]

ITEM_STATUSES = ("pending", "running", "done", "failed", "cancelled")


@dataclass(frozen=True)
class NewItem:
    """One item to submit: the key's sample id and the source to compute it from."""

    sample_id: str
    path: str


@dataclass(frozen=True)
class ClaimedItem:
    """An item a worker now holds under a lease; all items of one claim share a job."""

    item_id: int
    job_id: str
    recipe: str
    params: dict[str, Any]
    fingerprint: str
    sample_id: str
    path: str
    attempts: int
    lease_expires: float
    #: the source roots the job was accepted under (resolved); empty: none recorded
    roots: tuple[str, ...] = ()
    #: records the job asks for per sample (variants 0 .. variants - 1)
    variants: int = 1


@dataclass(frozen=True)
class QueuedItem:
    """Where one sample asked for by :meth:`cache_store.jobs.queue.JobQueue.enqueue_once` stands
    in the queue.

    ``reused`` is True when an existing item (another process's, or an earlier one) was
    taken instead of queueing a new one.
    """

    item_id: int
    job_id: str
    sample_id: str
    path: str
    status: str
    last_error: str | None
    reused: bool


@dataclass(frozen=True)
class ItemError:
    item_id: int
    sample_id: str
    path: str
    status: str
    attempts: int
    error: str


#: a job's states, as ``JobInfo.status``, ``GET /v1/jobs``, the page and ``spcache stats``
#: spell them
JOB_STATES = ("pending", "running", "done", "done_with_errors", "failed", "cancelled")


@dataclass(frozen=True)
class JobInfo:
    id: str
    recipe: str
    params: dict[str, Any]
    fingerprint: str
    priority: int
    created: float
    cancelled: bool
    already_ready: int
    counts: dict[str, int]
    errors: list[ItemError] = field(default_factory=list)
    #: Queue time (the queue's clock) of the job's latest done or failed item; None
    #: while none is.
    last_settled: float | None = None
    #: records asked for per sample: an item is done when all of them are stored
    variants: int = 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def percent(self) -> float:
        """Items settled (done or failed) as a percentage of all (100 when there are none):
        a cancelled job's dropped items count as not done, so it stays below 100."""
        settled = self.counts["done"] + self.counts["failed"]
        return 100.0 if self.total == 0 else round(100.0 * settled / self.total, 2)

    @property
    def samples_per_s(self) -> float | None:
        """Items the workers settled (done or failed; already-ready ones not counted) per
        second, from the job's creation to its latest settled item; None before any."""
        worked = self.counts["done"] + self.counts["failed"] - self.already_ready
        if self.last_settled is None or worked <= 0:
            return None
        elapsed = self.last_settled - self.created
        return None if elapsed <= 0 else round(worked / elapsed, 3)

    @property
    def eta_s(self) -> float | None:
        """Seconds left at :attr:`samples_per_s` (0 when nothing is left; None when no
        rate is known yet, or when the job was cancelled)."""
        left = self.counts["pending"] + self.counts["running"]
        if left == 0:
            return 0.0
        rate = self.samples_per_s
        return None if rate is None or self.cancelled else round(left / rate, 1)

    @property
    def status(self) -> str:
        """One of :data:`JOB_STATES`: ``pending``, ``running``, ``done`` (every item
        done), ``done_with_errors`` (some done, some failed), ``failed`` (every item that
        settled failed, none done) or ``cancelled`` (cancelled before every item settled).
        """
        c = self.counts
        if c["running"] or (c["pending"] and (c["done"] or c["failed"])):
            return "running"
        if c["pending"]:
            return "pending"
        if self.cancelled and c.get("cancelled", 0):
            return "cancelled"
        if c["failed"]:
            return "done_with_errors" if c["done"] else "failed"
        return "done"

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": self.status,
            "recipe": self.recipe,
            "params": self.params,
            "fingerprint": self.fingerprint,
            "variants": self.variants,
            "priority": self.priority,
            "created": self.created,
            "already_ready": self.already_ready,
            "total": self.total,
            "counts": dict(self.counts),
            "percent": self.percent,
            "samples_per_s": self.samples_per_s,
            "eta_s": self.eta_s,
            "errors": [
                {
                    "sample_id": e.sample_id,
                    "path": e.path,
                    "status": e.status,
                    "attempts": e.attempts,
                    "error": e.error,
                }
                for e in self.errors
            ],
        }


def job_info_from_row(
    row: sqlite3.Row, counts: dict[str, int], errors: list[ItemError], last_settled: float | None
) -> JobInfo:
    return JobInfo(
        row["id"],
        row["recipe"],
        json.loads(row["params"]),
        row["fingerprint"],
        row["priority"],
        row["created"],
        bool(row["cancelled"]),
        row["already_ready"],
        counts,
        errors,
        last_settled,
        int(row["variants"]),
    )
