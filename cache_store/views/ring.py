"""Batch slots shared by the training process and its forked DataLoader workers.

A worker of ``CachedDataset(views=True)`` packs each batch (Kaolin's layout, every
field's records end to end: :func:`cache_store.views.hop.packed`) into a slot of a
:class:`BatchRing` and sends the slot, not the bytes; the training process takes views
of the slot. The pack, the hop's one copy, then runs in the workers, in parallel, where
before the training process made it for every batch on its one core.

The ring is made by the process that reads the batches (the training process) before it
forks its workers: ``SLOTS`` slots of ``CAPACITY`` bytes in one shared anonymous mapping
(``MAP_NORESERVE``: a page is memory only once written), and a table of each slot's
state, version and writer, written under one process-shared lock:

- *free* -> *claimed* (version + 1, writer = the worker): by a worker, for a slot that is
  free, or claimed by a worker that is gone (its batch never reached the training
  process: an iterator dropped mid-epoch); first those it wrote before, then the lowest,
  so few slots' pages are ever touched, and a worker forked for an epoch maps few;
- *claimed* -> *opened*: by the training process as it unpickles the batch, only if the
  slot still holds that version (else it reads the records itself, as without a ring);
- *opened* -> *free*: by the training process once the last tensor viewing the slot is
  gone (a single aligned store, no lock: a worker reads either state).

So a slot is written only by the one worker that claimed it, and read by the training
process only while it is opened; a batch whose slot was reclaimed, a worker of a worker,
a worker started by ``spawn``/``forkserver`` (no ring there), ``pin_memory``, a batch
larger than a slot, no free slot, or the lock not had within :data:`WAIT_S` (a process
killed while holding it: the ring is then given up, by the training process for good):
the batch crosses as places, packed in the training process. Linux only (as the views
are).
"""

from __future__ import annotations

import logging
import mmap
import multiprocessing
import os
import threading
from typing import Any

from cache_store.processes import pid_alive
from cache_store.views.mapping import map_shared, populate

log = logging.getLogger(__name__)

__all__ = ["CAPACITY", "SLOTS", "BatchRing", "SlotMemory", "ring", "ring_here"]

#: slots in a ring: a DataLoader's batches in flight (workers x ``prefetch_factor``) and
#: those the training loop still holds
SLOTS = 32
#: bytes a slot holds (virtual: pages are memory once written)
CAPACITY = 64 << 20
#: how long a process waits for the ring's lock before it gives the ring up (a process
#: killed while holding it: the lock is held for microseconds otherwise)
WAIT_S = 2.0

_FREE, _CLAIMED, _OPENED = 0, 1, 2
_WORDS = 3  # state, version, writer pid


