"""Compaction: give the disk back (LMDB never shrinks its file by itself).

:func:`compact_environment` makes LMDB's compacting copy of ``<cache>/records/`` into
``<cache>/records.compact/`` (or, with ``rewrite``, a copy record by record, every page
filled: :func:`_repack`), then swaps the two directories in one step
(``renameat2(RENAME_EXCHANGE)``), so a path lookup always finds a whole environment (data
and lock file of one generation). Writers are held off by the write lock the
environment's writes share (:mod:`cache_store.stores.lmdb.environment`); open handles
notice the swap by the directory's inode and move to the new generation.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb

from cache_store.disk import flock_within, fsync_path
from cache_store.errors import CacheNotFound, SpcacheError, StoreBusy, StoreFull
from cache_store.stores.lmdb.environment import (
    COMPACT_DIR,
    DB_NAMES,
    DESCRIPTORS_DB,
    INDEXES_DB,
    RECORDS_DB,
    RECORDS_DIR,
    REMOVED_DB,
    WRITE_LOCK_FILENAME,
    EnvironmentHandle,
    out_of_space,
)
from cache_store.stores.lmdb import summaries

__all__ = ["ROOM_MARGIN_BYTES", "compact_environment", "copy_size", "leftover_copy"]

log = logging.getLogger(__name__)

_RENAME_EXCHANGE = 2


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


#: Free space compaction keeps beyond its copy's size (the copy's own metadata, the
#: file system's).
ROOM_MARGIN_BYTES = 1 << 20


def copy_size(handle: EnvironmentHandle) -> int:
    """Bytes LMDB's compacting copy of the environment takes: its two meta pages and
    every page of the main and the named databases (free pages are left out)."""
    with handle.read() as (txn, dbs):
        main = txn.stat()
        pages = 2
        for stat in [main, *(txn.stat(db) for db in dbs.values() if db is not None)]:
            pages += stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        return int(pages * main["psize"])


def _room_text(needed: int, root: Path) -> str:
    free = shutil.disk_usage(root).free
    return (
        f"compaction writes a copy of the records beside them before swapping it in and "
        f"needs about {needed} bytes ({needed / (1 << 20):.1f} MiB) free there, "
        f"{free} bytes ({free / (1 << 20):.1f} MiB) are; free some space (or spcache rm "
        f"fingerprints) and run it again; the cache is unchanged"
    )


def _check_room(root: Path, handle: EnvironmentHandle) -> int:
    """The free space the copy needs; :class:`StoreFull` saying so when it is not there."""
    needed = copy_size(handle) + ROOM_MARGIN_BYTES
    if shutil.disk_usage(root).free < needed:
        raise StoreFull(root, _room_text(needed, root))
    return needed


def leftover_copy(cache: str | os.PathLike[str]) -> int | None:
    """Bytes of a ``records.compact/`` a compaction that did not finish left in ``cache``
    (None: there is none). The next compaction removes it. While one runs, its copy in
    progress is there too."""
    spare = Path(cache) / COMPACT_DIR
    try:
        return sum(f.stat().st_size for f in spare.iterdir() if f.is_file())
    except (FileNotFoundError, NotADirectoryError):
        return None


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
    removed first; then the room for the copy is checked (:class:`StoreFull` saying what
    it needs; a copy that fails anyway is removed). Returns ``{"before": bytes, "after": bytes}`` of ``data.mdb``.
    """
    root = Path(cache)
    live = root / RECORDS_DIR
    if not (live / "data.mdb").is_file():
        raise CacheNotFound(root, f"no cache here ({RECORDS_DIR}/data.mdb missing)")
    fd = os.open(root / WRITE_LOCK_FILENAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if not flock_within(fd, fcntl.LOCK_EX, wait_s):
            raise StoreBusy(
                f"{root}: a writer kept the cache busy for {wait_s:.0f}s; "
                f"compaction not started (try again, or stop the worker)"
            )
        spare = root / COMPACT_DIR
        if spare.exists():
            log.warning("%s: removing %s left by an unfinished compaction", root, spare)
            shutil.rmtree(spare)
        before = (live / "data.mdb").stat().st_size
        live_env = EnvironmentHandle(root, readonly=True)
        counts: dict[str, int] = {}
        try:
            needed = _check_room(root, live_env)
            spare.mkdir()
            try:
                env, _ = live_env.environment()
                if rewrite is None:
                    env.copy(str(spare), compact=True)
                    _count_again(spare)  # the copy's transaction ids start again
                else:
                    counts = _repack(env, spare, rewrite)
                fsync_path(spare / "data.mdb")
                fsync_path(spare)
            except BaseException as exc:
                shutil.rmtree(spare, ignore_errors=True)  # never leave a partial copy
                if isinstance(exc, (lmdb.Error, OSError)) and out_of_space(exc):
                    raise StoreFull(root, _room_text(needed, root)) from exc
                if isinstance(exc, lmdb.Error):
                    raise live_env.damaged(exc) from exc
                raise
        finally:
            live_env.close()
        _exchange(spare, live)  # the one step: records/ is now the compacted copy
        fsync_path(root)
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
    out = lmdb.open(str(target), map_size=size, subdir=True, max_dbs=len(DB_NAMES), sync=False)
    walked = rewritten = 0
    try:
        with env.begin() as txn:  # writers are held off: this snapshot is the cache
            sources = {name: _open_existing(env, txn, name) for name in DB_NAMES}
            descriptors = {
                bytes(k): bytes(v)
                for k, v in (
                    txn.cursor(db=sources[DESCRIPTORS_DB]) if sources[DESCRIPTORS_DB] else []
                )
            }
            for name in (INDEXES_DB, REMOVED_DB):
                if sources[name] is not None:
                    _append_all(
                        out, name, ((bytes(k), bytes(v)) for k, v in txn.cursor(db=sources[name]))
                    )

            def records() -> Iterator[tuple[bytes, bytes]]:
                nonlocal walked, rewritten
                if sources[RECORDS_DB] is None:
                    return
                for key, value in txn.cursor(db=sources[RECORDS_DB]):
                    walked += 1
                    new = rewrite(bytes(key).decode("utf-8"), value)
                    if new is None:
                        yield bytes(key), bytes(value)
                        continue
                    d = new.descriptor
                    descriptors[f"{d.fingerprint}/{d.digest}".encode()] = d.text.encode()
                    rewritten += 1
                    yield bytes(key), bytes(new)

            _append_all(out, RECORDS_DB, records())
            _append_all(out, DESCRIPTORS_DB, iter(sorted(descriptors.items())))
        _count_in(out)  # the rewritten records' sizes, counted again
        out.sync(True)
    finally:
        out.close()
    # as LMDB's own copy leaves it: the data file only (the first opener makes the lock
    # file, with its reader table as large as that store asks for)
    (target / "lock.mdb").unlink(missing_ok=True)
    return {"records": walked, "rewritten": rewritten}


def _count_in(env: Any) -> None:
    """The summaries of ``env`` built in one walk (:func:`summaries.ensure`)."""
    with env.begin(write=True) as txn:
        summaries.ensure(txn, {name: env.open_db(name, txn=txn) for name in DB_NAMES})


def _count_again(target: Path) -> None:
    out = lmdb.open(str(target), map_size=1 << 20, subdir=True, max_dbs=len(DB_NAMES), sync=False)
    try:
        out.set_mapsize(max(out.info()["map_size"], 2 * os.path.getsize(target / "data.mdb")))
        _count_in(out)
        out.sync(True)
    finally:
        out.close()
    (target / "lock.mdb").unlink(missing_ok=True)


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
