"""LMDBStore: the embedded default store, one LMDB environment in ``<cache>/records/``.

Named databases in the environment: ``records`` (key -> record bytes), ``indexes``
(fingerprint -> dataset index bytes), ``descriptors`` (``<fingerprint>/<digest>`` ->
the descriptor text the fingerprint's format-2 records name, written in the transaction
of the first records that name it) and ``removed`` (see removal below).

Process and fork rules (py-lmdb 3.0 behaviour this module is built around):

* The environment opens lazily, on first use, in the process that uses it, and is
  re-opened when ``os.getpid()`` changes.
* py-lmdb refuses to open a path the process already has open, and that record is
  inherited by ``fork``. So every open ``LMDBStore`` closes its environment right before
  any ``os.fork`` (``os.register_at_fork``); parent and child each re-open on next use.
  Do not fork while another thread of the process is inside a read of the same store.
* A ``buffers=True`` view is valid only inside its transaction: records are decoded (or
  copied) before the transaction ends.
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
  (:mod:`cache_store.stores.isolated`). A commit that fails with ENOSPC/EIO raises
  :class:`StoreFull` ("no space left on <path>") so a writer can stop early.
* Removal (``spcache rm``/``prune``): a third named database, ``removed``, holds a
  tombstone (fingerprint -> removal time) written in the same transaction that drops
  the index; the records are then deleted in chunks. A read that misses a record or
  index of a tombstoned fingerprint raises :class:`FingerprintRemoved`; a write of its
  records or index is refused inside the write transaction (so a run that was under
  way cannot bring it back), until :meth:`LMDBStore.revive` lifts the tombstone for
  work requested after the removal.
* Compaction (:func:`compact_environment`): a compacting copy into ``records.compact/``,
  then ``renameat2(RENAME_EXCHANGE)`` swaps the two directories in one step, so a path
  lookup always finds a whole environment (data and lock file of one generation).
  Writers hold a shared ``flock`` on ``<cache>/records.lock`` for each write
  transaction; compaction holds it exclusively, so writers wait (up to
  ``COMPACT_WAIT_S``, then :class:`StoreBusy`). Processes notice a swap by the
  directory's inode: a writer before each write, a reader at most once a second; they
  open the new generation and close the old handle a minute later (reads in flight
  finish on the old file, which stays readable while mapped).

Why one module: LMDB's process rules (one environment per path and process, fork, the
compaction swap, the reader table) bind every operation on the environment; split, each
part would need them all.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import json
import logging
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from cache_store.errors import (
    CacheDamaged,
    CacheNotFound,
    FingerprintRemoved,
    RecordNotFound,
    SpcacheError,
    StoreBusy,
    StoreFull,
)
from cache_store import usage
from cache_store.keys import FINGERPRINT_HEX_CHARS, is_fingerprint, validate_fingerprint
from cache_store.process_local import ProcessLocal, park
from cache_store.format.decode import Record
from cache_store.format.descriptor import Descriptor
from cache_store.format.index import DatasetIndex, decode_index, encode_index
from cache_store.stores.base import RecordDecoder, Store, count_code_digest

__all__ = [
    "LMDBStore",
    "DEFAULT_MAP_SIZE",
    "DEFAULT_MAX_READERS",
    "RECORDS_DIR",
    "has_cache",
    "compact_environment",
    "WRITE_LOCK_FILENAME",
    "COMPACT_DIR",
]

log = logging.getLogger(__name__)

#: Subdirectory of a cache directory holding the LMDB environment.
RECORDS_DIR = "records"
DEFAULT_MAP_SIZE = 1 << 30
DEFAULT_MAX_READERS = 1024
_RECORDS_DB = b"records"
_INDEXES_DB = b"indexes"
_REMOVED_DB = b"removed"
_DESCRIPTORS_DB = b"descriptors"
_DB_NAMES = (_RECORDS_DB, _INDEXES_DB, _REMOVED_DB, _DESCRIPTORS_DB)
#: Writers hold a shared flock on ``<cache>/<this>`` per write; compaction an exclusive one.
WRITE_LOCK_FILENAME = "records.lock"
#: Where compaction builds the new generation (and leaves the old one, briefly).
COMPACT_DIR = RECORDS_DIR + ".compact"
#: A writer waits this long for a compaction to finish before raising StoreBusy.
COMPACT_WAIT_S = 600.0
#: A reader looks for a swapped (compacted) environment at most this often.
SWAP_CHECK_INTERVAL_S = 1.0
#: A handle on a swapped-out generation is closed this long after the swap was seen.
RETIRED_GRACE_S = 60.0
_RENAME_EXCHANGE = 2
#: "last written" (spcache ls, prune) is recorded at most once a minute per fingerprint
_note_written = usage.Throttle(usage.note_written, 60.0)
_KEYS_PER_TXN = 4096
#: A long-lived writer frees reader slots left by dead processes at most this often.
READER_CHECK_INTERVAL_S = 5.0
_MAX_KEY_BYTES = 511  # LMDB's default build

_SPACE_ERRORS = (os.strerror(errno.ENOSPC), os.strerror(errno.EIO), os.strerror(errno.EDQUOT))


def _out_of_space(exc: BaseException) -> bool:
    """py-lmdb reports a failed commit's errno only in its message."""
    return isinstance(exc, lmdb.DiskError) or any(m in str(exc) for m in _SPACE_ERRORS)


