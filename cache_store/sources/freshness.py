"""Is a stored record current for its source? The one answer, used everywhere.

A record is current for a source when the ``source_hash`` in its metadata equals the
content hash of the source: same bytes, same record (the key already pins recipe,
version and parameters). The engine skips such items on resume, the Ray driver skips
them before sharding, the service's warm-up counts them as ready, ``item_state``
explains the others and a read-through :class:`~cache_store.readers.dataset.CachedDataset`
refuses a stale one.

Hashing a whole source to answer is expensive (a 512 MB mesh is ~0.3 s of a core), so
records also carry ``source_stat``: the stat signature of the file they were computed
from (size, mtime_ns, inode, device, ctime_ns;
:func:`cache_store.sources.files.signature_of`), taken when the worker opened it.
:func:`compare_source` opens the source through the gate (one ``open`` + ``fstat``,
nothing read): an equal signature (:func:`same_signature`, the one comparison) is current
without reading a byte; a different one (edited, replaced, another file under the same
id, a record without a signature, or one stored before signatures held the change time)
is decided by the bounded hash, which a :class:`HashBudget` caps per request. The change
time is what makes an equal signature mean "not edited": ``touch -r`` puts an mtime back
and a re-created file can reuse its inode, but the kernel sets ctime to "now" on every
change. A signature is stored only when the file's mtime and ctime were both at least
:data:`RACY_S` old when it was taken: a file edited within the filesystem's timestamp
granularity of being read could keep its signature with other bytes, so such records are
always hashed.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cache_store.errors import CorruptRecord, RecordNotFound, SourceError
from cache_store.sources.files import SourceLimits, check_source, hash_source, signature_of

__all__ = [
    "STAT_FIELD",
    "RACY_S",
    "HashBudget",
    "SourceComparison",
    "compare_source",
    "trusted_signature",
    "same_signature",
    "is_current",
    "stale_variants",
    "stored_metadata",
    "stored_metadata_many",
    "unchanged_by_stat",
    "record_is_current",
    "stored_source_hash",
]

log = logging.getLogger(__name__)

#: The record metadata field that holds the source's stat signature.
STAT_FIELD = "source_stat"
#: A signature taken less than this long after the file's mtime is not stored.
RACY_S = 2.0


def trusted_signature(signature: str, now_ns: int | None = None) -> str:
    """``signature`` when its mtime and ctime are at least :data:`RACY_S` in the past,
    else ``""`` (never equal to a real signature: the record is hashed when checked).
    A signature without a ctime (stored by an older version) is never trusted."""
    try:
        _, mtime, _, _, ctime = signature.split(":")
        changed_ns = max(int(mtime), int(ctime))
    except ValueError:
        return ""
    now = time.time_ns() if now_ns is None else now_ns
    return signature if now - changed_ns >= RACY_S * 1e9 else ""


def same_signature(stored: str | None, now: str) -> bool:
    """Whether a record's stored stat signature (``None``/``""``: it has none) still
    describes the source whose signature is ``now``: then the record is current without
    hashing the source. Any difference, a signature of the old four-field form included,
    means "hash it to decide"."""
    return bool(stored) and stored == now


class HashBudget:
    """How many source bytes one request (or one reader) may still hash."""

    def __init__(self, max_bytes: int) -> None:
        self.left = int(max_bytes)
        self.hashed = 0  # bytes actually hashed
        self.refused = 0  # comparisons left undecided for want of budget

    def take(self, size: int) -> bool:
        if size > self.left:
            self.refused += 1
            return False
        self.left -= size
        return True


@dataclass(frozen=True)
class SourceComparison:
    """``current`` is True/False, or None when the hash was over the budget (undecided).
    ``source_hash`` is the file's hash when it was hashed; ``signature`` its stat
    signature now; ``hashed`` the bytes read to decide."""

    current: bool | None
    signature: str
    source_hash: str | None = None
    hashed: int = 0


def compare_source(
    meta: Mapping[str, Any],
    path: str | os.PathLike[str],
    limits: SourceLimits | None = None,
    *,
    budget: HashBudget | None = None,
) -> SourceComparison:
    """Compare a record's metadata with the source at ``path`` as it is now: its stat
    signature first, the bounded hash only when the signature differs (and ``budget``,
    if given, still covers the file). Raises :class:`SourceError` when the gate refuses
    the path (missing, not a regular file, outside the roots, over the size limit)."""
    check = check_source(path, limits)
    if same_signature(meta.get(STAT_FIELD), check.signature):
        return SourceComparison(True, check.signature)
    if budget is not None and not budget.take(check.size):
        return SourceComparison(None, check.signature)
    digest, signature, read = hash_source(path, limits)
    if budget is not None:
        budget.hashed += read
    return SourceComparison(is_current(meta.get("source_hash"), digest), signature, digest, read)


def is_current(stored_hash: str | None, source_hash: str) -> bool:
    """True when a record that holds ``stored_hash`` (None: no readable record) was
    computed from a source whose content hash is ``source_hash``."""
    return stored_hash is not None and stored_hash == source_hash


def stale_variants(stored_hashes: Sequence[str | None], source_hash: str) -> list[int]:
    """The variants of a sample a run computes: those whose stored record (source hash
    ``stored_hashes[v]``, None: none stored) is not current for a source whose content
    hash is ``source_hash`` (:func:`is_current`). Empty: every wanted record is current.
    The local engine's loaders and the Ray driver both decide by it."""
    return [v for v, stored in enumerate(stored_hashes) if not is_current(stored, source_hash)]


