"""The failure log: which samples failed, on which source content, and why.

A precompute run that fails a sample stores no record for it, so a re-run would
otherwise compute it again with no memory of the earlier failure. The log remembers the
last failure of each ``(fingerprint, sample id)``: the content hash of the source it
failed on, the reason, how often it failed that way in a row, and when. The engine then
says "failed again, same reason" for an unchanged source that fails the same way, and
with ``skip_failed`` does not retry it at all. A sample computed successfully is
forgotten.

One SQLite database in WAL mode, ``<cache>/failures.sqlite``, beside the records and
the job queue but outside both: record readers (datasets, the service, Zarr export)
never see it, and a failure is not a record. Opened, held (per thread, per process: a
forked child opens its own) and written as the job queue is
(:mod:`cache_store.jobs.db`). CPU only.

Every path that computes records writes here: ``spcache precompute`` (both engines) and
the queue's worker (``spcache worker`` and the one ``spcache serve`` runs), which computes
read-through misses and warm-ups. :func:`failures_of` is what ``spcache stats``, ``GET
/v1/caches/{fp}``, the status page and ``spcache ls`` show: this log merged with the
queue's failed items (a queue written by an older worker, or an item failed outside an
engine run), one entry per sample.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cache_store.jobs.db import ThreadConnections, connect, write_txn
from typing import Any

__all__ = [
    "FAILURES_FILENAME",
    "Failure",
    "FailureLog",
    "failures_of",
    "failure_counts",
    "MAX_FAILURES_LISTED",
]

#: failures listed per fingerprint at most by :func:`failures_of` (the count is exact)
MAX_FAILURES_LISTED = 50

FAILURES_FILENAME = "failures.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS failures (
    fingerprint  TEXT NOT NULL,
    sample_id    TEXT NOT NULL,
    source_hash  TEXT NOT NULL,
    reason       TEXT NOT NULL,
    path         TEXT NOT NULL,
    times        INTEGER NOT NULL,
    first_failed REAL NOT NULL,
    last_failed  REAL NOT NULL,
    PRIMARY KEY (fingerprint, sample_id)
)
"""
_BATCH = 500  # host parameters per IN (...) query, well under SQLite's limit


@dataclass(frozen=True)
class Failure:
    """The last failure of one sample: ``times`` counts failures in a row on the same
    source content with the same reason."""

    fingerprint: str
    sample_id: str
    source_hash: str
    reason: str
    path: str
    times: int
    first_failed: float
    last_failed: float