def _lookup(txn: Any, db: Any, key: str) -> Any:
    """The value under ``key`` or None; keys LMDB cannot hold (empty, over 511 bytes,
    not encodable) are simply absent."""
    if db is None or not isinstance(key, str):
        return None
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError:
        return None
    if not 0 < len(raw) <= _MAX_KEY_BYTES:
        return None
    return txn.get(raw, db=db)


def _removed_at(txn: Any, dbs: dict[bytes, Any], fingerprint: str) -> float | None:
    """When ``fingerprint`` was removed (its tombstone), or None."""
    db = dbs.get(_REMOVED_DB)
    if db is None or not is_fingerprint(fingerprint):
        return None
    value = txn.get(fingerprint.encode("ascii"), db=db)
    if value is None:
        return None
    try:
        return float(json.loads(bytes(value))["removed_at"])
    except (ValueError, KeyError, TypeError):
        return 0.0  # an unreadable tombstone still means "removed"


class _SharedEnv:
    """One LMDB environment per path per process, shared by every store on that path.

    py-lmdb allows a path to be open once per process, so two stores on one cache (a
    reader and a writer in the same process, say) must share the handle. A writable
    store upgrades a read-only handle by re-opening it.
    """

    def __init__(self) -> None:
        self.env: Any = None
        self.dbs: dict[bytes, Any] = {}
        self.pid: int | None = None
        self.writable = False
        self.reader_checked = time.monotonic()  # a writer checks when it opens
        self.users: weakref.WeakSet[LMDBStore] = weakref.WeakSet()
        self.dir_ino: int | None = None  # inode of the records directory opened
        self.swap_checked = time.monotonic()
        self.retired: list[tuple[Any, float]] = []  # swapped-out handles, closed later

    def close(self) -> None:
        env, self.env, self.dbs = self.env, None, {}
        retired, self.retired = self.retired, []
        for old in [env, *(e for e, _ in retired)]:
            if old is None:
                continue
            if self.pid == os.getpid():
                old.close()
            else:  # inherited through a fork that bypassed the hook: never close it here
                park(old)

    def close_retired(self, now: float) -> None:
        keep = []
        for env, since in self.retired:
            if now - since >= RETIRED_GRACE_S and self.pid == os.getpid():
                env.close()
            else:
                keep.append((env, since))
        self.retired = keep


#: This process's open environments by real path (one per path: py-lmdb refuses a second).
shared_envs: dict[str, _SharedEnv] = {}
_shared_lock = threading.Lock()
# Environments inherited through a fork that bypassed the at-fork hook are parked
# (cache_store.process_local): closing them in the child would touch the parent's locks.


def _close_all_before_fork() -> None:
    for shared in list(shared_envs.values()):
        if shared.env is not None and shared.pid == os.getpid():
            shared.close()


os.register_at_fork(before=_close_all_before_fork)


def _dir_inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except (FileNotFoundError, NotADirectoryError):
        return None


def has_cache(path: str | os.PathLike[str]) -> bool:
    """True once a writer has created the cache's LMDB environment under ``path``."""
    return (Path(path) / RECORDS_DIR).exists()


