"""Where a decoded batch's memory comes from: one storage per batch, pooled or shared.

:func:`cache_store.format.decode.decode_records` (and ``decode_record`` inside a DataLoader
worker) copies every field of a batch into ONE uint8 storage; this module allocates it:
in shared memory inside a DataLoader worker, else from a small per-process pool of
recently freed buffers. Nothing here knows the record format. torch is imported on first
use only, so importing this stays light.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, cast

from cache_store.views.mapping import PrivateMemory

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["BATCH_BUFFERS", "BufferPool", "allocate", "in_dataloader_worker"]


_get_worker_info: Any = None  # torch.utils.data.get_worker_info, found on first use


def in_dataloader_worker() -> bool:
    """True inside a DataLoader worker process (asked on every read: no import here)."""
    global _get_worker_info
    if _get_worker_info is None:
        from torch.utils.data import get_worker_info

        _get_worker_info = get_worker_info
    return _get_worker_info() is not None


def allocate(size: int, worker: bool) -> tuple[torch.Tensor, np.ndarray]:
    """A fresh uint8 tensor of ``size`` bytes on ONE untyped storage, and a NumPy view.

    In a DataLoader worker (``worker``) the storage is created in shared memory (what
    ``default_collate`` does for its output): handing it to the trainer then moves no
    bytes, where a private storage would be copied into shared memory first. Elsewhere
    the memory is NumPy's: its allocator reuses freed blocks, where torch's returns large
    ones to the OS and page-faults them back in on every read (measured: 47 us vs 14 us
    to allocate and fill 160 kB).
    """
    import torch

    if size and worker:
        storage = torch.UntypedStorage._new_shared(size)
        base = torch.empty(0, dtype=torch.uint8).set_(storage)
        return base, base.numpy()
    buf = BATCH_BUFFERS.take(size)
    return torch.from_numpy(buf), buf


#: a new pooled buffer is ``1 + 1/SLACK`` times the batch that asked for it
SLACK = 8


class BufferPool:
    """The last few batch buffers of this process, handed out again once nothing else
    refers to them.

    A batch of large records is tens of MB: a fresh allocation that size is new pages
    from the OS every time (measured: 3.2 ms to allocate and fill 25 MB, 1.0 ms for 8
    reused 3 MB buffers), which made batched reads of 3 MB records slower than per-sample
    ones. A buffer is reused only when its reference count shows that the pool holds the
    last reference (every tensor of a batch keeps its storage, and the storage the
    array, alive), so memory a caller still sees is never written. Holds at most
    ``keep`` buffers of at most ``largest`` bytes, ``budget`` bytes in all (larger
    batches are allocated fresh); past either, an idle buffer is let go first.

    A buffer is :class:`~cache_store.views.mapping.PrivateMemory`, returned to the OS
    when let go: an idle one is not inherited by a forked child (:meth:`before_fork`).
    A buffer is made :data:`SLACK` larger than the batch that asked for it: batches of
    other records differ in size by a few per cent, and one larger than every idle
    buffer took fresh pages (2,500 faults for 10 MB, 6-7 ms on the 2-core VM, against
    1.2 ms to copy the batch into a buffer already used), about once an epoch.

    ``keep`` is 8 because a DataLoader's training process holds up to 4-5 batches at
    once (the one in use, the one before it, those of its two workers that arrived
    out of turn); at 3, a batch in 2 at each epoch's start took fresh pages.
    """

    def __init__(self, keep: int = 8, largest: int = 64 << 20, budget: int = 192 << 20) -> None:
        self.keep, self.largest, self.budget = keep, largest, budget
        self.buffers: list[np.ndarray] = []
        self.lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        import numpy as np

        if size > self.largest:
            return np.empty(size, dtype=np.uint8)
        with self.lock:
            for i in range(len(self.buffers)):
                buf = self.buffers[i]
                # 3 = the list, ``buf`` and getrefcount's argument
                if size <= buf.size <= 2 * size and sys.getrefcount(buf) == 3:
                    try:  # in use from now on: inherited by a fork, whoever forks
                        _memory(buf).inherit(True)
                    except OSError:
                        continue  # (no memory for the split mapping) a fresh one instead
                    self.buffers.append(self.buffers.pop(i))  # most recent last
                    return buf[:size]
            # the caller writes every byte; the slack lets the next batches, of other
            # records and so a few % larger or smaller, reuse it
            buf = PrivateMemory(size + size // SLACK).array()
            self.buffers.append(buf)
            while len(self.buffers) > self.keep or (
                len(self.buffers) > 1 and sum(b.size for b in self.buffers) > self.budget
            ):
                # 2 = the list's and getrefcount's argument
                idle = [
                    j for j in range(len(self.buffers) - 1) if sys.getrefcount(self.buffers[j]) == 2
                ]
                del self.buffers[idle[0] if idle else 0]
            return buf[:size]

    def before_fork(self) -> None:
        """Before ``fork`` (this pool's lock held until the fork is done): a buffer
        nothing refers to but the pool is not inherited by the child (it could never be
        reached there), so the parent's next batch in it pays no copy-on-write fault per
        page; one a caller still holds is inherited as any memory. The mark lasts while
        the buffer is idle: :meth:`take` lifts it before handing the buffer out (a fork
        that runs no Python hook, in C, then inherits it too). Measured on the 2-core
        VM: the first three batches of 10 MB after each fork of the DataLoader's
        workers took 9-12 ms (2,500 page faults each) against 2-2.7 ms."""
        self.lock.acquire()
        for buf in self.buffers:
            try:  # 3 = the list's, ``buf`` and getrefcount's argument
                _memory(buf).inherit(sys.getrefcount(buf) != 3)
            except OSError as exc:  # it stays as it was: inherited, as any memory is
                log.warning("a batch buffer stays inherited by forked children: %s", exc)

    def after_fork_in_parent(self) -> None:
        self.lock.release()

    def after_fork_in_child(self) -> None:
        """In the child: the buffers it did not inherit are forgotten (their pages are
        not there), and the lock is new (the parent's was held for the fork)."""
        self.lock = threading.Lock()
        self.buffers = [buf for buf in self.buffers if _memory(buf).inherited]


def _memory(buf: np.ndarray) -> PrivateMemory:
    """The memory a pooled buffer views (its base)."""
    return cast(PrivateMemory, buf.base)


BATCH_BUFFERS = BufferPool()
os.register_at_fork(
    before=BATCH_BUFFERS.before_fork,
    after_in_parent=BATCH_BUFFERS.after_fork_in_parent,
    after_in_child=BATCH_BUFFERS.after_fork_in_child,
)
