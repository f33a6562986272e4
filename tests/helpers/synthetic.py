"""Small, valid SPC-shaped records for tests (the real recipes are computed elsewhere).

``spc_fields`` builds a genuine octree, pyramid, exsum and point hierarchy from random
points with a few lines of NumPy, so collate and dataset tests see consistent shapes.
"""

from __future__ import annotations

import numpy as np
import torch

from cache_store.keys import compute_fingerprint
from cache_store.format.encode import encode_record
from cache_store.recipes.specs import get_recipe_spec

__all__ = ["spc_fields", "spc_query_fields", "record_metadata", "make_record", "fingerprint_of"]


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


def spc_fields(seed: int, level: int = 4, num_points: int = 40) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    pts = rng.integers(0, 2**level, size=(num_points, 3))
    leaf = np.unique(_morton(pts, level))
    per_level = [np.unique(leaf >> (3 * (level - l))) for l in range(level + 1)]
    octree = []
    for l in range(level):
        children = per_level[l + 1]
        parents, inverse = np.unique(children >> 3, return_inverse=True)
        byte = np.zeros(len(parents), dtype=np.uint8)
        np.bitwise_or.at(byte, inverse, (1 << (children & 7)).astype(np.uint8))
        octree.append(byte)
    octree = np.concatenate(octree)
    counts = np.array([len(c) for c in per_level] + [0], dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.int32)
    popcount = np.unpackbits(octree[:, None], axis=1).sum(axis=1)
    hierarchy = np.concatenate([_unmorton(c, l) for l, c in enumerate(per_level)])
    return {
        "octree": torch.from_numpy(octree),
        "pyramid": torch.from_numpy(np.stack([counts, starts])),
        "exsum": torch.from_numpy(np.cumsum(popcount).astype(np.int32)),
        "point_hierarchy": torch.from_numpy(hierarchy),
        "center": torch.from_numpy(rng.normal(size=3).astype(np.float32)),
        "scale": torch.tensor(float(rng.uniform(0.5, 2.0)), dtype=torch.float32),
    }


def spc_query_fields(
    seed: int, level: int = 4, num_points: int = 40, num_queries: int = 64
) -> dict[str, torch.Tensor]:
    fields = spc_fields(seed, level, num_points)
    rng = np.random.default_rng(seed + 1)
    fields["query_points"] = torch.from_numpy(
        rng.uniform(-1, 1, (num_queries, 3)).astype(np.float32)
    )
    pidx = rng.integers(-1, 100, (num_queries, level + 1)).astype(np.int32)
    fields["query_pidx"] = torch.from_numpy(pidx)
    fields["occupancy"] = torch.from_numpy((pidx[:, -1] >= 0).astype(np.uint8))
    return fields


def fingerprint_of(recipe: str = "spc", **params: object) -> str:
    spec = get_recipe_spec(recipe)
    return compute_fingerprint(recipe, spec.version, spec.resolve(params))


def record_metadata(fingerprint: str, sample_id: str, recipe: str = "spc") -> dict[str, str]:
    return {
        "recipe": recipe,
        "recipe_version": str(get_recipe_spec(recipe).version),
        "fingerprint": fingerprint,
        "sample_id": sample_id,
        "source_hash": "0" * 16,
        "backend": "torch",
        "device": "cpu",
    }


def make_record(
    fingerprint: str, sample_id: str, seed: int, recipe: str = "spc", **shape: int
) -> bytes:
    maker = spc_query_fields if recipe == "spc_query" else spc_fields
    return encode_record(maker(seed, **shape), record_metadata(fingerprint, sample_id, recipe))
