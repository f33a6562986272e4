"""Fetching the units a reader will read next, in a thread, in the order asked.

A :class:`Prefetcher` belongs to one process (a store keeps it in a ``ProcessLocal``).
:meth:`Prefetcher.ahead` replaces what is still to fetch with the units given, in their
order (a sampler's window moves on: what it asked before and has not been fetched yet
is no longer next), and one daemon thread fetches them through
:meth:`LocalDisk.prefetch`, which never waits for space: a unit that does not fit now
is left to the reader, which fetches it when it needs it. At most ``budget`` bytes of
one request are fetched ahead, so a window never evicts the units it asked for first.

:func:`process_prefetcher` is how a store holds one (every backend of ``local_cache``
calls it, so the budget rule is here only): half the directory's limit.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from cache_store.local_cache.disk import LocalDisk, Unit
from cache_store.process_local import ProcessLocal

__all__ = ["Prefetcher", "process_prefetcher"]

log = logging.getLogger(__name__)


class Prefetcher:
    """One thread fetching ahead into ``disk`` (see the module doc).

    Args:
        disk: the local directory.
        budget: bytes of one request fetched at most (units already here count).
        size_of: a unit's bytes (how the budget is counted).
    """

    def __init__(self, disk: LocalDisk, budget: int, size_of: Callable[[Any], int]) -> None:
        self.disk = disk
        self.budget = budget
        self.size_of = size_of
        self.fetched = 0  # units this prefetcher fetched (or found here)
        self._pending: list[Unit] = []
        self._request = 0  # which ahead() call _pending is from
        self._wake = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def ahead(self, units: Sequence[Unit]) -> None:
        """Fetch ``units`` next, in this order (what an earlier call left is dropped)."""
        with self._wake:
            if self._stopped:
                return
            self._pending = list(units)[::-1]  # popped from the end
            self._request += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="spcache-prefetch", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def _next(self) -> tuple[Unit, int] | None:
        with self._wake:
            while not self._pending and not self._stopped:
                self._wake.wait()
            if self._stopped:
                return None
            return self._pending.pop(), self._request

    def _run(self) -> None:
        spent, request = 0, 0
        while True:
            got = self._next()
            if got is None:
                return
            unit, of_request = got
            if of_request != request:  # a new window: its own budget
                spent, request = 0, of_request
            try:
                size = self.size_of(unit)
                if spent + size <= self.budget and self.disk.prefetch(unit):
                    self.fetched += 1
                spent += size
            except Exception as exc:  # noqa: BLE001 - the reader fetches it and raises what it meets
                log.debug("prefetch of %s failed: %s", unit.name, exc)

    def close(self) -> None:
        """Stop the thread (after the fetch it is in, if any)."""
        with self._wake:
            self._stopped = True
            self._pending = []
            self._wake.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=60)


def process_prefetcher(disk: LocalDisk, size_of: Callable[[Any], int]) -> ProcessLocal[Prefetcher]:
    """A store's prefetcher, one per process (a forked loader worker never uses its
    parent's thread), closed with the store; it fetches at most half of ``disk``'s limit
    per request."""
    return ProcessLocal(
        functools.partial(Prefetcher, disk, disk.spec.limit // 2, size_of), Prefetcher.close
    )
