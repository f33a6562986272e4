"""Collate functions that batch variable-size SPC records the way Kaolin packs them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from cache_store.errors import ParameterError

__all__ = ["collate_spc", "CONCATENATED_FIELDS", "PYRAMID_FIELDS"]

#: Fields whose first dimension varies per octree: concatenated, never stacked (even when
#: every sample happens to have the same size, so a batch's layout never depends on luck).
CONCATENATED_FIELDS = ("octree", "exsum", "point_hierarchy", "point_hierarchy_dual",
                       "trinkets", "trinket_parents")

#: Per-octree pyramids: stacked, and every sample must have the same level.
PYRAMID_FIELDS = ("pyramid", "pyramid_dual")


def _problem(message: str) -> ParameterError:
    return ParameterError([message], what="SPC batch")


def _lengths(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.shape[0] for t in tensors], dtype=torch.int32)


def _numpy_views(tensors: Sequence[torch.Tensor]) -> list[np.ndarray] | None:
    # NumPy's concatenate/stack are plain memcpy loops; torch's CPU cat is several times
    # slower for small integer dtypes (int16 point hierarchies especially). Views only:
    # CPU tensors without autograd of a dtype NumPy has.
    if any(t.device.type != "cpu" or t.requires_grad or t.dtype == torch.bfloat16
           for t in tensors):
        return None
    return [t.numpy() for t in tensors]


def _cat(name: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if any(t.dim() == 0 for t in tensors) or len({t.shape[1:] for t in tensors}) > 1:
        shapes = sorted({tuple(t.shape) for t in tensors})
        raise _problem(f"{name}: shapes {shapes} can be neither stacked nor concatenated")
    arrays = _numpy_views(tensors)
    if arrays is None:
        return torch.cat(list(tensors))
    return torch.from_numpy(np.concatenate(arrays))


def _stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    arrays = _numpy_views(tensors)
    if arrays is None:
        return torch.stack(list(tensors))
    return torch.from_numpy(np.stack(arrays))


def collate_spc(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Batch SPC samples (dicts of CPU tensors from ``CachedDataset``).

    Kaolin's packed layout, keeping the record's field names:

    - ``octree`` (uint8 ``[sum num_bytes]``): octrees concatenated end to end, with
      ``lengths`` (int32 ``[B]``, bytes per octree).
    - ``pyramid`` (int32 ``[B, 2, level + 2]``): stacked (Kaolin's ``pyramids``); every
      sample must have the same level, as records of one fingerprint do.
    - ``exsum`` (int32 ``[sum num_bytes]``): concatenated; each record's inclusive sum
      restarts at its first byte, which is Kaolin 0.18's batched layout.
    - ``point_hierarchy`` (int16 ``[sum num_points, 3]``): concatenated; the pyramids
      give each octree's slice.
    - ``spc_sdf``'s ``point_hierarchy_dual`` (``[sum num_dual_points, 3]``), ``trinkets``
      (``[sum num_points, 8]``) and ``trinket_parents`` (``[sum num_points]``):
      concatenated like ``point_hierarchy``; ``pyramid_dual`` is stacked like ``pyramid``
      (``[B, 2, level + 2]``) and gives each sample's slice of the dual (row 1, last
      column: its size). Indices stay relative to their own sample (trinkets to their
      level of the sample's dual, ``trinket_parents`` and ``sdf_pidx`` to the sample's
      point hierarchy), as Kaolin's ``unbatched_*`` ops expect: add
      ``pyramid[b, 1, -1]`` summed over earlier samples to index the packed hierarchy.
    - any other tensor: stacked when every sample has the same shape (``center``
      ``[B, 3]``, ``scale`` ``[B]``, ``query_points`` ``[B, M, 3]``); otherwise
      concatenated along dim 0 with ``<name>_lengths`` (int32 ``[B]``).
    - anything else: ``torch.utils.data.default_collate``.

    Raises:
        ParameterError: empty batch, samples with different fields, pyramids of
            different levels, exsum not matching its octree, or tensors that fit neither
            layout.
    """
    if not samples:
        raise _problem("empty batch")
    names = list(samples[0])
    for i, sample in enumerate(samples):
        if set(sample) != set(names):
            raise _problem(f"sample {i} has fields {sorted(sample)}, sample 0 has {sorted(names)}")
    out: dict[str, Any] = {}
    for name in names:
        values = [sample[name] for sample in samples]
        if not all(isinstance(v, torch.Tensor) for v in values):
            out[name] = default_collate(values)
        elif name in CONCATENATED_FIELDS:
            out[name] = _cat(name, values)
            if name == "octree":
                out["lengths"] = _lengths(values)
        elif name in PYRAMID_FIELDS:
            shapes = sorted({tuple(v.shape) for v in values})
            if len(shapes) > 1:
                raise _problem(f"{name} shapes {shapes} differ: octrees of different levels "
                               f"cannot share one Kaolin batch (read one fingerprint per loader)")
            out[name] = _stack(values)
        elif len({v.shape for v in values}) == 1:
            out[name] = _stack(values)
        else:
            out[name] = _cat(name, values)
            out[f"{name}_lengths"] = _lengths(values)
    if "octree" in out and "exsum" in out and isinstance(out["exsum"], torch.Tensor):
        if out["exsum"].shape[0] != out["octree"].shape[0]:
            raise _problem(f"exsum has {out['exsum'].shape[0]} entries for "
                           f"{out['octree'].shape[0]} octree bytes (expected Kaolin 0.18's "
                           f"inclusive layout, one per byte)")
    return out
