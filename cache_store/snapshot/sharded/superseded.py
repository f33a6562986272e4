"""Reclaiming superseded parts: the copies of a sample that no reader reads any more.

Two runs into one destination (runs into a snapshot take no claims), an attempt retried
after a commit it did not report, or a source changed and recomputed commit a sample
more than once. Every reader reads one copy of each sample, the one
:meth:`~cache_store.snapshot.sharded.format.Dataset.admit` picks in commit order; the
others stay on the storage for good unless reclaimed here.

A committed part is *superseded* when no record of it is the copy a reader reads: not
in the manifests' view (every manifest, in commit order: a reader without
``index.json``) nor in the index's (``index.json``, then the manifests committed since:
:meth:`ShardedSnapshot.entry_of`). It is reclaimed only once that has lasted longer than
the age (``--orphan-age``; the orphan sweep's rule,
:func:`~cache_store.snapshot.sharded.storage.older_than`): its own manifest and the
manifests of the copies read instead were all committed at least that long ago, so a
reader that listed the commits before then, and may still read this part, has had that
long. One that reads it later still lists the commits again when it finds the part gone,
and reads the copy read instead (:meth:`ShardedSnapshot.read_located`). A part with one
record still read stays whole (a part is never rewritten: it is deleted or kept). Only
parts ``index.json`` has merged are taken (``spcache merge`` merges first), so a reader
of the index reads the same copies before and after.

Reclaiming one must not change what any reader reads: the copies read are computed
again without the parts to reclaim, and a part whose removal would change them is kept;
commits made meanwhile (another writer's) are looked for once more right before
anything is deleted, and the parts are worked out again if there are any. A part is
then taken out in the order that keeps the snapshot consistent at every step: its
manifest first (the part is then an orphan, never read: the orphan sweep takes it if
this stops here), ``index.json`` written without it
(:meth:`ShardedSnapshot.merge_index`), then its bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cache_store.errors import CorruptRecord
from cache_store.snapshot.sharded import storage
from cache_store.snapshot.sharded.format import (
    Dataset,
    Entry,
    commit_order,
    dataset_from_index,
    load_json,
    parse_manifest,
)
from cache_store.snapshot.sharded.maintenance import DEFAULT_ORPHAN_GRACE_S
from cache_store.snapshot.sharded.store import ShardedSnapshot

__all__ = ["superseded_parts"]

log = logging.getLogger(__name__)

#: How often the parts are worked out again when commits keep landing meanwhile.
_LOOKS = 3


@dataclass(frozen=True)
class _Commit:
    """One readable committed manifest."""

    part: str
    info: Mapping[str, Any]  # the listing entry of commits/<part>.json
    size: int  # the part's bytes (data_size)
    entries: tuple[tuple[str, Entry], ...]


def superseded_parts(
    location: str | os.PathLike[str],
    *,
    older_than_s: float = DEFAULT_ORPHAN_GRACE_S,
    storage_options: Mapping[str, Any] | None = None,
    remove: bool = False,
) -> dict[str, int]:
    """The committed parts of every fingerprint that no reader reads a record of, and
    has not for ``older_than_s`` seconds (see the module doc); with ``remove``, delete
    them (manifest, index entry, bytes). Returns ``{full location of the part: bytes}``
    (``s3://bucket/...`` with the URL's scheme), sorted."""
    store = ShardedSnapshot(location, readonly=not remove, storage_options=storage_options)
    try:
        found: dict[str, int] = {}
        for fingerprint in store.fingerprint_dirs():
            parts = _settled(store, fingerprint, older_than_s)
            if remove and parts:
                _reclaim(store, fingerprint, set(parts))
            for part, size in parts.items():
                path = store.path(fingerprint, "parts", f"{part}.bin")
                found[storage.full_location(store.fs, path)] = size
        return dict(sorted(found.items()))
    finally:
        store.close()


def _settled(store: ShardedSnapshot, fingerprint: str, older_than_s: float) -> dict[str, int]:
    """The superseded parts of ``fingerprint`` (part -> bytes), from a listing no commit
    landed after (worked out again if one did; none if commits keep landing)."""
    for _ in range(_LOOKS):
        commits = _commits(store, fingerprint)
        parts = _superseded(store, fingerprint, commits, older_than_s)
        if set(store.commit_names(fingerprint)) == {c.part for c in commits}:
            return parts
    log.warning(
        "%s: %s: commits kept landing while superseded parts were looked for; none taken",
        store.location,
        fingerprint,
    )
    return {}


def _commits(store: ShardedSnapshot, fingerprint: str) -> list[_Commit]:
    """The readable manifests of ``fingerprint``, in commit order. A damaged one is
    left out, as every reader leaves it out (``verify`` names it)."""
    try:
        listing = store.fs.ls(store.path(fingerprint, "commits"), detail=True, refresh=True)
    except FileNotFoundError:
        return []
    found = []
    for info in listing:
        name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
        if not name.endswith(".json") or name.startswith("."):
            continue
        part = name[: -len(".json")]
        try:
            doc, entries = parse_manifest(
                storage.read(store.fs, str(info["name"])), fingerprint, part
            )
        except (FileNotFoundError, CorruptRecord):  # UnsupportedFormat too
            continue
        found.append(
            (commit_order(doc, part), _Commit(part, info, int(doc["data_size"]), tuple(entries)))
        )
    return [commit for _, commit in sorted(found, key=lambda pair: pair[0])]


def _copies_read(commits: list[_Commit]) -> dict[str, str]:
    """Sample id -> the part its record is read from, when only ``commits`` exist."""
    dataset = Dataset(recipe=None)
    for commit in commits:
        for sample_id, entry in commit.entries:
            dataset.admit(sample_id, entry)
    return {sample_id: entry.part for sample_id, entry in dataset.entries.items()}


def _superseded(
    store: ShardedSnapshot, fingerprint: str, commits: list[_Commit], older_than_s: float
) -> dict[str, int]:
    """The parts of ``commits`` none of whose records is read, in either view, and whose
    manifest and those of the copies read instead are ``older_than_s`` old."""
    by_part = {commit.part: commit for commit in commits}
    read = _copies_read(commits)
    store.refresh()
    readers: dict[str, set[str]] = {}  # sample id -> the parts readers read it from
    for sample_id, part in read.items():
        indexed = store.entry_of(f"{fingerprint}/{sample_id}")
        readers[sample_id] = {part} | ({indexed.part} if indexed is not None else set())
    now = time.time()

    def aged(part: str) -> bool:
        commit = by_part.get(part)  # a part the index reads without a manifest: keep
        return commit is not None and storage.older_than(commit.info, older_than_s, now)

    merged = _merged_parts(store, fingerprint)
    candidates = {
        commit.part
        for commit in commits
        if aged(commit.part)
        and (merged is None or commit.part in merged)
        and all(
            commit.part not in readers[sample_id] and all(aged(p) for p in readers[sample_id])
            for sample_id, _ in commit.entries
        )
    }
    while candidates:  # what is read without them must be what is read now
        without = _copies_read([c for c in commits if c.part not in candidates])
        moved = {sid for sid, part in read.items() if without.get(sid) != part}
        if not moved:
            break
        candidates -= {p for p in candidates if any(s in moved for s, _ in by_part[p].entries)}
    return {part: by_part[part].size for part in sorted(candidates)}


def _merged_parts(store: ShardedSnapshot, fingerprint: str) -> set[str] | None:
    """The parts ``index.json`` has merged, or None when it cannot be read (readers then
    read the manifests alone). Only those are taken: a reader of the index reads the
    others' manifests after it, so taking one of them could change what it reads."""
    what = f"{fingerprint}/index.json"
    try:
        raw = storage.read(store.fs, store.path(what))
        return dataset_from_index(fingerprint, load_json(raw, what)).parts_seen
    except (FileNotFoundError, CorruptRecord):  # UnsupportedFormat too
        return None


def _reclaim(store: ShardedSnapshot, fingerprint: str, parts: set[str]) -> None:
    """Delete ``parts`` of ``fingerprint``: manifests, then the index, then the bytes."""
    fs = store.fs
    for part in sorted(parts):
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(store.path(fingerprint, "commits", f"{part}.json"))
    if fs.exists(store.path(fingerprint, "index.json")):
        store.merge_index(fingerprint)  # the parts leave its list; no record read moves
    for part in sorted(parts):
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(store.path(fingerprint, "parts", f"{part}.bin"))
    log.info("%s: %s: %d superseded part(s) reclaimed", store.location, fingerprint, len(parts))
