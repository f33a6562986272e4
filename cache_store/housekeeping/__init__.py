"""Housekeeping: list, remove, prune and compact the fingerprints of a cache.

Four plain functions, used by ``spcache ls|rm|prune|compact``, by the service
(``DELETE /v1/caches/{fingerprint}``) and by a worker with ``--max-size``
(:class:`SizeLimit`), one module each:

* :func:`ls` (:mod:`~cache_store.housekeeping.listing`): one row per fingerprint
  (recipe, records, exact bytes, failures, created, last written, last read, complete
  or partial against its index). Zarr snapshots are listed too; they are immutable, so
  the other three refuse them.
* :func:`rm` (:mod:`~cache_store.housekeeping.removal`): cancel the fingerprint's
  queued items, forget its failures, write its tombstone and drop its index (one LMDB
  transaction), then delete its records in chunks; a killed ``rm`` is finished by
  running it again.
* :func:`prune` and :class:`SizeLimit` (:mod:`~cache_store.housekeeping.eviction`):
  least recently used first, never what has work queued or running.
* :func:`compact` (:mod:`~cache_store.housekeeping.compaction`): give the disk back.

Walks over a whole cache that a damaged LMDB page could abort (``verify``, ``stats``,
the service's listings) run in a child process: :mod:`~cache_store.housekeeping.isolated`.

Sizes are the bytes of the stored records; ``data.mdb`` is at least that, and does not
shrink until :func:`compact` (LMDB reuses the freed pages for later writes). Sizes and
durations are parsed by :mod:`~cache_store.housekeeping.units`.
"""

from __future__ import annotations

from cache_store.housekeeping.compaction import compact
from cache_store.housekeeping.eviction import LimitTooSmall, SizeLimit, plan_prune, prune
from cache_store.housekeeping.listing import CacheEntry, ls
from cache_store.housekeeping.removal import rm
from cache_store.housekeeping.units import format_size, parse_duration, parse_size

__all__ = [
    "ls",
    "rm",
    "prune",
    "compact",
    "plan_prune",
    "parse_size",
    "parse_duration",
    "format_size",
    "LimitTooSmall",
    "SizeLimit",
    "CacheEntry",
]
