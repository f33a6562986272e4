"""Compaction: give the disk back (LMDB never shrinks its file by itself).

:func:`compact_environment` makes LMDB's compacting copy of ``<cache>/records/`` into
``<cache>/records.compact/``, then swaps the two directories in one step
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
from pathlib import Path

import lmdb

from cache_store.disk import flock_within, fsync_path
from cache_store.errors import CacheNotFound, SpcacheError, StoreBusy, StoreFull
from cache_store.stores.lmdb.environment import (
    COMPACT_DIR,
    RECORDS_DIR,
    WRITE_LOCK_FILENAME,
    EnvironmentHandle,
    out_of_space,
)

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


def compact_environment(cache: str | os.PathLike[str], *, wait_s: float = 60.0) -> dict[str, int]:
    """Shrink ``<cache>/records/data.mdb`` to what it holds: LMDB's compacting copy into
    ``<cache>/records.compact/``, then an atomic swap of the two directories.

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
        try:
            needed = _check_room(root, live_env)
            spare.mkdir()
            try:
                env, _ = live_env.environment()
                env.copy(str(spare), compact=True)
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
        return {"before": before, "after": after}
    finally:
        os.close(fd)
