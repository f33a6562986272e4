"""What the routes share: settings, the job queue, the (lazily opened) store, metrics."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from cache_store.jobs import JobQueue
from cache_store.lmdb_store import has_cache
from cache_store.store import Store, open_store
from service.metrics import Metrics
from service.settings import Settings

__all__ = ["ServiceContext", "CacheStats", "Context", "get_context"]

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class CacheStats:
    records: int
    bytes: int
    measured: float


class ServiceContext:
    """Per-app state. Opens nothing in the constructor; the store opens on first use.

    The store is read-only: the service never writes records or indexes (the worker
    does), so a bug here cannot damage what is stored.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.cache = Path(settings.cache)
        self.queue = JobQueue(self.cache)
        self.metrics = Metrics()
        # Late import: service.read_through imports this module.
        from service.read_through import WaitSlots

        self.waits = WaitSlots(settings.max_waiting_requests)
        self.started = time.time()
        self._store: Store | None = None
        self._store_lock = threading.Lock()
        self._stats: dict[str, CacheStats] = {}
        self._stats_at: float | None = None
        self._stats_lock = threading.Lock()

    def store(self) -> Store | None:
        """The cache's store, or None while the worker has not created it yet."""
        if self._store is not None:
            return self._store
        with self._store_lock:
            if self._store is None:
                if not has_cache(self.cache):
                    return None
                self._store = open_store(self.cache, readonly=True)
            return self._store

    def close(self) -> None:
        with self._store_lock:
            if self._store is not None:
                self._store.close()
                self._store = None
        self.queue.close()

    def cache_stats(self, fingerprint: str) -> CacheStats:
        """Records and bytes stored under a fingerprint.

        From one ``store.stats()`` pass over the whole cache (the LMDB store walks its
        keys and value lengths without copying values), reused for ``stats_ttl_s``.
        """
        now = time.time()
        with self._stats_lock:
            fresh = self._stats_at is not None and now - self._stats_at < self.settings.stats_ttl_s
            stats = self._stats
        if not fresh:
            store = self.store()
            per_fp = store.stats()["fingerprints"] if store is not None else {}
            stats = {fp: CacheStats(int(e.get("records", 0)), int(e.get("bytes", 0)), now)
                     for fp, e in per_fp.items()}
            with self._stats_lock:
                self._stats, self._stats_at = stats, now
        return stats.get(fingerprint, CacheStats(0, 0, now))


def get_context(request: Request) -> ServiceContext:
    """The app's :class:`ServiceContext` (set by ``create_app``)."""
    return request.app.state.ctx


#: Route parameter type: ``def route(ctx: Context)`` receives the app's context.
Context = Annotated[ServiceContext, Depends(get_context)]
