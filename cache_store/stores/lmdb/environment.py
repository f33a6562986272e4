"""The LMDB environments of this process: one per path, shared, re-opened after a fork
or a compaction swap, with the transactions every LMDB operation runs in.

An :class:`EnvironmentHandle` is one store's way to the environment of its cache (the
store owns one; nothing is opened until first use). Every handle of one path in one
process shares one :class:`_SharedEnv` (py-lmdb opens a path once per process); the
registry closes them all before any ``os.fork``. The handle's :meth:`~EnvironmentHandle.
read` and :meth:`~EnvironmentHandle.write` are the only ways in: reads turn any
``lmdb.Error`` into :class:`CacheDamaged`, writes hold the shared write lock that
compaction takes exclusively, grow the map when full and raise :class:`StoreFull` for
a full disk. The rules themselves are in :mod:`cache_store.stores.lmdb`'s doc.

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

from cache_store.errors import CacheDamaged, CacheNotFound, SpcacheError, StoreBusy, StoreFull
from cache_store.process_local import ProcessLocal, park
from cache_store.stores.lmdb.leases import Leases

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
    "RETIRED_GRACE_S",
    "SWAP_CHECK_INTERVAL_S",
    "WRITE_LOCK_FILENAME",
    "EnvironmentHandle",
    "has_cache",
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
DB_NAMES = (RECORDS_DB, INDEXES_DB, REMOVED_DB, DESCRIPTORS_DB)
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
#: A long-lived writer frees reader slots left by dead processes at most this often.
READER_CHECK_INTERVAL_S = 5.0

_SPACE_ERRORS = (os.strerror(errno.ENOSPC), os.strerror(errno.EIO), os.strerror(errno.EDQUOT))

Dbs = dict[bytes, Any]


def _out_of_space(exc: BaseException) -> bool:
    """py-lmdb reports a failed commit's errno only in its message."""
    return isinstance(exc, lmdb.DiskError) or any(m in str(exc) for m in _SPACE_ERRORS)


class _SharedEnv:
    """One LMDB environment per path per process, shared by every store on that path.

    py-lmdb allows a path to be open once per process, so two stores on one cache (a
    reader and a writer in the same process, say) must share the handle. A writable
    store upgrades a read-only handle by re-opening it.
    """

    def __init__(self) -> None:
        self.env: Any = None
        self.dbs: Dbs = {}
        self.pid: int | None = None
        self.writable = False
        self.reader_checked = time.monotonic()  # a writer checks when it opens
        self.users: weakref.WeakSet[EnvironmentHandle] = weakref.WeakSet()
        self.dir_ino: int | None = None  # inode of the records directory opened
        self.swap_checked = time.monotonic()
        # swapped-out handles and their read leases, closed later
        self.retired: list[tuple[Any, float, Leases | None]] = []
        #: read leases pinning the views of this process (made on the first view)
        self.leases: Leases | None = None

    def view_leases(self, env_path: Path) -> Leases:
        """The read leases of the open environment (see :mod:`.leases`)."""
        if self.leases is None:
            self.leases = Leases(str(env_path), os.getpid())
        return self.leases

    def close(self) -> None:
        env, self.env, self.dbs = self.env, None, {}
        leases, self.leases = self.leases, None
        retired, self.retired = self.retired, []
        for old, old_leases in [(env, leases), *((e, v) for e, _, v in retired)]:
            if old is None:
                continue
            if self.pid == os.getpid():
                if old_leases is not None:  # live views copied before their pins end
                    old_leases.close()
                old.close()
            else:  # inherited through a fork that bypassed the hook: never close it here
                park(old)

    def close_retired(self, now: float) -> None:
        keep = []
        for env, since, leases in self.retired:
            if now - since >= RETIRED_GRACE_S and self.pid == os.getpid():
                if leases is not None:
                    leases.close()
                env.close()
            else:
                keep.append((env, since, leases))
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

    def generation_inode(self) -> int | None:
        """The inode of the records directory this process opened (None: not open)."""
        joined = self._joined
        return joined[1].dir_ino if joined is not None else None

    def leases(self) -> Leases | None:
        """The read leases of the environment this handle has open, with ``data.mdb``
        open beside it; None when it was swapped meanwhile (the caller copies)."""
        self.environment()  # a swap is adopted here
        joined = self._joined
        if joined is None:
            return None
        shared = joined[1]
        leases = shared.leases
        if leases is not None and leases.data_fd is not None and leases.pid == os.getpid():
            return leases  # every read's path: no lock
        with _shared_lock:
            if shared.env is None:
                return None
            leases = shared.view_leases(self.env_path)
            return leases if leases.open_data(shared.dir_ino) else None

    def environment(self) -> tuple[Any, Dbs]:
        """The open environment and its databases (opened now if need be)."""
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

    def _adopt_swap(self, shared: _SharedEnv) -> tuple[Any, Dbs]:
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
                    shared.retired.append((shared.env, now, shared.leases))
                    shared.env, shared.dbs, shared.dir_ino = env, dbs, ino
                    shared.leases = None
            if shared.env is None:  # closed meanwhile (a fork): the slow path re-opens
                self._joined = None
                return self.environment()
            return shared.env, shared.dbs

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
            stale = env.reader_check()
            if stale:
                log.warning(
                    "%s: freed %d stale LMDB reader slot(s) left by dead processes",
                    self.env_path,
                    stale,
                )
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
            raise SpcacheError(f"{self.env_path}: cannot open LMDB environment: {exc}") from exc

    # -- reading -----------------------------------------------------------------------
    def begin(self) -> tuple[Any, Dbs]:
        """A read transaction (``buffers=True``) and the databases; the caller ends it
        (``txn.abort()``: read-only, it releases the reader slot)."""
        env, dbs = self.environment()
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
            raise self.damaged(exc) from exc
        return txn, dbs

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
        """A read transaction and the databases for the ``with`` block."""
        txn, dbs = self.begin()
        try:
            with txn:
                yield txn, dbs
        except lmdb.Error as exc:
            raise self.damaged(exc) from exc

    @staticmethod
    def _begin_read(env: Any) -> Any:
        try:
            return env.begin(buffers=True)
        except lmdb.MapResizedError:  # another process grew the map: adopt its size
            env.set_mapsize(0)
            return env.begin(buffers=True)

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
        with self._write_lock():
            env, dbs = self.environment()
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

    def _write_txn(self, env: Any, dbs: Dbs, action: Callable[[Any, Dbs], T], size_hint: int) -> T:
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
