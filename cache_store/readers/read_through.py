"""Which read-through client a reader's location gets: the service's
(:mod:`cache_store.readers.http_read_through`) for an ``http(s)://`` URL, the job
queue's (:mod:`cache_store.readers.queue_read_through`) for a cache directory. Each is
imported only when a location needs it."""

from __future__ import annotations

from typing import Any

__all__ = ["open_read_through"]


def open_read_through(
    kind: str,
    cache: str,
    recipe: str,
    params: dict[str, Any],
    fingerprint: str,
    miss_timeout: float,
    token: str | None,
    ca_file: str | None,
) -> Any:
    """A read-through client for the cache at ``cache`` (``kind``: its location's)."""
    if kind == "http":
        from cache_store.readers.http_read_through import HTTPReadThrough

        return HTTPReadThrough(
            cache,
            recipe,
            params,
            fingerprint,
            token=token,
            miss_timeout=miss_timeout,
            ca_file=ca_file,
        )
    from cache_store.readers.queue_read_through import QueueReadThrough

    return QueueReadThrough(cache, recipe, params, fingerprint, miss_timeout=miss_timeout)
