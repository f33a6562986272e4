"""``import_snapshot``: a snapshot's records copied into a local LMDB cache.

Copies the committed records of a snapshot (sharded or exported, a path or a URL) into a
local cache directory, checked on the way, and adds their ids to the index there (the
cache's samples stay), so training reads them at LMDB speed. Records already in the
cache with the same checksum are skipped, so an interrupted import is finished by
running it again; a damaged record is left out and named, the others copied.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import numpy as np

from cache_store.errors import CorruptRecord, FingerprintLookupError, RecordNotFound, UsageError
from cache_store.format.index import append_ids
from cache_store.keys import record_id, variant_counts
from cache_store.location import LocationLike, check_cache_dir, parse_location

__all__ = ["IMPORT_BATCH", "import_snapshot"]

log = logging.getLogger(__name__)

#: records per LMDB transaction while importing
IMPORT_BATCH = 64


def import_snapshot(
    source: LocationLike,
    cache: LocationLike,
    *,
    fingerprints: list[str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Copy the indexed records of ``source`` (a ``*.zarr`` snapshot) into the LMDB cache
    ``cache`` (created if missing); returns ``{fingerprint: {"copied", "present",
    "bad"}}``, ``bad`` mapping each sample id left out to why.

    The cache's index of a fingerprint keeps its ids, in its order, and gains the
    snapshot's new ones after them (:func:`~cache_store.format.index.append_ids`). A
    record that does not check out (:class:`~cache_store.errors.CorruptRecord`), or that
    the snapshot's index lists but cannot find, is left out and named, as ``verify``
    names it: the cache never takes a damaged record, and every good one is copied.
    Raises :class:`~cache_store.errors.UsageError` for a source that is no snapshot or a
    cache directory that cannot be used.
    """
    from cache_store.stores.opener import open_store

    where = parse_location(source)
    if where.kind != "zarr":
        raise UsageError(f"{source}: import reads a snapshot (*.zarr), not a cache or URL")
    target = check_cache_dir(cache, write=True)
    options: dict[str, Any] = {"storage_options": storage_options} if storage_options else {}
    result: dict[str, dict[str, Any]] = {}
    with open_store(where, True, **options) as src, open_store(target, readonly=False) as dst:
        for fingerprint in fingerprints or src.fingerprints():
            result[fingerprint] = _import_fingerprint(src, dst, fingerprint)
    return result


def _import_fingerprint(src: Any, dst: Any, fingerprint: str) -> dict[str, Any]:
    from cache_store.format.decode import check_record
    from cache_store.format.header import read_header

    index = src.get_index(fingerprint)
    # every record: a sample's variants too (a1, a1#v1, ...; cache_store.keys.record_id)
    ids = [
        record_id(sid, variant)
        for sid, count in zip(
            index.sample_ids.tolist(), index.variant_counts().tolist(), strict=True
        )
        for variant in range(count)
    ]
    copied = present = 0
    bad: dict[str, str] = {}
    for start in range(0, len(ids), IMPORT_BATCH):
        batch = []
        for sample_id in ids[start : start + IMPORT_BATCH]:
            key = f"{fingerprint}/{sample_id}"
            try:
                value = src.get(key)
                # the cache never takes a damaged record, nor one its descriptor does not match
                check_record(value, key=key, lookup=src.descriptor)
            except CorruptRecord as exc:
                bad[sample_id] = exc.reason
                log.warning("import: %s left out: %s", key, exc.reason)
                continue
            except RecordNotFound:
                bad[sample_id] = "listed in the snapshot's index, but not found there"
                log.warning("import: %s left out: %s", key, bad[sample_id])
                continue
            if dst.has(key) and (
                read_header(dst.get(key), key=key).metadata["checksum"]
                == read_header(value, key=key).metadata["checksum"]
            ):
                present += 1
                continue
            batch.append((key, value))
        if batch:
            dst.put_many(batch, src.descriptors_for(batch))
            copied += len(batch)
    good = variant_counts(rid for rid in ids if rid not in bad)  # sample -> variants
    try:
        before = dst.get_index(fingerprint)
        held = before.sample_ids.tolist()
        counts = dict(zip(held, before.variant_counts().tolist(), strict=True))
    except FingerprintLookupError:
        held, counts = [], {}
    merged = append_ids(held, good)
    grown = {sid: n for sid, n in good.items() if n > counts.get(sid, 1)}
    if merged != held or grown:
        counts.update(grown)
        dst.put_index(
            replace(
                index,
                sample_ids=np.array(merged, dtype=str),
                variants=np.array([counts.get(sid, 1) for sid in merged], dtype=np.uint16),
            )
        )
    return {"copied": copied, "present": present, "bad": bad}
