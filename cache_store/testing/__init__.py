"""Testing helpers shipped with spcache, as ``zarr.testing`` ships zarr's: the store
contract as test classes (:mod:`~cache_store.testing.store`) and the records it stores
(:mod:`~cache_store.testing.records`). Importing them needs neither pytest nor torch.
"""

from __future__ import annotations

from cache_store.testing.records import (
    FP_A,
    FP_B,
    FP_C,
    IDS_A,
    IDS_B,
    SWAPPED_FOR,
    SWAPPED_KEY,
    V1_KEYS,
    Content,
    contract_record,
    fingerprint_of,
    index_of,
    record_metadata,
    resolved_params,
    sample_content,
    spc_arrays,
    spc_query_arrays,
)
from cache_store.testing.format1 import as_format_1, encode_record_v1, metadata_read_back
from cache_store.testing.store import StoreContract, WritableStoreContract, raises

__all__ = [
    "FP_A",
    "FP_B",
    "FP_C",
    "IDS_A",
    "IDS_B",
    "SWAPPED_FOR",
    "SWAPPED_KEY",
    "V1_KEYS",
    "Content",
    "StoreContract",
    "as_format_1",
    "encode_record_v1",
    "metadata_read_back",
    "WritableStoreContract",
    "contract_record",
    "fingerprint_of",
    "index_of",
    "raises",
    "record_metadata",
    "resolved_params",
    "sample_content",
    "spc_arrays",
    "spc_query_arrays",
]
