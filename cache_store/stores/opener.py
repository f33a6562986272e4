"""Opening a store from a location: :func:`open_store` and the backend registry.

Kept apart from the contract (:mod:`cache_store.stores.base`), as zarr keeps its store
ABC apart from the code that turns a path into a store: the contract knows no backend,
and a backend module imports the contract without importing the opener, so the arrows
run one way (base <- backends <- opener).

:data:`STORE_BACKENDS` is a plain dict of backend name -> ``"module:Class"``; a module is
imported only when a location needs it, so backends can land (or be absent)
independently. An in-memory store (:class:`cache_store.stores.memory.MemoryStore`) has
no location to parse and is built directly, never through the opener.
"""

from __future__ import annotations

import importlib
from typing import Any

from cache_store.errors import ReadOnlyStoreError, UnknownName, UsageError
from cache_store.location import LocationLike, parse_location
from cache_store.stores.base import Store

__all__ = ["LOCAL_CACHE_BACKENDS", "STORE_BACKENDS", "open_store"]

#: Backend name -> "module:Class". Modules are imported when a location needs them, so
#: backends can land (or be absent) independently.
STORE_BACKENDS: dict[str, str] = {
    "lmdb": "cache_store.stores.lmdb:LMDBStore",
    "zarr": "cache_store.snapshot.zarr.store:ZarrStore",
    "http": "cache_store.stores.http:HTTPStore",
    "sharded": "cache_store.snapshot.sharded.store:ShardedSnapshot",
}

#: Backend name -> the backend that reads it through a bounded local directory
#: (``local_cache=``, :mod:`cache_store.local_cache`): remote locations only.
LOCAL_CACHE_BACKENDS: dict[str, str] = {
    "sharded": "cache_store.local_cache.sharded:CachedShardedSnapshot",
    "zarr": "cache_store.local_cache.zarr_snapshot:CachedZarrSnapshot",
}

# Remote ``*.zarr`` locations this process (or the process it was forked from) found
# sharded or exported, read through ``local_cache``: a snapshot's root marker is never
# removed, so a loader worker opening its store asks the bucket nothing.
_KIND_SEEN: dict[str, str] = {}


def open_store(cache: LocationLike | Store, readonly: bool = True, **options: Any) -> Store:
    """A store for ``cache``: a directory -> ``LMDBStore``; ``*.zarr`` path or URL ->
    ``ZarrStore`` (an exported snapshot) or ``ShardedSnapshot`` (one written by many
    writers, and any ``*.zarr`` opened for writing); ``http(s)://host:port`` ->
    ``HTTPStore``. A ``Store`` passes through. With ``local_cache`` (a
    :class:`~cache_store.local_cache.disk.LocalCache`), a remote location's backend
    that reads through that bounded local directory (:data:`LOCAL_CACHE_BACKENDS`).

    Nothing is opened yet (the first access opens it, in the calling process).
    """
    if isinstance(cache, Store):
        return cache
    parsed = parse_location(cache)
    if options.get("local_cache") is not None:
        if not readonly:
            raise UsageError(f"{parsed.text}: local_cache is for reading; a writer writes there")
        if parsed.is_local:
            raise UsageError(
                f"{parsed.text}: local_cache is for a remote snapshot (s3://....zarr); "
                f"this one is on this machine already"
            )
    name: str = parsed.kind
    if name == "zarr":
        from cache_store.snapshot.sharded.maintenance import snapshot_kind

        seen = options.get("local_cache") is not None and (
            f"{parsed.target} {options.get('storage_options')!r}"
        )
        kind: str | None = _KIND_SEEN.get(seen) if seen else None
        if kind is None:
            kind = snapshot_kind(parsed.target, options.get("storage_options"))
            if seen and kind is not None:
                _KIND_SEEN[seen] = kind
        if kind == "sharded" or (kind is None and not readonly):
            name = "sharded"
        elif not readonly:  # an exported snapshot is immutable: writers start a new one
            raise ReadOnlyStoreError(
                f"{parsed.text}: an exported Zarr snapshot is read-only; "
                f"write into a new location (a sharded snapshot)"
            )
    backends = STORE_BACKENDS if options.get("local_cache") is None else LOCAL_CACHE_BACKENDS
    if name not in backends:
        raise UsageError(
            f"{parsed.text}: local_cache reads a remote {' or '.join(backends)} store, "
            f"not a {name} one"
        )
    module_name, _, class_name = backends[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise UnknownName("store backend", name, [n for n in STORE_BACKENDS if n != name]) from exc
    return getattr(module, class_name)(parsed.target, readonly=readonly, **options)
