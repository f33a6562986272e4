"""LMDBStore: the embedded default store, one LMDB environment in ``<cache>/records/``.

Three named databases live in the environment: ``records`` (key -> record bytes),
``indexes`` (fingerprint -> dataset index bytes) and ``removed`` (fingerprint ->
tombstone).

The modules: :mod:`~cache_store.stores.lmdb.environment` (this process's environments,
one per path, and the transactions everything runs in), :mod:`~cache_store.stores.lmdb.
maps` (an environment's generations and the leases that keep their maps mapped),
:mod:`~cache_store.stores.lmdb.store` (:class:`LMDBStore`), :mod:`~cache_store.stores.
lmdb.tombstones` (removal markers) and :mod:`~cache_store.stores.lmdb.compaction`
(:func:`compact_environment`).

Process and fork rules (py-lmdb 3.0 behaviour this package is built around):

* The environment opens lazily, on first use, in the process that uses it, and is
  re-opened when ``os.getpid()`` changes.
* py-lmdb refuses to open a path the process already has open, and that record is
  inherited by ``fork``. So every open environment is closed right before any
  ``os.fork`` (``os.register_at_fork``); parent and child each re-open on next use.
  An environment another thread is writing to, or that a lease (below) holds, is the
  exception: closing it would pull it from under that write or that view (a recipe
  forking in ``compute`` while the engine's writer thread commits), so it stays open; the
  child inherits it parked and cannot open that cache itself (it is told why).
* Every read runs in a :class:`~cache_store.stores.lmdb.maps.MapLease`: a read
  transaction and a count on the generation of the map it reads. A ``buffers=True``
  view (``LMDBStore.read_view``, ``LMDBStore.lease``) is valid until its lease is
  released, and no memory a lease uses is ever unmapped under it: a swapped-out map
  closes with its last lease, and a re-map (``set_mapsize``) waits until no lease of the
  process uses the map (up to ``maps.REMAP_WAIT_S``, then :class:`StoreBusy`). Read-only
  processes map ``READER_MAP_BYTES`` (1 TiB of address space, not memory), so growth by
  a writer in another process never makes them re-map. Before issue 34 a swapped-out map
  was closed a fixed minute after the swap and a reader re-mapped at once, both under
  views still in use (SIGSEGV, SIGBUS).
* A writer opening the environment runs ``reader_check()``, freeing reader slots left by
  killed processes (a stale slot pins old pages and makes the file grow).
* The reader table is as large as the largest ``max_readers`` any process asked for
  since the lock file was created (a larger request grows the file, which outlives the
  processes). Every concurrent read transaction takes one slot: size ``max_readers``
  for (DataLoader workers x threads x processes), plus the service's threads. The
  default here, 1024, costs 64 KiB of lock file. A reader that finds the table full
  first frees slots of dead processes (``reader_check``), then raises.
* The map grows by itself: a write that finds it full doubles it (at least; enough for
  the batch) and retries; readers adopt a map grown by another process.
* Damage: any ``lmdb.Error`` from a read (a flipped byte in a page header, a page number
  past the file) becomes :class:`CacheDamaged` naming the cache, never a raw lmdb error.
  Some damage makes LMDB itself ``abort()`` the process inside a cursor walk; walks that
  must survive that (verify, stats, the service's listings) run in a child process
  (:mod:`cache_store.housekeeping.isolated`). A commit that fails with ENOSPC/EIO raises
  :class:`StoreFull` ("no space left on <path>") so a writer can stop early.
* Removal (``spcache rm``/``prune``): the ``removed`` database holds a tombstone
  (fingerprint -> removal time) written in the same transaction that drops the index;
  the records are then deleted in chunks. A read that misses a record or index of a
  tombstoned fingerprint raises :class:`FingerprintRemoved`; a write of its records or
  index is refused inside the write transaction (so a run that was under way cannot
  bring it back), until :meth:`LMDBStore.revive` lifts the tombstone for work requested
  after the removal.
* Compaction (:func:`compact_environment`): a compacting copy into ``records.compact/``,
  then ``renameat2(RENAME_EXCHANGE)`` swaps the two directories in one step, so a path
  lookup always finds a whole environment (data and lock file of one generation).
  Writers hold a shared ``flock`` on ``<cache>/records.lock`` for each write
  transaction; compaction holds it exclusively, so writers wait (up to
  ``COMPACT_WAIT_S``, then :class:`StoreBusy`). Processes notice a swap by the
  directory's inode: a writer before each write, a reader at most once a second; they
  open the new generation, and the old one closes when its last lease is released
  (reads in flight finish on the old file, which stays readable while mapped).
"""

from __future__ import annotations

from cache_store.stores.lmdb.compaction import compact_environment
from cache_store.stores.lmdb.environment import (
    COMPACT_DIR,
    DEFAULT_MAP_SIZE,
    DEFAULT_MAX_READERS,
    RECORDS_DIR,
    WRITE_LOCK_FILENAME,
    has_cache,
    shared_envs,
)
from cache_store.stores.lmdb.store import LMDBStore

__all__ = [
    "LMDBStore",
    "DEFAULT_MAP_SIZE",
    "DEFAULT_MAX_READERS",
    "RECORDS_DIR",
    "has_cache",
    "compact_environment",
    "shared_envs",
    "WRITE_LOCK_FILENAME",
    "COMPACT_DIR",
]
