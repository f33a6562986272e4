"""The LMDB environments of this process: one per path, shared, re-opened after a fork
or a compaction swap, with the transactions every LMDB operation runs in.

An :class:`EnvironmentHandle` is one store's way to the environment of its cache (the
store owns one; nothing is opened until first use). Every handle of one path in one
process shares one :class:`_SharedEnv` (py-lmdb opens a path once per process); the
registry closes them all before any ``os.fork``. The handle's :meth:`~EnvironmentHandle.
lease` (and :meth:`~EnvironmentHandle.read` built on it) and :meth:`~EnvironmentHandle.
write` are the only ways in: reads turn any ``lmdb.Error`` into :class:`CacheDamaged`
and hold a :class:`~cache_store.stores.lmdb.maps.MapLease` that keeps their map mapped
until released (:mod:`cache_store.stores.lmdb.maps`); writes hold
the shared write lock that compaction takes exclusively, grow the map when full (once
no lease uses it) and raise :class:`StoreFull` for a full disk. The rules themselves
are in :mod:`cache_store.stores.lmdb`'s doc.

Why one module: the registry, the fork hook, the swap adoption and the transactions
keep one invariant together (one open environment per path and process, of the current
generation, never used across a fork); split, each part would reach into the others'
state.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from cache_store.disk import flock_within
from cache_store.errors import CacheDamaged, CacheNotFound, SpcacheError, StoreBusy, StoreFull
from cache_store.process_local import ProcessLocal
from cache_store.stores.lmdb.leases import Leases, ReadLease, forget_windows
from cache_store.stores.lmdb.maps import Dbs, Generation, Generations, MapLease

__all__ = [
    "COMPACT_DIR",
    "COMPACT_WAIT_S",
    "DB_NAMES",
    "DESCRIPTORS_DB",
    "DEFAULT_MAP_SIZE",
    "DEFAULT_MAX_READERS",
    "INDEXES_DB",
    "READER_CHECK_INTERVAL_S",
    "RECORDS_DB",
    "RECORDS_DIR",
    "REMOVED_DB",
    "READER_MAP_BYTES",
    "SUMMARIES_DB",
    "SWAP_CHECK_INTERVAL_S",
    "WRITE_LOCK_FILENAME",
    "EnvironmentHandle",
    "has_cache",
    "out_of_space",
    "shared_envs",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Subdirectory of a cache directory holding the LMDB environment.
RECORDS_DIR = "records"
DEFAULT_MAP_SIZE = 1 << 30
DEFAULT_MAX_READERS = 1024
#: The named databases: records (key -> record), indexes (fingerprint -> dataset
#: index), removed (fingerprint -> tombstone; :mod:`cache_store.stores.lmdb.tombstones`),
#: descriptors (``<fingerprint>/<digest>`` -> the text of a descriptor its format-2
#: records name; :mod:`cache_store.format.descriptor`).
RECORDS_DB = b"records"
INDEXES_DB = b"indexes"
REMOVED_DB = b"removed"
DESCRIPTORS_DB = b"descriptors"
SUMMARIES_DB = b"summaries"
DB_NAMES = (RECORDS_DB, INDEXES_DB, REMOVED_DB, DESCRIPTORS_DB, SUMMARIES_DB)
#: Writers hold a shared flock on ``<cache>/<this>`` per write; compaction an exclusive one.
WRITE_LOCK_FILENAME = "records.lock"
#: Where compaction builds the new generation (and leaves the old one, briefly).
COMPACT_DIR = RECORDS_DIR + ".compact"
#: A writer waits this long for a compaction to finish before raising StoreBusy.
COMPACT_WAIT_S = 600.0
#: A reader looks for a swapped (compacted) environment at most this often.
SWAP_CHECK_INTERVAL_S = 1.0
#: Address space a read-only process maps for an environment: the data can grow this
#: far in other processes without this one re-mapping (which waits for its leases).
READER_MAP_BYTES = 1 << 40
#: A long-lived writer frees reader slots left by dead processes at most this often.
READER_CHECK_INTERVAL_S = 5.0

_SPACE_ERRORS = (os.strerror(errno.ENOSPC), os.strerror(errno.EIO), os.strerror(errno.EDQUOT))


def out_of_space(exc: BaseException) -> bool:
    """Whether an LMDB or OS error means the disk is full (py-lmdb reports a failed
    commit's errno only in its message)."""
    return isinstance(exc, lmdb.DiskError) or any(m in str(exc) for m in _SPACE_ERRORS)


def _open_reserving(env_path: Path, options: dict[str, Any]) -> Any:
    """A read-only environment mapping ``READER_MAP_BYTES`` of address space (not
    memory), so data other processes add never makes this one re-map; where that much
    cannot be mapped (a ``ulimit -v``), what the data needs."""
    try:
        return lmdb.open(
            str(env_path), readonly=True, create=False, map_size=READER_MAP_BYTES, **options
        )
    except lmdb.Error as exc:
        if os.strerror(errno.ENOMEM) not in str(exc) and not isinstance(exc, MemoryError):
            raise
        log.info(
            "%s: cannot reserve %d bytes of address space: %s", env_path, READER_MAP_BYTES, exc
        )
        return lmdb.open(str(env_path), readonly=True, create=False, **options)


class _SharedEnv:
    """One LMDB environment per path per process, shared by every store on that path.

    py-lmdb allows a path to be open once per process, so two stores on one cache (a
    reader and a writer in the same process, say) must share the handle. A writable
    store upgrades a read-only handle by re-opening it. Its generations (the current
    one and those retired by a swap while leases still use them) are ``maps``.
    """

    def __init__(self) -> None:
        self.maps = Generations()
        self.writable = False
        self.reader_checked = time.monotonic()  # a writer checks when it opens
        self.users: weakref.WeakSet[EnvironmentHandle] = weakref.WeakSet()
        self.swap_checked = time.monotonic()

    @property
    def pid(self) -> int | None:
        return self.maps.pid

    @property
    def current(self) -> Generation | None:
        return self.maps.current

    @property
    def env(self) -> Any:
        current = self.maps.current
        return None if current is None else current.env

    @property
    def dir_ino(self) -> int | None:
        current = self.maps.current
        return None if current is None else current.dir_ino

    def close(self, keep_windows: bool = False) -> None:
        self.maps.close(keep_windows)


#: This process's open environments by real path (one per path: py-lmdb refuses a second).
shared_envs: dict[str, _SharedEnv] = {}
_shared_lock = threading.Lock()
# Environments inherited through a fork that bypassed the at-fork hook are parked
# (cache_store.process_local): closing them in the child would touch the parent's locks.


#: write transactions under way in this process, by environment key (any thread)
_writes_under_way: dict[str, int] = {}
_writes_lock = threading.Lock()


@contextmanager
def _writing(key: str) -> Iterator[None]:
    """Count a write under way on the environment ``key`` for the fork hook."""
    with _writes_lock:
        _writes_under_way[key] = _writes_under_way.get(key, 0) + 1
    try:
        yield
    finally:
        with _writes_lock:
            left = _writes_under_way.pop(key) - 1
            if left:
                _writes_under_way[key] = left


def _close_all_before_fork() -> None:
    """Close this process's environments so a forked child can open its own, but never
    one another thread is writing to (it would fail that write): that one stays open
    here, and the child, which inherits py-lmdb's note that it is open, cannot open it."""
    for key, shared in list(shared_envs.items()):
        if shared.env is not None and shared.pid == os.getpid():
            if _writes_under_way.get(key):
                continue
            shared.close(keep_windows=True)


def _after_fork_in_child() -> None:
    global _writes_lock
    _writes_under_way.clear()  # the writing threads stayed in the parent
    _writes_lock = threading.Lock()  # it may have been held there at the fork
    for shared in shared_envs.values():
        shared.maps.forked()


os.register_at_fork(before=_close_all_before_fork, after_in_child=_after_fork_in_child)


def _dir_inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except (FileNotFoundError, NotADirectoryError):
        return None


def has_cache(path: str | os.PathLike[str]) -> bool:
    """True once a writer has created the cache's LMDB environment under ``path``."""
    return (Path(path) / RECORDS_DIR).exists()


class EnvironmentHandle:
    """One store's way to the LMDB environment under ``<path>/records/``.

    Assigns only; the environment opens on first use, in the calling process (see
    :class:`cache_store.stores.lmdb.LMDBStore` for the options).
    """

    def __init__(
        self,
        path: Path,
        *,
        readonly: bool = True,
        map_size: int = DEFAULT_MAP_SIZE,
        max_map_size: int | None = None,
        max_readers: int = DEFAULT_MAX_READERS,
        lock: bool = True,
        readahead: bool = False,
        sync: bool = True,
    ) -> None:
        self.path = path
        self.readonly = readonly
        self.map_size = map_size
        self.max_map_size = max_map_size
        self.max_readers = max_readers
        self.lock = lock
        self.readahead = readahead
        self.sync = sync
        # a partial, not a bound method: no reference cycle keeps a dropped handle alive
        self._resolved = ProcessLocal(functools.partial(os.path.realpath, path / RECORDS_DIR))
        # (pid, shared env) this handle joined: every read's first check, without the
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

    def close(self) -> None:
        """Stop using the environment; it closes when no handle of this process uses it."""
        self._joined = None
        with _shared_lock:
            shared = shared_envs.get(self._env_key)
            if shared is None:
                return
            shared.users.discard(self)
            if not shared.users:
                shared.close()
                forget_windows(self._env_key)  # kept by a fork hook's close: no reader left

    def generation_inode(self) -> int | None:
        """The inode of the records directory this process opened (None: not open)."""
        joined = self._joined
        return joined[1].dir_ino if joined is not None else None

    def environment(self) -> tuple[Any, Dbs]:
        """The open environment and its databases (opened now if need be). Use them
        only for what needs no transaction (``info()``); reads go through :meth:`lease`,
        which keeps the map from being unmapped under them."""
        _, current = self._current()
        return current.env, current.dbs

    def _current(self) -> tuple[_SharedEnv, Generation]:
        """This process's shared environment of the path and its current generation."""
        joined = self._joined
        if joined is not None:
            pid, shared = joined
            current = shared.current
            if (
                current is not None
                and pid == os.getpid()
                and shared.pid == pid
                and (self.readonly or shared.writable)
            ):
                if time.monotonic() - shared.swap_checked < SWAP_CHECK_INTERVAL_S:
                    return shared, current
                return self._adopt_swap(shared)
        known = shared_envs.get(self._env_key)
        if (
            known is not None
            and known.current is not None
            and known.pid == os.getpid()
            and (self.readonly or known.writable)
            and self in known.users
        ):
            self._joined = (os.getpid(), known)
            return known, known.current
        with _shared_lock:
            shared = shared_envs.setdefault(self._env_key, _SharedEnv())
            if shared.current is not None and shared.pid != os.getpid():
                shared.close()  # forked without the hook
            elif shared.current is not None and not self.readonly and not shared.writable:
                if shared.maps.in_use():  # py-lmdb would refuse to open the same files again
                    raise StoreBusy(
                        f"{self.env_path}: cannot open it for writing while a record "
                        f"view of this process holds it open read-only; release the view"
                    )
                shared.close()  # a writer upgrading a reader
            if shared.current is None:
                env, dbs, ino = self._open_env()
                shared.writable = not self.readonly
                shared.maps.adopt(env, dbs, ino, os.getpid())
                shared.swap_checked = time.monotonic()
            shared.users.add(self)
            self._joined = (os.getpid(), shared)
            assert shared.current is not None
            return shared, shared.current

    def _adopt_swap(self, shared: _SharedEnv) -> tuple[_SharedEnv, Generation]:
        """The current generation: when compaction swapped the records directory since
        this process opened it, open the new one; the old one is unmapped when the last
        lease on it is released (at once when there is none)."""
        with _shared_lock:
            shared.swap_checked = time.monotonic()
            if shared.current is not None and shared.pid == os.getpid():
                current = _dir_inode(self.env_path)
                if current is not None and current != shared.dir_ino:
                    log.info(
                        "%s: the environment was compacted (swapped); opening the new generation",
                        self.env_path,
                    )
                    shared.maps.adopt(*self._open_env(readonly=not shared.writable), os.getpid())
            latest = shared.current
        if latest is None:  # closed meanwhile (a fork): the slow path re-opens
            self._joined = None
            return self._current()
        return shared, latest

    def _open_env(self, readonly: bool | None = None) -> tuple[Any, Dbs, int | None]:
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

    def _open_env_once(self, readonly: bool) -> tuple[Any, Dbs]:
        options: dict[str, Any] = dict(
            subdir=True,
            max_dbs=len(DB_NAMES),
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
                env = _open_reserving(self.env_path, options)
                dbs: Dbs = {}
                for name in DB_NAMES:
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
            self._reader_check(env)
            dbs = {name: env.open_db(name, create=True) for name in DB_NAMES}
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
                raise self.damaged(exc) from exc
            if "already open in this process" in str(exc):  # see _close_all_before_fork
                raise SpcacheError(
                    f"{self.env_path}: cannot open the cache in this process: it was forked "
                    f"while another thread of its parent was writing to it, and LMDB "
                    f"allows one open per process (open it in a process started with "
                    f"spawn or forkserver, or fork when no write is under way)"
                ) from exc
            raise SpcacheError(f"{self.env_path}: cannot open LMDB environment: {exc}") from exc

    # -- reading -----------------------------------------------------------------------
    def view_leases(self) -> tuple[Leases, ReadLease] | None:
        """The view leases of the current generation (``data.mdb`` open beside it) and
        the read lease new views join, begun now (before the caller's lookup); None when
        no view can be pinned now (closed or swapped meanwhile, a re-map due): the
        caller reads copies. See :mod:`cache_store.stores.lmdb.leases`."""
        shared, current = self._current()
        leases = current.views
        if leases is None or leases.data_fd is None or leases.pid != os.getpid():
            with shared.maps.leases:
                if current.closed:
                    return None
                if current.views is None:
                    current.views = Leases(self._env_key, os.getpid(), current.dbs)
                leases = current.views
            if not leases.open_data(current.dir_ino):
                return None
        try:
            pin = leases.lease(current.env.begin)
        except lmdb.Error:  # the map must be re-mapped first: a lookup lease does that
            return None
        return leases, pin

    def lease(self) -> MapLease:
        """A read transaction (``buffers=True``) on the current generation, whose map
        stays mapped until :meth:`MapLease.release` (see :class:`MapLease`)."""
        for _ in range(10):
            shared, _ = self._current()
            taken = shared.maps.take()
            if taken is None:  # closed between the two (a fork): open it again
                continue
            try:
                txn = self._begin_read(taken)
            except lmdb.MapResizedError:
                # another process grew the data past this process's map: adopt its
                # size, once no lease of this process uses the map (a re-map moves it)
                shared.maps.give_back(taken)
                shared.maps.remap(taken, 0, self.env_path)
                continue
            except BaseException:
                shared.maps.give_back(taken)
                raise
            return MapLease(txn, taken.dbs, shared.maps, taken)
        raise StoreBusy(f"{self.env_path}: the environment keeps closing under this read")

    def _begin_read(self, taken: Generation) -> Any:
        """A read transaction on ``taken``; ``lmdb.MapResizedError`` passes through."""
        env, dbs = taken.env, taken.dbs
        if None in dbs.values() and self._retry_missing_dbs(dbs):
            # read-only handle opened before a writer created them
            for name, db in dbs.items():
                if db is None:
                    try:
                        dbs[name] = env.open_db(name, create=False)
                    except lmdb.NotFoundError:
                        pass
                    except lmdb.Error as exc:
                        raise self.damaged(exc) from exc
        try:
            try:
                return env.begin(buffers=True)
            except lmdb.ReadersFullError as exc:
                # Slots of processes killed inside a read are only freed by a reader
                # check; run it here too, so readers recover without waiting for a writer.
                freed = env.reader_check()
                if not freed:
                    raise self._readers_full(env) from exc
                log.warning(
                    "%s: freed %d stale LMDB reader slot(s) left by dead processes",
                    self.env_path,
                    freed,
                )
                try:
                    return env.begin(buffers=True)
                except lmdb.ReadersFullError as again:
                    raise self._readers_full(env) from again
        except lmdb.MapResizedError:
            raise
        except lmdb.Error as exc:
            raise self.damaged(exc) from exc

    def _retry_missing_dbs(self, dbs: Dbs) -> bool:
        # records and indexes at once; the tombstones (absent in caches made before they
        # existed, needed only on a miss) at most once a second, not on every read
        if dbs.get(RECORDS_DB) is None or dbs.get(INDEXES_DB) is None:
            return True
        now = time.monotonic()
        if now - self._removed_retry < 1.0:
            return False
        self._removed_retry = now
        return True

    def look_for_new_databases(self) -> None:
        """Make the next transaction open the databases a writer created since this
        handle looked (it looks at most once a second by itself)."""
        self._removed_retry = 0.0

    @contextmanager
    def read(self) -> Iterator[tuple[Any, Dbs]]:
        """A read transaction and the databases for the ``with`` block (a lease
        released at its end)."""
        lease = self.lease()
        try:
            yield lease.txn, lease.dbs
        except lmdb.Error as exc:
            raise self.damaged(exc) from exc
        finally:
            lease.release()

    def key_text(self, raw: Any) -> str:
        """A stored key as text; keys are checked UTF-8 when written, so one that is not
        comes from a damaged page."""
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise self.damaged(
                ValueError(f"a stored key is not UTF-8: {bytes(raw)[:80]!r}")
            ) from None

    def damaged(self, exc: BaseException) -> CacheDamaged:
        """The error for an ``lmdb.Error`` met reading (logged): the cache is damaged."""
        log.error(
            "%s: LMDB read failed, the cache is damaged: %s: %s",
            self.env_path,
            type(exc).__name__,
            exc,
        )
        return CacheDamaged(self.path, f"LMDB {type(exc).__name__}: {exc}")

    def _readers_full(self, env: Any = None) -> StoreBusy:
        size = self.max_readers if env is None else env.info()["max_readers"]
        return StoreBusy(
            f"{self.env_path}: LMDB reader table full (max_readers={size}; the "
            f"table is as large as the largest max_readers asked for since its lock file "
            f"was created); open every store with a larger max_readers (workers x threads "
            f"x processes)"
        )

    # -- writing -----------------------------------------------------------------------
    def write(self, action: Callable[[Any, Dbs], T], size_hint: int = 0) -> T:
        """Run ``action(txn, dbs)`` in one write transaction, growing the map when full;
        under a shared lock that compaction takes exclusively (see the package doc). The
        caller has checked that its store is writable."""
        with _writing(self._env_key), self._write_lock():
            shared, _ = self._current()
            # a compaction may have swapped the file: never write the old one
            shared, current = self._adopt_swap(shared)
            return self._write_txn(shared, current, action, size_hint)

    @contextmanager
    def _write_lock(self) -> Iterator[None]:
        """A shared ``flock`` on ``<cache>/records.lock`` for one write; waits up to
        ``COMPACT_WAIT_S`` while a compaction holds it exclusively."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / WRITE_LOCK_FILENAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:

            def say() -> None:
                log.info("%s: the cache is being compacted; writes wait for it", self.path)

            if not flock_within(fd, fcntl.LOCK_SH, COMPACT_WAIT_S, poll_s=0.1, on_wait=say):
                raise StoreBusy(
                    f"{self.path}: the cache is being compacted (spcache "
                    f"compact); writes waited {COMPACT_WAIT_S:.0f}s"
                )
            yield
        finally:
            os.close(fd)  # drops the lock

    def _write_txn(
        self,
        shared: _SharedEnv,
        current: Generation,
        action: Callable[[Any, Dbs], T],
        size_hint: int,
    ) -> T:
        env = current.env
        self._free_stale_readers(env)
        while True:
            try:
                with env.begin(write=True) as txn:
                    return action(txn, current.dbs)
            except lmdb.MapFullError:
                shared.maps.remap(current, self._grown_size(env, size_hint), self.env_path)
            except lmdb.MapResizedError:
                shared.maps.remap(current, 0, self.env_path)
            except lmdb.Error as exc:
                if out_of_space(exc):
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
        self._reader_check(env)

    def _reader_check(self, env: Any) -> None:
        """Free the reader slots of dead processes, and say so."""
        stale = env.reader_check()
        if stale:
            log.warning(
                "%s: freed %d stale LMDB reader slot(s) left by dead processes",
                self.env_path,
                stale,
            )

    def _grown_size(self, env: Any, size_hint: int) -> int:
        """The map size a full map grows to."""
        current = env.info()["map_size"]
        wanted = max(2 * current, current + 2 * size_hint)
        if self.max_map_size is not None:
            if current >= self.max_map_size:
                raise StoreFull(
                    self.env_path, f"LMDB map full at max_map_size {self.max_map_size} bytes"
                )
            wanted = min(wanted, self.max_map_size)
        log.info("%s: growing LMDB map from %d to %d bytes", self.env_path, current, wanted)
        return wanted
