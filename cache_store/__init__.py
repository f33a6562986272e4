"""cache_store: bytes at rest. CPU only; imports neither FastAPI nor CUDA.

Record format, keys and fingerprints, stores (LMDB, Zarr, HTTP), the job queue,
``CachedDataset`` and its collate functions.

``import cache_store`` stays light (no torch): the names that need torch
(``CachedDataset``, ``collate_spc``, ``decode_record``'s tensors) load on first access,
so the service and header-only readers start without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cache_store import errors
from cache_store.errors import *  # noqa: F403 - every error class: errors.__all__ is the one list
from cache_store.lazy_names import lazy_names
from cache_store.version import __version__

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from cache_store.format.decode import Record, decode_record
    from cache_store.format.encode import encode_record, select_fields
    from cache_store.format.header import read_metadata, record_checksum
    from cache_store.format.index import DatasetIndex
    from cache_store.jobs.failures import failures_of
    from cache_store.keys import (
        compute_fingerprint,
        record_key,
        split_key,
        validate_fingerprint,
        validate_sample_id,
    )
    from cache_store.readers.collate import collate_spc
    from cache_store.readers.dataset import CachedDataset
    from cache_store.readers.to_kaolin import to_kaolin_spc
    from cache_store.sources.discover import discover_sources
    from cache_store.stores.base import Store, VerifyReport
    from cache_store.stores.opener import open_store
    from cache_store.stores.lmdb import LMDBStore

# public name -> module that defines it, imported on first access (PEP 562)
_LAZY = {
    "compute_fingerprint": "cache_store.keys",
    "validate_fingerprint": "cache_store.keys",
    "validate_sample_id": "cache_store.keys",
    "record_key": "cache_store.keys",
    "split_key": "cache_store.keys",
    "Record": "cache_store.format.decode",
    "encode_record": "cache_store.format.encode",
    "decode_record": "cache_store.format.decode",
    "read_metadata": "cache_store.format.header",
    "record_checksum": "cache_store.format.header",
    "select_fields": "cache_store.format.encode",
    "Store": "cache_store.stores.base",
    "DatasetIndex": "cache_store.format.index",
    "VerifyReport": "cache_store.stores.base",
    "open_store": "cache_store.stores.opener",
    "LMDBStore": "cache_store.stores.lmdb",
    "CachedDataset": "cache_store.readers.dataset",
    "collate_spc": "cache_store.readers.collate",
    "discover_sources": "cache_store.sources.discover",
    "to_kaolin_spc": "cache_store.readers.to_kaolin",
    "failures_of": "cache_store.jobs.failures",
}

__all__ = [
    "__version__",
    "compute_fingerprint",
    "validate_fingerprint",
    "validate_sample_id",
    "record_key",
    "split_key",
    "Record",
    "encode_record",
    "decode_record",
    "read_metadata",
    "record_checksum",
    "select_fields",
    "Store",
    "DatasetIndex",
    "VerifyReport",
    "open_store",
    "LMDBStore",
    "CachedDataset",
    "collate_spc",
    "discover_sources",
    "to_kaolin_spc",
    "failures_of",
]
__all__ += errors.__all__


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
