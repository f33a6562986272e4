"""Read leases: the LMDB read transactions that keep the pages under live views as
they were verified.

LMDB never overwrites a page that a reader's snapshot may reach: a page freed by a
commit is reused only once every reader's snapshot is newer than that commit. So one
read transaction begun *before* a record is looked up pins that record's pages for as
long as it stays open, whatever later snapshot found it. A :class:`ReadLease` is such a
transaction, counted by the views that rely on it: every record viewed through
:meth:`LMDBStore.view_records <cache_store.stores.lmdb.store.LMDBStore.view_records>` is
looked up in a fresh transaction begun after the lease, mapped by this process itself
(:mod:`cache_store.views.mapping`), and the lease ends when its last view is released.
A lease takes new views for at most :data:`LEASE_S` seconds, so a reader that keeps a
few views for long pins one old snapshot, not every snapshot since (the file grows only
by what is freed while a view it pins lives).

Whenever the generation a lease belongs to closes (a store's close, the fork hook, a
compaction's retired generation once its last map lease is released:
:mod:`cache_store.stores.lmdb.maps`), :meth:`Leases.close` first swaps every live view's
pages for a private copy of their bytes (``MappedRange.detach``), then ends the
transactions; and before any ``fork`` every lease of the process is ended so
(:func:`end_all_before_fork`). A view never shows a byte that a writer put in a reused
page, and a forked child inherits copies, not pins it does not hold. These are not map
leases: a view does not keep LMDB's map mapped (it has its own mapping), so a re-map
never waits for views.

A view that never leaves the reader (``transient``: the hop's pack in the training
process copies it, then drops it) is a slice of this process's long-lived read-only
windows of ``data.mdb`` (:func:`cache_store.views.mapping.windows_of`), kept across
reads and the fork hook's close while the file stays the one at the path (a
compaction's swap retires them, and so does the close of the last store of the process
on the path): an epoch after the first faults no page in again. The lease pins
such a view's pages as any other's.

Where a view's bytes lie in ``data.mdb`` is read from this process's memory map
(``/proc/self/maps``: py-lmdb reports no map address), once per map and re-read when
LMDB maps the file anew (a grown map).

Where a record lies is also remembered (:data:`KNOWN`): the places found, by snapshot
(LMDB transaction id) of each ``data.mdb``, in a table shared with the processes forked
from this one (a DataLoader's workers find what the training process found, and it what
they found). A lookup transaction of that same snapshot of that same file finds each
such record where it was (a snapshot's pages change only by commits after it, which
give newer snapshots a new id), so the record is viewed there without asking
LMDB: py-lmdb touches every page of a value it returns (its "preload"), which costs a
fault per 64 KiB in a process whose map is new (220 us for a 2.4 MB record: each
DataLoader worker forked for an epoch, and the training process after each fork's
re-open). The pinning lease is begun before the lookup transaction either way, so
what pins a view is unchanged.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import xxhash

from cache_store.format.decode import Record
from cache_store.format.descriptor import DescriptorLookup
from cache_store.views.mapping import MappedRange, Windows, map_range, retire_windows, windows_of
from cache_store.views.records import Place, view_record

if TYPE_CHECKING:
    pass

__all__ = [
    "KNOWN",
    "LEASE_S",
    "KnownPlaces",
    "Leases",
    "ReadLease",
    "end_all_before_fork",
    "forget_windows",
]

log = logging.getLogger(__name__)

#: A lease takes new views for at most this long; later views begin a new lease.
LEASE_S = 1.0


class ReadLease:
    """One pinning read transaction and the views that rely on it."""

    __slots__ = ("ended", "owner", "ranges", "started", "txn", "views")

    def __init__(self, txn: Any, owner: Leases) -> None:
        self.txn = txn
        self.views = 0
        self.ranges: weakref.WeakSet[MappedRange] = weakref.WeakSet()
        self.started = time.monotonic()
        self.ended = False
        self.owner = owner

    def hold(self, mapped: MappedRange) -> None:
        with self.owner.lock:
            self.views += 1
            self.ranges.add(mapped)

    def release(self) -> None:
        """A view of this lease is gone (its mapping was unmapped)."""
        owner = self.owner
        with owner.lock:
            self.views -= 1
            if self.views <= 0:
                owner.end(self, detach=False)


class Leases:
    """The read leases of one open environment of this process (see the module doc).

    ``data_fd`` is this process's descriptor of the environment's ``data.mdb``, opened
    once it is known to be the file the environment has open; views are mapped from it.
    """

    def __init__(self, env_path: str, pid: int, dbs: Any) -> None:
        self.env_path = env_path
        self.pid = pid
        self.dbs = dbs  # the generation's databases (a lookup's tell which it is on)
        self.lock = threading.RLock()
        self.current: ReadLease | None = None
        self.live: set[ReadLease] = set()
        self.data_fd: int | None = None
        self.data_id: tuple[int, int] | None = None
        #: data.mdb's device, inode and change time when opened here: what KNOWN's
        #: places are kept under (see KnownPlaces on why not the inode alone)
        self.incarnation: tuple[int, int, int] | None = None
        self.windows: Windows | None = None  # this process's windows of data.mdb
        self.maps: list[tuple[int, int, int]] = []  # (start, end, file offset) of data.mdb
        _all.add(self)

    def open_data(self, dir_ino: int | None) -> bool:
        """Open ``data.mdb`` of the generation whose records directory has inode
        ``dir_ino`` (the one the environment opened); False when it was swapped since."""
        if self.data_fd is not None:
            return True
        try:
            if os.stat(self.env_path).st_ino != dir_ino:
                return False
            fd = os.open(os.path.join(self.env_path, "data.mdb"), os.O_RDONLY | os.O_CLOEXEC)
            if os.stat(self.env_path).st_ino != dir_ino:
                os.close(fd)
                return False
        except OSError:
            return False
        st = os.fstat(fd)
        self.data_fd, self.data_id = fd, (st.st_dev, st.st_ino)
        self.incarnation = (st.st_dev, st.st_ino, st.st_ctime_ns)
        try:
            self.windows = windows_of(self.data_path, fd)
        except OSError as exc:  # no descriptor left: views of their own mappings only
            log.warning("%s: no windows of data.mdb: %s", self.env_path, exc)
        return True

    @property
    def data_path(self) -> str:
        return os.path.join(self.env_path, "data.mdb")

    def lease(self, begin: Any) -> ReadLease:
        """The lease new views join: the current one while it is young, else a new one
        (``begin()`` makes its read transaction), reserved for the caller until
        :meth:`settle` (so no other thread ends it meanwhile). Call before the lookup
        transaction."""
        with self.lock:
            lease = self.current
            if lease is None or lease.ended or time.monotonic() - lease.started > LEASE_S:
                lease = self.current = ReadLease(begin(), self)
                self.live.add(lease)
            lease.views += 1  # the caller's reservation
            return lease

    def settle(self, lease: ReadLease) -> None:
        """The caller's reservation of ``lease`` is over: ended if no view relies on it."""
        with self.lock:
            lease.views -= 1
            if lease.views <= 0:
                self.end(lease, detach=False)

    def view(
        self,
        lease: ReadLease,
        key: str,
        snapshot: int,
        find: Callable[[], Any],
        fields: list[str] | None,
        verify: str,
        checked: tuple[Place, str] | None,
        lookup: DescriptorLookup,
        transient: bool = False,
        direct: bool = False,
    ) -> Record | None:
        """The record of ``key`` in the lookup transaction ``snapshot`` (its id), begun
        after ``lease``, as views of this process's own mapping of its pages, held by
        ``lease``; None where no view can be made (the caller copies). Where it lies is
        :data:`KNOWN` for that snapshot, or else asked of LMDB (``find()``: the value in
        LMDB's map, or raises why it is missing) and remembered. ``transient``: the
        caller never hands the views on (they are slices of read-only windows).
        ``direct``: the caller copies the tensors before the lookup transaction ends,
        so a record asked of LMDB now is viewed in LMDB's map, whose pages py-lmdb just
        touched (``view_record``'s ``over_same_bytes``), not in a window whose
        pages would be faulted in for the copy. See
        :func:`cache_store.views.records.view_record` for the rest."""
        import numpy as np

        if self.data_id is None or self.incarnation is None:
            return None
        value = None
        known = KNOWN.get(self.incarnation, snapshot, key)
        if known is None:
            value = find()
            length = len(value)
            addr = np.frombuffer(value, np.uint8).ctypes.data if length else None
            offset = None if addr is None else self.file_offset(addr)
            if offset is None:
                return None
            known = (offset, length)
            KNOWN.put(self.incarnation, snapshot, key, offset, length)
        if self.data_fd is None:
            return None
        offset, length = known
        windows = self.windows
        found = windows.range(offset, length, lease.release) if transient and windows else None
        mapped, at = found or map_range(self.data_fd, offset, length, lease.release)
        lease.hold(mapped)
        return view_record(
            mapped,
            at,
            length,
            key=key,
            fields=fields,
            lookup=lookup,
            place=(*self.data_id, offset, length),
            verify=verify,
            checked=checked,
            same_bytes=value,  # looked up now: the bytes hashed (py-lmdb touched them all)
            over_same_bytes=direct,
        )

    def file_offset(self, addr: int) -> int | None:
        """The offset in ``data.mdb`` of the byte at ``addr`` of LMDB's map; None when no
        mapping of that file holds it."""
        for start, end, offset in self.maps:
            if start <= addr < end:
                return addr - start + offset
        self.maps = self._read_maps()
        for start, end, offset in self.maps:
            if start <= addr < end:
                return addr - start + offset
        return None

    def _still_at_path(self) -> bool:
        try:
            st = os.stat(self.data_path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.data_id

    def _read_maps(self) -> list[tuple[int, int, int]]:
        if self.data_id is None:
            return []
        dev, ino = self.data_id
        found = []
        with open("/proc/self/maps", "rb") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) < 5 or int(parts[4]) != ino:
                    continue
                major, minor = (int(x, 16) for x in parts[3].split(b":"))
                if os.makedev(major, minor) != dev:
                    continue
                start, end = (int(x, 16) for x in parts[0].split(b"-"))
                found.append((start, end, int(parts[2], 16)))
        return found

    def end(self, lease: ReadLease, *, detach: bool) -> None:
        """End ``lease`` (its views copied first when ``detach``)."""
        with self.lock:
            if lease.ended:
                return
            if detach:
                for mapped in list(lease.ranges):
                    mapped.detach()
            lease.ended = True
            self.live.discard(lease)
            if self.current is lease:
                self.current = None
            txn, lease.txn = lease.txn, None
        if txn is not None and self.pid == os.getpid():
            txn.abort()

    def end_all(self) -> None:
        """End every lease, their live views copied first (before a fork)."""
        if self.pid != os.getpid():
            return
        with self.lock:
            for lease in list(self.live):
                self.end(lease, detach=True)

    def close(self, keep_windows: bool = False) -> None:
        """Before the environment closes: detach every live view, end every lease, close
        ``data.mdb``, retire this process's windows of it unless ``keep_windows`` (the
        fork hook's close: the parent reads on) and it is still the file at the path.
        In a process that inherited these leases, nothing is touched."""
        if self.pid != os.getpid():
            return
        if self.data_id is not None and not (keep_windows and self._still_at_path()):
            retire_windows(self.data_path, self.data_id)
        with self.lock:
            for lease in list(self.live):
                try:
                    self.end(lease, detach=True)
                except OSError as exc:  # pragma: no cover - mremap refused: no memory
                    log.error("%s: cannot detach a view: %s", self.env_path, exc)
                    raise
            fd, self.data_fd = self.data_fd, None
            self.maps = []
        if fd is not None:
            os.close(fd)


