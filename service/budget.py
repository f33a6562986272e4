"""Byte budgets of the read routes: per response and per process.

A record's size is read from the store *before* its bytes are copied
(``Store.value_size``; for LMDB the length of the value in a read transaction's map
view: no copy), so that:

* a response (one record, or a batch) larger than ``max_response_bytes`` is refused
  with 413 and the sizes, before any copy (a client can ask for ``?fields=`` subsets or
  fewer ids);
* the bytes held by all responses being built or sent at once stay within
  ``max_read_bytes_in_flight``: a request that would pass it is answered 503 with
  ``Retry-After`` (a burst of large reads waits instead of exhausting memory).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from cache_store.errors import ReadBudgetBusy
from cache_store.stores.base import Store

__all__ = ["ByteBudget", "record_length"]

log = logging.getLogger(__name__)


def record_length(store: Store, key: str) -> int:
    """The stored size of ``key``'s record, before any copy (``Store.value_size``: for
    LMDB the length of the map's value inside a read transaction).

    Raises :class:`RecordNotFound` like ``store.get``.
    """
    return store.value_size(key)


class ByteBudget:
    """Bytes reserved by responses in flight in this process, at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, what: str) -> Callable[[], None]:
        """Reserve ``nbytes``; returns the (idempotent) release. Raises
        :class:`ReadBudgetBusy` when the reservation does not fit now."""
        with self._lock:
            if self.used + nbytes > self.limit and self.used > 0:
                raise ReadBudgetBusy(
                    f"{what}: {nbytes} bytes would pass the service's read "
                    f"budget ({self.used} of {self.limit} bytes in flight); "
                    "retry shortly"
                )
            self.used += nbytes
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self.used -= nbytes

        return release
