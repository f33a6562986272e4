"""Snapshots: read-mostly copies of a cache, on a file system or in object storage, one
package per format (as MosaicML Streaming keeps each format's writer, reader and
encodings together).

* :mod:`cache_store.snapshot.zarr`: the exported snapshot (``spcache export``), one
  immutable Zarr v3 group per fingerprint.
* :mod:`cache_store.snapshot.sharded`: the sharded snapshot, appended to by many writers
  at once (Ray actors) in committed parts.
"""
