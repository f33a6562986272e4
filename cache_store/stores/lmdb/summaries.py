"""Per-fingerprint summaries, kept by the writers: what ``stats``, ``ls`` and the service's
cache views answer from without walking the records.

The ``summaries`` database holds one JSON value per fingerprint (its key): ``records``,
``bytes`` (the stored values' lengths), ``code_digests`` (recipe code digest -> records
computed by it, ``"none"`` for records that carry none) and, once its index is written,
``index`` (the index's description: :meth:`DatasetIndex.describe`), ``present`` (how
many indexed ids had a record when the index was written) and ``records_at_index``.

Rules, each kept in the same write transaction as the change it counts:

- :func:`count_put` for every record written (an overwrite takes the old value out
  first), :func:`count_index` for every index written, :func:`count_deleted` for every
  record deleted; a fingerprint left without records or index loses its summary.
- The marker (key :data:`MARKER`) says the summaries are kept, and names the write
  transaction that last kept them: every write transaction of an ``LMDBStore`` stamps
  its own id there (:func:`ensure`, first thing in the transaction). A write that did
  not (an older spcache, which knows no summaries; any other LMDB writer) leaves the
  marker naming an older transaction than the environment's last.
- A reader trusts them (:func:`read_trusted`) only when the marker names the very
  transaction its snapshot ends with and their record counts add up to the records
  database's own count (LMDB keeps it in the database's root: no walk); otherwise it
  walks. A writer that finds the marker naming another transaction than the one before
  its own builds them again in one walk (:func:`ensure`; so does the first write of this
  version on an older cache). A compacted copy starts its transaction ids again, so
  compaction builds them in the copy before the swap.
- ``present`` is exact while ``records == records_at_index`` (records are added, or a
  fingerprint is removed whole, never one by one); otherwise the reader counts it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from cache_store.errors import SpcacheError
from cache_store.format.header import read_header
from cache_store.keys import FINGERPRINT_HEX_CHARS
from cache_store.stores.lmdb.environment import (
    DESCRIPTORS_DB,
    INDEXES_DB,
    RECORDS_DB,
    SUMMARIES_DB,
)

__all__ = [
    "MARKER",
    "Tally",
    "code_digest_of",
    "count_deleted",
    "count_index",
    "count_put",
    "drop_index",
    "ensure",
    "read_trusted",
]

#: the key saying summaries are kept (sorts after every fingerprint: hex digits)
MARKER = b"~kept"
_VERSION = 1


def _marked_txn(txn: Any, db: Any) -> int | None:
    """The transaction id the marker names (None: no marker, or another version's)."""
    raw = None if db is None else txn.get(MARKER, db=db)
    if raw is None:
        return None
    try:
        mark = json.loads(bytes(raw))
        return int(mark["txn"]) if mark.get("version") == _VERSION else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _stamp(txn: Any, db: Any) -> None:
    txn.put(MARKER, json.dumps({"version": _VERSION, "txn": txn.id()}).encode(), db=db)


def code_digest_of(
    value: Any, fingerprint: str, descriptors: dict[str, str | None], txn: Any, db: Any
) -> str:
    """The recipe code digest a stored record counts under (its own ``code_digest``, a
    format-2 record's from its descriptor in ``db``; ``"none"`` when it has none or
    cannot be read). ``descriptors`` caches digest -> code digest for the caller."""
    try:
        meta = read_header(value).metadata
    except SpcacheError:
        return "none"
    digest = meta.get("descriptor")
    if digest is None:
        return str(meta.get("code_digest", "none"))
    if digest not in descriptors:
        code = None
        raw = None if db is None else txn.get(f"{fingerprint}/{digest}".encode(), db=db)
        if raw is not None:
            try:
                code = json.loads(bytes(raw))["metadata"].get("code_digest")
            except (ValueError, KeyError, TypeError, AttributeError):
                code = None
        descriptors[digest] = code
    return descriptors[digest] or "none"


class Tally:
    """Summaries being changed within one write transaction: loaded on first touch,
    written back by :meth:`save`."""

    def __init__(self, txn: Any, db: Any) -> None:
        self.txn, self.db = txn, db
        self.entries: dict[str, dict[str, Any]] = {}

    def entry(self, fingerprint: str) -> dict[str, Any]:
        found = self.entries.get(fingerprint)
        if found is None:
            raw = self.txn.get(fingerprint.encode(), db=self.db)
            found = json.loads(bytes(raw)) if raw is not None else {}
            found.setdefault("records", 0)
            found.setdefault("bytes", 0)
            found.setdefault("code_digests", {})
            self.entries[fingerprint] = found
        return found

    def add(self, fingerprint: str, size: int, code: str, sign: int = 1) -> None:
        entry = self.entry(fingerprint)
        entry["records"] += sign
        entry["bytes"] += sign * size
        codes = entry["code_digests"]
        codes[code] = codes.get(code, 0) + sign
        if codes[code] <= 0:
            del codes[code]

    def save(self) -> None:
        for fingerprint, entry in self.entries.items():
            key = fingerprint.encode()
            if entry["records"] <= 0 and "index" not in entry:
                self.txn.delete(key, db=self.db)
            else:
                self.txn.put(key, json.dumps(entry, sort_keys=True).encode(), db=self.db)
        self.entries = {}


def count_put(txn: Any, dbs: dict[bytes, Any], items: Iterable[tuple[bytes, bytes, str]]) -> None:
    """Count ``(key, value, code digest)`` about to be written (an overwritten value is
    taken out first)."""
    records_db, descriptors_db = dbs[RECORDS_DB], dbs[DESCRIPTORS_DB]
    tally = Tally(txn, dbs[SUMMARIES_DB])
    known: dict[str, dict[str, str | None]] = {}
    for key, value, code in items:
        fingerprint = key[:FINGERPRINT_HEX_CHARS].decode()
        old = txn.get(key, db=records_db)
        if old is not None:
            old_code = code_digest_of(
                old, fingerprint, known.setdefault(fingerprint, {}), txn, descriptors_db
            )
            tally.add(fingerprint, len(old), old_code, -1)
        tally.add(fingerprint, len(value), code)
    tally.save()


def count_deleted(txn: Any, dbs: dict[bytes, Any], fingerprint: str, values: Iterable[Any]) -> None:
    """Take deleted records of ``fingerprint`` (their values, read before the delete)
    out of its summary."""
    tally = Tally(txn, dbs[SUMMARIES_DB])
    known: dict[str, str | None] = {}
    for value in values:
        code = code_digest_of(value, fingerprint, known, txn, dbs[DESCRIPTORS_DB])
        tally.add(fingerprint, len(value), code, -1)
    tally.save()


def drop_index(txn: Any, dbs: dict[bytes, Any], fingerprint: str) -> None:
    """Note the index of ``fingerprint`` dropped (a removal)."""
    tally = Tally(txn, dbs[SUMMARIES_DB])
    entry = tally.entry(fingerprint)
    for name in ("index", "present", "records_at_index"):
        entry.pop(name, None)
    tally.save()


def count_index(
    txn: Any, dbs: dict[bytes, Any], describe: dict[str, Any], sample_ids: Iterable[str]
) -> None:
    """Note an index written for ``describe["fingerprint"]``: its description, and how
    many of its ids have a record now."""
    records_db = dbs[RECORDS_DB]
    fingerprint = describe["fingerprint"]
    tally = Tally(txn, dbs[SUMMARIES_DB])
    entry = tally.entry(fingerprint)
    prefix = fingerprint + "/"
    present = 0
    if records_db is not None:
        for sample_id in sample_ids:
            if txn.get((prefix + sample_id).encode(), db=records_db) is not None:
                present += 1
    entry["index"] = describe
    entry["present"] = present
    entry["records_at_index"] = entry["records"]
    tally.save()


def ensure(txn: Any, dbs: dict[bytes, Any]) -> bool:
    """Build the summaries in one walk unless they are kept already (see the module doc);
    True when they were built now. Every write transaction calls it first."""
    records_db, descriptors_db = dbs[RECORDS_DB], dbs[DESCRIPTORS_DB]
    indexes_db, summaries_db = dbs[INDEXES_DB], dbs[SUMMARIES_DB]
    if _marked_txn(txn, summaries_db) == txn.id() - 1 and _adds_up(txn, records_db, summaries_db):
        _stamp(txn, summaries_db)
        return False
    txn.drop(summaries_db, delete=False)
    tally = Tally(txn, summaries_db)
    known: dict[str, dict[str, str | None]] = {}
    if records_db is not None:
        for key, value in txn.cursor(db=records_db):
            fingerprint = bytes(key[:FINGERPRINT_HEX_CHARS]).decode()
            code = code_digest_of(
                value, fingerprint, known.setdefault(fingerprint, {}), txn, descriptors_db
            )
            tally.add(fingerprint, len(value), code)
    tally.save()
    if indexes_db is not None:
        from cache_store.format.index import decode_index

        for key, value in txn.cursor(db=indexes_db):
            fingerprint = bytes(key).decode()
            try:
                index = decode_index(value, key=f"index:{fingerprint}")
            except SpcacheError:
                continue  # an unreadable index: readers report it as they find it
            count_index(txn, dbs, index.describe(), index.sample_ids.tolist())
    _stamp(txn, summaries_db)
    return True


def _adds_up(txn: Any, records_db: Any, summaries_db: Any) -> bool:
    stored = 0 if records_db is None else int(txn.stat(records_db)["entries"])
    counted = 0
    for key, value in txn.cursor(db=summaries_db):
        if bytes(key) != MARKER:
            counted += int(json.loads(bytes(value)).get("records", 0))
    return stored == counted


def read_trusted(txn: Any, dbs: dict[bytes, Any]) -> dict[str, dict[str, Any]] | None:
    """Every fingerprint's summary, or None when they are not kept or do not add up (the
    caller walks the records)."""
    records_db, summaries_db = dbs.get(RECORDS_DB), dbs.get(SUMMARIES_DB)
    if summaries_db is None or _marked_txn(txn, summaries_db) != txn.id():
        return None
    out: dict[str, dict[str, Any]] = {}
    counted = 0
    for key, value in txn.cursor(db=summaries_db):
        if bytes(key) == MARKER:
            continue
        entry = json.loads(bytes(value))
        counted += int(entry.get("records", 0))
        out[bytes(key).decode()] = entry
    stored = 0 if records_db is None else int(txn.stat(records_db)["entries"])
    return out if stored == counted else None
