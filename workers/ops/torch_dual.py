"""Kaolin 0.18's dual octree and trinkets in pure PyTorch, bit for bit.

``unbatched_make_dual`` and ``unbatched_make_trinkets`` of ``kaolin.ops.spc`` (see
``docs/SPC_SEMANTICS.md``), with the same conventions as
:mod:`workers.ops.torch_spc`, which re-exports both: that module is the torch backend.
Python loops run over octree levels only. Bad input raises
:class:`~cache_store.errors.TensorTypeError` or :class:`~cache_store.errors.InvalidTensor`
naming the argument.
"""

from __future__ import annotations

import torch

from cache_store.errors import InvalidTensor

from . import _checks, _morton

__all__ = ["unbatched_make_dual", "unbatched_make_trinkets"]


def check_hierarchy(
    point_hierarchy: object, pyramid: object, names: tuple[str, str], corners: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A point hierarchy and its pyramid; returns ``(point_hierarchy, pyramid on the CPU,
    max_level)``. Level ``l``'s points must lie in ``[0, 2**l]`` when they are ``corners``
    (a dual octree), else in ``[0, 2**l)``."""
    ph_name, pyr_name = names
    point_hierarchy = _checks.check_tensor(ph_name, point_hierarchy, (torch.int16,), "torch.int16")
    if point_hierarchy.dim() != 2 or point_hierarchy.shape[1] != 3:
        raise InvalidTensor(
            f"{ph_name}: expected shape (num_points, 3), got {tuple(point_hierarchy.shape)}"
        )
    pyramid = _checks.check_tensor(pyr_name, pyramid, (torch.int32,), "torch.int32")
    if pyramid.dim() != 2 or pyramid.shape[0] != 2 or not 2 <= pyramid.shape[1] <= 17:
        raise InvalidTensor(
            f"{pyr_name}: expected shape (2, max_level + 2) with max_level in "
            f"[0, 15], got {tuple(pyramid.shape)}"
        )
    pyramid = pyramid.cpu()
    max_level = pyramid.shape[1] - 2
    counts = pyramid[0, : max_level + 1].to(torch.int64)
    starts = torch.cumsum(counts, 0) - counts
    if (
        bool((counts < 0).any())
        or not torch.equal(pyramid[1, : max_level + 1].to(torch.int64), starts)
        or int(pyramid[1, max_level + 1]) != point_hierarchy.shape[0]
    ):
        raise InvalidTensor(
            f"{pyr_name}: not a pyramid of {ph_name} (counts per level "
            f"{pyramid[0].tolist()}, starts {pyramid[1].tolist()}, "
            f"{point_hierarchy.shape[0]} points)"
        )
    level_of = torch.repeat_interleave(torch.arange(max_level + 1), counts).to(
        point_hierarchy.device
    )
    high = (1 << level_of).unsqueeze(1) + (1 if corners else 0)
    bad = (point_hierarchy < 0) | (point_hierarchy.to(torch.int64) >= high)
    if bool(bad.any()):
        row = int(bad.any(dim=1).nonzero()[0, 0])
        raise InvalidTensor(
            f"{ph_name}: point {row} {tuple(point_hierarchy[row].tolist())} lies outside its "
            f"level {int(level_of[row])} grid"
        )
    return point_hierarchy, pyramid, max_level


def level_slice(pyramid: torch.Tensor, level: int) -> slice:
    """The rows of ``level`` in a point hierarchy with this (CPU) pyramid."""
    start, count = int(pyramid[1, level]), int(pyramid[0, level])
    return slice(start, start + count)


# Bits of each axis in a Morton code (z at 3i, y at 3i + 1, x at 3i + 2), 21 bits each.
_AXIS_MASKS = tuple(sum(1 << (3 * i + k) for i in range(21)) for k in (2, 1, 0))  # x, y, z
_CORNER_BITS = torch.tensor([[(c >> 2) & 1, (c >> 1) & 1, c & 1] for c in range(8)])


def _corner_morton(points: torch.Tensor) -> torch.Tensor:
    """int64 (n, 8): the Morton codes of the 8 corners of each int16 voxel (n, 3).

    Encodes each voxel once, then adds 1 to each axis inside the code ("dilated"
    addition: the other axes' bits are set to 1 so the carry runs past them), and picks
    each corner's axis parts; in int64, so the far corner of a level-15 voxel (coordinate
    2**15, beyond int16) has its code too."""
    code = _morton.encode(points, torch.int64)
    parts = []
    for axis, mask in enumerate(_AXIS_MASKS):
        low = code & mask
        step = mask & -mask  # the axis's lowest bit
        plus_one = ((low | ~mask) + step) & mask
        parts.append(
            torch.stack([low, plus_one], dim=1)[:, _CORNER_BITS[:, axis].to(points.device)]
        )
    return parts[0] | parts[1] | parts[2]


def unbatched_make_dual(
    point_hierarchy: torch.Tensor, pyramid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The dual octree: the corners of every level's voxels, as a point hierarchy.

    Level ``l`` of the dual holds the distinct corners of level ``l``'s voxels (corner
    ``c`` of voxel ``p`` is ``p + (c >> 2 & 1, c >> 1 & 1, c & 1)``), sorted by Morton
    code, so its coordinates lie in ``[0, 2^l]``.

    Args:
        point_hierarchy (torch.ShortTensor): int16 of shape :math:`(\text{num_points}, 3)`.
        pyramid (torch.IntTensor): int32 of shape :math:`(2, \text{max_level} + 2)`.

    Returns:
        (torch.ShortTensor, torch.IntTensor): the dual point hierarchy, int16 of shape
        :math:`(\text{num_dual_points}, 3)` on the device of ``point_hierarchy``, and the
        dual pyramid, int32 of shape :math:`(2, \text{max_level} + 2)` on the CPU (row 0:
        points per level, 0 in the last column; row 1: first index of each level, the
        total in the last column).

    A level-15 hierarchy whose voxels reach the far border has corners at ``2^15``,
    which int16 cannot hold: it raises :class:`~cache_store.errors.InvalidTensor`.
    """
    point_hierarchy, pyramid, max_level = check_hierarchy(
        point_hierarchy, pyramid, ("point_hierarchy", "pyramid")
    )
    if max_level == _checks.MAX_LEVEL:
        leaves = point_hierarchy[level_slice(pyramid, max_level)]
        if bool((leaves == (1 << _checks.MAX_LEVEL) - 1).any()):
            raise InvalidTensor(
                "point_hierarchy: level-15 voxels on the far border have "
                "corners at 2**15, beyond int16"
            )
    levels = []
    for level in range(max_level + 1):
        codes = _corner_morton(point_hierarchy[level_slice(pyramid, level)])
        levels.append(torch.unique(codes.reshape(-1)))  # sorted ascending
    counts = torch.tensor([len(codes) for codes in levels] + [0], dtype=torch.int64)
    pyramid_dual = torch.zeros(2, max_level + 2, dtype=torch.int32)
    pyramid_dual[0] = counts.to(torch.int32)
    pyramid_dual[1] = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    dual = _morton.decode(torch.cat(levels)) if levels else point_hierarchy.new_empty(0, 3)
    return dual, pyramid_dual


def _lookup(table: torch.Tensor, codes: torch.Tensor, what: str) -> torch.Tensor:
    """int64 index into ``table`` (int64 codes, any order) of each of ``codes``; where a code
    appears several times, its last index (as a dict built in order would give). Raises
    InvalidTensor when a code is missing."""
    order = torch.argsort(table, stable=True)
    ordered = table.index_select(0, order)
    pos = torch.searchsorted(ordered, codes, right=True) - 1
    found = pos >= 0
    pos = pos.clamp_min(0)
    if len(ordered) == 0 or not bool((found & (ordered.index_select(0, pos) == codes)).all()):
        raise InvalidTensor(f"{what}")
    return order.index_select(0, pos)


def unbatched_make_trinkets(
    point_hierarchy: torch.Tensor,
    pyramid: torch.Tensor,
    point_hierarchy_dual: torch.Tensor,
    pyramid_dual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Trinkets (each voxel's 8 corners in the dual octree) and each voxel's parent.

    Args:
        point_hierarchy (torch.ShortTensor): int16 of shape :math:`(\text{num_points}, 3)`.
        pyramid (torch.IntTensor): int32 of shape :math:`(2, \text{max_level} + 2)`.
        point_hierarchy_dual (torch.ShortTensor): int16 of shape
            :math:`(\text{num_dual_points}, 3)`, from :func:`unbatched_make_dual`.
        pyramid_dual (torch.IntTensor): int32 of shape :math:`(2, \text{max_level} + 2)`.

    Returns:
        (torch.IntTensor, torch.IntTensor): on the device of ``point_hierarchy``:

        - trinkets, int32 of shape :math:`(\text{num_points}, 8)`: entry ``[i, c]`` is the
          index of voxel ``i``'s corner ``c`` *within its level* of the dual (add
          ``pyramid_dual[1, level]`` for the index in ``point_hierarchy_dual``);
        - parents, int32 of shape :math:`(\text{num_points})`: the index in
          ``point_hierarchy`` of each voxel's parent, -1 for the root.

    A corner missing from the dual, or a parent missing from the level above, raises
    :class:`~cache_store.errors.InvalidTensor` (Kaolin raises a ``KeyError``).
    """
    point_hierarchy, pyramid, max_level = check_hierarchy(
        point_hierarchy, pyramid, ("point_hierarchy", "pyramid")
    )
    dual, pyramid_dual, dual_level = check_hierarchy(
        point_hierarchy_dual, pyramid_dual, ("point_hierarchy_dual", "pyramid_dual"), corners=True
    )
    if dual_level != max_level:
        raise InvalidTensor(
            f"pyramid_dual: {dual_level + 1} levels, but pyramid has {max_level + 1}"
        )
    device = point_hierarchy.device
    dual = dual.to(device)
    trinkets, parents = [], []
    for level in range(max_level + 1):
        points = point_hierarchy[level_slice(pyramid, level)]
        corners = _corner_morton(points).reshape(-1)
        dual_codes = _morton.encode(dual[level_slice(pyramid_dual, level)], torch.int64)
        trinkets.append(
            _lookup(
                dual_codes,
                corners,
                f"point_hierarchy_dual: level {level} "
                "lacks corners of point_hierarchy's voxels; build it with "
                "unbatched_make_dual",
            ).view(-1, 8)
        )
        if level == 0:
            parents.append(torch.full((len(points),), -1, dtype=torch.int64, device=device))
            continue
        above = _morton.encode(point_hierarchy[level_slice(pyramid, level - 1)], torch.int64)
        mine = _morton.encode(points, torch.int64) >> 3
        parents.append(
            _lookup(
                above,
                mine,
                f"point_hierarchy: a level-{level} voxel has no parent at level {level - 1}",
            )
            + int(pyramid[1, level - 1])
        )
    return torch.cat(trinkets).to(torch.int32), torch.cat(parents).to(torch.int32)