class FailureLog:
    """The failure log of one cache directory (``<cache_dir>/failures.sqlite``).

    Nothing is opened until the first call; the file and schema are created then.
    """

    def __init__(self, cache_dir: str | os.PathLike[str], *, busy_timeout_s: float = 30.0) -> None:
        self.path = Path(cache_dir) / FAILURES_FILENAME
        self.busy_timeout_s = busy_timeout_s
        self._conns = ThreadConnections()

    def _conn(self) -> sqlite3.Connection:
        return self._conns.get(self._open)

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = connect(self.path, busy_timeout_s=self.busy_timeout_s)
        conn.execute(_SCHEMA)
        return conn

    def get_many(self, fingerprint: str, sample_ids: Iterable[str]) -> dict[str, Failure]:
        """The remembered failures among ``sample_ids`` (absent ids have none)."""
        ids = list(sample_ids)
        if not ids or not self.path.exists():
            return {}
        found: dict[str, Failure] = {}
        conn = self._conn()
        for i in range(0, len(ids), _BATCH):
            part = ids[i : i + _BATCH]
            marks = ",".join("?" * len(part))
            for row in conn.execute(
                f"SELECT * FROM failures WHERE fingerprint = ? AND sample_id IN ({marks})",
                (fingerprint, *part),
            ):
                found[row["sample_id"]] = Failure(**dict(row))
        return found

    def record(
        self, fingerprint: str, sample_id: str, path: str, source_hash: str, reason: str
    ) -> Failure:
        """Remember a failure; ``times`` grows when source and reason are those of the
        failure remembered before, else starts again at 1."""
        now = time.time()
        with write_txn(self._conn()) as conn:
            row = conn.execute(
                "SELECT * FROM failures WHERE fingerprint = ? AND sample_id = ?",
                (fingerprint, sample_id),
            ).fetchone()
            same = row is not None and row["source_hash"] == source_hash and row["reason"] == reason
            failure = Failure(
                fingerprint,
                sample_id,
                source_hash,
                reason,
                path,
                row["times"] + 1 if same else 1,
                row["first_failed"] if same else now,
                now,
            )
            conn.execute(
                "INSERT OR REPLACE INTO failures VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    failure.fingerprint,
                    failure.sample_id,
                    failure.source_hash,
                    failure.reason,
                    failure.path,
                    failure.times,
                    failure.first_failed,
                    failure.last_failed,
                ),
            )
        return failure

    def entries(self, fingerprint: str | None = None) -> list[Failure]:
        """Every remembered failure (of ``fingerprint``, or all), newest first."""
        if not self.path.exists():
            return []
        where, args = ("WHERE fingerprint = ? ", (fingerprint,)) if fingerprint else ("", ())
        rows = (
            self._conn()
            .execute(f"SELECT * FROM failures {where}ORDER BY last_failed DESC, sample_id", args)
            .fetchall()
        )
        return [Failure(**dict(row)) for row in rows]

    def forget(self, fingerprint: str, sample_ids: Iterable[str]) -> None:
        """Drop the failures of ``sample_ids`` (they have records now)."""
        ids = list(sample_ids)
        if not ids or not self.path.exists():
            return
        conn = self._conn()
        for i in range(0, len(ids), _BATCH):
            part = ids[i : i + _BATCH]
            conn.execute(
                f"DELETE FROM failures WHERE fingerprint = ? AND sample_id IN "
                f"({','.join('?' * len(part))})",
                (fingerprint, *part),
            )

    def forget_fingerprint(self, fingerprint: str) -> int:
        """Drop every remembered failure of ``fingerprint``; returns how many."""
        if not self.path.exists():
            return 0
        return (
            self._conn()
            .execute("DELETE FROM failures WHERE fingerprint = ?", (fingerprint,))
            .rowcount
        )

    def close(self) -> None:
        """Close this process's connections (the next call opens a new one)."""
        self._conns.close()


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _merged(cache_dir: Path, fingerprint: str | None) -> list[dict[str, Any]]:
    """The failure log's entries plus the queue's failed samples the log lacks."""
    from cache_store.jobs.queue import JOBS_FILENAME, JobQueue  # late: the queue is optional

    entries: dict[tuple[str, str], dict[str, Any]] = {}
    log = FailureLog(cache_dir)
    try:
        for f in log.entries(fingerprint):
            entries[(f.fingerprint, f.sample_id)] = {
                "fingerprint": f.fingerprint,
                "id": f.sample_id,
                "path": f.path,
                "reason": f.reason,
                "times": f.times,
                "when": _when(f.last_failed),
                "at": f.last_failed,
            }
    finally:
        log.close()
    if (cache_dir / JOBS_FILENAME).is_file():
        queue = JobQueue(cache_dir)
        try:
            for row in queue.failed_samples(fingerprint):
                entries.setdefault(
                    (row["fingerprint"], row["sample_id"]),
                    {
                        "fingerprint": row["fingerprint"],
                        "id": row["sample_id"],
                        "path": row["path"],
                        "reason": row["reason"],
                        "times": 1,
                        "when": _when(row["updated"]),
                        "at": row["updated"],
                    },
                )
        finally:
            queue.close()
    return sorted(entries.values(), key=lambda e: (-e["at"], e["fingerprint"], e["id"]))


def failures_of(
    cache_dir: str | os.PathLike[str], fingerprint: str, *, limit: int = MAX_FAILURES_LISTED
) -> dict[str, Any]:
    """The remembered failures of one fingerprint of a cache directory, newest first:
    ``{"count": N, "items": [{"id", "path", "reason", "when", "times"}, ...]}`` with at
    most ``limit`` items (``when``: ISO 8601 UTC of the last failure; ``times``: failures
    in a row on the same source and reason).

    Reads the failure log (every precompute, worker, read-through and Ray failure) and
    the job queue's failed items; creates neither file. A sample computed successfully
    since is not listed (the log forgets it; a queue item is superseded by a newer one),
    except one that failed only in the queue and was then computed by ``precompute``.
    """
    found = _merged(Path(cache_dir), fingerprint)
    return {
        "count": len(found),
        "items": [
            {k: e[k] for k in ("id", "path", "reason", "when", "times")}
            for e in found[: max(0, int(limit))]
        ],
    }


def failure_counts(cache_dir: str | os.PathLike[str]) -> dict[str, int]:
    """Fingerprint -> number of remembered failed samples, for every fingerprint with any."""
    counts: dict[str, int] = {}
    for entry in _merged(Path(cache_dir), None):
        counts[entry["fingerprint"]] = counts.get(entry["fingerprint"], 0) + 1
    return counts
