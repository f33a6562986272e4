"""``ls``: what a cache holds, one :class:`CacheEntry` per fingerprint.

Recipe, records, exact bytes, failures, created, last written, last read, and whether
it is complete against its index, removing (a killed ``rm``), or known only from
remembered failures. Zarr snapshots are listed too (through the store contract). The
entries are also what ``prune`` and a writer's ``--max-size`` decide by
(:mod:`cache_store.housekeeping.eviction`), and :func:`open_cache_store` is how every
housekeeping step opens a cache directory (a snapshot or URL refused by name).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from cache_store import usage
from cache_store.errors import CacheNotFound, FingerprintRemoved, ReadOnlyStoreError
from cache_store.housekeeping.units import format_size, from_iso_time, iso_time
from cache_store.location import LocationLike, parse_location
from cache_store.recipes.registry import RECIPE_SPECS
from cache_store.stores.opener import open_store

__all__ = [
    "CacheEntry",
    "cache_entries",
    "cache_root",
    "ls",
    "open_cache_store",
    "remembered_failures",
]

log = logging.getLogger(__name__)


@dataclass
class CacheEntry:
    """One fingerprint of a cache, as :func:`ls` reports it."""

    fingerprint: str
    recipe: str | None = None
    recipe_version: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    records: int = 0
    bytes: int = 0
    indexed: int = 0
    #: variants each indexed sample has at least (1: none); ``variants_max``: at most
    variants: int = 1
    variants_max: int = 1
    present: int = 0
    failed: int = 0
    created: float | None = None
    last_written: float | None = None
    last_read: float | None = None
    removed_at: float | None = None
    index_error: str | None = None
    #: code digest -> records computed by it (``"none"``: records that carry none)
    code_digests: dict[str, int] = field(default_factory=dict)

    def set_variants(self, described: Mapping[str, Any]) -> None:
        """The variant counts of an index's description (``DatasetIndex.describe``)."""
        self.variants = int(described.get("variants", 1))
        self.variants_max = int(described.get("variants_max", self.variants))

    @property
    def last_used(self) -> float:
        """What LRU order sorts by: the latest read or write recorded, else the index's
        creation (0: none known)."""
        marks = [t for t in (self.last_read, self.last_written) if t is not None]
        return max(marks) if marks else (self.created or 0.0)

    @property
    def state(self) -> str:
        if self.removed_at is not None:
            return "removing"  # tombstoned with records left: a killed rm; run it again
        if self.index_error:
            return "index unreadable"
        if self.recipe is None:
            return "failed" if not self.records and self.failed else "unindexed"
        return "complete" if self.present == self.indexed else "partial"

    @property
    def recipe_changed(self) -> bool | None:
        """Whether the installed recipe's version differs from the one that computed the
        records (None: not indexed)."""
        if self.recipe is None:
            return None
        spec = RECIPE_SPECS.get(self.recipe)
        return spec is None or spec.version != self.recipe_version

    @property
    def code_changed(self) -> bool | None:
        """Whether some of its records were computed by other recipe code than the
        installed recipe's (edited without a version bump), by the rule stats and the
        item route use. None: not indexed, the recipe is not installed here at this
        version, or no record carries a code digest."""
        from cache_store.recipes.registry import code_changed, installed_code_digest

        if self.recipe is None:
            return None
        installed = installed_code_digest(self.recipe, self.recipe_version)
        if installed is None:
            return None
        seen = {code_changed(installed, digest) for digest in self.code_digests}
        return True if True in seen else (False if False in seen else None)

    def as_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "recipe": self.recipe,
            "recipe_version": self.recipe_version,
            "params": self.params,
            "records": self.records,
            "bytes": self.bytes,
            "indexed": self.indexed,
            "variants": self.variants,
            "variants_max": self.variants_max,
            "state": self.state,
            "failed": self.failed,
            "created": iso_time(self.created),
            "last_written": iso_time(self.last_written),
            "last_read": iso_time(self.last_read),
            "recipe_changed": self.recipe_changed,
            "code_changed": self.code_changed,
        }


def _is_snapshot(cache: str | os.PathLike[str]) -> bool:
    return parse_location(cache).kind == "zarr"


def cache_root(cache: LocationLike) -> Path:
    """The directory of a local cache location (``file://`` stripped); a snapshot or a
    URL is refused by name, never folded by ``Path`` into a local ``s3:/...``."""
    where = parse_location(cache)
    if where.kind != "lmdb" or not where.is_local:
        raise ReadOnlyStoreError(
            f"{cache}: a Zarr snapshot or remote cache is immutable here; "
            f"rm, prune and compact act on a cache directory"
        )
    return Path(where.target)


def open_cache_store(cache: LocationLike, *, readonly: bool) -> Any:
    """The ``LMDBStore`` of a cache directory; ``CacheNotFound`` naming the path when
    there is none, ``ReadOnlyStoreError`` for a snapshot or a URL."""
    from cache_store.stores.lmdb import LMDBStore, has_cache

    root = cache_root(cache)
    if not root.is_dir():
        raise CacheNotFound(root, "not a directory" if root.exists() else "no such directory")
    if not has_cache(root):
        raise CacheNotFound(root, "no cache here (records/data.mdb missing)")
    return LMDBStore(root, readonly=readonly)


