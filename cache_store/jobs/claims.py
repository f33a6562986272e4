"""Claims: several runs computing into one cache divide the samples instead of each
computing all of them.

Every engine run into a local cache directory (``spcache precompute`` started once per
GPU, or twice by accident; the service's worker too) registers itself in
``<cache>/claims.sqlite`` and claims each sample before it loads it, a batch at a time,
in one ``BEGIN IMMEDIATE`` transaction: a sample nobody holds becomes this run's; one
held by a live run is left to it (the caller waits for its record); one held by a dead
run is taken over. Claims are dropped when the run ends (:meth:`RunClaims.close`), its
records committed first.

A run is dead when it ran on this machine and its process is gone
(:func:`cache_store.processes.pid_alive`), or, from another machine sharing the
directory, when it has not beaten for :data:`LEASE_S` (each claim beats; a waiting run
beats as it polls). The file is advice: without it (unwritable, damaged) a run claims
everything itself, as runs did before claims, and says so once.
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from cache_store.jobs.db import connect, write_txn
from cache_store.processes import pid_alive

__all__ = ["CLAIMS_FILENAME", "LEASE_S", "RunClaims", "live_runs"]

log = logging.getLogger(__name__)

CLAIMS_FILENAME = "claims.sqlite"
#: A run on another machine that has not beaten for this long is taken for dead.
LEASE_S = 600.0

_SCHEMA = (
    (
        "CREATE TABLE IF NOT EXISTS runs (id TEXT PRIMARY KEY, host TEXT NOT NULL, "
        "pid INTEGER NOT NULL, started REAL NOT NULL, beat REAL NOT NULL)"
    ),
    (
        "CREATE TABLE IF NOT EXISTS claims (fingerprint TEXT NOT NULL, "
        "sample_id TEXT NOT NULL, run TEXT NOT NULL, PRIMARY KEY (fingerprint, sample_id)) "
        "WITHOUT ROWID"
    ),
    "CREATE INDEX IF NOT EXISTS claims_by_run ON claims (run)",
)
_BATCH = 500  # ids per statement (SQLite's variable limit is 999 on old builds)


class RunClaims:
    """One run's claims on the samples of ``fingerprint`` in the cache at ``cache``."""

    def __init__(
        self, cache: str | os.PathLike[str], fingerprint: str, *, lease_s: float = LEASE_S
    ) -> None:
        self.path = Path(cache) / CLAIMS_FILENAME
        self.fingerprint = fingerprint
        self.lease_s = lease_s
        self.run_id = uuid.uuid4().hex
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.conn: sqlite3.Connection | None = None
        self.broken: str | None = None

    def _connection(self) -> sqlite3.Connection | None:
        if self.conn is None and self.broken is None:
            try:
                conn = connect(self.path, busy_timeout_s=60.0)
                with write_txn(conn):
                    for statement in _SCHEMA:
                        conn.execute(statement)
                    now = time.time()
                    conn.execute(
                        "INSERT INTO runs (id, host, pid, started, beat) VALUES (?, ?, ?, ?, ?)",
                        (self.run_id, self.host, self.pid, now, now),
                    )
                self.conn = conn
            except (sqlite3.Error, OSError) as exc:
                self._give_up(exc)
        return self.conn

    def _give_up(self, exc: BaseException) -> None:
        self.broken = str(exc)
        log.warning(
            "%s: claims unusable (%s); this run computes every sample it is given, "
            "even one another run is computing",
            self.path,
            exc,
        )
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def claim(self, sample_ids: Sequence[str]) -> set[str]:
        """The ids of ``sample_ids`` this run holds now: those nobody held, those it held
        already, and those of dead runs, taken over. Without a usable claims file: all."""
        conn = self._connection()
        if conn is None:
            return set(sample_ids)
        held: set[str] = set()
        try:
            with write_txn(conn):
                now = time.time()
                conn.execute("UPDATE runs SET beat = ? WHERE id = ?", (now, self.run_id))
                dead = self._dead_runs(conn, now)
                for start in range(0, len(sample_ids), _BATCH):
                    chunk = list(sample_ids[start : start + _BATCH])
                    conn.executemany(
                        "INSERT OR IGNORE INTO claims (fingerprint, sample_id, run) VALUES (?, ?, ?)",
                        [(self.fingerprint, sid, self.run_id) for sid in chunk],
                    )
                    marks = ",".join("?" * len(chunk))
                    rows = conn.execute(
                        f"SELECT sample_id, run FROM claims WHERE fingerprint = ? "
                        f"AND sample_id IN ({marks})",
                        (self.fingerprint, *chunk),
                    ).fetchall()
                    taken = [sid for sid, run in rows if run in dead]
                    if taken:
                        conn.executemany(
                            "UPDATE claims SET run = ? WHERE fingerprint = ? AND sample_id = ?",
                            [(self.run_id, self.fingerprint, sid) for sid in taken],
                        )
                        log.info(
                            "%d sample(s) of fingerprint %s were claimed by a run that "
                            "died; this run takes them over",
                            len(taken),
                            self.fingerprint,
                        )
                    held.update(sid for sid, run in rows if run == self.run_id or run in dead)
                for run in dead:  # their claims are taken over or still theirs to take
                    left = conn.execute("SELECT 1 FROM claims WHERE run = ? LIMIT 1", (run,))
                    if left.fetchone() is None:
                        conn.execute("DELETE FROM runs WHERE id = ?", (run,))
        except sqlite3.Error as exc:
            self._give_up(exc)
            return set(sample_ids)
        return held

    def _dead_runs(self, conn: sqlite3.Connection, now: float) -> set[str]:
        dead = set()
        for run, host, pid, beat in conn.execute("SELECT id, host, pid, beat FROM runs"):
            if run == self.run_id:
                continue
            if host == self.host:
                if not pid_alive(int(pid)):
                    dead.add(run)
            elif now - float(beat) > self.lease_s:
                dead.add(run)
        # claims whose run row is gone (a run removed while its claims were written)
        orphans = conn.execute(
            "SELECT DISTINCT run FROM claims WHERE run NOT IN (SELECT id FROM runs)"
        ).fetchall()
        dead.update(run for (run,) in orphans)
        return dead

    def close(self) -> None:
        """Drop this run's claims and its registration (its records are committed)."""
        conn, self.conn = self.conn, None
        if conn is None:
            return
        try:
            with write_txn(conn):
                conn.execute("DELETE FROM claims WHERE run = ?", (self.run_id,))
                conn.execute("DELETE FROM runs WHERE id = ?", (self.run_id,))
        except sqlite3.Error as exc:  # left behind: taken over once this process is gone
            log.warning("%s: cannot drop this run's claims: %s", self.path, exc)
        finally:
            conn.close()


def live_runs(cache: str | os.PathLike[str]) -> dict[str, str]:
    """Fingerprints a live run holds claims on -> that run (``run pid N on HOST``), read
    from ``<cache>/claims.sqlite`` without writing it; {} when there is none or it cannot
    be read (advice, as the claims are). Live as :meth:`RunClaims.claim` judges it."""
    path = Path(cache) / CLAIMS_FILENAME
    if not path.is_file():
        return {}
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
        try:
            rows = conn.execute(
                "SELECT DISTINCT c.fingerprint, r.host, r.pid, r.beat "
                "FROM claims c JOIN runs r ON r.id = c.run"
            ).fetchall()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        log.debug("%s: not read (%s)", path, exc)
        return {}
    now, here = time.time(), socket.gethostname()
    found: dict[str, str] = {}
    for fingerprint, host, pid, beat in rows:
        alive = pid_alive(int(pid)) if host == here else now - float(beat) <= LEASE_S
        if alive:
            found.setdefault(str(fingerprint), f"run pid {pid} on {host}")
    return found