def stored_metadata(store: Any, key: str) -> dict[str, str] | None:
    """The metadata of the record stored under ``key``; None when there is none, or it
    is unreadable (logged: it will be computed again)."""
    try:
        return store.record_metadata(key)
    except RecordNotFound:
        return None
    except CorruptRecord as exc:
        log.warning("stored record %s is unreadable (%s); treating it as absent", key, exc)
        return None


def stored_metadata_many(store: Any, keys: list[str]) -> list[dict[str, str] | None]:
    """:func:`stored_metadata` of each of ``keys``, asked of the store at once
    (``Store.records_metadata``: an LMDB store reads thousands per transaction)."""
    out: list[dict[str, str] | None] = []
    for key, meta in zip(keys, store.records_metadata(keys), strict=True):
        if isinstance(meta, CorruptRecord):
            log.warning("stored record %s is unreadable (%s); treating it as absent", key, meta)
        out.append(meta if isinstance(meta, dict) else None)
    return out


def unchanged_by_stat(meta: Mapping[str, Any], path: str | os.PathLike[str]) -> bool:
    """True when the record's stored stat signature is the file's at ``path`` now, as
    ``lstat`` sees it (a regular file, no link at the end), without opening it: a re-run
    over an unchanged source decides "current" so, where the signature was stored (a
    record without one, or a path that is not a local file, goes the way of
    :func:`compare_source`). What the signature covers is :func:`signature_of`'s."""
    stored = meta.get(STAT_FIELD)
    if not stored:
        return False
    try:
        st = os.lstat(path)
    except (OSError, ValueError, TypeError):
        return False
    return stat.S_ISREG(st.st_mode) and same_signature(stored, signature_of(st))


def stored_source_hash(store: Any, key: str) -> str | None:
    """The ``source_hash`` of the record stored under ``key``; None when there is no
    record, or when it is unreadable (logged: it will be computed again). A store that
    knows its records' source hashes without reading them (a sharded snapshot, from its
    manifests) answers directly."""
    lookup = getattr(store, "source_hash_of", None)
    if lookup is not None:
        return lookup(key)
    meta = stored_metadata(store, key)
    return None if meta is None else meta.get("source_hash")


def record_is_current(
    store: Any,
    key: str,
    path: str | os.PathLike[str],
    limits: SourceLimits | None = None,
    *,
    budget: HashBudget | None = None,
) -> bool:
    """True when ``store`` holds a readable record under ``key`` computed from the
    source at ``path`` as it is now (an unreadable source, or one left undecided by
    ``budget``, is never current)."""
    meta = stored_metadata(store, key)
    if meta is None:
        return False
    try:
        return compare_source(meta, path, limits, budget=budget).current is True
    except SourceError:
        return False
