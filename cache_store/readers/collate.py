"""Collate functions that batch variable-size SPC records the way Kaolin packs them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate
from torch.utils.data._utils.collate import default_collate_fn_map

from cache_store.errors import ParameterError
from cache_store.views.hop import LocatedBatch, LocatedSample, collate_located

__all__ = ["collate_spc", "SpcSample", "CONCATENATED_FIELDS", "PYRAMID_FIELDS"]

#: Fields whose first dimension varies per octree: concatenated, never stacked (even when
#: every sample happens to have the same size, so a batch's layout never depends on luck).
CONCATENATED_FIELDS = (
    "octree",
    "exsum",
    "point_hierarchy",
    "point_hierarchy_dual",
    "trinkets",
    "trinket_parents",
)

#: Per-octree pyramids: stacked, and every sample must have the same level.
PYRAMID_FIELDS = ("pyramid", "pyramid_dual")

# default_collate over a views=True dataset's located samples collates their tensors
# (torch's documented way to teach default_collate a type)
default_collate_fn_map[LocatedSample] = collate_located


class SpcSample(dict[str, Any]):
    """A sample as ``CachedDataset`` returns it: a dict of CPU tensors by field name
    that also carries ``variable``, the fields its recipe declares with a first
    dimension each record sets for itself (``Field("int16", "[N, 3]", ...)``), so
    :func:`collate_spc` batches them by their declaration, not by the batch's shapes,
    and ``sample_id``, which sample it is (None where unknown), which :func:`collate_spc`
    lists as the batch's ``"sample_ids"``. Neither is a key: the dict holds the
    record's tensors only."""

    variable: frozenset[str] = frozenset()
    sample_id: str | None = None

    def __init__(
        self,
        tensors: Mapping[str, Any],
        variable: Iterable[str] = (),
        sample_id: str | None = None,
    ) -> None:
        super().__init__(tensors)
        self.variable = frozenset(variable)
        self.sample_id = sample_id


def _problem(message: str) -> ParameterError:
    return ParameterError([message], what="SPC batch")


def _lengths(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.shape[0] for t in tensors], dtype=torch.int32)


def _numpy_views(tensors: Sequence[torch.Tensor]) -> list[np.ndarray] | None:
    # NumPy's concatenate/stack are plain memcpy loops; torch's CPU cat is several times
    # slower for small integer dtypes (int16 point hierarchies especially). Views only:
    # CPU tensors without autograd of a dtype NumPy has.
    if any(t.device.type != "cpu" or t.requires_grad or t.dtype == torch.bfloat16 for t in tensors):
        return None
    return [t.numpy() for t in tensors]