class LMDBStore(Store):
    """Records in an LMDB environment under ``<path>/records/``.

    Args:
        path: the cache directory.
        readonly: readers open read-only (``put_*`` raise ``ReadOnlyStoreError``); a
            read-only store on a directory without a cache raises ``CacheNotFound``.
        map_size: initial map size in bytes for a writer (grows by itself).
        max_map_size: growth stops here (``None``: no bound but the disk).
        max_readers: size of the reader table (see the module doc).
        lock: use LMDB's lock file (readers of a read-only medium may pass False, if
            nothing writes meanwhile).
        readahead: OS read-ahead on the map; off by default (random access over data
            larger than memory).
        sync: fsync on commit (writers).

    Environment options are those of the first store that opens the path in a process.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        readonly: bool = True,
        map_size: int = DEFAULT_MAP_SIZE,
        max_map_size: int | None = None,
        max_readers: int = DEFAULT_MAX_READERS,
        lock: bool = True,
        readahead: bool = False,
        sync: bool = True,
    ) -> None:
        super().__init__(path, readonly=readonly)
        if map_size <= 0 or (max_map_size is not None and max_map_size < map_size):
            raise ValueError(f"map_size {map_size} / max_map_size {max_map_size} out of range")
        self.path = Path(path)
        self.map_size = int(map_size)
        self.max_map_size = max_map_size
        self.max_readers = int(max_readers)
        self.lock = lock
        self.readahead = readahead
        self.sync = sync
        # a partial, not a bound method: no reference cycle keeps a dropped store alive
        self._resolved = ProcessLocal(functools.partial(os.path.realpath, self.path / RECORDS_DIR))
        # (pid, shared env) this store joined: every read's first check, without the
        # realpath lookup and WeakSet membership test of the full one
        self._joined: tuple[int, _SharedEnv] | None = None
        self._removed_retry = 0.0

    # -- environment lifecycle ---------------------------------------------------------
    @property
    def env_path(self) -> Path:
        return self.path / RECORDS_DIR

    @property
    def _env_key(self) -> str:
        # resolved once per process: realpath costs several syscalls, reads are hot
        return self._resolved.get()

    def open(self) -> LMDBStore:
        """Open now (otherwise the first access does). Returns self."""
        self._environment()
        return self

    def close(self) -> None:
        """Stop using the environment; it closes when no store of this process uses it."""
        self._joined = None
        with _shared_lock:
            shared = shared_envs.get(self._env_key)
            if shared is None:
                return
            shared.users.discard(self)
            if not shared.users:
                shared.close()

    def _environment(self) -> tuple[Any, dict[bytes, Any]]:
        joined = self._joined
        if joined is not None:
            pid, shared = joined
            if (
                shared.env is not None
                and pid == os.getpid()
                and shared.pid == pid
                and (self.readonly or shared.writable)
            ):
                if time.monotonic() - shared.swap_checked < SWAP_CHECK_INTERVAL_S:
                    return shared.env, shared.dbs
                return self._adopt_swap(shared)
        known = shared_envs.get(self._env_key)
        if (
            known is not None
            and known.env is not None
            and known.pid == os.getpid()
            and (self.readonly or known.writable)
            and self in known.users
        ):
            self._joined = (os.getpid(), known)
            return known.env, known.dbs
        with _shared_lock:
            shared = shared_envs.setdefault(self._env_key, _SharedEnv())
            if shared.env is not None and (
                shared.pid != os.getpid() or (not self.readonly and not shared.writable)
            ):
                shared.close()  # forked without the hook, or a writer upgrading a reader
            if shared.env is None:
                shared.env, shared.dbs, shared.dir_ino = self._open_env()
                shared.pid, shared.writable = os.getpid(), not self.readonly
                shared.swap_checked = time.monotonic()
            shared.users.add(self)
            self._joined = (os.getpid(), shared)
            return shared.env, shared.dbs

    def _adopt_swap(self, shared: _SharedEnv) -> tuple[Any, dict[bytes, Any]]:
        """The environment of the current generation: when compaction swapped the
        records directory since this process opened it, open the new one (the old handle
        is closed ``RETIRED_GRACE_S`` later, so reads in flight finish on it)."""
        with _shared_lock:
            now = time.monotonic()
            shared.swap_checked = now
            if shared.env is not None and shared.pid == os.getpid():
                shared.close_retired(now)
                current = _dir_inode(self.env_path)
                if current is not None and current != shared.dir_ino:
                    log.info(
                        "%s: the environment was compacted (swapped); opening the new generation",
                        self.env_path,
                    )
                    env, dbs, ino = self._open_env(readonly=not shared.writable)
                    shared.retired.append((shared.env, now))
                    shared.env, shared.dbs, shared.dir_ino = env, dbs, ino
            if shared.env is None:  # closed meanwhile (a fork): the slow path re-opens
                self._joined = None
                return self._environment()
            return shared.env, shared.dbs

    def _open_env(self, readonly: bool | None = None) -> tuple[Any, dict[bytes, Any], int | None]:
        """Open the environment; returns it, its databases and the records directory's
        inode. Retried when compaction swaps the directory during the open (LMDB opens
        the lock file and the data file by path, one after the other)."""
        for _ in range(10):
            before = _dir_inode(self.env_path)
            env, dbs = self._open_env_once(self.readonly if readonly is None else readonly)
            after = _dir_inode(self.env_path)
            if before == after:
                return env, dbs, after
            env.close()
        raise StoreBusy(f"{self.env_path}: the environment keeps being swapped while opening")

    def _open_env_once(self, readonly: bool) -> tuple[Any, dict[bytes, Any]]:
        options: dict[str, Any] = dict(
            subdir=True,
            max_dbs=4,
            max_readers=self.max_readers,
            lock=self.lock,
            readahead=self.readahead,
        )
        env = None
        try:
            if readonly:
                if not (self.env_path / "data.mdb").is_file():
                    reason = (
                        "not a directory"
                        if self.path.exists() and not self.path.is_dir()
                        else f"no cache here ({RECORDS_DIR}/data.mdb missing)"
                    )
                    raise CacheNotFound(self.path, reason)
                env = lmdb.open(str(self.env_path), readonly=True, create=False, **options)
                dbs: dict[bytes, Any] = {}
                for name in _DB_NAMES:
                    try:
                        dbs[name] = env.open_db(name, create=False)
                    except lmdb.NotFoundError:
                        dbs[name] = None  # no writer has created it yet: empty
                return env, dbs
            self.env_path.mkdir(parents=True, exist_ok=True)
            env = lmdb.open(
                str(self.env_path),
                map_size=self.map_size,
                sync=self.sync,
                metasync=self.sync,
                **options,
            )
            stale = env.reader_check()
            if stale:
                log.warning(
                    "%s: freed %d stale LMDB reader slot(s) left by dead processes",
                    self.env_path,
                    stale,
                )
            dbs = {name: env.open_db(name, create=True) for name in _DB_NAMES}
            return env, dbs
        except lmdb.Error as exc:
            if env is not None:
                env.close()
            if isinstance(exc, lmdb.ReadersFullError):  # opening reads, so it needs a slot
                raise self._readers_full() from exc
            if isinstance(
                exc,
                (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError, lmdb.BadTxnError),
            ):
                raise self._damaged(exc) from exc
            raise SpcacheError(f"{self.env_path}: cannot open LMDB environment: {exc}") from exc

    # -- transactions ----------------------------------------------------------------
    def _begin(self) -> tuple[Any, dict[bytes, Any]]:
        """A read transaction (``buffers=True``) and the databases; the caller ends it."""
        env, dbs = self._environment()
        if None in dbs.values() and self._retry_missing_dbs(dbs):
            # read-only handle opened before a writer created them
            for name, db in dbs.items():
                if db is None:
                    try:
                        dbs[name] = env.open_db(name, create=False)
                    except lmdb.NotFoundError:
                        pass
                    except lmdb.Error as exc:
                        raise self._damaged(exc) from exc
        try:
            txn = self._begin_read(env)
        except lmdb.ReadersFullError as exc:
            # Slots of processes killed inside a read are only freed by a reader check;
            # run it here too, so readers recover without waiting for a writer.
            freed = env.reader_check()
            if not freed:
                raise self._readers_full(env) from exc
            log.warning(
                "%s: freed %d stale LMDB reader slot(s) left by dead processes",
                self.env_path,
                freed,
            )
            try:
                txn = self._begin_read(env)
            except lmdb.ReadersFullError as again:
                raise self._readers_full(env) from again
        except lmdb.Error as exc:
            raise self._damaged(exc) from exc
        return txn, dbs

    def _retry_missing_dbs(self, dbs: dict[bytes, Any]) -> bool:
        # records and indexes at once; the tombstones (absent in caches made before they
        # existed, needed only on a miss) at most once a second, not on every read
        if dbs.get(_RECORDS_DB) is None or dbs.get(_INDEXES_DB) is None:
            return True
        now = time.monotonic()
        if now - self._removed_retry < 1.0:
            return False
        self._removed_retry = now
        return True

    def _key_text(self, raw: Any) -> str:
        """A stored key as text; keys are checked UTF-8 when written, so one that is not
        comes from a damaged page."""
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise self._damaged(
                ValueError(f"a stored key is not UTF-8: {bytes(raw)[:80]!r}")
            ) from None

    def _damaged(self, exc: BaseException) -> CacheDamaged:
        log.error(
            "%s: LMDB read failed, the cache is damaged: %s: %s",
            self.env_path,
            type(exc).__name__,
            exc,
        )
        return CacheDamaged(self.path, f"LMDB {type(exc).__name__}: {exc}")

    @contextmanager
    def _read(self) -> Iterator[tuple[Any, dict[bytes, Any]]]:
        txn, dbs = self._begin()
        try:
            with txn:
                yield txn, dbs
        except lmdb.Error as exc:
            raise self._damaged(exc) from exc

    @staticmethod
    def _begin_read(env: Any) -> Any:
        try:
            return env.begin(buffers=True)
        except lmdb.MapResizedError:  # another process grew the map: adopt its size
            env.set_mapsize(0)
            return env.begin(buffers=True)

    def _readers_full(self, env: Any = None) -> StoreBusy:
        size = self.max_readers if env is None else env.info()["max_readers"]
        return StoreBusy(
            f"{self.env_path}: LMDB reader table full (max_readers={size}; the "
            f"table is as large as the largest max_readers asked for since its lock file "
            f"was created); open every store with a larger max_readers (workers x threads "
            f"x processes)"
        )

    def _write(self, action: Any, size_hint: int = 0) -> Any:
        """Run ``action(txn, dbs)`` in one write transaction, growing the map when full;
        under a shared lock that compaction takes exclusively (see the module doc)."""
        self.check_writable()
        with self._write_lock():
            env, dbs = self._environment()
            joined = self._joined
            if (
                joined is not None
            ):  # a compaction may have swapped the file: never write the old one
                env, dbs = self._adopt_swap(joined[1])
            return self._write_txn(env, dbs, action, size_hint)

    @contextmanager
    def _write_lock(self) -> Iterator[None]:
        """A shared ``flock`` on ``<cache>/records.lock`` for one write; waits up to
        ``COMPACT_WAIT_S`` while a compaction holds it exclusively."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / WRITE_LOCK_FILENAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            deadline, told = time.monotonic() + COMPACT_WAIT_S, False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise StoreBusy(
                            f"{self.path}: the cache is being compacted (spcache "
                            f"compact); writes waited {COMPACT_WAIT_S:.0f}s"
                        ) from None
                    if not told:
                        log.info("%s: the cache is being compacted; writes wait for it", self.path)
                        told = True
                    time.sleep(0.1)
            yield
        finally:
            os.close(fd)  # drops the lock

    def _write_txn(self, env: Any, dbs: dict[bytes, Any], action: Any, size_hint: int) -> Any:
        self._free_stale_readers(env)
        while True:
            try:
                with env.begin(write=True) as txn:
                    return action(txn, dbs)
            except lmdb.MapFullError:
                self._grow(env, size_hint)
            except lmdb.MapResizedError:
                env.set_mapsize(0)
            except lmdb.Error as exc:
                if _out_of_space(exc):
                    log.error("%s: write failed: %s", self.env_path, exc)
                    raise StoreFull(self.env_path, str(exc)) from exc
                raise

    def _free_stale_readers(self, env: Any) -> None:
        # A reader killed inside a transaction pins its snapshot: until its slot is
        # freed, no page freed after it can be reused and the file only grows. The
        # check at open is not enough for a writer that runs for days.
        shared = shared_envs.get(self._env_key)
        now = time.monotonic()
        if shared is None or now - shared.reader_checked < READER_CHECK_INTERVAL_S:
            return
        shared.reader_checked = now
        stale = env.reader_check()
        if stale:
            log.warning(
                "%s: freed %d stale LMDB reader slot(s) left by dead processes",
                self.env_path,
                stale,
            )

    def _grow(self, env: Any, size_hint: int) -> None:
        current = env.info()["map_size"]
        wanted = max(2 * current, current + 2 * size_hint)
        if self.max_map_size is not None:
            if current >= self.max_map_size:
                raise StoreFull(
                    self.env_path, f"LMDB map full at max_map_size {self.max_map_size} bytes"
                )
            wanted = min(wanted, self.max_map_size)
        log.info("%s: growing LMDB map from %d to %d bytes", self.env_path, current, wanted)
        env.set_mapsize(wanted)

    # -- primitives ------------------------------------------------------------------
    def _missing(self, txn: Any, dbs: dict[bytes, Any], key: str) -> RecordNotFound:
        """The error for a record not found: :class:`FingerprintRemoved` when its
        fingerprint carries a tombstone (looked up only on a miss)."""
        removed = _removed_at(txn, dbs, key[:FINGERPRINT_HEX_CHARS])
        if removed is not None:
            return FingerprintRemoved(key[:FINGERPRINT_HEX_CHARS], self.location, removed, key=key)
        return RecordNotFound(key, self.location)

    def get(self, key: str) -> bytes:
        with self._read() as (txn, dbs):
            value = _lookup(txn, dbs[_RECORDS_DB], key)
            if value is None:
                raise self._missing(txn, dbs, key)
            return bytes(value)

    @contextmanager
    def read_view(self, key: str) -> Iterator[Any]:
        # The map's own bytes, valid inside one read transaction (held for the block).
        with self._read() as (txn, dbs):
            value = _lookup(txn, dbs[_RECORDS_DB], key)
            if value is None:
                raise self._missing(txn, dbs, key)
            yield value

    def supply(
        self, keys: list[str], fields: list[str] | None, decoder: RecordDecoder
    ) -> list[Record]:
        # The map's own bytes, decoded inside one read transaction: one copy per tensor.
        # The hot path of every read: no context-manager generator around the transaction.
        txn, dbs = self._begin()
        try:
            db = dbs[_RECORDS_DB]
            values = []
            for key in keys:
                value = _lookup(txn, db, key)
                if value is None:
                    raise self._missing(txn, dbs, key)
                values.append(value)
            return decoder.values(values)
        except lmdb.Error as exc:
            raise self._damaged(exc) from exc
        finally:
            txn.abort()  # read-only: ends it and releases the reader slot

    def value_size(self, key: str) -> int:
        # the value's length in the map view: no copy
        txn, dbs = self._begin()
        try:
            value = _lookup(txn, dbs[_RECORDS_DB], key)
            if value is None:
                raise self._missing(txn, dbs, key)
            return len(value)
        except lmdb.Error as exc:
            raise self._damaged(exc) from exc
        finally:
            txn.abort()

    def generation(self) -> int:
        """The id of the environment's last committed write transaction (read from its
        meta page, no transaction): any write that landed, in any process, changes it.
        Tagged with the records directory's inode, so a compacted environment swapped in
        (whose counter starts again) counts as a change too."""
        env, _ = self._environment()
        try:
            txnid = int(env.info()["last_txnid"])
        except lmdb.Error as exc:
            raise self._damaged(exc) from exc
        joined = self._joined
        inode = joined[1].dir_ino if joined is not None else None
        return txnid if inode is None else (inode << 48) | (txnid & ((1 << 48) - 1))

    def put_many(
        self, items: Iterable[tuple[str, bytes]], descriptors: Iterable[Descriptor] = ()
    ) -> int:
        self.check_writable()
        batch = self.check_items(items, descriptors)
        # in key order: a record whose key follows every stored one is appended
        # (MDB_APPEND), which fills pages; any other insert splits a full page in two
        checked = sorted(((k.encode(), v) for k, v in batch.records), key=lambda kv: kv[0])
        named = [
            (f"{d.fingerprint}/{d.digest}".encode(), d.text.encode()) for d in batch.descriptors
        ]

        def put(txn: Any, dbs: dict[bytes, Any]) -> int:
            self._refuse_removed(
                txn, dbs, {key[:FINGERPRINT_HEX_CHARS].decode() for key, _ in checked}
            )
            for key, text in named:  # with the first records that name it (or over a
                if txn.get(key, db=dbs[_DESCRIPTORS_DB]) != text:  # damaged copy)
                    txn.put(key, text, db=dbs[_DESCRIPTORS_DB])
            records = dbs[_RECORDS_DB]
            cursor = txn.cursor(db=records)
            last = bytes(cursor.key()) if cursor.last() else b""
            for key, value in checked:
                if key > last:
                    txn.put(key, value, db=records, append=True)
                    last = key
                else:
                    txn.put(key, value, db=records)
            return len(checked)

        count = self._write(put, sum(len(v) for _, v in checked))
        for fingerprint in {key[:FINGERPRINT_HEX_CHARS].decode() for key, _ in checked}:
            _note_written(self.path, fingerprint)
        return count

    def load_descriptor(self, fingerprint: str, digest: str) -> bytes | None:
        # Asked once per descriptor and process. A handle opened before any writer made
        # the database looks for it again now, not a second later: the record naming it
        # was read already. Absent from a removed fingerprint: FingerprintRemoved.
        for again in (False, True):
            with self._read() as (txn, dbs):
                db = dbs.get(_DESCRIPTORS_DB)
                if db is not None or again:
                    value = _lookup(txn, db, f"{fingerprint}/{digest}")
                    if value is not None:
                        return bytes(value)
                    removed = _removed_at(txn, dbs, fingerprint)
                    if removed is not None:
                        raise FingerprintRemoved(fingerprint, self.location, removed)
                    return None
            self._removed_retry = 0.0  # the next transaction opens databases made since
        return None

    def has(self, key: str) -> bool:
        with self._read() as (txn, dbs):
            db = dbs[_RECORDS_DB]
            return _lookup(txn, db, key) is not None

    def keys(self, prefix: str = "") -> Iterator[str]:
        # Chunks of keys per short transaction: a consumer that stops early, or works
        # slowly between keys, never pins an old snapshot (or a reader slot).
        try:
            raw_prefix = prefix.encode("utf-8")
        except UnicodeEncodeError:
            return  # no key can start with it
        start = raw_prefix
        skip_start = False
        while True:
            chunk = self._key_chunk(start, raw_prefix, skip_start)
            yield from (self._key_text(k) for k in chunk)
            if len(chunk) < _KEYS_PER_TXN:
                return
            start, skip_start = chunk[-1], True

    def _key_chunk(self, start: bytes, prefix: bytes, skip_start: bool) -> list[bytes]:
        with self._read() as (txn, dbs):
            if dbs[_RECORDS_DB] is None:
                return []
            cursor = txn.cursor(db=dbs[_RECORDS_DB])
            found: list[bytes] = []
            if not cursor.set_range(start):
                return found
            for key in cursor.iternext(keys=True, values=False):
                key = bytes(key)
                if not key.startswith(prefix):
                    break
                if skip_start and key == start:
                    continue
                found.append(key)
                if len(found) == _KEYS_PER_TXN:
                    break
            return found

    def put_index(self, index: DatasetIndex) -> None:
        value = encode_index(index)

        def put(txn: Any, dbs: dict[bytes, Any]) -> None:
            self._refuse_removed(txn, dbs, {index.fingerprint})
            txn.put(index.fingerprint.encode(), value, db=dbs[_INDEXES_DB])

        self._write(put, len(value))

    def _refuse_removed(self, txn: Any, dbs: dict[bytes, Any], fingerprints: set[str]) -> None:
        for fingerprint in fingerprints:
            removed = _removed_at(txn, dbs, fingerprint)
            if removed is not None:
                raise FingerprintRemoved(fingerprint, self.location, removed)

    def get_index(self, fingerprint: str) -> DatasetIndex:
        validate_fingerprint(fingerprint)
        with self._read() as (txn, dbs):
            db = dbs[_INDEXES_DB]
            value = None if db is None else txn.get(fingerprint.encode(), db=db)
            if value is not None:
                return decode_index(value, key=f"index:{fingerprint}")
            removed = _removed_at(txn, dbs, fingerprint)
        if removed is not None:
            raise FingerprintRemoved(fingerprint, self.location, removed)
        raise self.index_missing(fingerprint)

    def fingerprints(self) -> list[str]:
        with self._read() as (txn, dbs):
            if dbs[_INDEXES_DB] is None:
                return []
            cursor = txn.cursor(db=dbs[_INDEXES_DB])
            return [self._key_text(k) for k in cursor.iternext(keys=True, values=False)]

    # -- removal (spcache rm / prune) --------------------------------------------------
    def removals(self) -> dict[str, float]:
        """Tombstoned fingerprints -> when they were removed."""
        with self._read() as (txn, dbs):
            db = dbs.get(_REMOVED_DB)
            if db is None:
                return {}
            out = {}
            for key in txn.cursor(db=db).iternext(keys=True, values=False):
                fingerprint = self._key_text(key)
                out[fingerprint] = _removed_at(txn, dbs, fingerprint) or 0.0
            return out

    def removed_at(self, fingerprint: str) -> float | None:
        """When ``fingerprint`` was removed, or None if it carries no tombstone."""
        with self._read() as (txn, dbs):
            return _removed_at(txn, dbs, fingerprint)

    def mark_removed(self, fingerprint: str, when: float | None = None) -> float:
        """Step one of removing a fingerprint, in one transaction: write its tombstone
        (an existing one keeps its time) and drop its index. From then on its readers get
        :class:`FingerprintRemoved` and its writes are refused. Returns the removal time."""
        validate_fingerprint(fingerprint)
        stamp = time.time() if when is None else float(when)

        def mark(txn: Any, dbs: dict[bytes, Any]) -> float:
            earlier = _removed_at(txn, dbs, fingerprint)
            if earlier is None:
                txn.put(
                    fingerprint.encode(),
                    json.dumps({"removed_at": stamp}).encode(),
                    db=dbs[_REMOVED_DB],
                )
            txn.delete(fingerprint.encode(), db=dbs[_INDEXES_DB])
            return stamp if earlier is None else earlier

        return self._write(mark)

    def delete_records(self, fingerprint: str, *, chunk: int = 1024) -> tuple[int, int]:
        """Step two: delete every record of ``fingerprint``, ``chunk`` per transaction
        (each commit is a consistent state; a kill leaves fewer records, never a broken
        one). Returns ``(records, bytes)`` deleted."""
        prefix = validate_fingerprint(fingerprint).encode() + b"/"

        def delete(txn: Any, dbs: dict[bytes, Any]) -> tuple[int, int]:
            cursor = txn.cursor(db=dbs[_RECORDS_DB])
            count = size = 0
            if not cursor.set_range(prefix):
                return 0, 0
            while count < chunk and bytes(cursor.key()).startswith(prefix):
                size += len(cursor.value())
                count += 1
                if not cursor.delete():  # moves to the next item; False at the end
                    break
            return count, size

        def forget_descriptors(txn: Any, dbs: dict[bytes, Any]) -> None:
            left = txn.cursor(db=dbs[_RECORDS_DB])
            if left.set_range(prefix) and bytes(left.key()).startswith(prefix):
                return  # written since (computed again after the removal): still named
            cursor = txn.cursor(db=dbs[_DESCRIPTORS_DB])
            if cursor.set_range(prefix):
                while bytes(cursor.key()).startswith(prefix) and cursor.delete():
                    pass

        total = total_bytes = 0
        while True:
            count, size = self._write(delete)
            total, total_bytes = total + count, total_bytes + size
            if count < chunk:
                self._write(forget_descriptors)  # no record names them any more
                return total, total_bytes

    def record_fingerprints(self) -> list[str]:
        """Fingerprints that have at least one record (indexed or not), sorted: one seek
        per fingerprint, not a walk over every record."""
        found: list[str] = []
        with self._read() as (txn, dbs):
            if dbs[_RECORDS_DB] is None:
                return found
            cursor = txn.cursor(db=dbs[_RECORDS_DB])
            position = cursor.first()
            while position:
                key = bytes(cursor.key())
                head = key[:FINGERPRINT_HEX_CHARS]
                found.append(self._key_text(head))
                position = cursor.set_range(head + b"0")  # "0" sorts right after "/"
        return found

    def fingerprint_size(self, fingerprint: str) -> tuple[int, int]:
        """``(records, bytes)`` stored under ``fingerprint`` (record values' lengths; the
        values themselves are not read)."""
        prefix = validate_fingerprint(fingerprint).encode() + b"/"
        count = size = 0
        with self._read() as (txn, dbs):
            if dbs[_RECORDS_DB] is None:
                return 0, 0
            cursor = txn.cursor(db=dbs[_RECORDS_DB])
            if not cursor.set_range(prefix):
                return 0, 0
            for key, value in cursor:
                if not bytes(key).startswith(prefix):
                    break
                count += 1
                size += len(value)
        return count, size

    def revive(self, fingerprint: str, requested_at: float) -> bool:
        """Lift the tombstone of ``fingerprint`` if it is older than ``requested_at`` (work
        on it asked for after the removal); True when one was lifted."""
        validate_fingerprint(fingerprint)
        if self.readonly:
            return False
        with self._read() as (txn, dbs):
            if _removed_at(txn, dbs, fingerprint) is None:
                return False  # the common case: no write transaction

        def lift(txn: Any, dbs: dict[bytes, Any]) -> bool:
            removed = _removed_at(txn, dbs, fingerprint)
            if removed is None or removed > requested_at:
                return False
            txn.delete(fingerprint.encode(), db=dbs[_REMOVED_DB])
            return True

        lifted = bool(self._write(lift))
        if lifted:
            log.info("%s: fingerprint %s computed again after its removal", self.path, fingerprint)
        return lifted

    # -- conveniences done natively ----------------------------------------------------
    def stats(self) -> dict[str, Any]:
        per_fp: dict[str, dict[str, Any]] = {}
        with self._read() as (txn, dbs):
            if dbs[_RECORDS_DB] is not None:
                for key, value in txn.cursor(db=dbs[_RECORDS_DB]):
                    entry = per_fp.setdefault(
                        self._key_text(key[:FINGERPRINT_HEX_CHARS]), {"records": 0, "bytes": 0}
                    )
                    entry["records"] += 1
                    entry["bytes"] += len(value)
                    count_code_digest(
                        entry, value, bytes(key[:FINGERPRINT_HEX_CHARS]).decode(), self.descriptor
                    )
            env, _ = self._environment()
            info, stat = env.info(), env.stat()
        out = self._finish_stats(per_fp)
        out["lmdb"] = {
            "map_size": info["map_size"],
            "used_bytes": (info["last_pgno"] + 1) * stat["psize"],
            "max_readers": info["max_readers"],
            "readers_in_use": info["num_readers"],
        }
        return out


