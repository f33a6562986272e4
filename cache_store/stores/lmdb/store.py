"""LMDBStore: the live cache's records and indexes, on the :class:`Store` contract.

The store's primitives, the removal steps ``rm`` and ``prune`` call, and the
conveniences LMDB does natively (lengths without copies, stats from the summaries). Every
operation runs in a transaction of the store's :class:`EnvironmentHandle`
(:mod:`cache_store.stores.lmdb.environment`); tombstones are
:mod:`cache_store.stores.lmdb.tombstones`, the summaries its writes keep
:mod:`cache_store.stores.lmdb.summaries`, views' read leases
:mod:`cache_store.stores.lmdb.leases`. The rules all of it keeps: :mod:`cache_store.stores.lmdb`.

Why one module: it is one class, the store contract's methods on one LMDB environment;
what could go (tombstones, summaries, the environment, compaction, view leases) has gone.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from cache_store import usage
from cache_store.errors import CorruptRecord, FingerprintRemoved, RecordNotFound, SpcacheError
from cache_store.format.decode import Record
from cache_store.format.descriptor import Descriptor, bind_metadata
from cache_store.format.header import read_own_metadata
from cache_store.format.index import DatasetIndex, IndexPage, decode_index, encode_index
from cache_store.keys import FINGERPRINT_HEX_CHARS, validate_fingerprint
from cache_store.stores.base import RecordDecoder, Store, count_code_digest, note_mixed_code
from cache_store.stores.lmdb import summaries, tombstones
from cache_store.views.records import Pack, Place, repacked
from cache_store.stores.lmdb.environment import (
    DEFAULT_MAP_SIZE,
    DEFAULT_MAX_READERS,
    DESCRIPTORS_DB,
    INDEXES_DB,
    RECORDS_DB,
    REMOVED_DB,
    EnvironmentHandle,
)
from cache_store.stores.lmdb.maps import MapLease

__all__ = ["LMDBStore"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: "last written" (spcache ls, prune) is recorded at most once a minute per fingerprint
_note_written = usage.Throttle(usage.note_written, 60.0)
#: Keys listed per read transaction (a slow consumer never pins an old snapshot).
KEYS_PER_TXN = 4096
_MAX_KEY_BYTES = 511  # LMDB's default build


def lookup_value(txn: Any, db: Any, key: str) -> Any:
    """The value under ``key`` or None (every value this module asks LMDB for); keys
    LMDB cannot hold (empty, over 511 bytes, not encodable) are simply absent."""
    if db is None or not isinstance(key, str):
        return None
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError:
        return None
    if not 0 < len(raw) <= _MAX_KEY_BYTES:
        return None
    return txn.get(raw, db=db)


class LMDBStore(Store):
    """Records in an LMDB environment under ``<path>/records/``.

    Args:
        path: the cache directory.
        readonly: readers open read-only (``put_*`` raise ``ReadOnlyStoreError``); a
            read-only store on a directory without a cache raises ``CacheNotFound``.
        map_size: initial map size in bytes for a writer (grows by itself).
        max_map_size: growth stops here (``None``: no bound but the disk).
        max_readers: size of the reader table (see the package doc).
        lock: use LMDB's lock file (readers of a read-only medium may pass False, if
            nothing writes meanwhile).
        readahead: OS read-ahead on the map; off by default (random access over data
            larger than memory).
        sync: fsync on commit (writers).

    Environment options are those of the first store that opens the path in a process.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        readonly: bool = True,
        map_size: int = DEFAULT_MAP_SIZE,
        max_map_size: int | None = None,
        max_readers: int = DEFAULT_MAX_READERS,
        lock: bool = True,
        readahead: bool = False,
        sync: bool = True,
    ) -> None:
        super().__init__(path, readonly=readonly)
        if map_size <= 0 or (max_map_size is not None and max_map_size < map_size):
            raise ValueError(f"map_size {map_size} / max_map_size {max_map_size} out of range")
        self.path = Path(path)
        self.map_size = int(map_size)
        self.max_map_size = max_map_size
        self.max_readers = int(max_readers)
        self.lock = lock
        self.readahead = readahead
        self.sync = sync
        #: this store's way to the environment (nothing opened yet)
        self.handle = EnvironmentHandle(
            self.path,
            readonly=self.readonly,
            map_size=self.map_size,
            max_map_size=max_map_size,
            max_readers=self.max_readers,
            lock=lock,
            readahead=readahead,
            sync=sync,
        )

    @property
    def env_path(self) -> Path:
        return self.handle.env_path

    def open(self) -> LMDBStore:
        """Open now (otherwise the first access does). Returns self."""
        self.handle.environment()
        return self

    def close(self) -> None:
        """Stop using the environment; it closes when no store of this process uses it."""
        self.handle.close()

    # -- transactions (the handle's, for this store) ------------------------------------
    def _environment(self) -> tuple[Any, dict[bytes, Any]]:
        return self.handle.environment()

    def _read(self) -> AbstractContextManager[tuple[Any, dict[bytes, Any]]]:
        return self.handle.read()

    def _write(self, action: Callable[[Any, dict[bytes, Any]], T], size_hint: int = 0) -> T:
        """Run ``action(txn, dbs)`` in one write transaction (refused when read-only),
        the summaries kept (:func:`~cache_store.stores.lmdb.summaries.ensure`) first."""
        self.check_writable()

        def kept(txn: Any, dbs: dict[bytes, Any]) -> T:
            summaries.ensure(txn, dbs)
            return action(txn, dbs)

        return self.handle.write(kept, size_hint)

    # -- primitives ------------------------------------------------------------------
    def _stored(self, txn: Any, dbs: Any, key: str) -> Any:
        """The value under ``key`` in ``txn`` (LMDB's map); raises why it is missing."""
        value = lookup_value(txn, dbs[RECORDS_DB], key)
        if value is None:
            raise tombstones.missing(txn, dbs, key, self.location)
        return value

    def get(self, key: str) -> bytes:
        with self._read() as (txn, dbs):
            return bytes(self._stored(txn, dbs, key))

    @contextmanager
    def read_view(self, key: str) -> Iterator[Any]:
        # The map's own bytes, valid until the block ends: a lease keeps the map mapped
        # (a compaction or another process's growth meanwhile cannot unmap it).
        with self.lease(key) as lease:
            yield lease.view

    def lease(self, key: str) -> MapLease:
        """The record under ``key`` lent from the map: ``lease.view`` (a buffer) stays
        valid until ``lease.release()`` (or the end of ``with store.lease(key) as
        lease:``), whatever compacts or grows the cache meanwhile; see
        :class:`~cache_store.stores.lmdb.maps.MapLease`. Release it soon: it holds
        a read transaction and, after a compaction, the old file's disk space."""
        lease = self.handle.lease()
        try:
            value = self._stored(lease.txn, lease.dbs, key)
        except lmdb.Error as exc:
            lease.release()
            raise self.handle.damaged(exc) from exc
        except BaseException:
            lease.release()
            raise
        lease.view = value
        return lease

    def supply(
        self, keys: list[str], fields: list[str] | None, decoder: RecordDecoder
    ) -> list[Record]:
        # The map's own bytes, decoded inside one read transaction: one copy per tensor.
        # The hot path of every read: no context-manager generator around the transaction.
        lease = self.handle.lease()
        try:
            txn, dbs = lease.txn, lease.dbs
            return decoder.values([self._stored(txn, dbs, key) for key in keys])
        except lmdb.Error as exc:
            raise self.handle.damaged(exc) from exc
        finally:
            lease.release()

    def view_records(
        self,
        keys: list[str],
        fields: list[str] | None,
        verify: str,
        checked: Mapping[str, tuple[Place, str]] | None = None,
        transient: bool = False,
        pack: Pack | None = None,
    ) -> list[Record] | None:
        # Pinned by a read lease begun before the lookup (its own read transaction, not
        # a MapLease: that would hold the map, so a re-map would wait for the views),
        # mapped by this process from data.mdb where LMDB's map shows the value (see
        # cache_store.stores.lmdb.leases).
        found = None if self.views_refused() else self.handle.view_leases()
        if found is None:
            return None
        leases, pin = found
        try:
            lookup = self.handle.lease()
        except BaseException:
            leases.settle(pin)
            raise
        try:
            if lookup.dbs is not leases.dbs:  # a swap adopted between the two: copies
                return None
            txn, records, direct = lookup.txn, [], pack is not None
            snapshot = txn.id()  # where a record lies in it may be known: no lookup
            for key in keys:
                told = None if checked is None else checked.get(key)
                find = functools.partial(self._stored, txn, lookup.dbs, key)
                how = (fields, verify, told, self.descriptor, transient, direct)
                record = leases.view(pin, key, snapshot, find, *how)
                if record is None:  # not where views can be made: the copy path
                    return None
                records.append(record)
            return records if pack is None else repacked(records, pack)  # LMDB's map held
        except lmdb.Error as exc:
            raise self.handle.damaged(exc) from exc
        finally:
            lookup.release()
            leases.settle(pin)

    def views_refused(self) -> str | None:
        if not self.lock:
            return "opened without LMDB's lock file: no read lease can pin a view's pages"
        return None

    def value_size(self, key: str) -> int:
        # the value's length in the map view: no copy
        lease = self.handle.lease()
        try:
            return len(self._stored(lease.txn, lease.dbs, key))
        except lmdb.Error as exc:
            raise self.handle.damaged(exc) from exc
        finally:
            lease.release()

    def generation(self) -> int:
        """The id of the environment's last committed write transaction (read from its
        meta page, no transaction): any write that landed, in any process, changes it.
        Tagged with the records directory's inode, so a compacted environment swapped in
        (whose counter starts again) counts as a change too."""
        env, _ = self._environment()
        try:
            txnid = int(env.info()["last_txnid"])
        except lmdb.Error as exc:
            raise self.handle.damaged(exc) from exc
        inode = self.handle.generation_inode()
        return txnid if inode is None else (inode << 48) | (txnid & ((1 << 48) - 1))

    def put_many(
        self, items: Iterable[tuple[str, bytes]], descriptors: Iterable[Descriptor] = ()
    ) -> int:
        self.check_writable()
        batch = self.check_items(items, descriptors)
        # in key order: a record whose key follows every stored one is appended
        # (MDB_APPEND), which fills pages; any other insert splits a full page in two
        checked = sorted(
            (
                (k.encode(), v, code)
                for (k, v), code in zip(batch.records, batch.codes, strict=True)
            ),
            key=lambda kv: kv[0],
        )
        named = [
            (f"{d.fingerprint}/{d.digest}".encode(), d.text.encode()) for d in batch.descriptors
        ]

        def put(txn: Any, dbs: dict[bytes, Any]) -> int:
            tombstones.refuse(
                txn,
                dbs,
                {key[:FINGERPRINT_HEX_CHARS].decode() for key, _, _ in checked},
                self.location,
            )
            summaries.count_put(txn, dbs, checked)  # before the puts: it reads what they replace
            for key, text in named:  # with the first records that name it (or over a
                if txn.get(key, db=dbs[DESCRIPTORS_DB]) != text:  # damaged copy)
                    txn.put(key, text, db=dbs[DESCRIPTORS_DB])
            records = dbs[RECORDS_DB]
            cursor = txn.cursor(db=records)
            last = bytes(cursor.key()) if cursor.last() else b""
            for key, value, _ in checked:
                if key > last:
                    txn.put(key, value, db=records, append=True)
                    last = key
                else:
                    txn.put(key, value, db=records)
            return len(checked)

        count = self._write(put, sum(len(v) for _, v, _ in checked))
        for fingerprint in {key[:FINGERPRINT_HEX_CHARS].decode() for key, _, _ in checked}:
            _note_written(self.path, fingerprint)
        return count

    def load_descriptor(self, fingerprint: str, digest: str) -> bytes | None:
        # Asked once per descriptor and process. A handle opened before any writer made
        # the database looks for it again now, not a second later: the record naming it
        # was read already. Absent from a removed fingerprint: FingerprintRemoved.
        for again in (False, True):
            with self._read() as (txn, dbs):
                db = dbs.get(DESCRIPTORS_DB)
                if db is not None or again:
                    value = lookup_value(txn, db, f"{fingerprint}/{digest}")
                    if value is not None:
                        return bytes(value)
                    removed = tombstones.removed_at(txn, dbs, fingerprint)
                    if removed is not None:
                        raise FingerprintRemoved(fingerprint, self.location, removed)
                    return None
            self.handle.look_for_new_databases()
        return None

    def records_metadata(self, keys: Sequence[str]) -> list[dict[str, str] | SpcacheError]:
        # headers parsed from the map's bytes, KEYS_PER_TXN keys per read transaction
        out: list[dict[str, str] | SpcacheError] = []
        for start in range(0, len(keys), KEYS_PER_TXN):
            chunk = keys[start : start + KEYS_PER_TXN]
            heads: list[dict[str, str] | SpcacheError] = []
            lease = self.handle.lease()
            try:
                txn, db = lease.txn, lease.dbs[RECORDS_DB]
                for key in chunk:
                    value = lookup_value(txn, db, key)
                    if value is None:
                        heads.append(RecordNotFound(key, self.location))
                        continue
                    try:
                        heads.append(read_own_metadata(value, key=key))
                    except CorruptRecord as exc:
                        heads.append(exc)
            except lmdb.Error as exc:
                raise self.handle.damaged(exc) from exc
            finally:
                lease.release()
            for key, head in zip(chunk, heads, strict=True):
                if isinstance(head, SpcacheError):
                    out.append(head)
                    continue
                try:
                    out.append(bind_metadata(head, key, self.descriptor))
                except CorruptRecord as exc:
                    out.append(exc)
        return out

    def has(self, key: str) -> bool:
        with self._read() as (txn, dbs):
            db = dbs[RECORDS_DB]
            return lookup_value(txn, db, key) is not None

    def keys(self, prefix: str = "") -> Iterator[str]:
        # Chunks of keys per short transaction: a consumer that stops early, or works
        # slowly between keys, never pins an old snapshot (or a reader slot).
        try:
            raw_prefix = prefix.encode("utf-8")
        except UnicodeEncodeError:
            return  # no key can start with it
        start = raw_prefix
        skip_start = False
        while True:
            chunk = self._key_chunk(start, raw_prefix, skip_start)
            yield from (self.handle.key_text(k) for k in chunk)
            if len(chunk) < KEYS_PER_TXN:
                return
            start, skip_start = chunk[-1], True

    def _key_chunk(self, start: bytes, prefix: bytes, skip_start: bool) -> list[bytes]:
        with self._read() as (txn, dbs):
            if dbs[RECORDS_DB] is None:
                return []
            cursor = txn.cursor(db=dbs[RECORDS_DB])
            found: list[bytes] = []
            if not cursor.set_range(start):
                return found
            for key in cursor.iternext(keys=True, values=False):
                key = bytes(key)
                if not key.startswith(prefix):
                    break
                if skip_start and key == start:
                    continue
                found.append(key)
                if len(found) == KEYS_PER_TXN:
                    break
            return found

    def put_index(self, index: DatasetIndex) -> None:
        value = encode_index(index)

        def put(txn: Any, dbs: dict[bytes, Any]) -> None:
            tombstones.refuse(txn, dbs, {index.fingerprint}, self.location)
            txn.put(index.fingerprint.encode(), value, db=dbs[INDEXES_DB])
            summaries.count_index(txn, dbs, index.describe(), index.sample_ids.tolist())

        self._write(put, len(value))

    def get_index(self, fingerprint: str) -> DatasetIndex:
        return self._read_index(fingerprint, lambda value, key: decode_index(value, key=key))

    def get_index_page(self, fingerprint: str, offset: int, limit: int) -> IndexPage:
        from cache_store.format.index import index_page  # one page, no object per other id

        return self._read_index(fingerprint, lambda v, key: index_page(v, offset, limit, key=key))

    def _read_index(self, fingerprint: str, read: Callable[[Any, str], T]) -> T:
        validate_fingerprint(fingerprint)
        with self._read() as (txn, dbs):
            db = dbs[INDEXES_DB]
            value = None if db is None else txn.get(fingerprint.encode(), db=db)
            if value is not None:
                return read(value, f"index:{fingerprint}")
            removed = tombstones.removed_at(txn, dbs, fingerprint)
        if removed is not None:
            raise FingerprintRemoved(fingerprint, self.location, removed)
        raise self.index_missing(fingerprint)

    def fingerprints(self) -> list[str]:
        with self._read() as (txn, dbs):
            if dbs[INDEXES_DB] is None:
                return []
            cursor = txn.cursor(db=dbs[INDEXES_DB])
            return [self.handle.key_text(k) for k in cursor.iternext(keys=True, values=False)]

    # -- removal (spcache rm / prune) --------------------------------------------------
    def removals(self) -> dict[str, float]:
        """Tombstoned fingerprints -> when they were removed."""
        with self._read() as (txn, dbs):
            db = dbs.get(REMOVED_DB)
            if db is None:
                return {}
            out = {}
            for key in txn.cursor(db=db).iternext(keys=True, values=False):
                fingerprint = self.handle.key_text(key)
                out[fingerprint] = tombstones.removed_at(txn, dbs, fingerprint) or 0.0
            return out

    def removed_at(self, fingerprint: str) -> float | None:
        """When ``fingerprint`` was removed, or None if it carries no tombstone."""
        with self._read() as (txn, dbs):
            return tombstones.removed_at(txn, dbs, fingerprint)

    def mark_removed(self, fingerprint: str, when: float | None = None) -> float:
        """Step one of removing a fingerprint, in one transaction: write its tombstone
        (an existing one keeps its time) and drop its index. From then on its readers get
        :class:`FingerprintRemoved` and its writes are refused. Returns the removal time."""
        validate_fingerprint(fingerprint)
        stamp = time.time() if when is None else float(when)

        def mark(txn: Any, dbs: dict[bytes, Any]) -> float:
            summaries.drop_index(txn, dbs, fingerprint)
            return tombstones.mark(txn, dbs, fingerprint, stamp)

        return self._write(mark)

    def delete_records(self, fingerprint: str, *, chunk: int = 1024) -> tuple[int, int]:
        """Step two: delete every record of ``fingerprint``, ``chunk`` per transaction
        (each commit is a consistent state; a kill leaves fewer records, never a broken
        one). Returns ``(records, bytes)`` deleted."""
        prefix = validate_fingerprint(fingerprint).encode() + b"/"

        def delete(txn: Any, dbs: dict[bytes, Any]) -> tuple[int, int]:
            cursor = txn.cursor(db=dbs[RECORDS_DB])
            count = size = 0
            if not cursor.set_range(prefix):
                return 0, 0
            deleted = []
            while count < chunk and bytes(cursor.key()).startswith(prefix):
                value = cursor.value()
                deleted.append(value)
                size += len(value)
                count += 1
                if not cursor.delete():  # moves to the next item; False at the end
                    break
            summaries.count_deleted(txn, dbs, fingerprint, deleted)
            return count, size

        def forget_descriptors(txn: Any, dbs: dict[bytes, Any]) -> None:
            left = txn.cursor(db=dbs[RECORDS_DB])
            if left.set_range(prefix) and bytes(left.key()).startswith(prefix):
                return  # written since (computed again after the removal): still named
            cursor = txn.cursor(db=dbs[DESCRIPTORS_DB])
            if cursor.set_range(prefix):
                while bytes(cursor.key()).startswith(prefix) and cursor.delete():
                    pass

        total = total_bytes = 0
        while True:
            count, size = self._write(delete)
            total, total_bytes = total + count, total_bytes + size
            if count < chunk:
                self._write(forget_descriptors)  # no record names them any more
                return total, total_bytes

    def record_fingerprints(self) -> list[str]:
        """Fingerprints that have at least one record (indexed or not), sorted: one seek
        per fingerprint, not a walk over every record."""
        found: list[str] = []
        with self._read() as (txn, dbs):
            if dbs[RECORDS_DB] is None:
                return found
            cursor = txn.cursor(db=dbs[RECORDS_DB])
            position = cursor.first()
            while position:
                key = bytes(cursor.key())
                head = key[:FINGERPRINT_HEX_CHARS]
                found.append(self.handle.key_text(head))
                position = cursor.set_range(head + b"0")  # "0" sorts right after "/"
        return found

    def fingerprint_size(self, fingerprint: str) -> tuple[int, int]:
        """``(records, bytes)`` stored under ``fingerprint`` (record values' lengths; the
        values themselves are not read)."""
        prefix = validate_fingerprint(fingerprint).encode() + b"/"
        count = size = 0
        with self._read() as (txn, dbs):
            if dbs[RECORDS_DB] is None:
                return 0, 0
            cursor = txn.cursor(db=dbs[RECORDS_DB])
            if not cursor.set_range(prefix):
                return 0, 0
            for key, value in cursor:
                if not bytes(key).startswith(prefix):
                    break
                count += 1
                size += len(value)
        return count, size

    def revive(self, fingerprint: str, requested_at: float) -> bool:
        """Lift the tombstone of ``fingerprint`` if it is older than ``requested_at`` (work
        on it asked for after the removal); True when one was lifted."""
        validate_fingerprint(fingerprint)
        if self.readonly:
            return False
        with self._read() as (txn, dbs):
            if tombstones.removed_at(txn, dbs, fingerprint) is None:
                return False  # the common case: no write transaction

        lifted = self._write(lambda txn, dbs: tombstones.lift(txn, dbs, fingerprint, requested_at))
        if lifted:
            log.info("%s: fingerprint %s computed again after its removal", self.path, fingerprint)
        return lifted

    # -- conveniences done natively ----------------------------------------------------
    def summaries(self) -> dict[str, dict[str, Any]] | None:
        """Every fingerprint's summary as the writers keep it
        (:mod:`cache_store.stores.lmdb.summaries`), or None when they are not kept here
        (a cache no writer of this version has written yet)."""
        with self._read() as (txn, dbs):
            return summaries.read_trusted(txn, dbs)

    def present_count(self, fingerprint: str, summary: dict[str, Any]) -> int:
        """How many ids of ``fingerprint``'s index have a record: from its ``summary``
        while no record was added since the index was written, else counted."""
        if "index" not in summary:
            return 0
        if "present" in summary and summary.get("records_at_index") == summary.get("records"):
            return int(summary.get("present", 0))
        prefix = fingerprint + "/"
        stored = {key[len(prefix) :] for key in self.keys(prefix)}
        ids = self.get_index(fingerprint).sample_ids.tolist()
        return sum(1 for sid in ids if sid in stored)

    def stats(self) -> dict[str, Any]:
        """The stats from the summaries the writers keep, without a walk; a walk over
        every record where they are not kept (see :meth:`summaries`)."""
        kept = self.summaries()
        if kept is not None:
            out = self._summarized_stats(kept)
        else:
            out = self._walked_stats()
        env, _ = self._environment()
        with self._read():
            info, stat = env.info(), env.stat()
        out["lmdb"] = {
            "map_size": info["map_size"],
            "used_bytes": (info["last_pgno"] + 1) * stat["psize"],
            "max_readers": info["max_readers"],
            "readers_in_use": info["num_readers"],
        }
        return out

    def _summarized_stats(self, kept: dict[str, dict[str, Any]]) -> dict[str, Any]:
        per_fp: dict[str, dict[str, Any]] = {}
        for fingerprint, summary in kept.items():
            entry: dict[str, Any] = {"records": summary["records"], "bytes": summary["bytes"]}
            if summary.get("code_digests"):
                entry["code_digests"] = dict(summary["code_digests"])
            note_mixed_code(entry)
            if "index" in summary:
                entry.update(summary["index"])
            per_fp[fingerprint] = entry
        return {
            "location": self.location,
            "records": sum(e["records"] for e in per_fp.values()),
            "bytes": sum(e["bytes"] for e in per_fp.values()),
            "fingerprints": dict(sorted(per_fp.items())),
        }

    def _walked_stats(self) -> dict[str, Any]:
        per_fp: dict[str, dict[str, Any]] = {}
        with self._read() as (txn, dbs):
            if dbs[RECORDS_DB] is not None:
                for key, value in txn.cursor(db=dbs[RECORDS_DB]):
                    entry = per_fp.setdefault(
                        self.handle.key_text(key[:FINGERPRINT_HEX_CHARS]),
                        {"records": 0, "bytes": 0},
                    )
                    entry["records"] += 1
                    entry["bytes"] += len(value)
                    count_code_digest(
                        entry, value, bytes(key[:FINGERPRINT_HEX_CHARS]).decode(), self.descriptor
                    )
        return self._finish_stats(per_fp)
