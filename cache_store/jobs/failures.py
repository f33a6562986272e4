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
never see it, and a failure is not a record. Standard library only, CPU only.
Connections are per process (a forked child opens its own).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FAILURES_FILENAME", "Failure", "FailureLog"]

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
        self._local = threading.local()

    def _conn(self) -> sqlite3.Connection:
        conn, pid = getattr(self._local, "conn", None), getattr(self._local, "pid", None)
        if conn is None or pid != os.getpid():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute(_SCHEMA)
            self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    def get_many(self, fingerprint: str, sample_ids: Iterable[str]) -> dict[str, Failure]:
        """The remembered failures among ``sample_ids`` (absent ids have none)."""
        ids = list(sample_ids)
        if not ids or not self.path.exists():
            return {}
        found: dict[str, Failure] = {}
        conn = self._conn()
        for i in range(0, len(ids), _BATCH):
            part = ids[i:i + _BATCH]
            marks = ",".join("?" * len(part))
            for row in conn.execute(f"SELECT * FROM failures WHERE fingerprint = ? "
                                    f"AND sample_id IN ({marks})", (fingerprint, *part)):
                found[row["sample_id"]] = Failure(**dict(row))
        return found

    def record(self, fingerprint: str, sample_id: str, path: str, source_hash: str,
               reason: str) -> Failure:
        """Remember a failure; ``times`` grows when source and reason are those of the
        failure remembered before, else starts again at 1."""
        now = time.time()
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            row = conn.execute("SELECT * FROM failures WHERE fingerprint = ? AND sample_id = ?",
                               (fingerprint, sample_id)).fetchone()
            same = row is not None and row["source_hash"] == source_hash and row["reason"] == reason
            failure = Failure(fingerprint, sample_id, source_hash, reason, path,
                              row["times"] + 1 if same else 1,
                              row["first_failed"] if same else now, now)
            conn.execute("INSERT OR REPLACE INTO failures VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (failure.fingerprint, failure.sample_id, failure.source_hash,
                          failure.reason, failure.path, failure.times, failure.first_failed,
                          failure.last_failed))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return failure

    def forget(self, fingerprint: str, sample_ids: Iterable[str]) -> None:
        """Drop the failures of ``sample_ids`` (they have records now)."""
        ids = list(sample_ids)
        if not ids or not self.path.exists():
            return
        conn = self._conn()
        for i in range(0, len(ids), _BATCH):
            part = ids[i:i + _BATCH]
            conn.execute(f"DELETE FROM failures WHERE fingerprint = ? AND sample_id IN "
                         f"({','.join('?' * len(part))})", (fingerprint, *part))

    def close(self) -> None:
        """Close this thread's connection (the next call opens a new one)."""
        conn, pid = getattr(self._local, "conn", None), getattr(self._local, "pid", None)
        if conn is not None and pid == os.getpid():
            conn.close()
        self._local.conn = None
