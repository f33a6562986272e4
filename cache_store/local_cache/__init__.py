"""Remote caches read through a bounded directory on this machine (``local_cache=``).

:mod:`~cache_store.local_cache.spec` parses what the user gives (a directory, a limit);
:mod:`~cache_store.local_cache.disk` keeps the directory (fetched once, least recently
used out, never above the limit, shared by every process of the machine);
:mod:`~cache_store.local_cache.prefetch` fetches ahead in a reader's order (a
:class:`~cache_store.readers.sampler.Sampler`'s read-ahead asks it); one module per
remote backend says what its unit is: a sharded snapshot's parts
(:mod:`~cache_store.local_cache.sharded`), an exported Zarr snapshot's chunk files
(:mod:`~cache_store.local_cache.zarr_snapshot`), versions of the service's records
(:mod:`~cache_store.local_cache.service_records`). :func:`cache_store.stores.opener.open_store`
opens them when given ``local_cache``.
"""

from __future__ import annotations

from cache_store.local_cache.disk import LocalDisk, directory_bytes
from cache_store.local_cache.spec import LocalCache

__all__ = ["LocalCache", "LocalDisk", "directory_bytes"]
