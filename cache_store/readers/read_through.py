"""Which read-through client a dataset's cache gets: the job queue of a cache directory
(:mod:`cache_store.readers.queue_read_through`) or the service at a URL
(:mod:`cache_store.readers.http_read_through`), one per process."""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Mapping
from typing import Any

from cache_store.location import parse_location
from cache_store.process_local import ProcessLocal
from cache_store.stores.base import Store

__all__ = ["open_read_through", "read_through_client"]


def read_through_client(
    cache: str | os.PathLike[str] | Store,
    recipe: str,
    params: dict[str, Any],
    fingerprint: str,
    *,
    miss_timeout: float,
    store_options: Mapping[str, Any],
    variants: int = 1,
) -> ProcessLocal[Any]:
    """The read-through client of ``cache`` (a location or a store), made on first use
    in each process (an inherited one is parked). It is opened by a module function
    over plain values, never a dataset's bound method: that would be a reference cycle
    keeping a dropped dataset's store open until the cyclic collector runs. The token
    and CA file are the store's, else ``store_options``'. ``variants``: the records
    of each sample a miss asks for."""
    location = parse_location(cache.location if isinstance(cache, Store) else cache)
    token = getattr(cache, "token", None) or store_options.get("token")
    ca_file = getattr(cache, "ca_file", None) or store_options.get("ca_file")
    return ProcessLocal(
        functools.partial(
            open_read_through,
            location.kind,
            location.target,
            recipe,
            params,
            fingerprint,
            miss_timeout,
            token,
            ca_file,
            variants,
        ),
        operator.methodcaller("close"),
    )


def open_read_through(
    kind: str,
    cache: str,
    recipe: str,
    params: dict[str, Any],
    fingerprint: str,
    miss_timeout: float,
    token: str | None,
    ca_file: str | None,
    variants: int = 1,
) -> Any:
    """A read-through client for the cache at ``cache`` (``kind``: its location's),
    queueing ``variants`` records of each sample it asks for."""
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
            variants=variants,
        )
    from cache_store.readers.queue_read_through import QueueReadThrough

    return QueueReadThrough(
        cache, recipe, params, fingerprint, miss_timeout=miss_timeout, variants=variants
    )
