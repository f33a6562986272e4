"""A remote sharded snapshot read through a bounded local directory: parts are the unit.

A committed part (``<fp>/parts/<part>.bin``) never changes, and a reader that reads its
records together (the sampler's block-local order keeps a part's samples in one window)
reads it whole: :class:`CachedShardedSnapshot` fetches each part it needs once into the
:class:`~cache_store.local_cache.disk.LocalDisk`, checked against its manifest's
``data_size`` and ``data_xxh3`` before anyone reads it, then reads records from the
local copy (``pread`` of the manifest's ranges) and checks each against the manifest as
every read of a sharded snapshot does.

What is served never depends on the local copy:

- a record that fails its checks from the local copy sets the copy aside
  (:meth:`LocalDisk.discard`: damaged on disk) and is read from the snapshot by range,
  as without ``local_cache``: it is served if good there, ``CorruptRecord`` if not; the
  part is fetched again on its next read;
- a part whose fetched bytes do not match its manifest (damaged in the snapshot) is not
  kept: its records are read by range, each checked, so a damaged record fails alone.
- a part gone from the snapshot since this process listed it (a superseded copy that
  ``spcache merge --remove-superseded`` reclaimed) and not here: the commits are listed
  again once and the copy that listing names is read (``read_located``, as for every
  read of a sharded snapshot); a part kept here is still read from its copy (it never
  changes, and a warm epoch asks the bucket nothing).

``prefetch(keys)`` fetches the parts of ``keys`` (first appearance first) in a thread
of this process (:mod:`cache_store.local_cache.prefetch`). ``get_index`` refuses a
``cache_limit`` that cannot hold the dataset's largest part, before any read.

What a listing found is kept for the process, not the store: a store opened later in
this process, or in a process forked from it (a DataLoader worker, each epoch), starts
from the last listing of the snapshot (:data:`LISTINGS`) and each part's ``data_size``
and ``data_xxh3`` once read (:data:`DESCRIBED`: a committed manifest never changes), so
an epoch whose parts are all here makes no request at all. Freshness is a reader's, as
for one :class:`ShardedSnapshot`: ``get_index`` (a new ``CachedDataset``) lists the
commits again, and a key not in the listing lists them again (at most once a second,
``MISS_RELIST_S``), in whichever process misses it. Only plain values are inherited
(no file system, socket or lock: the file system stays in a ``ProcessLocal``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from cache_store.errors import CorruptRecord
from cache_store.format.decode import Record
from cache_store.format.index import DatasetIndex
from cache_store.keys import split_key
from cache_store.local_cache.disk import LocalDisk
from cache_store.local_cache.spec import LocalCache
from cache_store.local_cache.prefetch import Prefetcher, process_prefetcher
from cache_store.process_local import ProcessLocal
from cache_store.snapshot.sharded import storage
from cache_store.snapshot.sharded.format import Dataset, Entry, parse_manifest
from cache_store.snapshot.sharded.store import PartMissing, ShardedSnapshot
from cache_store.stores.base import RecordDecoder

__all__ = ["DESCRIBED", "LISTINGS", "CachedShardedSnapshot", "PartUnit"]

log = logging.getLogger(__name__)

_HASH_BLOCK = 8 << 20

#: (location, fingerprint) -> the last listing this process made or inherited, and when
#: (``time.monotonic()``, one clock for a process and its forks)
LISTINGS: dict[tuple[str, str], tuple[Dataset, float]] = {}
#: a part unit's name -> its manifest's (``data_size``, ``data_xxh3``), once read
DESCRIBED: dict[str, tuple[int, str]] = {}


class PartUnit:
    """One committed part as a unit of the local directory: named by the snapshot's
    location, fingerprint and part (parts are never rewritten under one name), sized
    and checked by its manifest."""

    def __init__(self, store: ShardedSnapshot, fingerprint: str, part: str) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.part = part
        where = hashlib.blake2b(store.location.encode(), digest_size=8).hexdigest()
        self.name = f"sharded/{where}/{fingerprint}/{part}.bin"
        self._manifest: tuple[int, str] | None = None

    def _described(self) -> tuple[int, str]:
        """(``data_size``, ``data_xxh3``) from the part's manifest."""
        if self._manifest is None:
            self._manifest = DESCRIBED.get(self.name)
        if self._manifest is None:
            raw = storage.read(
                self.store.fs, self.store.path(self.fingerprint, "commits", f"{self.part}.json")
            )
            doc, _ = parse_manifest(raw, self.fingerprint, self.part)
            self._manifest = (int(doc["data_size"]), str(doc.get("data_xxh3", "")))
            DESCRIBED[self.name] = self._manifest
        return self._manifest

    def size(self) -> int:
        return self._described()[0]

    def fetch(self, path: str) -> None:
        remote = self.store.path(self.fingerprint, "parts", f"{self.part}.bin")
        self.store.fs.get_file(remote, path)

    def check(self, path: str) -> None:
        size, expected = self._described()
        hasher = xxhash.xxh3_64()
        with open(path, "rb") as f:
            while block := f.read(_HASH_BLOCK):
                hasher.update(block)
        if hasher.hexdigest() != expected:
            raise CorruptRecord(
                f"{self.fingerprint}/parts/{self.part}.bin",
                f"its {size} bytes do not match the xxh3 its manifest committed",
            )


