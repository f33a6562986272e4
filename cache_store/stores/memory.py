"""MemoryStore: records and indexes in this process's memory, on the :class:`Store` contract.

For tests and examples of code written against the contract, and as the buffer of a
writer whose records go elsewhere (the Ray actor's ``ShardBuffer`` hands each record to
its driver). Writes are checked as every backend checks them (keys, headers, the record
naming its key); reads are decoded and checked by the base like any other.

What a store holds is a :class:`MemoryData` (records, encoded indexes, a change counter
and a lock); stores built on the same one see each other's writes, as two handles on one
LMDB cache do. Nothing is shared between processes: a forked child has a copy. There is
no location to parse, so :func:`~cache_store.stores.opener.open_store` never opens one:
build it directly.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from cache_store.errors import RecordNotFound
from cache_store.format.descriptor import Descriptor
from cache_store.format.index import DatasetIndex, decode_index, encode_index
from cache_store.stores.base import Store

__all__ = ["MemoryData", "MemoryStore"]


@dataclass
class MemoryData:
    """What one or more :class:`MemoryStore` hold: record key -> bytes, fingerprint ->
    encoded index, the descriptors the records name, and a counter of the writes that
    landed."""

    records: dict[str, bytes] = field(default_factory=dict)
    indexes: dict[str, bytes] = field(default_factory=dict)
    #: (fingerprint, digest) -> the text of a descriptor the records name
    descriptors: dict[tuple[str, str], str] = field(default_factory=dict)
    writes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class MemoryStore(Store):
    """A store in memory (see the module doc).

    Args:
        location: a name for messages (``memory://`` by default).
        readonly: refuse writes (``ReadOnlyStoreError``).
        data: the contents to share with another store; default a new, empty one.
    """

    def __init__(
        self,
        location: str = "memory://",
        *,
        readonly: bool = False,
        data: MemoryData | None = None,
    ) -> None:
        super().__init__(location, readonly=readonly)
        self.data = MemoryData() if data is None else data

    # -- primitives ------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        with self.data.lock:
            value = self.data.records.get(key) if isinstance(key, str) else None
        if value is None:
            raise RecordNotFound(key, self.location)
        return value

    def put_many(
        self, items: Iterable[tuple[str, bytes]], descriptors: Iterable[Descriptor] = ()
    ) -> int:
        self.check_writable()
        batch = self.check_items(items, descriptors)  # every item, before any is written
        with self.data.lock:
            for d in batch.descriptors:
                self.data.descriptors[(d.fingerprint, d.digest)] = d.text
            # plain bytes: what encode_record returns carries its descriptor, kept above
            self.data.records.update((key, bytes(value)) for key, value in batch.records)
            self.data.writes += 1
        return len(batch.records)

    def load_descriptor(self, fingerprint: str, digest: str) -> str | None:
        with self.data.lock:
            return self.data.descriptors.get((fingerprint, digest))

    def has(self, key: str) -> bool:
        with self.data.lock:
            return key in self.data.records

    def keys(self, prefix: str = "") -> Iterator[str]:
        with self.data.lock:
            found = [k for k in self.data.records if k.startswith(prefix)]
        return iter(sorted(found, key=lambda k: k.encode("utf-8")))

    def close(self) -> None:
        """Nothing to release: the contents stay, and the store can be used again."""

    def put_index(self, index: DatasetIndex) -> None:
        self.check_writable()
        value = encode_index(index)
        with self.data.lock:
            self.data.indexes[index.fingerprint] = value
            self.data.writes += 1

    def get_index(self, fingerprint: str) -> DatasetIndex:
        with self.data.lock:
            value = self.data.indexes.get(fingerprint)
        if value is None:
            raise self.index_missing(fingerprint)
        return decode_index(value, key=f"index:{fingerprint}")

    def fingerprints(self) -> list[str]:
        with self.data.lock:
            return sorted(self.data.indexes)

    # -- conveniences ------------------------------------------------------------------
    def generation(self) -> int:
        """The number of writes that landed in this store's data."""
        with self.data.lock:
            return self.data.writes
