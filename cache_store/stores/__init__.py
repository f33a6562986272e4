"""Where records rest: the store contract (base), how a location opens a store (opener),
and the backends kept here: the LMDB cache, the HTTP reader. The snapshots' stores live
with their formats in :mod:`cache_store.snapshot`."""
