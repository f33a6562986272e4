"""SQLite plumbing of the job queue and the failure log: connections, transactions, the
queue's schema.

The one way this package opens SQLite (:func:`connect`: autocommit, WAL, the pragmas),
holds connections (:class:`ThreadConnections`: one per thread, per process through
:class:`~cache_store.process_local.ProcessLocal`, all closed together) and writes
(``BEGIN IMMEDIATE`` transactions, :class:`write_txn`); plus the job queue's schema
(created on first open, versioned in ``meta``), the small helpers its statements
share, and :class:`QueueAccess`, what the queue's parts reach the database through.
Nothing about jobs' states.
"""

from __future__ import annotations

import abc
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from cache_store.process_local import ProcessLocal

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "MIGRATIONS",
    "Connections",
    "QueueAccess",
    "ThreadConnections",
    "column_json",
    "chunks",
    "connect",
    "schema_statements",
    "write_txn",
]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 3
#: Statements that bring a database of each older schema version to the next one.
MIGRATIONS: dict[int, list[str]] = {
    # 1 -> 2: the source roots a job was accepted under travel with it (JSON list)
    1: ["ALTER TABLE jobs ADD COLUMN roots TEXT NOT NULL DEFAULT '[]'"],
    # 2 -> 3: the records a job asks for per sample (variants 0 .. variants - 1)
    2: ["ALTER TABLE jobs ADD COLUMN variants INTEGER NOT NULL DEFAULT 1"],
}

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    id            TEXT PRIMARY KEY,
    recipe        TEXT NOT NULL,
    params        TEXT NOT NULL,
    fingerprint   TEXT NOT NULL,
    priority      INTEGER NOT NULL DEFAULT 0,
    created       REAL NOT NULL,
    cancelled     INTEGER NOT NULL DEFAULT 0,
    already_ready INTEGER NOT NULL DEFAULT 0,
    roots         TEXT NOT NULL DEFAULT '[]',
    variants      INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS items (
    id            INTEGER PRIMARY KEY,
    job_id        TEXT NOT NULL REFERENCES jobs(id),
    seq           INTEGER NOT NULL,
    fingerprint   TEXT NOT NULL,
    sample_id     TEXT NOT NULL,
    path          TEXT NOT NULL,
    status        TEXT NOT NULL,
    attempts      INTEGER NOT NULL DEFAULT 0,
    last_error    TEXT,
    lease_owner   TEXT,
    lease_expires REAL,
    updated       REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS items_by_job ON items(job_id, status, seq);
CREATE INDEX IF NOT EXISTS items_by_status ON items(status, lease_expires);
CREATE INDEX IF NOT EXISTS items_by_sample ON items(fingerprint, sample_id, status);
CREATE TABLE IF NOT EXISTS heartbeats (
    worker_id TEXT PRIMARY KEY,
    pid       INTEGER NOT NULL,
    seen      REAL NOT NULL,
    info      TEXT NOT NULL DEFAULT '{}'
);
"""

# Connections inherited across fork are parked (cache_store.process_local), never used,
# closed or collected: closing one in the child could checkpoint or unlink the WAL under
# the parent's feet.


class Connections:
    """One process's SQLite connections: one per thread, all closed together."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.all: list[sqlite3.Connection] = []
        self.lock = threading.Lock()

    def add(self, conn: sqlite3.Connection) -> None:
        self.local.conn = conn
        with self.lock:
            self.all.append(conn)

    def close(self) -> None:
        with self.lock:
            conns, self.all = self.all, []
        for conn in conns:
            try:
                conn.close()
            except sqlite3.ProgrammingError:
                # Made in another thread; SQLite lets only that thread close it, and it
                # is freed when that thread's local storage goes.
                log.debug("left a connection of another thread to its thread")


def connect(path: str | Path, *, busy_timeout_s: float) -> sqlite3.Connection:
    """A connection to the SQLite file ``path`` as every database here uses it:
    autocommit (transactions are explicit, :class:`write_txn`), rows as ``sqlite3.Row``,
    ``busy_timeout``, WAL journal (a warning when the filesystem refuses it),
    ``synchronous = NORMAL`` and foreign keys on. Usable by the thread that made it."""
    conn = sqlite3.connect(
        path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=True
    )
    conn.row_factory = sqlite3.Row
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
    mode = _journal_mode_wal(conn, busy_timeout_s)
    if mode.lower() != "wal":
        log.warning("%s: SQLite refused WAL mode (got %s); concurrency will suffer", path, mode)
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


def _journal_mode_wal(conn: sqlite3.Connection, busy_timeout_s: float) -> str:
    """Switch ``conn``'s file to WAL; returns the journal mode SQLite reports after.

    Two processes opening a fresh file at once (the service and its worker on a new
    cache) both ask for the switch, which needs the file to themselves: SQLite answers
    "database is locked" at once there, without waiting the busy timeout (one in six
    such pairs here). So the switch is tried again, a few milliseconds apart, for the
    busy timeout; a file already in WAL answers at once."""
    deadline = time.monotonic() + busy_timeout_s
    pause = 0.002
    while True:
        try:
            return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            if time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


class ThreadConnections:
    """One connection per thread of each process, opened on first use. The process's
    set is a :class:`ProcessLocal`: a forked child opens its own and parks the inherited
    ones (never used or closed: closing one could checkpoint or unlink the WAL under the
    parent's feet)."""

    def __init__(self) -> None:
        self.process: ProcessLocal[Connections] = ProcessLocal(Connections, Connections.close)

    def get(self, opener: Callable[[], sqlite3.Connection]) -> sqlite3.Connection:
        """This thread's connection, made by ``opener()`` when it has none. (The opener
        is passed per call, not kept: a bound method kept here would be a reference
        cycle holding a dropped owner's connections open until the cyclic collector.)"""
        conns = self.process.get()
        conn = getattr(conns.local, "conn", None)
        if conn is None:
            conn = opener()
            conns.add(conn)
        return conn

    def close(self) -> None:
        """Close this process's connections (re-opened on next use)."""
        self.process.close()


class write_txn:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on error) on an autocommit connection."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.conn.execute("ROLLBACK" if exc_type is not None else "COMMIT")


def schema_statements() -> list[str]:
    return [s.strip() for s in SCHEMA.split(";") if s.strip()]


def column_json(obj: Any) -> str:
    """JSON text for a queue column (params, heartbeat info): sorted keys, no spaces.
    Not a fingerprint's text: that is :func:`cache_store.keys.canonical_json`."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def chunks(seq: Sequence[int], n: int) -> Iterable[Sequence[int]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


class QueueAccess(abc.ABC):
    """What each part of the job queue (:mod:`cache_store.jobs.queue`,
    :mod:`~cache_store.jobs.queries`, :mod:`~cache_store.jobs.liveness`) works through:
    this thread's connection, the check that the file is still the one opened, and the
    queue's clock (seconds since the epoch)."""

    clock: Callable[[], float]

    @abc.abstractmethod
    def connection(self) -> sqlite3.Connection:
        """This thread's connection to the queue's database."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raise ``QueueDamaged`` if the file was lost since it was opened."""
