"""``compact``: give a cache's disk back (LMDB never shrinks its file by itself).

The housekeeping face of :func:`cache_store.stores.lmdb.compact_environment`: the same
checks of the location as the other steps, then the compacting copy swapped in.
"""

from __future__ import annotations

import os

from cache_store.housekeeping.listing import cache_root, open_cache_store

__all__ = ["compact"]


def compact(cache: str | os.PathLike[str], *, wait_s: float = 60.0) -> dict[str, int]:
    """Shrink the cache's ``data.mdb`` to what it holds (a compacting copy swapped in
    atomically; readers keep reading, writers wait). Returns ``{"before", "after"}``
    file sizes in bytes."""
    from cache_store.stores.lmdb import compact_environment

    root = cache_root(cache)
    open_cache_store(root, readonly=True).close()
    return compact_environment(root, wait_s=wait_s)