def cache_entries(cache: str | os.PathLike[str], *, failure_only: bool = False) -> list[CacheEntry]:
    """Every fingerprint with an index or records (or a tombstone with records left),
    with exact sizes; with ``failure_only``, also those known only from remembered
    failures (every sample failed: no record, no index)."""
    if _is_snapshot(cache):
        return _snapshot_entries(cache)
    store = open_cache_store(cache, readonly=True)
    try:
        stats = store.stats()["fingerprints"]  # from the writers' summaries where kept
        kept = store.summaries()
        removals = store.removals()
        entries = []
        for fp, info in stats.items():
            entry = CacheEntry(
                fp,
                records=int(info.get("records", 0)),
                bytes=int(info.get("bytes", 0)),
                removed_at=removals.get(fp),
                code_digests=dict(info.get("code_digests", {})),
            )
            if "index_error" in info:
                entry.index_error = str(info["index_error"])
            if "recipe" in info:
                entry.recipe, entry.recipe_version = info["recipe"], int(info["recipe_version"])
                entry.params = dict(info["params"])
                entry.indexed = int(info["samples"])
                entry.set_variants(info)
                entry.created = from_iso_time(info.get("created"))
                if entry.indexed:
                    try:
                        entry.present = store.present_count(fp, _summary_of(kept, fp, store))
                    except FingerprintRemoved as exc:  # removed since the walk above
                        entry.removed_at = exc.removed_at or time.time()
                        entry.present = 0
            if entry.removed_at is not None and not entry.records:
                continue  # removed completely: nothing left to list
            entries.append(entry)
    finally:
        store.close()
    root = cache_root(cache)
    failed = remembered_failures(root)
    if failure_only:  # not one removed: its failures are writes the removal refused
        listed = {e.fingerprint for e in entries} | set(removals)
        entries += [CacheEntry(fp) for fp in sorted(failed) if fp not in listed]
    for entry in entries:
        entry.failed = failed.get(entry.fingerprint, 0)
        entry.last_read = usage.last_read(root, entry.fingerprint)
        entry.last_written = usage.last_written(root, entry.fingerprint)
    return entries


def _summary_of(kept: dict[str, Any] | None, fingerprint: str, store: Any) -> dict[str, Any]:
    """The summary ``present_count`` reads: the writers' one, or (not kept) one that
    makes it count the fingerprint's records."""
    if kept is not None and fingerprint in kept:
        return dict(kept[fingerprint])
    return {"index": True}


def _snapshot_entries(cache: str | os.PathLike[str]) -> list[CacheEntry]:
    store = open_store(cache, readonly=True)
    try:
        stats = store.stats()["fingerprints"]
    finally:
        store.close()
    entries = []
    for fp, info in stats.items():
        entry = CacheEntry(
            fp,
            records=int(info.get("records", 0)),
            bytes=int(info.get("bytes", 0)),
            code_digests=dict(info.get("code_digests", {})),
        )
        if "recipe" in info:
            entry.recipe, entry.recipe_version = info["recipe"], int(info["recipe_version"])
            entry.params, entry.indexed = dict(info["params"]), int(info["samples"])
            entry.set_variants(info)
            entry.present = min(entry.indexed, entry.records)
            entry.created = from_iso_time(info.get("created"))
        entries.append(entry)
    return entries


def remembered_failures(cache: Path) -> dict[str, int]:
    """Failed samples per fingerprint (the failure log and the queue's failed items);
    empty, with a warning, when they cannot be read."""
    from cache_store.jobs.failures import failure_counts

    try:
        return failure_counts(cache)  # the failure log and the queue's failed items
    except Exception as exc:  # noqa: BLE001 - the counts are extra; say why they are absent
        log.warning("%s: failures unreadable: %s", cache, exc)
        return {}


def ls(cache: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """One JSON-able row per fingerprint of ``cache`` (a cache directory or a ``.zarr``
    snapshot), least recently used first: ``fingerprint``, ``recipe``,
    ``recipe_version``, ``params``, ``records``, ``bytes`` (exact), ``indexed``,
    ``state`` (complete / partial / unindexed / removing, or failed: nothing stored,
    only remembered failures), ``failed``, ``created``,
    ``last_written``, ``last_read`` (ISO 8601 UTC or None), ``recipe_changed`` (the
    installed recipe's version differs) and ``code_changed`` (some records were computed by
    other code than the installed recipe's, under the same version). A copy left by a
    compaction that did not finish (``records.compact/``) is a WARNING naming its size
    (``spcache compact`` removes it)."""
    where = parse_location(cache)
    if where.kind == "lmdb" and where.is_local:
        _warn_of_leftover_copy(where.path())
    entries = sorted(
        cache_entries(cache, failure_only=True), key=lambda e: (e.last_used, e.fingerprint)
    )
    return [e.as_json() for e in entries]


def _warn_of_leftover_copy(root: Path) -> None:
    from cache_store.stores.lmdb.compaction import leftover_copy

    size = leftover_copy(root)
    if size is not None:
        log.warning(
            "%s: records.compact/ (%s, %d bytes) is a copy left by a compaction that did not "
            "finish (or one running now); spcache compact --cache %s removes it",
            root,
            format_size(size),
            size,
            root,
        )
