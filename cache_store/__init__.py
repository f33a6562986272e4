"""cache_store: bytes at rest. CPU only; imports neither FastAPI nor CUDA.

Record format, keys and fingerprints, stores (LMDB, Zarr, HTTP), the job queue,
``CachedDataset`` and its collate functions.

``import cache_store`` stays light (no torch): the names that need torch
(``CachedDataset``, ``collate_spc``, ``decode_record``'s tensors) load on first access,
so the service and header-only readers start without it.
"""

from __future__ import annotations

import importlib
from typing import Any

from cache_store.errors import (
    CacheNotFound,
    CorruptRecord,
    FingerprintLookupError,
    InvalidSampleId,
    JobNotFound,
    MissTimeout,
    NoWorkerAlive,
    ParameterError,
    ReadOnlyStoreError,
    StoreBusy,
    RecordNotFound,
    SampleFailed,
    SourceError,
    SpcacheError,
    UnknownName,
    UnsupportedFormat,
)

__version__ = "0.1.0"

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
    "open_store": "cache_store.stores.base",
    "LMDBStore": "cache_store.stores.lmdb",
    "CachedDataset": "cache_store.readers.dataset",
    "collate_spc": "cache_store.readers.collate",
    "discover_sources": "cache_store.sources.discover",
    "to_kaolin_spc": "cache_store.readers.to_kaolin",
    "failures_of": "cache_store.jobs.failures",
}

__all__ = [
    "__version__",
    "SpcacheError",
    "SampleFailed",
    "NoWorkerAlive",
    "MissTimeout",
    "RecordNotFound",
    "CorruptRecord",
    "UnsupportedFormat",
    "InvalidSampleId",
    "SourceError",
    "UnknownName",
    "ParameterError",
    "FingerprintLookupError",
    "ReadOnlyStoreError",
    "StoreBusy",
    "CacheNotFound",
    "JobNotFound",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cache_store' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
