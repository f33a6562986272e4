"""The generations of one LMDB environment in this process, and the leases that keep
their memory maps mapped.

A *generation* is one opened records directory: its LMDB environment (a memory map),
databases and directory inode. A compaction swaps in a new directory, so a process may
hold two or more: the ``current`` one and ``retired`` ones. Every read takes a
:class:`MapLease` on the current generation, and the rule is: **no memory a lease uses
is unmapped while it is held**. A retired generation is closed by its last lease
released (at once when it has none); a re-map (``set_mapsize``, after another process
grew the data, or to grow a full map) waits until no lease of the process uses the map,
and new leases wait for the re-map. :mod:`cache_store.stores.lmdb.environment` keeps one
:class:`Generations` per path and process; issue 34 found readers killed by SIGSEGV and
SIGBUS when a fixed timer closed, or a re-map moved, maps still in use.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from cache_store.errors import StoreBusy
from cache_store.process_local import park

__all__ = ["REMAP_WAIT_S", "Dbs", "Generation", "Generations", "MapLease"]

Dbs = dict[bytes, Any]

#: A re-map waits this long for the leases of its process on the map to be released.
REMAP_WAIT_S = 60.0


class Generation:
    """One opened generation of the records directory: its LMDB environment (the memory
    map), databases and directory inode, and how many leases of this process use it."""

    __slots__ = ("closed", "dbs", "dir_ino", "env", "users", "views")

    def __init__(self, env: Any, dbs: Dbs, dir_ino: int | None) -> None:
        self.env, self.dbs, self.dir_ino = env, dbs, dir_ino
        self.users = 0
        self.closed = False
        #: the read leases pinning views of this generation's records
        #: (:mod:`cache_store.stores.lmdb.leases`): their views are copied and their
        #: transactions ended before the environment closes
        self.views: Any = None


class Generations:
    """The generations of one environment in the process that opened them (``pid``):
    ``current`` (None: closed) and ``retired``, each closed by its last lease."""

    def __init__(self) -> None:
        self.current: Generation | None = None
        self.retired: list[Generation] = []
        self.pid: int | None = None
        #: guards the lease counts; notified when a count drops to zero
        self.leases = threading.Condition(threading.Lock())
        self.remapping = False

    def forked(self) -> None:
        """In a child just forked: the lock may have been held by a thread of the parent,
        and the leases counted are the parent's (the maps are parked at next use)."""
        self.leases = threading.Condition(threading.Lock())
        self.remapping = False

    def adopt(self, env: Any, dbs: Dbs, dir_ino: int | None, pid: int) -> None:
        """Make a generation ``pid`` opened current, retiring the one before."""
        with self.leases:
            self.pid = pid
            if self.current is not None:
                self.retired.append(self.current)
            self.current = Generation(env, dbs, dir_ino)
            self._close_unused()

    def close(self, keep_windows: bool = False) -> None:
        """Let go of every generation: those without a lease close now, the others when
        their last lease is released. ``keep_windows``: this process reads on (a fork
        hook's close): its windows of the file stay (``Leases.close``)."""
        with self.leases:
            if self.current is not None:
                self.retired.append(self.current)
            self.current = None
            self._close_unused(keep_windows)

    def in_use(self) -> bool:
        """Whether a lease of this process holds a map of this environment."""
        with self.leases:
            return any(m.users for m in self.retired) or bool(
                self.current is not None and self.current.users
            )

    def take(self) -> Generation | None:
        """A lease on the current generation (None: closed meanwhile; open it again)."""
        with self.leases:
            while self.remapping:
                self.leases.wait()
            current = self.current
            if current is None:
                return None
            current.users += 1
            return current

    def give_back(self, taken: Generation) -> None:
        with self.leases:
            taken.users -= 1
            if not taken.users:
                self._close_unused()
                self.leases.notify_all()

    def remap(self, taken: Generation, size: int, env_path: Path) -> None:
        """``set_mapsize(size)`` on ``taken``, which moves its memory map: only once no
        lease of this process uses it (new leases wait meanwhile); :class:`StoreBusy`
        when one is still held after ``REMAP_WAIT_S`` (by this very thread, say)."""
        with self.leases:
            while self.remapping:
                self.leases.wait()
            self.remapping = True
            try:
                deadline = time.monotonic() + REMAP_WAIT_S
                while taken.users:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise StoreBusy(
                            f"{env_path}: the LMDB map must be re-mapped (to grow it, or "
                            f"another process grew it) but a record view of this process "
                            f"is still held after {REMAP_WAIT_S:.0f}s; release views first"
                        )
                    self.leases.wait(left)
                if not taken.closed:
                    taken.env.set_mapsize(size)
            finally:
                self.remapping = False
                self.leases.notify_all()

    def _close_unused(self, keep_windows: bool = False) -> None:
        # with self.leases held
        keep = []
        inherited = self.pid != os.getpid()  # leases counted here are the parent's
        for old in self.retired:
            if old.users and not inherited:
                keep.append(old)
                continue
            old.closed = True
            if inherited:  # through a fork that bypassed the hook: never close it here
                park(old.env)
            else:
                if old.views is not None:
                    old.views.close(keep_windows)
                old.env.close()
        self.retired = keep


class MapLease:
    """A read transaction on one generation of the map, and the promise that its memory
    stays mapped until :meth:`release`: buffers read in ``txn`` (``buffers=True`` views
    into the map) are valid until then, whatever happens meanwhile in this process or
    others: a compaction swapping in a new file (the old one is unmapped by the last
    lease released), another process growing the data (this process re-maps only when
    no lease uses the map), a store closing. Release every lease, and soon: while held it
    pins its snapshot (the file cannot reuse pages freed after it) and, after a swap, the
    old file's disk space. ``release`` is idempotent; ``with lease:`` releases at the end.
    ``view`` is the record :meth:`LMDBStore.lease <cache_store.stores.lmdb.store.
    LMDBStore.lease>` looked up in ``txn`` (None for a plain transaction).
    """

    __slots__ = ("_map", "_maps", "dbs", "txn", "view")

    def __init__(self, txn: Any, dbs: Dbs, maps: Generations, taken: Generation) -> None:
        self.txn = txn
        self.dbs = dbs
        self.view: Any = None
        self._maps: Generations | None = maps
        self._map = taken

    def release(self) -> None:
        """End the transaction and let go of the map (unmapped now if it was retired
        and this was its last lease)."""
        maps, self._maps = self._maps, None
        if maps is None:
            return
        self.view = None
        try:
            self.txn.abort()  # read-only: ends it and releases the reader slot
        finally:
            maps.give_back(self._map)

    def __enter__(self) -> MapLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