class KnownPlaces:
    """Where records lie (offset, length) by file, snapshot (transaction id) and key, in
    one table shared with every process forked from the one that made this object (an
    anonymous shared mapping made at import, before any DataLoader forks): the training
    process finds where its workers found each record of an epoch, a persistent worker
    where its sibling did, and each epoch's new workers what the run found before. One
    table, not a dict per process as well: at a million records a dict of keys would
    cost each process a few hundred MB; an entry here is 48 bytes, shared.

    A file is its device, inode and change time as a process found them when it opened
    it (``Leases.incarnation``), not its inode alone: a compaction's new ``data.mdb``
    starts its transaction ids again at 1 and may get the inode of one removed before,
    so (inode, id) can name two files' snapshots over a long run; their change times
    differ. (Processes that opened the file across a write key its places apart: they
    are then looked up once more, never misread.)

    An entry is six 64-bit words: two independent hashes of (file, key), the snapshot,
    offset and length, and a check hash of those five, written last; an entry read torn
    by a concurrent write, or overwritten by another key, fails its check or its hashes
    and counts as unknown (looked up). ``slots`` entries (a power of two); one whose few
    probed slots are all taken overwrites the first, so past about ``slots`` records a
    run looks some up again.
    """

    PROBES = 4
    WORDS = 6

    def __init__(self, slots: int = 1 << 20) -> None:
        self.slots = slots
        self._map = mmap.mmap(-1, slots * self.WORDS * 8)  # shared, pages on use
        self.shared = memoryview(self._map).cast("Q")

    def get(self, file_id: tuple[int, ...], snapshot: int, key: str) -> tuple[int, int] | None:
        tags = _tags(file_id, key)
        for slot in self._probe(tags[0]):
            entry = tuple(self.shared[slot : slot + self.WORDS])
            if entry[:3] == (*tags, snapshot) and entry[5] == _check(entry[:5]):
                return entry[3], entry[4]
        return None

    def put(
        self, file_id: tuple[int, ...], snapshot: int, key: str, offset: int, length: int
    ) -> None:
        tags = _tags(file_id, key)
        slots = self._probe(tags[0])
        free = [s for s in slots if self.shared[s] == tags[0]] or [
            s for s in slots if self.shared[s] == 0
        ]
        slot = free[0] if free else slots[0]
        entry = (*tags, snapshot, offset, length)
        self.shared[slot + 5] = 0  # invalid while it is written
        for i, word in enumerate(entry):
            self.shared[slot + i] = word
        self.shared[slot + 5] = _check(entry)

    def _probe(self, tag: int) -> list[int]:
        mask = self.slots - 1
        return [((tag + i) & mask) * self.WORDS for i in range(self.PROBES)]

    def clear(self) -> None:
        """Forget every place, in every process sharing the table (looked up again)."""
        try:  # the shared pages freed (read as zeros), not written
            self._map.madvise(mmap.MADV_REMOVE)
        except (AttributeError, OSError):
            self._map[:] = bytes(len(self._map))


