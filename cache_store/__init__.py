"""cache_store: bytes at rest. CPU only; imports neither FastAPI nor CUDA.

Record format, keys and fingerprints, stores (LMDB, Zarr, HTTP), the job queue,
``CachedDataset`` and its collate functions.
"""

from cache_store.errors import (
    CorruptRecord,
    FingerprintLookupError,
    InvalidSampleId,
    JobNotFound,
    ParameterError,
    ReadOnlyStoreError,
    RecordNotFound,
    SourceError,
    SpcacheError,
    UnknownName,
    UnsupportedFormat,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "SpcacheError",
    "RecordNotFound",
    "CorruptRecord",
    "UnsupportedFormat",
    "InvalidSampleId",
    "SourceError",
    "UnknownName",
    "ParameterError",
    "FingerprintLookupError",
    "ReadOnlyStoreError",
    "JobNotFound",
]
