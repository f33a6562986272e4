"""The exported snapshot: one Zarr v3 group per fingerprint, written by ``spcache export``
and read by :class:`~cache_store.snapshot.zarr.store.ZarrStore`.

Its layout rule (:mod:`~cache_store.snapshot.zarr.format`), the chunk files read and
written without zarr's pipeline (:mod:`~cache_store.snapshot.zarr.chunks`), the exporter
(:mod:`~cache_store.snapshot.zarr.export`) and the store. Nothing is imported here: zarr
loads only when a snapshot is opened or written.
"""
