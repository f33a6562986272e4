"""Is a stored record current for its source? The one answer, used everywhere.

A record is current for a source when the ``source_hash`` in its metadata equals the
content hash of the source (:func:`cache_store.sources.hashing.hash_file`): same bytes, same
record (the key already pins recipe, version and parameters). The engine skips such
items on resume, the Ray driver skips them before sharding, the service's warm-up counts
them as ready and ``item_state`` explains the others.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from cache_store.errors import CorruptRecord, RecordNotFound, SourceError
from cache_store.sources.hashing import hash_file
from cache_store.format.record import read_metadata

__all__ = ["is_current", "record_is_current", "stored_source_hash"]

log = logging.getLogger(__name__)


def is_current(stored_hash: str | None, source_hash: str) -> bool:
    """True when a record that holds ``stored_hash`` (None: no readable record) was
    computed from a source whose content hash is ``source_hash``."""
    return stored_hash is not None and stored_hash == source_hash


def stored_source_hash(store: Any, key: str) -> str | None:
    """The ``source_hash`` of the record stored under ``key``; None when there is no
    record, or when it is unreadable (logged: it will be computed again)."""
    try:
        return read_metadata(store.get(key), key=key).get("source_hash")
    except RecordNotFound:
        return None
    except CorruptRecord as exc:
        log.warning("stored record %s is unreadable (%s); treating it as absent", key, exc)
        return None


def record_is_current(store: Any, key: str, path: str | os.PathLike[str]) -> bool:
    """True when ``store`` holds a readable record under ``key`` computed from the
    source at ``path`` as it is now (an unreadable source is never current)."""
    stored = stored_source_hash(store, key)
    if stored is None:
        return False
    try:
        return is_current(stored, hash_file(path))
    except SourceError:
        return False
