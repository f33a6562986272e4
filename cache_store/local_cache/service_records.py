"""The service's records read through a bounded local directory: a record's version is
the unit.

A record can change on the service under the same key (recomputed), so what this reader
keeps is an HTTP cache. The unit is one version of one record, named by the service, the
key and the record's strong ETag (its checksum,
:func:`~cache_store.format.header.record_etag`, computed here from the bytes, so a name
is unique to its bytes), kept in the :class:`~cache_store.local_cache.disk.LocalDisk`
(fetched once, least recently used out, never above the limit, shared by every process
of the machine). Which version the directory holds for a key is a note of the directory
(:meth:`LocalDisk.note`), so a loader worker forked for the next epoch knows it too.

Each read of a whole record is one request to the record route:

- with a copy here, ``If-None-Match`` names its ETag; a ``304`` is read from the copy
  (pinned while read: :meth:`LocalDisk.held`), its ETag checked against its name again
  (a copy damaged on disk is set aside and the record fetched);
- a ``200`` (no copy, or a new version) brings the bytes: they are kept as a new unit
  and noted as the key's version; the old version's copy goes when least recently used.

Every record is checked as :class:`~cache_store.stores.http.HTTPStore` checks it (the
same code: its ``request_record`` and ``verified``; bound to its key when decoded), a
confirmed copy as a fetched one. A record larger than the limit can hold raises
``LimitTooSmall`` naming both (the service does not list record sizes up front). Reads
of a subset (``fields=``) are the service's re-encoded records: read without the
directory, as without ``local_cache``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import Any

from cache_store.errors import CorruptRecord, RecordNotFound
from cache_store.format.header import record_etag
from cache_store.local_cache.disk import LocalDisk
from cache_store.local_cache.spec import LocalCache
from cache_store.stores.http import HTTPStore

__all__ = ["CachedHTTPStore", "RecordUnit"]


class RecordUnit:
    """One version of one record as a unit of the local directory: named by the service
    (``where``, a digest of its URL), the key and the version's ETag; ``value`` its bytes
    when they are here to be kept (a unit only looked up has none)."""

    def __init__(self, where: str, key: str, etag: str, value: bytes | None = None) -> None:
        self.key = key
        self.etag = etag
        self.value = value
        self.name = f"http/{where}/{key}/{etag}"

    def size(self) -> int:
        if self.value is None:
            raise RecordNotFound(self.key, "no local copy of this version to fetch")
        return len(self.value)

    def fetch(self, path: str) -> None:
        assert self.value is not None  # size() refused it first
        with open(path, "wb") as f:
            f.write(self.value)

    def check(self, path: str) -> None:
        with open(path, "rb") as f:
            raw = f.read()
        got = record_etag(raw, key=self.key)
        if got != self.etag:
            raise CorruptRecord(self.key, f"local copy has ETag {got}, expected {self.etag}")


class CachedHTTPStore(HTTPStore):
    """An :class:`HTTPStore` whose whole records are kept in ``local_cache`` and asked
    for conditionally (see the module doc). Takes the store's arguments and
    ``local_cache``."""

    def __init__(self, url: str, *, local_cache: LocalCache, **options: Any) -> None:
        super().__init__(url, **options)
        self.local_cache = local_cache
        self.disk = LocalDisk(local_cache)
        self.where = hashlib.blake2b(self.url.encode(), digest_size=8).hexdigest()

    def __repr__(self) -> str:
        return f"CachedHTTPStore({self.url!r}, {self.disk!r})"

    def _label(self, key: str) -> str:
        return f"http/{self.where}/{key}"

    def _fetch(self, key: str, fields: list[str] | None) -> Any:
        if fields is not None:
            return super()._fetch(key, fields)
        held = self.disk.noted(self._label(key))
        unit = None if held is None else RecordUnit(self.where, key, held)
        if unit is not None and self.disk.has(unit):
            response = self.request_record(key, headers={"If-None-Match": held})
            if response.status_code == 304:
                value = self._copy(unit)
                if value is not None:
                    return self.verified(key, value, response, whole=True)
                response = self.request_record(key)  # evicted or damaged meanwhile
        else:
            response = self.request_record(key)
        value = self.verified(key, response.content, response, whole=True)
        self._keep(key, value)
        return value

    def _copy(self, unit: RecordUnit) -> bytes | None:
        """The bytes of ``unit``'s copy, its ETag checked; None when there is none (a
        damaged one is set aside)."""
        with self.disk.held(unit) as fd:
            if fd is None:
                return None
            raw = os.pread(fd, os.fstat(fd).st_size, 0)
        try:
            good = record_etag(raw, key=unit.key) == unit.etag
        except CorruptRecord:
            good = False
        if not good:
            self.disk.discard(unit)
            return None
        return raw

    def _keep(self, key: str, value: bytes) -> None:
        """Keep ``value`` (a verified record) as the key's version here."""
        etag = record_etag(value, key=key)
        with self.disk.pinned(RecordUnit(self.where, key, etag, bytes(value))):
            pass
        self.disk.note(self._label(key), etag)

    def _fetch_many(
        self, keys: Iterable[str], fields: list[str] | None
    ) -> tuple[dict[str, memoryview], dict[str, str]]:
        """Whole records one conditional request each (a batch answer has no ETags);
        subsets through the batch route."""
        if fields is not None:
            return super()._fetch_many(keys, fields)
        found: dict[str, memoryview] = {}
        missing: dict[str, str] = {}
        for key in dict.fromkeys(keys):
            try:
                found[key] = memoryview(self._fetch(key, None))
            except RecordNotFound as exc:
                missing[key] = str(exc)
        return found, missing
