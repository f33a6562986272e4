"""Keeping a sharded snapshot: what a location holds, merging the manifests into each
fingerprint's index, and sweeping what dead writers left.

The driver of a run merges the manifests into ``index.json`` periodically and at the
end (:func:`merge_into`); ``spcache merge`` does the same by hand (:func:`merge`,
idempotent). Nothing is deleted on a failure path: :func:`orphan_parts` lists parts
with no manifest and the temporary files of a write cut short (older than a grace
period, and never a part a live writer claims: :mod:`~cache_store.snapshot.sharded.claims`),
and ``spcache merge --remove-orphans`` deletes them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from cache_store.errors import ParameterError
from cache_store.keys import validate_fingerprint
from cache_store.snapshot.sharded import storage
from cache_store.snapshot.sharded.claims import live_claims, part_of
from cache_store.snapshot.sharded.format import ROOT_MARKER
from cache_store.snapshot.sharded.store import ShardedSnapshot

__all__ = [
    "DEFAULT_ORPHAN_GRACE_S",
    "is_sharded",
    "merge",
    "merge_into",
    "orphan_parts",
    "snapshot_kind",
]

#: A part without a manifest younger than this may still be being written.
DEFAULT_ORPHAN_GRACE_S = 3600.0


def snapshot_kind(
    location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> str | None:
    """What a ``*.zarr`` location holds: ``"sharded"`` (its root marker exists),
    ``"exported"`` (a Zarr hierarchy that ``spcache export`` wrote: read-only), or None
    (nothing yet)."""
    fs, root = storage.open_fs(os.fspath(location), storage_options or {})
    if fs.exists(f"{root}/{ROOT_MARKER}"):
        return "sharded"
    return "exported" if fs.exists(f"{root}/zarr.json") else None


def is_sharded(
    location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> bool:
    """Whether ``location`` holds a sharded snapshot (its root marker exists)."""
    return snapshot_kind(location, storage_options) == "sharded"


def merge_into(
    store: ShardedSnapshot,
    fingerprint: str,
    *,
    order: Sequence[str] = (),
    describe: Mapping[str, Any] | None = None,
) -> int:
    """Write ``index.json`` for ``fingerprint`` from every committed manifest (``order``'s
    ids first, described by ``describe`` when given); returns the records indexed
    (:meth:`ShardedSnapshot.merge_index`)."""
    return store.merge_index(fingerprint, order=order, describe=describe)


def merge(
    location: str | os.PathLike[str],
    *,
    fingerprint: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, int]:
    """Merge the manifests of every fingerprint (or one) into its ``index.json``;
    returns ``{fingerprint: records indexed}``."""
    store = ShardedSnapshot(location, readonly=False, storage_options=storage_options)
    try:
        if not store.fs.exists(store.path(ROOT_MARKER)):
            raise ParameterError(
                [f"{store.location}: not a sharded snapshot (no {ROOT_MARKER})"], what="merge"
            )
        if fingerprint:
            fingerprints = [validate_fingerprint(fingerprint)]
        else:
            fingerprints = store.fingerprints()
            # a damaged index whose manifests do not say what computed them: an error
            # (from merge_into) rather than an index silently left damaged
            fingerprints += [
                fp
                for fp in store.fingerprint_dirs()
                if fp not in fingerprints and f"{fp}/index.json" in store.unreadable(fp)
            ]
        return {fp: merge_into(store, fp) for fp in fingerprints}
    finally:
        store.close()


def orphan_parts(
    location: str | os.PathLike[str],
    *,
    older_than_s: float = DEFAULT_ORPHAN_GRACE_S,
    storage_options: Mapping[str, Any] | None = None,
    remove: bool = False,
) -> list[str]:
    """What writers that died left behind, last modified more than ``older_than_s`` ago:
    parts with no manifest, the temporary files (``parts/.tmp-*``, ``commits/.tmp-*``)
    of a writer killed while writing one, and dead writers' claims. A part a live writer
    claims (:mod:`cache_store.snapshot.sharded.claims`) is never one, whatever
    ``older_than_s``. With ``remove``, delete them. Returns their full locations (with
    the URL's scheme: ``s3://bucket/...``), sorted."""
    store = ShardedSnapshot(location, readonly=not remove, storage_options=storage_options)
    try:
        found: list[str] = []
        fs = store.fs
        for fingerprint in store.fingerprint_dirs():
            found += _leftovers(store, fingerprint, older_than_s)
        found.sort()
        if remove:
            for path in found:
                with contextlib.suppress(FileNotFoundError):
                    fs.rm_file(path)
        return [storage.full_location(fs, path) for path in found]
    finally:
        store.close()


def _leftovers(store: ShardedSnapshot, fingerprint: str, older_than_s: float) -> list[str]:
    """The orphans of one fingerprint. Listed in the order :mod:`claims` needs: commits,
    parts, then claims; then commits once more for the candidate parts."""
    fs, now = store.fs, time.time()
    committed = set(store.commit_names(fingerprint))
    candidates: list[tuple[str, str]] = []  # (path, part)
    for folder in ("parts", "commits"):
        try:
            listing = fs.ls(store.path(fingerprint, folder), detail=True, refresh=True)
        except FileNotFoundError:
            continue
        for info in listing:
            name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            leftover = name.startswith(".tmp-") or (
                folder == "parts" and name.endswith(".bin") and name[:-4] not in committed
            )
            if not leftover or info.get("type") == "directory":
                continue
            if not storage.older_than(info, older_than_s, now):
                continue
            candidates.append((str(info["name"]), part_of(name)))
    live, stale = live_claims(fs, store.path(fingerprint), time.time())
    found = [str(info["name"]) for info in stale if storage.older_than(info, older_than_s, now)]
    if candidates:  # a fresh listing (a cached one could miss a commit made since)
        committed.update(store.commit_names(fingerprint))
    for path, part in candidates:
        if part in live:
            continue  # being written
        if path.endswith(".bin") and part in committed:
            continue  # committed since commits were listed
        found.append(path)
    return found