def _end_to_end(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one flat view when they already lie end to end in one storage
    (as ``CachedDataset``'s batched reads lay a field out), else None."""
    first = tensors[0]
    if first.device.type != "cpu" or first.requires_grad:
        return None
    storage = first.untyped_storage()
    ptr, dtype, at = storage.data_ptr(), first.dtype, first.data_ptr()
    for t in tensors:
        if (
            t.data_ptr() != at
            or t.dtype is not dtype
            or t.requires_grad
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != ptr
        ):
            return None
        at += t.nbytes
    offset = (first.data_ptr() - ptr) // first.element_size()
    total = sum(t.numel() for t in tensors)
    return torch.empty(0, dtype=dtype).set_(storage, offset, (total,), (1,))


def _cat(name: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if any(t.dim() == 0 for t in tensors) or len({t.shape[1:] for t in tensors}) > 1:
        shapes = sorted({tuple(t.shape) for t in tensors})
        raise _problem(f"{name}: shapes {shapes} can be neither stacked nor concatenated")
    flat = _end_to_end(tensors)
    if flat is not None:  # already concatenated in memory: a view, no copy
        return flat.view(-1, *tensors[0].shape[1:])
    arrays = _numpy_views(tensors)
    if arrays is None:
        return torch.cat(list(tensors))
    return torch.from_numpy(np.concatenate(arrays))


def _stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    flat = _end_to_end(tensors)
    if flat is not None:  # already stacked in memory: a view, no copy
        return flat.view(len(tensors), *tensors[0].shape)
    arrays = _numpy_views(tensors)
    if arrays is None:
        return torch.stack(list(tensors))
    return torch.from_numpy(np.stack(arrays))


def collate_spc(samples: Sequence[Mapping[str, Any] | None]) -> dict[str, Any]:
    """Batch SPC samples (dicts of CPU tensors from ``CachedDataset``).

    ``None`` samples (what ``CachedDataset(on_error="skip")`` returns for a sample it
    left out) are dropped: the batch is shorter. A batch of nothing but ``None`` gives
    an empty dict, which a training loop skips (``if not batch: continue``): a
    DataLoader cannot drop a batch by itself.

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
    - a field the recipe declares with a first dimension each record sets for itself
      (a plugin's ``voxels`` ``Field("int16", "[N, 3]", ...)``): always concatenated
      along dim 0, with ``<name>_lengths`` (int32 ``[B]``), also in a batch of one or of
      equal sizes, so every batch of an epoch has one layout. ``CachedDataset``'s samples
      (:class:`SpcSample`) carry these names, when the recipe is installed where the
      dataset reads; a ``transform`` that returns a plain dict keeps them for the
      fields it leaves under their names.
    - any other tensor (first dimension fixed by the recipe's parameters, or a sample
      that carries no declaration): stacked when every sample has the same shape
      (``center`` ``[B, 3]``, ``scale`` ``[B]``, ``query_points`` ``[B, M, 3]``);
      otherwise concatenated along dim 0 with ``<name>_lengths`` (int32 ``[B]``).
    - anything else: ``torch.utils.data.default_collate``.
    - ``sample_ids`` (a list of str, one per sample kept, in batch order): which samples
      the batch holds, when every sample says (``CachedDataset``'s do: its
      :class:`SpcSample`'s ``sample_id``), so a training loop can log and check what it
      trained on. Not added when a field of that name exists.

    In a DataLoader worker of ``CachedDataset(views=True)`` the samples are
    :class:`~cache_store.views.hop.LocatedSample` (where each checked record lies): the
    batch is then a :class:`~cache_store.views.hop.LocatedBatch`, which the training
    process unpickles as this function's batch of its own views of those records.

    A field whose tensors already lie end to end in one storage (``CachedDataset``'s
    batched reads lay each field of a batch out that way) is returned as a view of that
    storage, without copying; otherwise it is copied into a new tensor.

    Raises:
        ParameterError: empty batch (no samples at all), samples with different fields, pyramids of
            different levels, exsum not matching its octree, or tensors that fit neither
            layout.
    """
    if not samples:
        raise _problem("empty batch")
    present = [sample for sample in samples if sample is not None]
    if not present:
        return {}
    if all(isinstance(sample, LocatedSample) for sample in present):
        # in a DataLoader worker of CachedDataset(views=True): the batch crosses as where
        # its records lie and is collated in the training process (cache_store.views.hop)
        return LocatedBatch(present, collate_spc)  # type: ignore[arg-type,return-value]
    names = list(present[0])
    for i, sample in enumerate(present):
        if set(sample) != set(names):
            raise _problem(f"sample {i} has fields {sorted(sample)}, sample 0 has {sorted(names)}")
    variable: set[str] = set()
    for sample in present:
        variable.update(getattr(sample, "variable", ()))
    sample_ids = [getattr(sample, "sample_id", None) for sample in present]
    out: dict[str, Any] = {}
    for name in names:
        values = [sample[name] for sample in present]
        if not all(isinstance(v, torch.Tensor) for v in values):
            out[name] = default_collate(values)
        elif name in CONCATENATED_FIELDS:
            out[name] = _cat(name, values)
            if name == "octree":
                out["lengths"] = _lengths(values)
        elif name in PYRAMID_FIELDS:
            shapes = sorted({tuple(v.shape) for v in values})
            if len(shapes) > 1:
                raise _problem(
                    f"{name} shapes {shapes} differ: octrees of different levels "
                    f"cannot share one Kaolin batch (read one fingerprint per loader)"
                )
            out[name] = _stack(values)
        elif name not in variable and len({v.shape for v in values}) == 1:
            out[name] = _stack(values)
        else:
            out[name] = _cat(name, values)
            out[f"{name}_lengths"] = _lengths(values)
    if (
        "octree" in out
        and "exsum" in out
        and isinstance(out["exsum"], torch.Tensor)
        and out["exsum"].shape[0] != out["octree"].shape[0]
    ):
        raise _problem(
            f"exsum has {out['exsum'].shape[0]} entries for "
            f"{out['octree'].shape[0]} octree bytes (expected Kaolin 0.18's "
            f"inclusive layout, one per byte)"
        )
    if "sample_ids" not in out and all(isinstance(s, str) for s in sample_ids):
        out["sample_ids"] = sample_ids
    return out
