"""Where a decoded batch's memory comes from: one storage per batch, pooled or shared.

:func:`cache_store.format.decode.decode_records` (and ``decode_record`` inside a DataLoader
worker) copies every field of a batch into ONE uint8 storage; this module allocates it:
in shared memory inside a DataLoader worker, else from a small per-process pool of
recently freed buffers. Nothing here knows the record format. torch is imported on first
use only, so importing this stays light.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any


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


class BufferPool:
    """The last few batch buffers of this process, handed out again once nothing else
    refers to them.

    A batch of large records is tens of MB: a fresh allocation that size is new pages
    from the OS every time (measured: 3.2 ms to allocate and fill 25 MB, 1.0 ms for 8
    reused 3 MB buffers), which made batched reads of 3 MB records slower than per-sample
    ones. A buffer is reused only when its reference count shows that the pool holds the
    last reference (every tensor of a batch keeps its storage, and the storage the
    array, alive), so memory a caller still sees is never written. Holds at most
    ``keep`` buffers of at most ``largest`` bytes (192 MiB per process at most; larger
    batches are allocated fresh).
    """

    def __init__(self, keep: int = 3, largest: int = 64 << 20) -> None:
        self.keep, self.largest = keep, largest
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
                    self.buffers.append(self.buffers.pop(i))  # most recent last
                    return buf[:size]
            buf = np.empty(size, dtype=np.uint8)  # uninitialised: every byte is written
            self.buffers.append(buf)
            if len(self.buffers) > self.keep:
                del self.buffers[0]
            return buf[:size]


BATCH_BUFFERS = BufferPool()
