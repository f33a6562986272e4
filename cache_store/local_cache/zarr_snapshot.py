"""A remote exported Zarr snapshot read through a bounded local directory: chunk files
are the unit.

An exported fingerprint group is published once (its ``complete`` attribute set last)
and never changes under its ``writer`` token (``overwrite`` exports a new token), so a
chunk file of it (``<fp>/headers/c/<n>``, ``<fp>/data/<field>/c/<n>/0``) is immutable
under a name holding that token. A read decodes whole chunks anyway, so
:class:`CachedZarrSnapshot` fetches each chunk file it needs once into the
:class:`~cache_store.local_cache.disk.LocalDisk`, checked before anyone reads it (its
size as the bucket lists it, and the CRC-32C the exporter's last codec appended:
:func:`~cache_store.snapshot.zarr.chunks.check_chunk_crc`, the check every direct read
makes), then decodes it from the local copy with the same direct reader a local
snapshot uses (:class:`~cache_store.snapshot.zarr.chunks.LocalChunkReader`); records are
checked as every read of a Zarr snapshot checks them (header, per-field xxh3).

What is served never depends on the local copy:

- a copy whose CRC fails when read (damaged on disk) is set aside
  (:meth:`LocalDisk.discard`) and fetched again, checked;
- a chunk whose fetched bytes fail their check (damaged in the snapshot) is not kept:
  the records in it fail with ``CorruptRecord``, as they do without ``local_cache``.

``prefetch(keys)`` fetches the chunk files the records of ``keys`` are read from (each
record's header chunk, then its fields' data chunks; first appearance first) in a
thread of this process (:mod:`cache_store.local_cache.prefetch`, as for a sharded
snapshot's parts): a sampler's read-ahead asks it.

The sizes of a group's chunk files come from one listing of the group per process
(:data:`LISTED`, inherited by forked loader workers, so an epoch whose chunks are all
here makes no request); ``get_index`` refuses a ``cache_limit`` that cannot hold the
largest of them, before any read. A chunk the listing lacks was never written (all
fill value), as for a local snapshot.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from cache_store.errors import CorruptRecord
from cache_store.format.index import DatasetIndex
from cache_store.local_cache.disk import LocalDisk
from cache_store.local_cache.prefetch import Prefetcher, process_prefetcher
from cache_store.local_cache.spec import LocalCache
from cache_store.process_local import ProcessLocal
from cache_store.snapshot.sharded.storage import open_fs
from cache_store.snapshot.zarr.chunks import LocalChunkReader, check_chunk_crc, chunk_key
from cache_store.snapshot.zarr.group import ChunkReaders
from cache_store.snapshot.zarr.store import ZarrStore

__all__ = ["LISTED", "CachedChunkReader", "CachedZarrSnapshot", "ChunkUnit"]

log = logging.getLogger(__name__)

#: (location, fingerprint, writer token) -> each chunk file's bytes, by its path in the
#: group (``"data/octree/c/3/0"``): the listing this process made or inherited
LISTED: dict[tuple[str, str, str], dict[str, int]] = {}


class ChunkUnit:
    """One chunk file as a unit of the local directory: named by the snapshot's
    location, fingerprint, writer token and the file's path in the group (never
    rewritten under one name), sized by the listing, checked by its CRC-32C."""

    def __init__(self, store: CachedZarrSnapshot, fingerprint: str, writer: str, path: str):
        self.store = store
        self.fingerprint = fingerprint
        self.path = path
        where = hashlib.blake2b(store.location.encode(), digest_size=8).hexdigest()
        self.name = f"zarr/{where}/{fingerprint}/{writer}/{path}"
        self._size = store.chunk_sizes(fingerprint, writer)[path]

    def size(self) -> int:
        return self._size

    def fetch(self, path: str) -> None:
        self.store.fs.get_file(self.store.remote(self.fingerprint, self.path), path)

    def check(self, path: str) -> None:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            check_chunk_crc(raw, self.path)
        except ValueError as exc:
            raise CorruptRecord(f"{self.fingerprint}/{self.path}", str(exc)) from None


class CachedChunkReader(LocalChunkReader):
    """The direct reader of one array of a remote snapshot: each chunk file is read
    from its local copy (pinned while read), fetched when absent; the rows of a chunk
    are always decoded from the whole file (its CRC checked on every read)."""

    def __init__(
        self, store: CachedZarrSnapshot, fingerprint: str, writer: str, path: str, array: Any
    ) -> None:
        super().__init__("", array)
        self.raw = False  # never rows in place: a copy may be evicted between reads
        self.store = store
        self.fingerprint = fingerprint
        self.writer = writer
        self.path = path

    def unit(self, index: int) -> ChunkUnit | None:
        """The unit of chunk ``index``'s file; None when it was never written."""
        path = f"{self.path}/{chunk_key(index, len(self.chunk_shape))}"
        if path not in self.store.chunk_sizes(self.fingerprint, self.writer):
            return None  # never written: all fill value
        return ChunkUnit(self.store, self.fingerprint, self.writer, path)

    def units(self, start: int, stop: int) -> list[ChunkUnit]:
        """The units of the chunk files rows ``start:stop`` lie in, in row order."""
        step = self.chunk_shape[0]
        found = (self.unit(i) for i in range(start // step, (stop - 1) // step + 1))
        return [unit for unit in found if unit is not None] if stop > start else []

    def chunk_bytes(self, index: int) -> bytes | None:
        unit = self.unit(index)
        if unit is None:
            return None  # never written: all fill value
        path = unit.path
        disk = self.store.disk
        for attempt in (0, 1):
            try:
                with disk.pinned(unit) as fd:
                    raw = os.pread(fd, unit.size(), 0)
            except CorruptRecord as exc:  # what was fetched is not what was published
                raise ValueError(f"chunk {path}: {exc.reason}") from None
            try:
                check_chunk_crc(raw, path)
            except ValueError:
                if attempt:
                    raise
                disk.discard(unit)  # damaged on disk: fetched again, checked
                continue
            return raw
        raise AssertionError("unreachable")


class CachedZarrSnapshot(ZarrStore):
    """A :class:`ZarrStore` over a remote snapshot whose chunk files are read through
    ``local_cache`` (see the module doc). Takes the store's arguments and
    ``local_cache``."""

    def __init__(
        self,
        location: str | os.PathLike[str],
        *,
        local_cache: LocalCache,
        readonly: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(location, readonly=readonly, storage_options=storage_options, **options)
        self.local_cache = local_cache
        self.disk = LocalDisk(local_cache)
        self._fs: ProcessLocal[tuple[Any, str]] = ProcessLocal(
            functools.partial(open_fs, self.location, self.storage_options)
        )
        self._fitted: ProcessLocal[set[str]] = ProcessLocal(set)
        self._prefetcher: ProcessLocal[Prefetcher] = process_prefetcher(self.disk, ChunkUnit.size)

    @property
    def fs(self) -> Any:
        """This process's file system of the snapshot (never a parent's)."""
        return self._fs.get()[0]

    def remote(self, fingerprint: str, path: str) -> str:
        """Where ``path`` of ``fingerprint``'s group is on :attr:`fs`."""
        return f"{self._fs.get()[1]}/{fingerprint}/{path}"

    def chunk_sizes(self, fingerprint: str, writer: str) -> dict[str, int]:
        """Every chunk file of the group with its bytes, by path (one listing)."""
        key = (self.location, fingerprint, writer)
        found = LISTED.get(key)
        if found is None:
            head = self.remote(fingerprint, "")
            listed = self.fs.find(head, detail=True)
            found = {
                str(name)[len(head) :]: int(info["size"])
                for name, info in listed.items()
                if str(name)[len(head) :].startswith(("headers/c/", "data/"))
            }
            LISTED[key] = found
        return found

    def chunk_readers(self, fingerprint: str, attrs: dict[str, Any]) -> ChunkReaders | None:
        writer = str(attrs.get("writer", ""))

        def reader(path: str, array: Any) -> LocalChunkReader:
            return CachedChunkReader(self, fingerprint, writer, path, array)

        return reader

    def get_index(self, fingerprint: str) -> DatasetIndex:
        index = super().get_index(fingerprint)
        if fingerprint not in self._fitted.get():
            snap = self._snapshot(fingerprint)
            if snap is not None and snap.local is None:
                log.warning(
                    "%s: fingerprint %s is not in the layout read directly; it is read "
                    "by range, not through %s",
                    self.location,
                    fingerprint,
                    self.local_cache.directory,
                )
            elif snap is not None:
                sizes = self.chunk_sizes(fingerprint, str(snap.attrs.get("writer", "")))
                largest = max(((size, path) for path, size in sizes.items()), default=None)
                if largest is not None:
                    self.disk.check_fits(largest[0], f"chunk {largest[1]} of {fingerprint}")
            self._fitted.get().add(fingerprint)
        return index

    # -- reading ahead ------------------------------------------------------------
    def prefetch(self, keys: Sequence[str]) -> None:
        """Fetch the chunk files of ``keys``' records in a thread, in the order they
        first appear (a record's header chunk, then its fields' data chunks)."""
        units: dict[str, ChunkUnit] = {}
        for key in keys:
            found = self._locate(key)
            readers = None if found is None else found[0].local
            if found is None or readers is None:
                continue
            snap, row = found
            for name, reader in readers.items():
                if not isinstance(reader, CachedChunkReader):
                    continue
                o = snap.header_offsets if name == "headers" else snap.field_offsets[name]
                for unit in reader.units(int(o[row]), int(o[row + 1])):
                    units.setdefault(unit.name, unit)
        if units:
            self._prefetcher.get().ahead(list(units.values()))

    def close(self) -> None:
        self._prefetcher.close()
        super().close()
