"""Tombstones: the ``removed`` database, fingerprint -> when it was removed.

Removing a fingerprint (``spcache rm``/``prune``) writes its tombstone in the same
transaction that drops its index (:func:`mark`); its records are then deleted in chunks.
While the tombstone stands, a read that misses a record or index of the fingerprint
raises :class:`FingerprintRemoved` (:func:`missing`) and a write of its records or index
is refused inside the write transaction (:func:`refuse`), so a run that was under way
cannot bring it back, until work requested after the removal lifts it (:func:`lift`).

Functions over one transaction (``txn``) and the environment's databases (``dbs``);
:class:`cache_store.stores.lmdb.LMDBStore` runs them in its reads and writes.
"""

from __future__ import annotations

import json
from typing import Any

from cache_store.errors import FingerprintRemoved, RecordNotFound
from cache_store.keys import FINGERPRINT_HEX_CHARS, is_fingerprint
from cache_store.stores.lmdb.environment import INDEXES_DB, REMOVED_DB

__all__ = ["lift", "mark", "missing", "refuse", "removed_at"]


def removed_at(txn: Any, dbs: dict[bytes, Any], fingerprint: str) -> float | None:
    """When ``fingerprint`` was removed (its tombstone), or None."""
    db = dbs.get(REMOVED_DB)
    if db is None or not is_fingerprint(fingerprint):
        return None
    value = txn.get(fingerprint.encode("ascii"), db=db)
    if value is None:
        return None
    try:
        return float(json.loads(bytes(value))["removed_at"])
    except (ValueError, KeyError, TypeError):
        return 0.0  # an unreadable tombstone still means "removed"


def missing(txn: Any, dbs: dict[bytes, Any], key: str, location: str) -> RecordNotFound:
    """The error for a record not found: :class:`FingerprintRemoved` when its
    fingerprint carries a tombstone (looked up only on a miss)."""
    fingerprint = key[:FINGERPRINT_HEX_CHARS]
    removed = removed_at(txn, dbs, fingerprint)
    if removed is not None:
        return FingerprintRemoved(fingerprint, location, removed, key=key)
    return RecordNotFound(key, location)


def refuse(txn: Any, dbs: dict[bytes, Any], fingerprints: set[str], location: str) -> None:
    """Raise :class:`FingerprintRemoved` if one of ``fingerprints`` carries a tombstone
    (inside a write transaction: the write is then not made)."""
    for fingerprint in fingerprints:
        removed = removed_at(txn, dbs, fingerprint)
        if removed is not None:
            raise FingerprintRemoved(fingerprint, location, removed)


def mark(txn: Any, dbs: dict[bytes, Any], fingerprint: str, stamp: float) -> float:
    """Write the tombstone of ``fingerprint`` (an existing one keeps its time) and drop
    its index; returns the removal time."""
    earlier = removed_at(txn, dbs, fingerprint)
    if earlier is None:
        txn.put(
            fingerprint.encode(),
            json.dumps({"removed_at": stamp}).encode(),
            db=dbs[REMOVED_DB],
        )
    txn.delete(fingerprint.encode(), db=dbs[INDEXES_DB])
    return stamp if earlier is None else earlier


def lift(txn: Any, dbs: dict[bytes, Any], fingerprint: str, requested_at: float) -> bool:
    """Delete the tombstone of ``fingerprint`` if it is older than ``requested_at``;
    True when one was lifted."""
    removed = removed_at(txn, dbs, fingerprint)
    if removed is None or removed > requested_at:
        return False
    txn.delete(fingerprint.encode(), db=dbs[REMOVED_DB])
    return True
