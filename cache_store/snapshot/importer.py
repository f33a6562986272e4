"""``import_snapshot``: a snapshot's records copied into a local LMDB cache.

Copies the committed records of a snapshot (sharded or exported, a path or a URL) into a
local cache directory, checked on the way, and writes their index there, so training
reads them at LMDB speed. Records already in the cache with the same checksum are
skipped, so an interrupted import is finished by running it again.
"""

from __future__ import annotations

from typing import Any

from cache_store.errors import UsageError
from cache_store.location import LocationLike, check_cache_dir, parse_location

__all__ = ["IMPORT_BATCH", "import_snapshot"]

#: records per LMDB transaction while importing
IMPORT_BATCH = 64


def import_snapshot(
    source: LocationLike,
    cache: LocationLike,
    *,
    fingerprints: list[str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, dict[str, int]]:
    """Copy the indexed records of ``source`` (a ``*.zarr`` snapshot) into the LMDB cache
    ``cache`` (created if missing); returns ``{fingerprint: {"copied", "present"}}``.

    Raises :class:`~cache_store.errors.UsageError` for a source that is no snapshot or a
    cache directory that cannot be used, and a record's own error
    (:class:`~cache_store.errors.CorruptRecord`) for one that does not check out: the
    cache never takes a damaged record.
    """
    from cache_store.format.decode import check_record
    from cache_store.format.header import read_header
    from cache_store.stores.opener import open_store

    where = parse_location(source)
    if where.kind != "zarr":
        raise UsageError(f"{source}: import reads a snapshot (*.zarr), not a cache or URL")
    target = check_cache_dir(cache, write=True)
    options: dict[str, Any] = {"storage_options": storage_options} if storage_options else {}
    result: dict[str, dict[str, int]] = {}
    with open_store(where, True, **options) as src, open_store(target, readonly=False) as dst:
        for fingerprint in fingerprints or src.fingerprints():
            index = src.get_index(fingerprint)
            keys = [f"{fingerprint}/{sid}" for sid in index.sample_ids.tolist()]
            copied = present = 0
            for start in range(0, len(keys), IMPORT_BATCH):
                batch = []
                for key in keys[start : start + IMPORT_BATCH]:
                    value = src.get(key)
                    if dst.has(key) and (
                        read_header(dst.get(key), key=key).metadata["checksum"]
                        == read_header(value, key=key).metadata["checksum"]
                    ):
                        present += 1
                        continue
                    batch.append((key, value))
                if batch:
                    for key, value in batch:  # the cache never takes a damaged record
                        check_record(value, key=key, lookup=src.descriptor)
                    dst.put_many(batch, src.descriptors_for(batch))
                    copied += len(batch)
            dst.put_index(index)
            result[fingerprint] = {"copied": copied, "present": present}
    return result
