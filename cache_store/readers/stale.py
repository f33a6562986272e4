"""The rules of ``CachedDataset(sources=..., on_stale=...)``: whether a stored record is
current for its source file, and waiting until stale records are recomputed.

Both are functions of plain values (a path, a record's metadata, a dict of what this
process verified, callables), so the dataset that calls them keeps only its state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from cache_store.errors import MissTimeout
from cache_store.sources.files import SourceLimits, check_source, hash_source
from cache_store.sources.freshness import STAT_FIELD, is_current, same_signature, trusted_signature

__all__ = ["staleness", "wait_until_current"]

_LIMITS = SourceLimits()


def staleness(
    path: str, meta: Mapping[str, str], verified: dict[int, tuple[str, str]], i: int
) -> tuple[str, str] | None:
    """None when the record read for position ``i``, whose metadata is ``meta``, is
    current for its source ``path``; else ``(path, the source's hash now)``. A hash that
    matched is remembered in ``verified`` (this process's, by position) with the stat
    signature it was taken at, so an unchanged file is not hashed again. Raises
    SourceError for an unusable source."""
    signature = check_source(path, _LIMITS).signature
    if same_signature(meta.get(STAT_FIELD), signature):
        return None
    checksum = meta.get("checksum", "")
    if verified.get(int(i)) == (signature, checksum):
        return None
    digest, seen, _ = hash_source(path, _LIMITS)
    if is_current(meta.get("source_hash"), digest):
        if trusted_signature(seen):
            verified[int(i)] = (seen, checksum)
        return None
    return path, digest


def wait_until_current(
    ask: Callable[[], object],
    current: Callable[[str], bool],
    keys: Iterable[str],
    *,
    miss_timeout: float,
    what: str,
) -> None:
    """Call ``ask`` (queue the stale samples again) until ``current`` holds for every
    key, backing off up to a second between rounds; ``MissTimeout`` naming ``what``
    after ``miss_timeout`` seconds."""
    keys = list(keys)
    deadline = time.monotonic() + miss_timeout
    delay = 0.05
    while True:
        ask()
        if all(current(key) for key in keys):
            return
        if time.monotonic() >= deadline:
            raise MissTimeout(f"{what} were not recomputed within {miss_timeout:g} s")
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
