"""What the routes share: settings, the job queue, the (lazily opened) store, metrics."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Request

from cache_store.errors import CacheDamaged, CacheNotFound
from cache_store.housekeeping.isolated import stats_cache
from cache_store.jobs.queue import JobQueue
from cache_store.stores.base import Store
from cache_store.stores.opener import open_store
from service.budget import ByteBudget
from service.limits import WaitSlots
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
        self.waits = WaitSlots(settings.max_waiting_requests)

        self.read_budget = ByteBudget(settings.max_read_bytes_in_flight)
        self.started = time.time()
        self._store: Store | None = None
        self._store_lock = threading.Lock()
        self._walk: dict[str, Any] | None = None
        self._walk_damage: CacheDamaged | None = None
        self._walk_signature: int | None = None
        self._walk_at = 0.0
        self._walk_lock = threading.Lock()

    def store(self) -> Store | None:
        """The cache's store, or None while the worker has not created it yet."""
        if self._store is not None:
            return self._store
        with self._store_lock:
            if self._store is None:
                store = open_store(self.cache, readonly=True)
                try:
                    store.generation()  # opens it: CacheNotFound until a writer made it
                except CacheNotFound:
                    store.close()
                    return None
                self._store = store
            return self._store

    def close(self) -> None:
        with self._store_lock:
            if self._store is not None:
                self._store.close()
                self._store = None
        self.queue.close()

    def cache_walk(self, want: str | None = None) -> dict[str, Any]:
        """Per fingerprint: records, bytes and (when indexed) the index's description.

        One ``store.stats()`` walk over the whole cache, run in a child process
        (:func:`cache_store.housekeeping.isolated.stats_cache`): a damaged LMDB page that makes LMDB
        abort kills the child, never the service. The result is reused until the store's
        ``generation()`` changes (and at least ``stats_ttl_s``). Raises
        :class:`CacheDamaged` while the last walk found the cache damaged. A fingerprint
        ``want`` the last walk did not see is looked for again as soon as a write landed.
        """
        with self._walk_lock:  # one walk at a time; the others wait for its answer
            store = self.store()
            if store is None:
                return {}
            try:
                signature = store.generation()
            except CacheDamaged:
                signature = None  # cannot tell: the walk says what is wrong
            now = time.time()
            known = self._walk is not None or self._walk_damage is not None
            stale = now - self._walk_at >= self.settings.stats_ttl_s or (
                want is not None and self._walk is not None and want not in self._walk
            )
            # a damaged cache is walked again each time the walk is stale: damage and its
            # repair happen out of band, without a write the counter would count
            changed = (
                signature is None
                or signature != self._walk_signature
                or self._walk_damage is not None
            )
            if not known or (changed and stale):
                try:
                    self._walk = stats_cache(self.cache)["fingerprints"]
                    self._walk_damage = None
                except CacheDamaged as exc:
                    self._walk, self._walk_damage = None, exc
                self._walk_signature, self._walk_at = signature, now
            if self._walk_damage is not None:
                raise CacheDamaged(self._walk_damage.cache, self._walk_damage.reason)
            assert self._walk is not None
            return self._walk

    def forget_walk(self) -> None:
        """Make the next :meth:`cache_walk` walk again (after a removal)."""
        with self._walk_lock:
            self._walk, self._walk_damage, self._walk_at = None, None, 0.0

    def cache_stats(self, fingerprint: str) -> CacheStats:
        """Records and bytes stored under a fingerprint (from :meth:`cache_walk`)."""
        entry = self.cache_walk(fingerprint).get(fingerprint, {})
        return CacheStats(int(entry.get("records", 0)), int(entry.get("bytes", 0)), self._walk_at)


def get_context(request: Request) -> ServiceContext:
    """The app's :class:`ServiceContext` (set by ``create_app``)."""
    return request.app.state.ctx


#: Route parameter type: ``def route(ctx: Context)`` receives the app's context.
Context = Annotated[ServiceContext, Depends(get_context)]