def _tags(file_id: tuple[int, ...], key: str) -> tuple[int, int]:
    """Two independent 64-bit hashes of a key of a file (never 0: a free slot)."""
    text = f"{':'.join(map(str, file_id))}:{key}".encode()
    return xxhash.xxh3_64_intdigest(text) | 1, xxhash.xxh3_64_intdigest(text, seed=1) | 1


def _check(words: tuple[int, ...]) -> int:
    return xxhash.xxh3_64_intdigest(struct.pack("5Q", *words)) | 1


#: The known places of this process and those forked from it (the same file's same
#: snapshot is the same there).
KNOWN = KnownPlaces()


#: every Leases of this process (the fork hook ends theirs)
_all: weakref.WeakSet[Leases] = weakref.WeakSet()


def forget_windows(env_path: str) -> None:
    """This process's windows of ``env_path``'s ``data.mdb`` are retired: it has no
    store on that environment any more (``Leases.close`` keeps them across a fork)."""
    retire_windows(os.path.join(env_path, "data.mdb"))


def end_all_before_fork() -> None:
    """Before ``fork``: end every read lease of this process, its live views copied
    first. A child never holds the parent's reader slots, so the views it inherits must
    not rely on them; and the parent starts new leases on its next read."""
    for leases in list(_all):
        leases.end_all()


os.register_at_fork(before=end_all_before_fork)
