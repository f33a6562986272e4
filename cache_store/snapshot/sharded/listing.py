"""Listing one fingerprint of a sharded snapshot: what its readers read from.

A listing reads ``index.json`` (unless it starts from a listing it has already, or
rebuilds from the manifests alone), then the manifest of every part committed that it
has not seen yet, and admits their records in commit order
(:meth:`~cache_store.snapshot.sharded.format.Dataset.admit`). What could not be read is
noted in a :class:`Problems`: a damaged ``index.json`` is read around (the manifests
rebuild the dataset, ``spcache merge`` writes it again), a damaged manifest's records
are not read; each is warned about once, not at every listing.

Functions of a file system and paths: what a process keeps of its listings, and when it
lists again, is :class:`~cache_store.snapshot.sharded.store.ShardedSnapshot`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cache_store.errors import CorruptRecord
from cache_store.snapshot.sharded import storage
from cache_store.snapshot.sharded.format import (
    Dataset,
    commit_order,
    dataset_from_index,
    load_json,
    parse_manifest,
)

__all__ = ["Problems", "list_commits", "read_index"]

log = logging.getLogger(__name__)


@dataclass
class Problems:
    """What of one fingerprint could not be read at the last listing."""

    index: str | None = None  # why index.json was read around, if it was
    commits: dict[str, str] = field(default_factory=dict)  # part -> why its manifest was not


def read_index(
    fs: Any, path: Callable[..., str], fingerprint: str, problems: Problems, location: str
) -> Dataset | None:
    """The dataset ``index.json`` holds, or None: none yet, or one that cannot be read
    (noted in ``problems``; the manifests then rebuild it, and ``merge`` writes it
    again). ``path(fingerprint, name)`` is a file's full path."""
    what = f"{fingerprint}/index.json"
    try:
        raw = storage.read(fs, path(fingerprint, "index.json"))
    except FileNotFoundError:
        problems.index = None
        return None
    try:
        dataset = dataset_from_index(fingerprint, load_json(raw, what))
    except CorruptRecord as exc:  # UnsupportedFormat too
        if problems.index != exc.reason:
            log.warning(
                "%s: %s; its committed manifests are read instead (spcache merge writes it again)",
                location,
                exc,
            )
        problems.index = exc.reason
        return None
    problems.index = None
    return dataset


def list_commits(
    fs: Any,
    path: Callable[..., str],
    fingerprint: str,
    *,
    known: Dataset | None,
    committed: Callable[[], list[str]],
    problems: Problems,
    location: str,
    describe: Mapping[str, Any] | None = None,
    with_index: bool = True,
) -> Dataset | None:
    """What ``fingerprint`` holds: ``known`` (a listing made before, updated in place)
    or else ``index.json`` (unless not ``with_index``), and the manifests of the parts
    ``committed()`` lists that neither includes; None when nothing is committed.
    ``describe`` (recipe, version, params) says what computed the records when none of
    the manifests does."""
    dataset = known
    if dataset is None and with_index:
        dataset = read_index(fs, path, fingerprint, problems, location)
    new = [p for p in committed() if dataset is None or p not in dataset.parts_seen]
    docs = []
    unreadable: dict[str, str] = {}
    for part in new:
        try:
            raw = storage.read(fs, path(fingerprint, "commits", f"{part}.json"))
            docs.append(parse_manifest(raw, fingerprint, part) + (part,))
        except FileNotFoundError:
            continue
        except CorruptRecord as exc:  # UnsupportedFormat too
            unreadable[part] = exc.reason
            if problems.commits.get(part) != exc.reason:  # once, not at every listing
                log.warning("%s: commit %s ignored: %s", location, part, exc)
    # A part not read again was read before (it is in the dataset): only the parts
    # listed as new can still be unreadable.
    problems.commits = unreadable
    docs.sort(key=lambda d: commit_order(d[0], d[2]))
    if dataset is None:
        described = [d[0]["dataset"] for d in docs if isinstance(d[0].get("dataset"), dict)]
        if describe is not None and docs:
            described.insert(0, dict(describe))
        if not docs:
            return None
        if not described:
            described = [{"recipe": None}]  # records readable, index not yet
        try:
            dataset = Dataset(**described[0], created=str(docs[0][0].get("committed_at", "")))
        except TypeError as exc:
            raise CorruptRecord(
                f"{fingerprint}/commits", f"malformed dataset description ({exc})"
            ) from None
    for doc, entries, part in docs:
        described_here = doc.get("dataset")
        if dataset.recipe is None and isinstance(described_here, dict):
            try:
                dataset.recipe = str(described_here["recipe"])
                dataset.recipe_version = int(described_here["recipe_version"])
                dataset.params = dict(described_here["params"])
            except (KeyError, TypeError, ValueError):
                log.warning("%s: commit %s has a malformed dataset description", location, part)
        dataset.parts_seen.add(part)
        dataset.descriptors.update(doc.get("descriptors", {}))  # checked by parse_manifest
        for sample_id, entry in entries:
            dataset.admit(sample_id, entry)
    return dataset