class BatchRing:
    """``slots`` slots of ``capacity`` bytes shared with the processes forked from the
    one that made it (see the module doc for the rules). Raises ``OSError``."""

    def __init__(self, slots: int | None = None, capacity: int | None = None) -> None:
        self.slots = SLOTS if slots is None else slots
        self.capacity = CAPACITY if capacity is None else capacity
        slots, capacity = self.slots, self.capacity
        self.owner = os.getpid()
        self.addr = map_shared(slots * capacity)
        self._table = mmap.mmap(-1, slots * _WORDS * 8)  # shared, anonymous
        self.words = memoryview(self._table).cast("q")
        # fork's: a semaphore unlinked at once (no resource tracker process); inherited
        self.lock = multiprocessing.get_context("fork").Lock()
        self.disabled = ""
        #: slots whose pages this process has mapped: slot -> bytes (a process after a
        #: fork maps a shared mapping's pages anew: populated in one call on first use)
        self.mapped: tuple[int, dict[int, int]] = (self.owner, {})

    # -- in a worker -----------------------------------------------------------------
    def usable_here(self) -> bool:
        """Whether this process may pack into the ring: a child the ring's owner forked
        (the one that unpickles what it sends)."""
        return not self.disabled and os.getppid() == self.owner

    def claim(self, size: int) -> tuple[int, int] | None:
        """A slot for ``size`` bytes, claimed by this process: ``(slot, version)``, or
        None (none free, too large, or the lock not had in time)."""
        if size > self.capacity or not self.usable_here():
            return None
        if not self.lock.acquire(timeout=WAIT_S):
            self._give_up("its lock was not had in time (a process died holding it?)")
            return None
        words, me = self.words, os.getpid()
        # the slots this process has written first (their pages are mapped here), then
        # the lowest: a worker forked for an epoch maps few slots (2 ms per 10 MB)
        mapped = self._mapped_here()
        order = [*mapped, *(slot for slot in range(self.slots) if slot not in mapped)]
        try:
            for slot in order:
                at = slot * _WORDS
                state, writer = words[at], words[at + 2]
                if state == _FREE or (state == _CLAIMED and writer != me and not pid_alive(writer)):
                    words[at + 1] += 1
                    words[at + 2] = me
                    words[at] = _CLAIMED
                    return slot, words[at + 1]
            return None
        finally:
            self.lock.release()

    def unclaim(self, slot: int, version: int) -> None:
        """Give back a slot this process claimed and will not send (a pack that failed)."""
        at = slot * _WORDS
        if self.lock.acquire(timeout=WAIT_S):
            try:
                if self.words[at] == _CLAIMED and self.words[at + 1] == version:
                    self.words[at] = _FREE
            finally:
                self.lock.release()

    def writable(self, slot: int, size: int) -> Any:
        """A NumPy uint8 view of ``size`` bytes of ``slot`` to pack into (its pages
        mapped in one call the first time this process writes that far into it)."""
        self._populate(slot, size, True)
        return SlotMemory(self, slot, size, held=False).array()

    # -- in the training process -----------------------------------------------------
    def open(self, slot: int, version: int, size: int) -> SlotMemory | None:
        """The batch a worker packed into ``slot`` at ``version``: its memory, held (the
        slot is free again when the memory is gone). None where the slot does not hold
        that version any more, or this is not the ring's owner."""
        if self.disabled or os.getpid() != self.owner:
            return None
        if not 0 <= slot < self.slots or size > self.capacity:
            return None
        if not self.lock.acquire(timeout=WAIT_S):
            self._give_up("its lock was not had in time (a process died holding it?)")
            return None
        at = slot * _WORDS
        try:
            if self.words[at] != _CLAIMED or self.words[at + 1] != version:
                return None
            self.words[at] = _OPENED
        finally:
            self.lock.release()
        self._populate(slot, size, False)
        return SlotMemory(self, slot, size, held=True)

    def states(self) -> list[tuple[int, int, int]]:
        """Each slot's ``(state, version, writer)`` (0 free, 1 claimed, 2 opened)."""
        w = self.words
        return [(w[i * _WORDS], w[i * _WORDS + 1], w[i * _WORDS + 2]) for i in range(self.slots)]

    def _mapped_here(self) -> dict[int, int]:
        """The slots this process has mapped (after a fork: none yet)."""
        pid = os.getpid()
        if self.mapped[0] != pid:
            self.mapped = (pid, {})
        return self.mapped[1]

    def _populate(self, slot: int, size: int, write: bool) -> None:
        done = self._mapped_here()
        if done.get(slot, 0) >= size:
            return
        done[slot] = size
        populate(self.addr + slot * self.capacity, size, write)

    def _give_up(self, why: str) -> None:
        if not self.disabled:
            self.disabled = why
            log.warning("batches cross the DataLoader hop as places from now on: %s", why)


class SlotMemory:
    """``size`` bytes of a slot: :meth:`array` views them. ``held`` (the training process
    reads the slot): the slot is released when the last array (and tensor) viewing them
    is gone."""

    __slots__ = ("__weakref__", "pid", "ring", "size", "slot")

    def __init__(self, ring: BatchRing, slot: int, size: int, held: bool) -> None:
        self.ring, self.slot, self.size = ring, slot, size
        self.pid = os.getpid() if held else -1

    @property
    def __array_interface__(self) -> dict[str, Any]:
        addr = self.ring.addr + self.slot * self.ring.capacity
        return {"shape": (self.size,), "typestr": "|u1", "data": (addr, False), "version": 3}

    def array(self) -> Any:
        import numpy as np

        return np.asarray(self)

    def __del__(self, _getpid: Any = os.getpid) -> None:  # bound now: at exit, os may go
        # a child forked while the training process held the batch inherits this object:
        # only the ring's owner frees the slot
        if self.pid == _getpid():
            self.ring.words[self.slot * _WORDS] = _FREE


_ring: list[BatchRing | None] = [None]
_ring_lock = threading.Lock()
_unmade: list[str] = []


def ring_here(wanted: bool = True) -> BatchRing | None:
    """Make this process's ring if it has none and is ``wanted`` (a training process,
    before it forks its DataLoader's workers: ``CachedDataset(views=True)`` calls this as
    it is made). A DataLoader worker keeps the ring its parent made (what it packs into);
    any other process forked from a ring's maker (a training process its launcher forked)
    makes its own. None where it cannot be made (said once)."""
    from cache_store.format.buffers import in_dataloader_worker

    if not wanted:
        return None
    with _ring_lock:
        found = _ring[0]
        if found is not None and (
            found.owner == os.getpid() or (found.owner == os.getppid() and in_dataloader_worker())
        ):
            return found
        if _unmade:
            return None
        try:
            made = _ring[0] = BatchRing()
        except (OSError, ValueError) as exc:
            _unmade.append(str(exc))
            log.warning("no batch ring (batches are packed in the training process): %s", exc)
            return None
        return made


def _forked() -> None:
    global _ring_lock
    _ring_lock = threading.Lock()  # it may have been held by a thread of the parent


os.register_at_fork(after_in_child=_forked)


def ring() -> BatchRing | None:
    """The ring this process may pack into or read from: its own, or the one its parent
    made before forking it (a DataLoader worker)."""
    return _ring[0]
