"""Zarr v3 snapshots: the layout rule (format), the chunk files, the exporter that writes them
and the store that reads them."""
