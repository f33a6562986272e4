"""Eviction: ``prune`` (least recently used first) and a writer's ``--max-size``.

:func:`plan_prune` is the one rule both follow: least recently used first (last read
or written, else created); never a fingerprint with queue items pending or running, nor
one named in ``protect``; ``keep`` alone keeps the N most recently used and removes the
rest; a ``max_size`` the kept ones do not fit in is refused before anything is removed
(:class:`LimitTooSmall`). :func:`prune` runs it once; :class:`SizeLimit` after every
batch a long-running writer commits. Removal itself is :func:`~cache_store.
housekeeping.removal.rm`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cache_store.errors import LimitTooSmall
from cache_store.housekeeping.listing import (
    CacheEntry,
    cache_entries,
    cache_root,
    open_cache_store,
)
from cache_store.housekeeping.removal import active_fingerprints, rm
from cache_store.housekeeping.units import format_size, parse_duration, parse_size

__all__ = ["LimitTooSmall", "SizeLimit", "plan_prune", "prune"]

log = logging.getLogger(__name__)


def plan_prune(
    entries: list[CacheEntry],
    *,
    max_size: int | None = None,
    unused_for: float | None = None,
    keep: int | None = None,
    protect: Iterable[str] = (),
    now: float | None = None,
    strict: bool = True,
) -> tuple[list[CacheEntry], list[CacheEntry]]:
    """``(remove, kept)``: which fingerprints a prune removes, least recently used first.

    ``protect`` (queued, running, being written) and the ``keep`` most recently used are
    never removed; ``unused_for`` removes the others unused that long; ``max_size``
    removes more, oldest first, until the rest fits. ``keep`` alone removes every other
    fingerprint. Raises :class:`LimitTooSmall`, before anything is chosen, when the
    fingerprints that must be kept hold more than ``max_size`` together (``strict``, a
    prune asked for once) or one of them alone does (not ``strict``: a writer's limit,
    which evicts what it can and warns).
    """
    if max_size is None and unused_for is None and keep is None:
        raise ValueError("prune needs at least one of max_size, unused_for, keep")
    now = time.time() if now is None else now
    protected = set(protect)
    lru = sorted(entries, key=lambda e: (e.last_used, e.fingerprint))
    kept_recent = {e.fingerprint for e in lru[-keep:]} if keep else set()
    must_keep = [e for e in lru if e.fingerprint in protected or e.fingerprint in kept_recent]
    keep_names = {e.fingerprint for e in must_keep}
    if max_size is not None and must_keep:
        _check_limit(max_size, must_keep, protected, keep, strict=strict)
    candidates = [e for e in lru if e.fingerprint not in keep_names]
    chosen: set[str] = set()
    if max_size is None and unused_for is None:  # --keep N alone: the rest goes
        chosen = {e.fingerprint for e in candidates}
    if unused_for is not None:
        chosen = {e.fingerprint for e in candidates if e.last_used < now - unused_for}
    if max_size is not None:
        total = sum(e.bytes for e in entries if e.fingerprint not in chosen)
        for entry in candidates:
            if total <= max_size:
                break
            if entry.fingerprint not in chosen:
                chosen.add(entry.fingerprint)
                total -= entry.bytes
    remove = [e for e in lru if e.fingerprint in chosen]
    kept = [e for e in lru if e.fingerprint not in chosen]
    return remove, kept


def _check_limit(
    max_size: int,
    must_keep: list[CacheEntry],
    protected: set[str],
    keep: int | None,
    *,
    strict: bool,
) -> None:
    """Raise :class:`LimitTooSmall` naming the kept fingerprints that do not fit."""

    def why(entry: CacheEntry) -> str:
        if entry.fingerprint in protected:
            return "it has queue items pending or running, or is being written"
        return f"it is among the {keep} most recently used kept (--keep)"

    limit = f"size limit {max_size} bytes ({format_size(max_size)})"
    largest = max(must_keep, key=lambda e: e.bytes)
    if largest.bytes > max_size:
        raise LimitTooSmall(
            f"{limit} is smaller than fingerprint {largest.fingerprint} ({largest.bytes} "
            f"bytes, {format_size(largest.bytes)}), which must be kept: {why(largest)}; "
            f"give a larger limit"
        )
    together = sum(e.bytes for e in must_keep)
    if not strict or together <= max_size:
        return
    named = "; ".join(
        f"{e.fingerprint} ({e.bytes} bytes, {format_size(e.bytes)}: {why(e)})" for e in must_keep
    )
    raise LimitTooSmall(
        f"{limit} is smaller than the {len(must_keep)} fingerprints that must be kept, "
        f"{together} bytes ({format_size(together)}) together: {named}; give a larger "
        f"limit" + (" or a smaller --keep" if keep else "")
    )


def prune(
    cache: str | os.PathLike[str],
    *,
    max_size: int | str | None = None,
    unused_for: float | str | None = None,
    keep: int | None = None,
    dry_run: bool = False,
    protect: Iterable[str] = (),
    compact_after: bool = False,
) -> dict[str, Any]:
    """Remove least recently used fingerprints (see :func:`plan_prune`); never one with
    queue items pending or running. Returns ``{"removed": [rows], "kept": [rows],
    "bytes_before", "bytes_after", "dry_run"}`` (rows as :func:`ls`'s)."""
    root = cache_root(cache)
    limit = None if max_size is None else parse_size(max_size)
    unused = None if unused_for is None else parse_duration(unused_for)
    if keep is not None and keep < 0:
        raise ValueError(f"keep {keep}: must not be negative")
    open_cache_store(root, readonly=True).close()  # a clear error for a snapshot or a bad path
    entries = cache_entries(root)
    remove, kept = plan_prune(
        entries,
        max_size=limit,
        unused_for=unused,
        keep=keep,
        protect=set(protect) | active_fingerprints(root),
    )
    if remove and not dry_run:
        rm(root, [e.fingerprint for e in remove], compact_after=compact_after)
    before = sum(e.bytes for e in entries)
    return {
        "removed": [e.as_json() for e in remove],
        "kept": [e.as_json() for e in kept],
        "bytes_before": before,
        "bytes_after": before - sum(e.bytes for e in remove),
        "dry_run": dry_run,
    }


class SizeLimit:
    """``--max-size`` for a long-running writer (``spcache worker``/``serve``).

    :meth:`check_start` refuses a limit smaller than the largest fingerprint already
    stored (while it is written again it could not be evicted). :meth:`after_batch`,
    called after each batch the writer committed, evicts least recently used
    fingerprints until the records fit, never ``writing`` nor one with queue items
    pending or running. Sizes of the other fingerprints are re-walked at most every
    ``refresh_s``; the one being written after every batch.
    """

    def __init__(
        self, cache: str | os.PathLike[str], max_size: int, *, refresh_s: float = 60.0
    ) -> None:
        self.cache = Path(cache)
        self.max_size = int(max_size)
        self.refresh_s = refresh_s
        self._entries: dict[str, CacheEntry] = {}
        self._walked = 0.0
        self._warned: set[str] = set()

    def _refresh(self, writing: str | None) -> None:
        from cache_store.stores.lmdb import has_cache

        if not has_cache(self.cache):
            self._entries = {}
            return
        now = time.monotonic()
        if now - self._walked >= self.refresh_s or not self._entries:
            self._entries = {e.fingerprint: e for e in cache_entries(self.cache)}
            self._walked = now
        elif writing is not None:
            store = open_cache_store(self.cache, readonly=True)
            try:
                records, size = store.fingerprint_size(writing)
            finally:
                store.close()
            entry = self._entries.setdefault(writing, CacheEntry(writing))
            entry.records, entry.bytes = records, size
            entry.last_written = time.time()

    def total(self) -> int:
        return sum(e.bytes for e in self._entries.values())

    def check_start(self) -> None:
        """Raise :class:`LimitTooSmall` for a limit below the largest stored fingerprint."""
        self._refresh(None)
        if not self._entries:
            return
        largest = max(self._entries.values(), key=lambda e: e.bytes)
        if largest.bytes > self.max_size:
            raise LimitTooSmall(
                f"--max-size {self.max_size} bytes ({format_size(self.max_size)}) is smaller "
                f"than fingerprint {largest.fingerprint} already in {self.cache} "
                f"({largest.bytes} bytes, {format_size(largest.bytes)}): it could not be "
                f"evicted while it is written; give a larger limit or remove it first "
                f"(spcache rm)"
            )

    def after_batch(self, writing: str | None) -> list[str]:
        """Evict what the limit asks for; returns the fingerprints removed."""
        self._refresh(writing)
        if self.total() <= self.max_size:
            return []
        protect = active_fingerprints(self.cache) | ({writing} if writing else set())
        entries = list(self._entries.values())
        try:
            remove, _ = plan_prune(entries, max_size=self.max_size, protect=protect, strict=False)
        except LimitTooSmall as exc:
            remove = []
            if writing not in self._warned:
                self._warned.add(writing or "")
                log.warning("%s: over --max-size and nothing can be evicted: %s", self.cache, exc)
        if remove:
            names = [e.fingerprint for e in remove]
            log.info(
                "%s: %d bytes stored, over --max-size %d: evicting %s (least recently used)",
                self.cache,
                self.total(),
                self.max_size,
                ", ".join(names),
            )
            rm(self.cache, names)
            for name in names:
                self._entries.pop(name, None)
        if self.total() > self.max_size and writing not in self._warned:
            self._warned.add(writing or "")
            log.warning(
                "%s: still %d bytes stored, over --max-size %d: the rest is queued, "
                "running or being written",
                self.cache,
                self.total(),
                self.max_size,
            )
        return [e.fingerprint for e in remove]