class CachedShardedSnapshot(ShardedSnapshot):
    """A :class:`ShardedSnapshot` (read-only) whose parts are read through ``local_cache``
    (see the module doc). Takes the snapshot's arguments and ``local_cache``; writes are
    refused (a writer has no use for a local copy)."""

    def __init__(
        self,
        location: str | os.PathLike[str],
        *,
        local_cache: LocalCache,
        readonly: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(location, readonly=True, storage_options=storage_options, **options)
        self.local_cache = local_cache
        self.disk = LocalDisk(local_cache)
        self._units: ProcessLocal[dict[tuple[str, str], PartUnit]] = ProcessLocal(dict)
        self._not_kept: ProcessLocal[set[tuple[str, str]]] = ProcessLocal(set)
        self._prefetcher: ProcessLocal[Prefetcher] = process_prefetcher(self.disk, self.size_of)
        self._fitted: ProcessLocal[set[str]] = ProcessLocal(set)

    def unit(self, fingerprint: str, part: str) -> PartUnit:
        """The unit of ``part`` (one object per process, so its manifest is read once)."""
        units = self._units.get()
        found = units.get((fingerprint, part))
        if found is None:
            found = units[(fingerprint, part)] = PartUnit(self, fingerprint, part)
        return found

    def size_of(self, unit: PartUnit) -> int:
        """``unit``'s bytes: its copy's when here (no request), else its manifest's."""
        here = self.disk.copy_size(unit)
        return unit.size() if here is None else here

    # -- the process's listing (see the module doc) -----------------------------------
    def known_listing(self, fingerprint: str) -> tuple[Dataset, float] | None:
        found = LISTINGS.get((self.location, fingerprint))
        if found is None:
            return None
        dataset, at = found  # a copy: the store that listed it may list again meanwhile
        return dataset.copy(), at

    def note_listing(self, fingerprint: str, dataset: Dataset, at: float) -> None:
        LISTINGS[(self.location, fingerprint)] = (dataset, at)

    # -- refusing a limit up front --------------------------------------------------
    def get_index(self, fingerprint: str) -> DatasetIndex:
        index = super().get_index(fingerprint)
        if fingerprint not in self._fitted.get():
            self._check_fits(fingerprint)
            self._fitted.get().add(fingerprint)
        return index

    def _check_fits(self, fingerprint: str) -> None:
        """``LimitTooSmall`` when the largest committed part cannot fit (one LIST)."""
        committed = set(self.commit_names(fingerprint))
        try:
            listed = self.fs.ls(self.path(fingerprint, "parts"), detail=True, refresh=True)
        except FileNotFoundError:
            return
        sizes = {
            str(info["name"]).rstrip("/").rsplit("/", 1)[-1][: -len(".bin")]: int(info["size"])
            for info in listed
            if str(info["name"]).endswith(".bin")
        }
        largest = max(
            ((size, part) for part, size in sizes.items() if part in committed), default=None
        )
        if largest is not None:
            self.disk.check_fits(largest[0], f"part {largest[1]} of {fingerprint}")

    # -- reading ------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """Values of ``keys``: each part's records from its local copy, one pin per part
        at a time (see the module doc)."""
        return self._values(keys)[0]

    def supply(
        self, keys: list[str], fields: list[str] | None, decoder: RecordDecoder
    ) -> list[Record]:
        """Decoded as every read is; a record whose fields fail their checks from a local
        copy sets that copy aside, and its part's records are read again by range."""
        values, local = self._values(keys)
        while True:
            try:
                return decoder.values(values)
            except CorruptRecord as exc:
                unit = local.get(exc.key)
                if unit is None:  # read by range: damaged in the snapshot itself
                    raise
                self.disk.discard(unit)
                again = [n for n, key in enumerate(keys) if local.get(key) is unit]
                fresh = ShardedSnapshot.get_many(self, [keys[n] for n in again])
                for n, value in zip(again, fresh, strict=True):
                    values[n] = value
                    local.pop(keys[n], None)

    def _values(self, keys: Sequence[str]) -> tuple[list[bytes], dict[str, PartUnit]]:
        """The values of ``keys`` and, for those read from a local copy, its unit (a
        part gone since the listing: listed again once, ``read_located``)."""
        return self.read_located(keys, self._values_at)

    def _values_at(
        self, located: list[tuple[str, Entry]]
    ) -> tuple[list[bytes], dict[str, PartUnit]]:
        by_part: dict[tuple[str, str], list[tuple[int, str, Entry]]] = {}
        for n, (key, entry) in enumerate(located):
            by_part.setdefault((split_key(key)[0], entry.part), []).append((n, key, entry))
        out: list[bytes] = [b""] * len(located)
        local: dict[str, PartUnit] = {}
        for (fingerprint, part), group in by_part.items():
            values = self._from_copy(fingerprint, part, group)
            if values is None:  # not kept, or damaged here: by range, as without a copy
                values = self.read_ranges([(key, entry) for _, key, entry in group])
            else:
                local.update((key, self.unit(fingerprint, part)) for _, key, _ in group)
            for (n, _, _), value in zip(group, values, strict=True):
                out[n] = value
        return out, local

    def _from_copy(
        self, fingerprint: str, part: str, group: list[tuple[int, str, Entry]]
    ) -> list[bytes] | None:
        """The records of ``group`` from the local copy of ``part``, each checked against
        the manifest; None when the part is not kept here or the copy turns out damaged
        (then set aside). ``PartMissing`` when the part has no copy here and it (or its
        manifest, read to fetch it) is not in the snapshot."""
        if (fingerprint, part) in self._not_kept.get():
            return None
        unit = self.unit(fingerprint, part)
        try:
            with self.disk.pinned(unit) as fd:
                raw = [os.pread(fd, entry.length, entry.offset) for _, _, entry in group]
        except FileNotFoundError:  # its manifest or bytes, asked for to fetch it
            raise PartMissing(group[0][1], part) from None
        except CorruptRecord as exc:  # what was fetched is not what was committed
            log.warning(
                "%s: part %s is not kept in %s (%s); its records are read by range",
                self.location,
                part,
                self.local_cache.directory,
                exc.reason,
            )
            self._not_kept.get().add((fingerprint, part))
            return None
        try:
            return [
                self.checked(value, key, entry)
                for value, (_, key, entry) in zip(raw, group, strict=True)
            ]
        except CorruptRecord:
            self.disk.discard(unit)
            return None

    # -- reading ahead ------------------------------------------------------------
    def prefetch(self, keys: Sequence[str]) -> None:
        """Fetch the parts of ``keys`` in a thread, in the order they first appear."""
        units: dict[tuple[str, str], PartUnit] = {}
        for key in keys:
            entry = self.entry_of(key)
            if entry is not None:
                fingerprint = split_key(key)[0]
                if (fingerprint, entry.part) not in units:
                    units[(fingerprint, entry.part)] = self.unit(fingerprint, entry.part)
        if units:
            self._prefetcher.get().ahead(list(units.values()))

    def close(self) -> None:
        self._prefetcher.close()
        super().close()
