"""Records and datasets for tests: small valid SPC records, their fingerprints and
indexes, and the content the store contract stores.

:func:`spc_arrays` builds a genuine octree, pyramid, exsum and point hierarchy from
random points (NumPy), so every reader sees consistent shapes; :func:`contract_record`
encodes one as a record of ``spc`` or ``spc_query``; :func:`sample_content` is three
fingerprints of two recipes, ids with slashes and non-ASCII characters included, and
records of both formats: :data:`V1_KEYS` hold records of format 1 (each carrying its
whole metadata), the others format 2 (naming the descriptor their fingerprint's records
share); a fingerprint holds both, another format 1 only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cache_store.format.encode import encode_record
from cache_store.format.index import DatasetIndex
from cache_store.keys import compute_fingerprint
from cache_store.recipes.registry import get_recipe_spec
from cache_store.testing.format1 import as_format_1

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
    "contract_record",
    "fingerprint_of",
    "index_of",
    "record_metadata",
    "resolved_params",
    "sample_content",
    "spc_arrays",
    "spc_query_arrays",
]

Content = tuple[dict[str, bytes], list[DatasetIndex]]


def resolved_params(recipe: str, **params: Any) -> dict[str, Any]:
    """``params`` completed with ``recipe``'s defaults, as a dataset index records them."""
    return dict(get_recipe_spec(recipe).resolve(params))


def fingerprint_of(recipe: str = "spc", **params: Any) -> str:
    """The fingerprint of ``recipe`` at its installed version with ``params``."""
    return compute_fingerprint(
        recipe, get_recipe_spec(recipe).version, resolved_params(recipe, **params)
    )


FP_A = fingerprint_of("spc", level=4)
FP_B = fingerprint_of("spc_query", level=4)
FP_C = fingerprint_of("spc", level=5)
IDS_A = ["chairs/a1", "chairs/a2", "tables/t1", "unicode/é-ü", "zeta"]
IDS_B = ["chairs/a1", "lamps/l1"]
#: In a swapped store, this key holds the record of SWAPPED_FOR (same length, so a
#: snapshot's ids can be swapped in place).
SWAPPED_KEY = f"{FP_A}/chairs/a1"
SWAPPED_FOR = f"{FP_A}/chairs/a2"
#: Keys whose record is of format 1 in :func:`sample_content` (the rest: format 2).
V1_KEYS = frozenset({f"{FP_A}/tables/t1", f"{FP_A}/unicode/é-ü", f"{FP_C}/only"})


def _morton(points: np.ndarray, level: int) -> np.ndarray:
    code = np.zeros(len(points), dtype=np.int64)
    for i in range(level):
        for axis, shift in ((2, 0), (1, 1), (0, 2)):  # z -> 3i, y -> 3i+1, x -> 3i+2
            code |= ((points[:, axis].astype(np.int64) >> i) & 1) << (3 * i + shift)
    return code


def _unmorton(code: np.ndarray, level: int) -> np.ndarray:
    pts = np.zeros((len(code), 3), dtype=np.int16)
    for i in range(level):
        for axis, shift in ((2, 0), (1, 1), (0, 2)):
            pts[:, axis] |= (((code >> (3 * i + shift)) & 1) << i).astype(np.int16)
    return pts


def spc_arrays(seed: int, level: int = 4, num_points: int = 40) -> dict[str, np.ndarray]:
    """A genuine octree of ``num_points`` random points, with its pyramid, exsum and point
    hierarchy, and a normalisation, as an ``spc`` record holds them:

    ``octree`` uint8 ``[num_nodes]``, ``pyramid`` int32 ``[2, level + 2]``, ``exsum``
    int32 ``[num_nodes]``, ``point_hierarchy`` int16 ``[num_points_all_levels, 3]``,
    ``center`` float32 ``[3]``, ``scale`` float32 ``[]``.
    """
    rng = np.random.default_rng(seed)
    pts = rng.integers(0, 2**level, size=(num_points, 3))
    leaf = np.unique(_morton(pts, level))
    per_level = [np.unique(leaf >> (3 * (level - lvl))) for lvl in range(level + 1)]
    octree = []
    for lvl in range(level):
        children = per_level[lvl + 1]
        parents, inverse = np.unique(children >> 3, return_inverse=True)
        byte = np.zeros(len(parents), dtype=np.uint8)
        np.bitwise_or.at(byte, inverse, (1 << (children & 7)).astype(np.uint8))
        octree.append(byte)
    octree_bytes = np.concatenate(octree)
    counts = np.array([len(c) for c in per_level] + [0], dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.int32)
    popcount = np.unpackbits(octree_bytes[:, None], axis=1).sum(axis=1)
    hierarchy = np.concatenate([_unmorton(c, lvl) for lvl, c in enumerate(per_level)])
    return {
        "octree": octree_bytes,
        "pyramid": np.stack([counts, starts]),
        "exsum": np.cumsum(popcount).astype(np.int32),
        "point_hierarchy": hierarchy,
        "center": rng.normal(size=3).astype(np.float32),
        "scale": np.array(rng.uniform(0.5, 2.0), dtype=np.float32),
    }


