"""Helpers for the Zarr snapshot tests: an LMDB cache filled with given records, every
fingerprint of it exported, a snapshot copied to damage, and the sample snapshot the
reading, exporting and damage tests share."""

from __future__ import annotations

import shutil
from pathlib import Path

from cache_store.format.index import DatasetIndex
from cache_store.snapshot.zarr.export import export_snapshot
from cache_store.stores.lmdb import LMDBStore
from cache_store.testing import sample_content

__all__ = ["copy_snapshot", "export_all", "export_sample", "fill_lmdb"]

Exported = tuple[dict[str, bytes], list[DatasetIndex], Path, Path]


def fill_lmdb(path: Path, records: dict[str, bytes], indexes: list[DatasetIndex]) -> LMDBStore:
    store = LMDBStore(path, readonly=False, map_size=1 << 22)
    store.put_many(records.items())
    for index in indexes:
        store.put_index(index)
    return store


def export_all(cache: LMDBStore, dest: Path | str, **options) -> None:
    for fp in cache.fingerprints():
        export_snapshot(cache, fp, dest, **options)


def export_sample(root: Path) -> Exported:
    """(records, indexes, lmdb cache dir, snapshot dir): the contract's sample content in
    an LMDB cache under ``root``, exported compressed (the default is "none" locally:
    tests count on whole chunks holding many records, each decoded and CRC-checked at
    once)."""
    records, indexes = sample_content()
    cache = fill_lmdb(root / "cache", records, indexes)
    export_all(cache, root / "snap.zarr", codec="zstd")
    cache.close()
    return records, indexes, root / "cache", root / "snap.zarr"


def copy_snapshot(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
