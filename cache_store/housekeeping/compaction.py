"""``compact``: give a cache's disk back (LMDB never shrinks its file by itself).

The housekeeping face of :func:`cache_store.stores.lmdb.compact_environment`: the same
checks of the location as the other steps, then the compacting copy swapped in; with
``rewrite_records``, a copy record by record that rewrites format-1 records as format 2
(:func:`cache_store.format.encode.upgrade_record`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from cache_store.errors import CorruptRecord
from cache_store.housekeeping.listing import cache_root, open_cache_store

__all__ = ["compact"]

log = logging.getLogger(__name__)


def compact(
    cache: str | os.PathLike[str], *, wait_s: float = 60.0, rewrite_records: bool = False
) -> dict[str, int]:
    """Shrink the cache's ``data.mdb`` to what it holds (a compacting copy swapped in
    atomically; readers keep reading, writers wait). Returns ``{"before", "after"}``
    file sizes in bytes.

    With ``rewrite_records``, the copy is written record by record: every format-1
    record rewritten as format 2 (the same tensors and metadata, what the fingerprint's
    records share moved to its descriptor), every page filled whole (LMDB's own copy
    keeps pages as full as they were). Slower than the plain copy, and writers wait for
    all of it. A record that does not check out is copied as it is (``verify`` names
    it). Adds ``records``, ``rewritten`` and ``unreadable`` counts."""
    from cache_store.stores.lmdb import compact_environment

    root = cache_root(cache)
    open_cache_store(root, readonly=True).close()
    if not rewrite_records:
        return compact_environment(root, wait_s=wait_s)
    from cache_store.format.encode import upgrade_record

    unreadable = 0

    def rewrite(key: str, value: bytes) -> Any:
        nonlocal unreadable
        try:
            return upgrade_record(value, key=key)
        except CorruptRecord as exc:
            unreadable += 1
            log.warning("compact: %s is copied as it is: %s", key, exc.reason)
            return None

    return {**compact_environment(root, wait_s=wait_s, rewrite=rewrite), "unreadable": unreadable}
