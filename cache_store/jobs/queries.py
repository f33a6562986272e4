"""The job queue's read side: jobs with their counts and errors, items, failed samples,
and the fingerprints with work in hand.

Reads are single statements in autocommit mode, so no read transaction stays open and
the WAL can always be checkpointed. Part of :class:`cache_store.jobs.queue.JobQueue`;
the values returned are :mod:`cache_store.jobs.rows`'.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any

from cache_store.errors import JobNotFound
from cache_store.jobs.db import QueueAccess, chunks
from cache_store.jobs.rows import ITEM_STATUSES, ItemError, JobInfo, job_info_from_row

__all__ = ["QueueQueries"]


class QueueQueries(QueueAccess):
    """The queue's read methods (a part of :class:`~cache_store.jobs.queue.JobQueue`)."""

    def item_statuses(self, item_ids: Iterable[int]) -> dict[int, tuple[str, str | None]]:
        """``item id -> (status, last_error)`` in one statement (a waiter's cheap poll)."""
        ids = list(item_ids)
        out: dict[int, tuple[str, str | None]] = {}
        conn = self.connection()
        for chunk in chunks(ids, 500):
            marks = ",".join("?" * len(chunk))
            for row in conn.execute(
                f"SELECT id, status, last_error FROM items WHERE id IN ({marks})", tuple(chunk)
            ):
                out[row[0]] = (row[1], row[2])
        return out

    # -- reading -----------------------------------------------------------------------

    def job(self, job_id: str, *, errors_offset: int = 0, errors_limit: int = 100) -> JobInfo:
        """One job with its counts and one page of its failed items' errors (QueueDamaged
        when the file was lost: a deleted file's open connection would still answer)."""
        conn = self.connection()
        self.check()
        row = conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        counts, settled = self._job_counts(conn, [job_id])
        errors = self._errors(conn, job_id, errors_offset, errors_limit)
        return job_info_from_row(row, counts[job_id], errors, settled.get(job_id))

    def jobs(
        self,
        *,
        limit: int = 100,
        offset: int = 0,
        fingerprint: str | None = None,
        errors_limit: int = 0,
    ) -> list[JobInfo]:
        """Jobs, newest first, with counts and, for a job with failed items, the first
        ``errors_limit`` of their errors (ask :meth:`job` for more)."""
        conn = self.connection()
        self.check()
        where, args = ("WHERE fingerprint = ? ", (fingerprint,)) if fingerprint else ("", ())
        rows = conn.execute(
            f"SELECT * FROM jobs {where}ORDER BY created DESC, id LIMIT ? OFFSET ?",
            (*args, max(0, int(limit)), max(0, int(offset))),
        ).fetchall()
        counts, settled = self._job_counts(conn, [r["id"] for r in rows])
        out = []
        for r in rows:
            errors = []
            if errors_limit > 0 and counts[r["id"]]["failed"]:
                errors = self._errors(conn, r["id"], 0, errors_limit)
            out.append(job_info_from_row(r, counts[r["id"]], errors, settled.get(r["id"])))
        return out

    @staticmethod
    def _errors(conn: sqlite3.Connection, job_id: str, offset: int, limit: int) -> list[ItemError]:
        errs = conn.execute(
            "SELECT id, sample_id, path, status, attempts, last_error FROM items "
            "WHERE job_id = ? AND status = 'failed' ORDER BY seq LIMIT ? OFFSET ?",
            (job_id, max(0, int(limit)), max(0, int(offset))),
        ).fetchall()
        return [
            ItemError(
                e["id"],
                e["sample_id"],
                e["path"],
                e["status"],
                e["attempts"],
                e["last_error"] or "",
            )
            for e in errs
        ]

    def counts(self) -> dict[str, int]:
        """Items in the whole queue by status."""
        out = dict.fromkeys(ITEM_STATUSES, 0)
        for row in self.connection().execute("SELECT status, COUNT(*) FROM items GROUP BY status"):
            out[row[0]] = row[1]
        return out

    def items(self, job_id: str, *, status: str | None = None) -> list[dict[str, Any]]:
        """Every item of a job (for tests, ``explain`` and debugging)."""
        conn = self.connection()
        if conn.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone() is None:
            raise JobNotFound(job_id)
        sql = "SELECT * FROM items WHERE job_id = ?"
        args: tuple[Any, ...] = (job_id,)
        if status is not None:
            sql += " AND status = ?"
            args += (status,)
        return [dict(r) for r in conn.execute(sql + " ORDER BY seq", args)]

    def latest_item(self, fingerprint: str, sample_id: str) -> dict[str, Any] | None:
        """The most recently updated queue item for this key, or None."""
        row = (
            self.connection()
            .execute(
                "SELECT * FROM items WHERE fingerprint = ? AND sample_id = ? "
                "ORDER BY updated DESC, id DESC LIMIT 1",
                (fingerprint, sample_id),
            )
            .fetchone()
        )
        return dict(row) if row is not None else None

    def failed_samples(self, fingerprint: str | None = None) -> list[dict[str, Any]]:
        """Samples whose newest (non-cancelled) item failed: ``{"fingerprint",
        "sample_id", "path", "reason", "updated"}`` dicts, newest first."""
        where, args = ("AND i.fingerprint = ? ", (fingerprint,)) if fingerprint else ("", ())
        rows = (
            self.connection()
            .execute(
                "SELECT i.fingerprint, i.sample_id, i.path, i.last_error, i.updated FROM items i "
                "WHERE i.status = 'failed' "
                + where
                + "AND NOT EXISTS (SELECT 1 FROM items n WHERE n.fingerprint = i.fingerprint "
                "AND n.sample_id = i.sample_id AND n.status != 'cancelled' "
                "AND (n.updated > i.updated OR (n.updated = i.updated AND n.id > i.id))) "
                "ORDER BY i.updated DESC, i.id DESC",
                args,
            )
            .fetchall()
        )
        return [
            {
                "fingerprint": r["fingerprint"],
                "sample_id": r["sample_id"],
                "path": r["path"],
                "reason": r["last_error"] or "failed",
                "updated": r["updated"],
            }
            for r in rows
        ]

    def sample_ids(
        self, fingerprint: str, *, prefix: str = "", after: str = "", limit: int = 100
    ) -> list[str]:
        """Distinct sample ids queued under ``fingerprint`` (any status) that start with
        ``prefix`` and sort after ``after``, in UTF-8 byte order (as record keys sort),
        at most ``limit``: a page of a cache's sample list for the status page."""
        start = max(prefix, after)
        rows = self.connection().execute(
            "SELECT DISTINCT sample_id FROM items WHERE fingerprint = ? AND sample_id >= ? "
            "ORDER BY sample_id LIMIT ?",
            (fingerprint, start, limit + 1),
        )
        out = []
        for (sample_id,) in rows:
            if not sample_id.startswith(prefix):
                break
            if sample_id != after:
                out.append(sample_id)
        return out[:limit]

    # -- housekeeping (spcache rm / prune) ---------------------------------------------
    def active_fingerprints(self) -> dict[str, int]:
        """Fingerprints with items pending or running -> how many (never pruned)."""
        rows = self.connection().execute(
            "SELECT fingerprint, COUNT(*) FROM items WHERE status IN ('pending', 'running') "
            "GROUP BY fingerprint"
        )
        return dict(rows)

    @staticmethod
    def _job_counts(
        conn: sqlite3.Connection,
        job_ids: Sequence[str],
    ) -> tuple[dict[str, dict[str, int]], dict[str, float]]:
        """Per job: items by status, and the latest ``updated`` of a done or failed item."""
        out = {j: dict.fromkeys(ITEM_STATUSES, 0) for j in job_ids}
        settled: dict[str, float] = {}
        if not job_ids:
            return out, settled
        marks = ",".join("?" * len(job_ids))
        sql = (
            f"SELECT job_id, status, COUNT(*), MAX(updated) FROM items "
            f"WHERE job_id IN ({marks}) GROUP BY job_id, status"
        )
        for job_id, status, count, latest in conn.execute(sql, tuple(job_ids)):
            out[job_id][status] = count
            if status in ("done", "failed"):
                settled[job_id] = max(settled.get(job_id, latest), latest)
        return out, settled