def spc_query_arrays(
    seed: int, level: int = 4, num_points: int = 40, num_queries: int = 64
) -> dict[str, np.ndarray]:
    """:func:`spc_arrays` and the fields of ``spc_query``: ``query_points`` float32
    ``[num_queries, 3]``, ``query_pidx`` int32 ``[num_queries, level + 1]``,
    ``occupancy`` uint8 ``[num_queries]``."""
    fields = spc_arrays(seed, level, num_points)
    rng = np.random.default_rng(seed + 1)
    fields["query_points"] = rng.uniform(-1, 1, (num_queries, 3)).astype(np.float32)
    pidx = rng.integers(-1, 100, (num_queries, level + 1)).astype(np.int32)
    fields["query_pidx"] = pidx
    fields["occupancy"] = (pidx[:, -1] >= 0).astype(np.uint8)
    return fields


def record_metadata(
    fingerprint: str, sample_id: str, recipe: str = "spc", source_hash: str = "0" * 16
) -> dict[str, str]:
    """The metadata a record of ``recipe`` computed for ``fingerprint/sample_id`` from a
    source with ``source_hash`` carries."""
    return {
        "recipe": recipe,
        "recipe_version": str(get_recipe_spec(recipe).version),
        "fingerprint": fingerprint,
        "sample_id": sample_id,
        "source_hash": source_hash,
        "backend": "torch",
        "device": "cpu",
    }


def contract_record(
    fingerprint: str,
    sample_id: str,
    seed: int,
    *,
    recipe: str = "spc",
    source_hash: str = "0" * 16,
    **shape: int,
) -> bytes:
    """A valid record of ``recipe`` (:func:`spc_arrays`, or :func:`spc_query_arrays` for
    ``spc_query``; ``shape``: their ``level``, ``num_points``...), its metadata naming
    ``fingerprint/sample_id`` and ``source_hash``."""
    import torch  # the fields go in as tensors: a 0-d NumPy array is stored as [1]

    maker = spc_query_arrays if recipe == "spc_query" else spc_arrays
    tensors = {name: torch.from_numpy(array) for name, array in maker(seed, **shape).items()}
    return encode_record(tensors, record_metadata(fingerprint, sample_id, recipe, source_hash))


def index_of(recipe: str, ids: list[str], **params: Any) -> DatasetIndex:
    """The dataset index of ``recipe`` at its installed version with ``params``."""
    return DatasetIndex(
        fingerprint_of(recipe, **params),
        recipe,
        get_recipe_spec(recipe).version,
        resolved_params(recipe, **params),
        np.array(ids, dtype=str),
    )


def sample_content() -> Content:
    """Records of three fingerprints of two recipes, ids with slashes and non-ASCII
    characters included, those of :data:`V1_KEYS` in format 1, and the three datasets'
    indexes."""

    records = {f"{FP_A}/{sid}": contract_record(FP_A, sid, i) for i, sid in enumerate(IDS_A)}
    records |= {
        f"{FP_B}/{sid}": contract_record(FP_B, sid, 10 + i, recipe="spc_query")
        for i, sid in enumerate(IDS_B)
    }
    records[f"{FP_C}/only"] = contract_record(FP_C, "only", 99, level=5)
    records = {k: as_format_1(v) if k in V1_KEYS else v for k, v in records.items()}
    indexes = [
        index_of("spc", IDS_A, level=4),
        index_of("spc_query", IDS_B, level=4),
        index_of("spc", ["only"], level=5),
    ]
    return records, indexes
