"""Small, valid SPC-shaped records for tests (the real recipes are computed elsewhere).

The builders live in :mod:`cache_store.testing` (NumPy, shared with the store contract):
a genuine octree, pyramid, exsum and point hierarchy from random points, so collate and
dataset tests see consistent shapes. Here they come as torch tensors.
"""

from __future__ import annotations

import torch

from cache_store.format.encode import encode_record
from cache_store.testing import fingerprint_of, record_metadata, spc_arrays, spc_query_arrays

__all__ = ["spc_fields", "spc_query_fields", "record_metadata", "make_record", "fingerprint_of"]


def spc_fields(seed: int, level: int = 4, num_points: int = 40) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in spc_arrays(seed, level, num_points).items()}


def spc_query_fields(
    seed: int, level: int = 4, num_points: int = 40, num_queries: int = 64
) -> dict[str, torch.Tensor]:
    arrays = spc_query_arrays(seed, level, num_points, num_queries)
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def make_record(
    fingerprint: str, sample_id: str, seed: int, recipe: str = "spc", **shape: int
) -> bytes:
    maker = spc_query_fields if recipe == "spc_query" else spc_fields
    return encode_record(maker(seed, **shape), record_metadata(fingerprint, sample_id, recipe))
