"""Sharded snapshots: many writers (one per GPU) append committed parts; readers see only
committed ones; one index is merged from the parts' manifests.

The layout and the commit rule (:mod:`~cache_store.snapshot.sharded.format`), where the
bytes go (:mod:`~cache_store.snapshot.sharded.storage`: a directory or any fsspec URL),
the store (:mod:`~cache_store.snapshot.sharded.store`) and keeping it
(:mod:`~cache_store.snapshot.sharded.maintenance`: merge, orphan sweep;
:mod:`~cache_store.snapshot.sharded.superseded`: copies no reader reads). The names
writers, readers and ``spcache merge`` use are importable from here.
"""

from __future__ import annotations

from cache_store.snapshot.sharded.format import ROOT_MARKER
from cache_store.snapshot.sharded.maintenance import (
    DEFAULT_ORPHAN_GRACE_S,
    is_sharded,
    merge,
    merge_into,
    orphan_parts,
    snapshot_kind,
)
from cache_store.snapshot.sharded.storage import CommitConflict
from cache_store.snapshot.sharded.store import ShardedSnapshot
from cache_store.snapshot.sharded.superseded import superseded_parts

__all__ = [
    "DEFAULT_ORPHAN_GRACE_S",
    "ROOT_MARKER",
    "CommitConflict",
    "ShardedSnapshot",
    "is_sharded",
    "merge",
    "merge_into",
    "orphan_parts",
    "snapshot_kind",
    "superseded_parts",
]