# --------------------------------------------------------------------------- compaction


def _exchange(a: Path, b: Path) -> None:
    """Swap two directory entries in one step (``renameat2(RENAME_EXCHANGE)``, Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        raise SpcacheError(
            "compaction needs renameat2(RENAME_EXCHANGE) (Linux, glibc >= 2.28); not available here"
        ) from None
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise SpcacheError(
            f"cannot swap {a} and {b}: {os.strerror(err)} (compaction needs a "
            f"file system with renameat2 RENAME_EXCHANGE)"
        )


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def compact_environment(
    cache: str | os.PathLike[str],
    *,
    wait_s: float = 60.0,
    rewrite: Callable[[str, bytes], Any] | None = None,
) -> dict[str, int]:
    """Shrink ``<cache>/records/data.mdb`` to what it holds: LMDB's compacting copy into
    ``<cache>/records.compact/``, then an atomic swap of the two directories.

    With ``rewrite``, the copy is made record by record instead (:func:`_repack`): each
    record is written as ``rewrite(key, value)`` returns it (new bytes with their
    ``descriptor``, written too; None: as it is), every database in key order with
    whole pages (LMDB's own copy keeps each page as full as it was). Adds ``records``
    and ``rewritten`` counts.

    Writers are held off for the copy (an exclusive flock on ``records.lock``; a writer
    in the middle of a transaction is waited for up to ``wait_s``, then
    :class:`StoreBusy`). Readers keep reading the old file until they notice the swap
    (see the module doc). A leftover ``records.compact/`` from a killed compaction is
    removed first. Returns ``{"before": bytes, "after": bytes}`` of ``data.mdb``.
    """
    root = Path(cache)
    live = root / RECORDS_DIR
    if not (live / "data.mdb").is_file():
        raise CacheNotFound(root, f"no cache here ({RECORDS_DIR}/data.mdb missing)")
    fd = os.open(root / WRITE_LOCK_FILENAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StoreBusy(
                        f"{root}: a writer kept the cache busy for {wait_s:.0f}s; "
                        f"compaction not started (try again, or stop the "
                        f"worker)"
                    ) from None
                time.sleep(0.05)
        spare = root / COMPACT_DIR
        if spare.exists():
            log.warning("%s: removing %s left by an unfinished compaction", root, spare)
            shutil.rmtree(spare)
        spare.mkdir()
        before = (live / "data.mdb").stat().st_size
        store = LMDBStore(root, readonly=True)
        counts: dict[str, int] = {}
        try:
            env, _ = store._environment()
            if rewrite is None:
                env.copy(str(spare), compact=True)
            else:
                counts = _repack(env, spare, rewrite)
        except lmdb.Error as exc:
            raise store._damaged(exc) from exc
        finally:
            store.close()
        _fsync_path(spare / "data.mdb")
        _fsync_path(spare)
        _exchange(spare, live)  # the one step: records/ is now the compacted copy
        _fsync_path(root)
        after = (live / "data.mdb").stat().st_size
        shutil.rmtree(spare)  # the old generation; processes still mapping it keep reading it
        log.info("%s: compacted data.mdb from %d to %d bytes", root, before, after)
        return {"before": before, "after": after, **counts}
    finally:
        os.close(fd)


_REPACK_TXN = 8192  # records per write transaction of a repack (bounds its dirty pages)


def _repack(env: Any, target: Path, rewrite: Callable[[str, bytes], Any]) -> dict[str, int]:
    """Copy every database of ``env`` into a new environment at ``target`` in key order
    with MDB_APPEND (pages filled whole), each record as ``rewrite`` returns it."""
    size = max(env.info()["map_size"], 2 * (env.info()["last_pgno"] + 1) * env.stat()["psize"])
    out = lmdb.open(str(target), map_size=size, subdir=True, max_dbs=4, sync=False)
    walked = rewritten = 0
    try:
        with env.begin() as txn:  # writers are held off: this snapshot is the cache
            sources = {name: _open_existing(env, txn, name) for name in _DB_NAMES}
            descriptors = {
                bytes(k): bytes(v)
                for k, v in (
                    txn.cursor(db=sources[_DESCRIPTORS_DB]) if sources[_DESCRIPTORS_DB] else []
                )
            }
            for name in (_INDEXES_DB, _REMOVED_DB):
                if sources[name] is not None:
                    _append_all(
                        out, name, ((bytes(k), bytes(v)) for k, v in txn.cursor(db=sources[name]))
                    )

            def records() -> Iterator[tuple[bytes, bytes]]:
                nonlocal walked, rewritten
                if sources[_RECORDS_DB] is None:
                    return
                for key, value in txn.cursor(db=sources[_RECORDS_DB]):
                    walked += 1
                    new = rewrite(bytes(key).decode("utf-8"), value)
                    if new is None:
                        yield bytes(key), bytes(value)
                        continue
                    d = new.descriptor
                    descriptors[f"{d.fingerprint}/{d.digest}".encode()] = d.text.encode()
                    rewritten += 1
                    yield bytes(key), bytes(new)

            _append_all(out, _RECORDS_DB, records())
            _append_all(out, _DESCRIPTORS_DB, iter(sorted(descriptors.items())))
        out.sync(True)
    finally:
        out.close()
    # as LMDB's own copy leaves it: the data file only (the first opener makes the lock
    # file, with its reader table as large as that store asks for)
    (target / "lock.mdb").unlink(missing_ok=True)
    return {"records": walked, "rewritten": rewritten}


def _open_existing(env: Any, txn: Any, name: bytes) -> Any:
    try:
        return env.open_db(name, txn=txn, create=False)
    except lmdb.NotFoundError:
        return None


def _append_all(out: Any, name: bytes, items: Iterator[tuple[bytes, bytes]]) -> None:
    """Write ``items`` (in key order) into database ``name`` of ``out``, appended."""
    db = out.open_db(name)
    while True:
        with out.begin(write=True) as txn:
            count = 0
            for key, value in items:
                txn.put(key, value, db=db, append=True)
                count += 1
                if count == _REPACK_TXN:
                    break
        if count < _REPACK_TXN:
            return
