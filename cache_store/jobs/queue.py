"""The job queue: warm-up requests become jobs, workers drain their items.

One SQLite database in WAL mode, ``<cache>/jobs.sqlite``, shared by the service (which
submits, lists and cancels) and by one worker per GPU (which claims, renews, completes,
fails and releases). A *job* is a recipe, its resolved parameters and fingerprint, the
records it asks for per sample (``variants``), a priority and a creation time; its
*items* are ``(sample id, source path)`` pairs (an item is done once each of its
variants is stored), each with a status::

    pending --claim--> running --complete--> done
       ^                  |  \\--fail (attempts left)--> pending
       |                  |   \\-fail (permanent / none left)--> failed
       +---release / lease expired
    pending --cancel--> cancelled

Guarantees:

* A claim is one ``BEGIN IMMEDIATE`` transaction (with a busy timeout), so two workers
  never hold the same item and a claim never fails with "database is locked".
* A claim comes with a lease the worker renews; an item whose lease expired (its worker
  died) is claimed again, and counts as a spent attempt. Attempts are bounded: an item
  out of attempts fails with its last error.
* A done item is never handed out again, and an item is not handed out while the same
  ``(fingerprint, sample id)`` is held under a live lease by another job's item.
* Connections are per process and per thread: a process that finds itself forked opens
  its own and never touches (not even to close) one it inherited.
* The file a queue opened is the file it keeps using: ``check()`` (run by every submit
  and claim, and by the service's ``/readyz``) raises :class:`QueueDamaged`, with an
  ERROR log, when it was deleted, replaced (another device/inode) or truncated (smaller
  than seen: SQLite never shrinks it without VACUUM). Open connections would otherwise
  keep answering from a deleted file, or SQLite would silently start an empty queue.
  A process adopts a restored file only when it starts again.

This module holds the queue's file (open, migrate, check) and every state change of a
job and its items. Reads are :mod:`cache_store.jobs.queries`', heartbeats and liveness
:mod:`cache_store.jobs.liveness`' (both mixed into :class:`JobQueue`); the values it
takes and returns live in :mod:`cache_store.jobs.rows`, its schema and SQLite plumbing
in :mod:`cache_store.jobs.db`; every public name is importable from here.

Why one module: every state change of a job and its items is one SQL transaction
written here, so the rules of the state machine (claims, leases, attempts, cancels)
are read, and changed, in one place.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from cache_store.errors import JobNotFound, QueueDamaged, SpcacheError
from cache_store.jobs.db import (
    MIGRATIONS,
    SCHEMA_VERSION,
    ThreadConnections,
    column_json,
    chunks,
    connect,
    schema_statements,
    write_txn,
)
from cache_store.jobs.liveness import WorkerLiveness
from cache_store.jobs.queries import QueueQueries
from cache_store.jobs.rows import (
    ITEM_STATUSES,
    ClaimedItem,
    ItemError,
    JobInfo,
    NewItem,
    QueuedItem,
)

__all__ = [
    "ITEM_STATUSES",
    "JOBS_FILENAME",
    "JobQueue",
    "JobInfo",
    "ClaimedItem",
    "ItemError",
    "NewItem",
    "QueuedItem",
]

log = logging.getLogger(__name__)

JOBS_FILENAME = "jobs.sqlite"
_SQLITE_HEADER_BYTES = 100  # a database file is at least its header


class JobQueue(QueueQueries, WorkerLiveness):
    """The SQLite job queue of one cache directory.

    Args:
        cache_dir: the cache directory; the database is ``<cache_dir>/jobs.sqlite``.
        max_attempts: claims an item may take (including ones lost to an expired lease)
            before it fails for good.
        busy_timeout_s: how long a statement waits for another process's write lock.
        clock: seconds since the epoch (leases, timestamps); tests pass a fake one.

    Nothing is opened until the first call; the schema is created then if missing.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        *,
        max_attempts: int = 3,
        busy_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if busy_timeout_s <= 0:
            raise ValueError(f"busy_timeout_s must be > 0, got {busy_timeout_s}")
        self.cache_dir = Path(cache_dir)
        self.path = self.cache_dir / JOBS_FILENAME
        self.max_attempts = max_attempts
        self.busy_timeout_s = busy_timeout_s
        self.clock = clock
        self._conns = ThreadConnections()
        self._identity: tuple[int, int] | None = None  # (device, inode) of the file opened
        self._seen_size = 0

    # -- connections -------------------------------------------------------------------

    def connection(self) -> sqlite3.Connection:
        """This thread's connection (per process: an inherited one is parked, never used)."""
        return self._conns.get(self._open_checked)

    def _open_checked(self) -> sqlite3.Connection:
        self.check()  # never let SQLite create a fresh file in place of a lost one
        conn = self._open()
        if self._identity is None:
            st = os.stat(self.path)
            self._identity, self._seen_size = (st.st_dev, st.st_ino), st.st_size
        return conn

    def _open(self) -> sqlite3.Connection:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        conn = connect(self.path, busy_timeout_s=self.busy_timeout_s)
        with write_txn(conn):
            for statement in schema_statements():  # not executescript: it would COMMIT first
                conn.execute(statement)
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None:
                conn.execute(
                    "INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
                )
            else:
                version = int(row[0])
                while version in MIGRATIONS and version < SCHEMA_VERSION:
                    for statement in MIGRATIONS[version]:
                        conn.execute(statement)
                    version += 1
                    conn.execute(
                        "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),)
                    )
                    log.info("%s: job queue schema migrated to version %d", self.path, version)
                if version != SCHEMA_VERSION:
                    raise SpcacheError(
                        f"{self.path}: job queue schema version {row[0]} is not "
                        f"the supported {SCHEMA_VERSION}"
                    )
        return conn

    def close(self) -> None:
        """Close this process's connections (those opened in this process only)."""
        self._conns.close()

    def check(self) -> None:
        """Raise :class:`QueueDamaged` if the file this queue opened was deleted, replaced
        or truncated since (nothing to check before the first use)."""
        if self._identity is None:
            return
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise self._damaged("the file was deleted") from None
        if (st.st_dev, st.st_ino) != self._identity:
            raise self._damaged(
                "the file was replaced by another one "
                f"(device/inode {self._identity} -> {(st.st_dev, st.st_ino)})"
            )
        if st.st_size < self._seen_size or st.st_size < _SQLITE_HEADER_BYTES:
            raise self._damaged(f"the file was truncated ({self._seen_size} -> {st.st_size} bytes)")
        self._seen_size = st.st_size

    def _damaged(self, reason: str) -> QueueDamaged:
        log.error(
            "job queue damaged: %s: %s; refusing to submit or claim until it is "
            "restored and the process restarted",
            self.path,
            reason,
        )
        return QueueDamaged(self.path, reason)

    # -- submitting (service side) -----------------------------------------------------

    def submit(
        self,
        recipe: str,
        params: dict[str, Any],
        fingerprint: str,
        items: Iterable[NewItem | tuple[str, str]],
        *,
        priority: int = 0,
        ready: Iterable[NewItem | tuple[str, str]] = (),
        roots: Sequence[str | os.PathLike[str]] = (),
        variants: int = 1,
    ) -> str:
        """Create a job; returns its id.

        ``items`` are queued ``pending``. ``ready`` are samples the caller found already
        computed (record present, source unchanged): they are recorded ``done`` without
        being queued, so the job's counts and its dataset index include them. ``roots``
        are the source roots the job was accepted under: every worker that claims its
        items reads their sources only inside them (:attr:`ClaimedItem.roots`).
        ``variants``: the records computed of each sample (:attr:`ClaimedItem.variants`).
        """
        todo = [it if isinstance(it, NewItem) else NewItem(*it) for it in items]
        done = [it if isinstance(it, NewItem) else NewItem(*it) for it in ready]
        job_id = uuid.uuid4().hex
        now = self.clock()
        conn = self.connection()
        self.check()
        with write_txn(conn):
            conn.execute(
                "INSERT INTO jobs (id, recipe, params, fingerprint, priority, created, "
                "already_ready, roots, variants) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job_id,
                    recipe,
                    column_json(params),
                    fingerprint,
                    int(priority),
                    now,
                    len(done),
                    _roots_json(roots),
                    int(variants),
                ),
            )
            conn.executemany(
                "INSERT INTO items (job_id, seq, fingerprint, sample_id, path, status, updated) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    (job_id, seq, fingerprint, it.sample_id, str(it.path), status, now)
                    for seq, (it, status) in enumerate(
                        [(d, "done") for d in done] + [(t, "pending") for t in todo]
                    )
                ],
            )
        log.info(
            "job %s: %s %s, %d items queued, %d already ready",
            job_id,
            recipe,
            fingerprint[:12],
            len(todo),
            len(done),
        )
        return job_id

    def cancel(self, job_id: str) -> JobInfo:
        """Cancel a job: its pending items become ``cancelled``; running ones finish."""
        conn = self.connection()
        with write_txn(conn):
            if conn.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone() is None:
                raise JobNotFound(job_id)
            conn.execute("UPDATE jobs SET cancelled = 1 WHERE id = ?", (job_id,))
            conn.execute(
                "UPDATE items SET status = 'cancelled', updated = ? "
                "WHERE job_id = ? AND status = 'pending'",
                (self.clock(), job_id),
            )
        return self.job(job_id)

    def enqueue_once(
        self,
        recipe: str,
        params: dict[str, Any],
        fingerprint: str,
        items: Iterable[NewItem | tuple[str, str]],
        *,
        priority: int = 100,
        stale: Iterable[str] = (),
        roots: Sequence[str | os.PathLike[str]] = (),
        variants: int = 1,
    ) -> list[QueuedItem]:
        """Queue each sample unless the queue already has it in hand; one transaction.

        The read-through path: many loader processes missing the same sample call this
        at about the same time, and the sample must be computed once. For each item the
        newest queue item of the same ``(fingerprint, sample id)`` is reused when it is

        * ``pending`` or ``running``: it will produce the record;
        * ``done``: the record was written (the caller reads it again), unless the
          sample is in ``stale``: the caller found that record out of date with its
          source, so it is computed again;
        * ``failed`` no earlier than the source file's last change: the caller reports
          its ``last_error`` instead of computing it again every epoch (a source edited
          since gets a new item).

        An item whose job asked for fewer than ``variants`` records per sample is not
        reused: it would not produce the variant the caller waits for.

        Every other sample (never queued, cancelled, failed before its source changed)
        becomes an item of one new job of ``priority`` (high: ahead of warm-ups), accepted
        under ``roots`` (as :meth:`submit`), asking for ``variants`` records per sample.
        Returns one :class:`QueuedItem` per item, in the given order.
        """
        wanted = [it if isinstance(it, NewItem) else NewItem(*it) for it in items]
        again = set(stale)
        out: dict[str, QueuedItem] = {}
        conn = self.connection()
        now = self.clock()
        with write_txn(conn):
            todo: list[NewItem] = []
            todo_ids: set[str] = set()  # a set: a list scan made 24k items take 26 s
            for it in wanted:
                if it.sample_id in out or it.sample_id in todo_ids:
                    continue
                row = conn.execute(
                    "SELECT i.id, i.job_id, i.path, i.status, i.last_error, i.updated FROM "
                    "items i JOIN jobs j ON j.id = i.job_id WHERE i.fingerprint = ? AND "
                    "i.sample_id = ? AND i.status != 'cancelled' AND j.variants >= ? "
                    "ORDER BY i.updated DESC, i.id DESC LIMIT 1",
                    (fingerprint, it.sample_id, int(variants)),
                ).fetchone()
                if (
                    row is not None
                    and not (row["status"] == "done" and it.sample_id in again)
                    and (row["status"] != "failed" or row["updated"] >= _mtime(it.path))
                ):
                    out[it.sample_id] = QueuedItem(
                        row["id"],
                        row["job_id"],
                        it.sample_id,
                        row["path"],
                        row["status"],
                        row["last_error"],
                        True,
                    )
                else:
                    todo.append(it)
                    todo_ids.add(it.sample_id)
            if todo:
                job_id = uuid.uuid4().hex
                conn.execute(
                    "INSERT INTO jobs (id, recipe, params, fingerprint, priority, created, "
                    "already_ready, roots, variants) VALUES (?, ?, ?, ?, ?, ?, 0, ?, ?)",
                    (
                        job_id,
                        recipe,
                        column_json(params),
                        fingerprint,
                        int(priority),
                        now,
                        _roots_json(roots),
                        int(variants),
                    ),
                )
                for seq, it in enumerate(todo):
                    cur = conn.execute(
                        "INSERT INTO items (job_id, seq, fingerprint, sample_id, path, status, "
                        "updated) VALUES (?, ?, ?, ?, ?, 'pending', ?)",
                        (job_id, seq, fingerprint, it.sample_id, str(it.path), now),
                    )
                    assert cur.lastrowid is not None  # set by every INSERT
                    out[it.sample_id] = QueuedItem(
                        cur.lastrowid, job_id, it.sample_id, str(it.path), "pending", None, False
                    )
        if todo:
            log.info(
                "read-through job %s: %s %s, %d item(s) queued, %d reused",
                job_id,
                recipe,
                fingerprint[:12],
                len(todo),
                len(out) - len(todo),
            )
        return [out[it.sample_id] for it in wanted if it.sample_id in out]

    def cancel_fingerprint(self, fingerprint: str) -> int:
        """Cancel every pending item of ``fingerprint`` (and mark its jobs cancelled);
        running items finish (their writes are refused once the fingerprint is removed).
        Returns the items cancelled."""
        conn = self.connection()
        with write_txn(conn):
            cur = conn.execute(
                "UPDATE items SET status = 'cancelled', updated = ? "
                "WHERE fingerprint = ? AND status = 'pending'",
                (self.clock(), fingerprint),
            )
            conn.execute(
                "UPDATE jobs SET cancelled = 1 WHERE fingerprint = ? AND id IN "
                "(SELECT job_id FROM items WHERE fingerprint = ? AND status = "
                "'cancelled')",
                (fingerprint, fingerprint),
            )
            return cur.rowcount

    def forget_failed(self, fingerprint: str) -> int:
        """Failed items of ``fingerprint`` become ``cancelled``, so a later request
        computes those samples again instead of answering with the old failure. Returns
        how many."""
        conn = self.connection()
        with write_txn(conn):
            return conn.execute(
                "UPDATE items SET status = 'cancelled', updated = ? "
                "WHERE fingerprint = ? AND status = 'failed'",
                (self.clock(), fingerprint),
            ).rowcount

    # -- working (worker side) ---------------------------------------------------------

    def claim(self, worker_id: str, *, limit: int = 8, lease_s: float = 60.0) -> list[ClaimedItem]:
        """Atomically take up to ``limit`` items of one job under a lease of ``lease_s``.

        Takes the best job first (highest priority, then oldest), and within it items in
        submission order. Items whose lease expired are claimable again; those that are
        out of attempts are failed here with their last error.
        """
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        conn = self.connection()
        self.check()
        now = self.clock()
        with write_txn(conn):
            self._sweep_expired(conn, now)
            first = conn.execute(
                "SELECT i.job_id FROM items i JOIN jobs j ON j.id = i.job_id "
                "WHERE j.cancelled = 0 AND "
                + _CLAIMABLE
                + " ORDER BY j.priority DESC, j.created, i.seq LIMIT 1",
                (now, now),
            ).fetchone()
            if first is None:
                return []
            job = conn.execute("SELECT * FROM jobs WHERE id = ?", (first[0],)).fetchone()
            rows = conn.execute(
                "SELECT i.* FROM items i WHERE i.job_id = ? AND "
                + _CLAIMABLE
                + " ORDER BY i.seq LIMIT ?",
                (job["id"], now, now, int(limit)),
            ).fetchall()
            expires = now + lease_s
            conn.executemany(
                "UPDATE items SET status = 'running', attempts = attempts + 1, lease_owner = ?, "
                "lease_expires = ?, updated = ? WHERE id = ?",
                [(worker_id, expires, now, r["id"]) for r in rows],
            )
        params = json.loads(job["params"])
        roots = tuple(json.loads(job["roots"]))
        return [
            ClaimedItem(
                r["id"],
                job["id"],
                job["recipe"],
                params,
                job["fingerprint"],
                r["sample_id"],
                r["path"],
                r["attempts"] + 1,
                expires,
                roots,
                int(job["variants"]),
            )
            for r in rows
        ]

    def renew(self, worker_id: str, item_ids: Iterable[int], *, lease_s: float = 60.0) -> set[int]:
        """Extend the leases ``worker_id`` still holds; returns the ids it still holds."""
        ids = list(item_ids)
        if not ids:
            return set()
        conn = self.connection()
        now = self.clock()
        held: set[int] = set()
        with write_txn(conn):
            for chunk in chunks(ids, 500):
                marks = ",".join("?" * len(chunk))
                conn.execute(
                    f"UPDATE items SET lease_expires = ?, updated = ? WHERE id IN ({marks}) "
                    "AND status = 'running' AND lease_owner = ?",
                    (now + lease_s, now, *chunk, worker_id),
                )
                held.update(
                    r[0]
                    for r in conn.execute(
                        f"SELECT id FROM items WHERE id IN ({marks}) AND status = 'running' "
                        "AND lease_owner = ?",
                        (*chunk, worker_id),
                    )
                )
        lost = set(ids) - held
        if lost:
            log.warning(
                "worker %s lost the lease on %d item(s): %s",
                worker_id,
                len(lost),
                sorted(lost)[:10],
            )
        return held

    def complete(self, worker_id: str, item_id: int) -> bool:
        """Mark an item done (its record has committed). Returns False if it was done already.

        Done whoever holds the lease now: the record is in the store, and a second
        worker that took over an expired lease would only compute it again.
        """
        conn = self.connection()
        with write_txn(conn):
            cur = conn.execute(
                "UPDATE items SET status = 'done', last_error = NULL, lease_owner = ?, "
                "lease_expires = NULL, updated = ? WHERE id = ? AND status != 'done'",
                (worker_id, self.clock(), item_id),
            )
        return cur.rowcount == 1

    def fail(self, worker_id: str, item_id: int, error: str, *, permanent: bool = False) -> str:
        """Record a failed attempt; returns the item's new status.

        The new status is ``pending`` (retried), ``failed`` or ``cancelled``.

        ``permanent`` (e.g. a source that cannot be read) fails it now; otherwise it is
        retried while attempts remain (``cancelled`` instead if its job was cancelled).
        An item this worker no longer holds is left alone.
        """
        conn = self.connection()
        with write_txn(conn):
            row = conn.execute(
                "SELECT i.status, i.attempts, i.lease_owner, j.cancelled FROM items i "
                "JOIN jobs j ON j.id = i.job_id WHERE i.id = ?",
                (item_id,),
            ).fetchone()
            if row is None or row["status"] != "running" or row["lease_owner"] != worker_id:
                return row["status"] if row is not None else "missing"
            if permanent or row["attempts"] >= self.max_attempts:
                status = "failed"
            else:  # a retry, unless the job was cancelled meanwhile
                status = "cancelled" if row["cancelled"] else "pending"
            conn.execute(
                "UPDATE items SET status = ?, last_error = ?, lease_owner = NULL, "
                "lease_expires = NULL, updated = ? WHERE id = ?",
                (status, error[:4000], self.clock(), item_id),
            )
        return status

    def release(self, worker_id: str, item_ids: Iterable[int]) -> int:
        """Hand back items unfinished (clean shutdown): pending again, attempt not counted."""
        ids = list(item_ids)
        conn = self.connection()
        n = 0
        with write_txn(conn):
            for chunk in chunks(ids, 500):
                marks = ",".join("?" * len(chunk))
                cur = conn.execute(
                    f"UPDATE items SET status = CASE WHEN (SELECT cancelled FROM jobs "
                    f"WHERE jobs.id = items.job_id) THEN 'cancelled' ELSE 'pending' END, "
                    f"attempts = MAX(attempts - 1, 0), lease_owner = NULL, lease_expires = NULL, "
                    f"updated = ? WHERE id IN ({marks}) AND status = 'running' AND lease_owner = ?",
                    (self.clock(), *chunk, worker_id),
                )
                n += cur.rowcount
        return n

    def expire_leases_of(self, pid: int, reason: str) -> int:
        """Hand back the items a worker process of this host held when it died: each is
        claimable at once, as if its lease had just run out (the attempt it was on
        counts, so a sample that kills its worker still runs out of attempts), with
        ``reason`` as its last error. For the process that saw the worker end (its
        supervisor): without this the next worker waits out the dead one's leases.
        Returns the number of items handed back."""
        conn = self.connection()
        host = socket.gethostname()
        now = self.clock()
        with write_txn(conn):
            owners = {f"{host}:{pid}"}  # the default worker id
            for row in conn.execute("SELECT worker_id, info FROM heartbeats WHERE pid = ?", (pid,)):
                if json.loads(row["info"]).get("host") == host:
                    owners.add(row["worker_id"])
            marks = ",".join("?" * len(owners))
            cur = conn.execute(  # expired long ago: claimable by the next claim
                f"UPDATE items SET lease_expires = 0, last_error = ?, updated = ? "
                f"WHERE status = 'running' AND lease_owner IN ({marks})",
                (reason[:4000], now, *sorted(owners)),
            )
        return cur.rowcount

    def _sweep_expired(self, conn: sqlite3.Connection, now: float) -> None:
        """Expired leases: cancelled jobs' items become cancelled, out-of-attempts fail."""
        conn.execute(
            "UPDATE items SET status = 'cancelled', lease_owner = NULL, lease_expires = NULL, "
            "updated = ? WHERE status = 'running' AND lease_expires < ? AND job_id IN "
            "(SELECT id FROM jobs WHERE cancelled = 1)",
            (now, now),
        )
        conn.execute(
            "UPDATE items SET status = 'failed', lease_owner = NULL, lease_expires = NULL, "
            "updated = ?, last_error = COALESCE(last_error || '; ', '') || "
            "'lease expired after the last attempt (worker died or hung)' "
            "WHERE status = 'running' AND lease_expires < ? AND attempts >= ?",
            (now, now, self.max_attempts),
        )


# An item is claimable when pending, or running under an expired lease, and no other
# item for the same key is running under a live lease. Bound twice to ``now``.
_CLAIMABLE = (
    "(i.status = 'pending' OR (i.status = 'running' AND i.lease_expires < ?)) "
    "AND NOT EXISTS (SELECT 1 FROM items o WHERE o.fingerprint = i.fingerprint "
    "AND o.sample_id = i.sample_id AND o.id != i.id AND o.status = 'running' "
    "AND o.lease_expires >= ?)"
)


def _roots_json(roots: Sequence[str | os.PathLike[str]]) -> str:
    return json.dumps([os.path.realpath(r) for r in roots])


def _mtime(path: str) -> float:
    """A source's last change (queue clock seconds); 0 when it cannot be read, so a
    recorded failure for it stands."""
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0
