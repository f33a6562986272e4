"""A remote sharded snapshot read through ``local_cache`` keeps the store contract.

:class:`~cache_store.local_cache.sharded.CachedShardedSnapshot` is a backend of its own
(``open_store(..., local_cache=...)``), so it runs the shared read contract like every
other: a sharded snapshot is written to a bucket of moto's S3 server by the backend's
own writer, then read through a local directory, every part fetched once into it. The
swapped store plants a committed part past every check, as the sharded snapshot's own
contract does; a read from the local copy must refuse it as a read from S3 would."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cache_store.format.header import read_header
from cache_store.format.index import DatasetIndex
from cache_store.local_cache.sharded import CachedShardedSnapshot
from cache_store.local_cache.spec import LocalCache
from cache_store.snapshot.sharded import ShardedSnapshot, storage
from cache_store.snapshot.sharded.format import manifest
from cache_store.stores.opener import open_store
from cache_store.testing import SWAPPED_FOR, SWAPPED_KEY, StoreContract
from tests.helpers.s3 import S3Server, moto_s3


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with moto_s3() as server:
        yield server


class TestCachedShardedSnapshotContract(StoreContract):
    """The shared read contract, on a sharded snapshot in S3 read through ``local_cache``."""

    @pytest.fixture(autouse=True)
    def _where(self, s3: S3Server, tmp_path: Path) -> None:
        self.root = f"s3://{s3.new_bucket()}/x"
        self.options = {"endpoint_url": s3.endpoint, "key": "testing", "secret": "testing"}
        self.directory = tmp_path / "lc"
        self.written = 0

    def _write(self, records: dict[str, bytes], indexes: list[DatasetIndex]) -> ShardedSnapshot:
        self.written += 1
        writer = ShardedSnapshot(
            f"{self.root}/snap{self.written}.zarr", readonly=False, storage_options=self.options
        )
        writer.put_many(records.items())
        for index in indexes:
            writer.put_index(index)
        return writer

    def _reader(self, writer: ShardedSnapshot) -> CachedShardedSnapshot:
        writer.close()
        store = open_store(
            writer.location,
            storage_options=self.options,
            local_cache=LocalCache.parse(self.directory, "64M"),
        )
        assert isinstance(store, CachedShardedSnapshot)
        return store

    def make_store(
        self, records: dict[str, bytes], indexes: list[DatasetIndex]
    ) -> CachedShardedSnapshot:
        return self._reader(self._write(records, indexes))

    def make_swapped_store(
        self, records: dict[str, bytes], indexes: list[DatasetIndex]
    ) -> CachedShardedSnapshot:
        """The record of ``SWAPPED_FOR`` committed under ``SWAPPED_KEY`` in a part of its
        own, past the writer's checks (its manifest's record checksum made up)."""
        writer = self._write(records, indexes)
        fingerprint, sample_id = SWAPPED_KEY.split("/", 1)
        value = records[SWAPPED_FOR]
        part = "planted-p0001-00000000"
        digest = read_header(value).metadata.get("descriptor")  # the one stored with it
        named = {} if digest is None else {digest: writer.descriptor(fingerprint, digest)}
        doc = json.loads(
            manifest(fingerprint, part, [(SWAPPED_KEY, value)], value, "planted", named)
        )
        doc["records"] = [[sample_id, 0, len(value), doc["records"][0][3], "f" * 16]]
        storage.write(writer.fs, writer.path(fingerprint, "parts", f"{part}.bin"), value)
        storage.write_once(
            writer.fs,
            writer.path(fingerprint, "commits", f"{part}.json"),
            json.dumps(doc).encode(),
        )
        return self._reader(writer)

    def test_reads_come_from_the_local_copies(self) -> None:
        """Not a contract rule: that the contract above ran through the local directory
        (each part fetched once into ``data/``), not past it."""
        store, records, _ = self.opened()
        for key, value in records.items():
            assert store.get(key) == value
        assert isinstance(store, CachedShardedSnapshot)
        parts = set()
        for key in records:
            entry = store.entry_of(key)
            assert entry is not None
            parts.add((key.split("/", 1)[0], entry.part))
        assert len(os.listdir(self.directory / "data")) == len(parts) > 0
