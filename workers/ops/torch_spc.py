"""Kaolin 0.18's SPC ops in pure PyTorch, bit for bit, on whatever device the inputs live.

Same names, argument order, dtypes, shapes and results as ``kaolin.ops.spc`` (see
``docs/SPC_SEMANTICS.md``). Every function is vectorised: Python loops
run over octree levels only (at most 15), never over points or nodes. Outputs live on the
device of the inputs, except pyramids, which Kaolin keeps on the CPU and so do we.

Bad input raises :class:`~cache_store.errors.TensorTypeError` (a ``TypeError``) or
:class:`~cache_store.errors.InvalidTensor` (a ``ValueError``) naming the argument; where
Kaolin would read out of bounds or loop forever we refuse instead (see ``_checks``).

The dual octree and trinkets are written in :mod:`workers.ops.torch_dual` and re-exported
here, so this module is the whole torch backend; Morton codes are in ``_morton``.
"""

from __future__ import annotations

import warnings

import torch

from cache_store.errors import InvalidTensor

from . import _checks, _morton
from .torch_dual import unbatched_make_dual, unbatched_make_trinkets

__all__ = [
    "name",
    "quantize_points",
    "points_to_morton",
    "morton_to_points",
    "unbatched_points_to_octree",
    "scan_octrees",
    "generate_points",
    "unbatched_query",
    "unbatched_get_level_points",
    "points_to_corners",
    "unbatched_make_dual",
    "unbatched_make_trinkets",
]

name = "torch"

# Morton codes of up to 10 levels (30 bits) fit int32, which sorts and shifts about twice
# as fast as int64 on the CPU; deeper levels use int64.
_INT32_LEVELS = 10


def quantize_points(x: torch.Tensor, level: int) -> torch.Tensor:
    r"""Quantize :math:`[-1, 1]` coordinates to integer voxels of :math:`[0, 2^{level})`.

    ``floor(clamp(2**level * (x + 1) / 2, 0, 2**level - 1))`` computed in the precision of
    ``x`` (float16 input is quantized in float16, as Kaolin does), then cast to int16.
    Points outside :math:`[-1, 1]` are clamped to the border voxels.

    Args:
        x (torch.FloatTensor): float16/32/64 coordinates of shape :math:`(..., 3)`, no NaN.
        level (int): level of the grid, in [0, 15].

    Returns:
        (torch.ShortTensor): int16 voxel coordinates, of the same shape as ``x``.
    """
    x = _checks.check_float_coords(x)
    level = _checks.check_level(level)
    res = 2**level
    return torch.floor(torch.clamp(res * (x + 1.0) / 2.0, 0, res - 1.0)).short()


def points_to_morton(points: torch.Tensor) -> torch.Tensor:
    r"""Morton codes of quantized points.

    For each bit i of the coordinates, z's bit goes to 3i, y's to 3i+1 and x's to 3i+2.

    Args:
        points (torch.ShortTensor): int16 points of shape :math:`(..., \text{num_points}, 3)`,
            non-negative. A lone point of shape (3,) is refused (Kaolin 0.18 fails on it).

    Returns:
        (torch.LongTensor): int64 codes of shape :math:`(..., \text{num_points})`.
    """
    shape = _checks.check_morton_points(points).shape
    flat = _checks.check_points(points.reshape(-1, 3), allow_empty=True)
    return _morton.encode(flat, torch.int64).reshape(shape[:-1])


def morton_to_points(morton: torch.Tensor) -> torch.Tensor:
    r"""Quantized points of Morton codes (the inverse of :func:`points_to_morton`).

    Args:
        morton (torch.LongTensor): int64 codes of shape :math:`(...)`, in :math:`[0, 2^{45})`.

    Returns:
        (torch.ShortTensor): int16 points of shape :math:`(..., 3)`.
    """
    morton = _checks.check_morton(morton)
    return _morton.decode(morton.reshape(-1)).reshape(*morton.shape, 3)


_CHILD_BITS = torch.tensor([1 << c for c in range(8)], dtype=torch.uint8)


def _run_starts(values: torch.Tensor) -> torch.Tensor:
    """int64 indices where a run of equal values starts in a 1-d tensor (at least 1 long)."""
    first = torch.ones(values.shape[0], dtype=torch.bool, device=values.device)
    torch.ne(values[1:], values[:-1], out=first[1:])
    return first.nonzero().squeeze(1)


def sorted_unique_morton(points: torch.Tensor, level: int, is_sorted: bool) -> torch.Tensor:
    """Sorted distinct Morton codes of valid points (int32 up to level 10, else int64).

    With ``is_sorted`` the points must already be in Morton order (else InvalidTensor);
    both backends' ``unbatched_points_to_octree(sorted=True)`` check it with this."""
    dtype = torch.int32 if level <= _INT32_LEVELS else torch.int64
    morton = _morton.encode(points, dtype)
    if not is_sorted:  # sort + drop repeats is cheaper than torch.unique on the CPU
        morton = torch.sort(morton).values
        return morton.index_select(0, _run_starts(morton))
    if morton.shape[0] > 1:
        step = morton[1:] - morton[:-1]
        if bool((step < 0).any()):
            row = int((step < 0).nonzero()[0, 0]) + 1
            raise InvalidTensor(
                f"points: sorted=True but the points are not in Morton order (row {row} comes "
                f"before row {row - 1}); pass sorted=False to sort them"
            )
        if bool((step == 0).any()):  # duplicates add nothing to an octree; drop them
            morton = torch.unique_consecutive(morton)
    return morton


def unbatched_points_to_octree(
    points: torch.Tensor, level: int, sorted: bool = False
) -> torch.Tensor:  # `sorted` is Kaolin's name
    r"""Build the octree of a set of quantized points.

    Points are deduplicated and ordered by Morton code; the octree holds one byte per
    non-leaf node, breadth first, in Morton order within a level; bit ``c`` of a byte is
    set when child ``c = (x_bit << 2) | (y_bit << 1) | z_bit`` exists.

    Args:
        points (torch.ShortTensor): int16 points of shape :math:`(\text{num_points}, 3)`,
            in :math:`[0, 2^{level})`, at least one.
        level (int): depth of the octree (the level of the points), in [1, 15].
        sorted (bool): the points are already in Morton order (duplicates are tolerated;
            out-of-order points raise). Default: False.

    Returns:
        (torch.ByteTensor): uint8 octree of shape :math:`(\text{num_bytes})`.
    """
    level = _checks.check_level(level, low=1)
    points = _checks.check_points(points, level)
    morton = sorted_unique_morton(points, level, bool(sorted))
    child_bits = _CHILD_BITS.to(morton.device)
    levels = []
    for _ in range(level):
        parent = morton >> 3
        starts = _run_starts(parent)
        # Children of one parent are adjacent and distinct, so the byte is the sum of their
        # bits: a difference of running sums (mod 256, exact since each byte is < 256).
        running = torch.cumsum(child_bits.index_select(0, morton & 7), 0, dtype=torch.uint8)
        ends = torch.empty_like(starts)
        ends[:-1] = starts[1:] - 1
        ends[-1] = morton.shape[0] - 1
        at_end = running.index_select(0, ends)
        levels.append(torch.diff(at_end, prepend=at_end.new_zeros(1)))
        morton = parent.index_select(0, starts)
    return torch.cat(levels[::-1])


def scan_octrees(
    octrees: torch.Tensor, lengths: torch.Tensor, legacy_exsum: bool = False
) -> tuple[int, torch.Tensor, torch.Tensor]:
    r"""Scan packed octrees: their depth, pyramids and per-octree inclusive bit sums.

    Args:
        octrees (torch.ByteTensor): uint8 packed octrees of shape :math:`(\text{num_bytes})`.
        lengths (torch.IntTensor): bytes per octree, integer of shape
            :math:`(\text{batch_size})` (on any device), summing to ``num_bytes``.
        legacy_exsum (bool): return the deprecated pre-0.18 exsum layout (a leading 0 per
            octree, size ``num_bytes + batch_size``) with a DeprecationWarning. Default: False.

    Returns:
        (int, torch.IntTensor, torch.IntTensor):

            - max_level: the depth shared by all octrees.
            - pyramids: int32 of shape :math:`(\text{batch_size}, 2, \text{max_level} + 2)`,
              on the CPU. Row 0: points per level (the last column is 0); row 1: index of
              each level's first point (the last column is the number of points).
            - exsum: int32 of shape :math:`(\text{num_bytes})` on the device of ``octrees``:
              the inclusive running sum of set bits, restarted for each octree.
    """
    octrees = _checks.check_octree(octrees, "octrees")
    lengths = _checks.check_lengths(lengths, octrees.shape[0])
    exsum = _checks.inclusive_exsum(octrees, lengths)
    max_level, pyramids = _checks.octree_structure(exsum, lengths)
    if legacy_exsum:
        warnings.warn(
            "scan_octrees(legacy_exsum=True) returns the deprecated exsum layout of "
            "size num_bytes + batch_size",
            DeprecationWarning,
            stacklevel=2,
        )
        exsum = _checks.to_legacy_exsum(exsum, lengths)
    return max_level, pyramids, exsum


def checked_structure(
    octrees: torch.Tensor, pyramids: torch.Tensor, exsum: torch.Tensor, caller: str
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Check that ``pyramids`` and ``exsum`` are those of ``octrees``; return
    ``(max_level, byte lengths (int64 CPU), exsum in the current layout)``."""
    octrees = _checks.check_octree(octrees, "octrees")
    pyramids = _checks.check_pyramids(pyramids)
    max_level = pyramids.shape[2] - 2
    lengths = pyramids[:, 1, max_level].to(torch.int64)
    if bool((lengths < 1).any()) or int(lengths.sum()) != octrees.shape[0]:
        raise InvalidTensor(
            f"pyramids: they describe octrees of {lengths.tolist()} bytes, but octrees holds "
            f"{octrees.shape[0]} bytes"
        )
    exsum = _checks.current_exsum(exsum, lengths, caller)
    expected = _checks.inclusive_exsum(octrees, lengths)
    if exsum.device != octrees.device or not torch.equal(exsum, expected):
        raise InvalidTensor(
            "exsum: not the inclusive bit sums of octrees (on their device); "
            "compute it with scan_octrees"
        )
    level, expected_pyramids = _checks.octree_structure(expected, lengths)
    if level != max_level or not torch.equal(pyramids, expected_pyramids):
        raise InvalidTensor("pyramids: not the pyramids of octrees; compute them with scan_octrees")
    return max_level, lengths, exsum


_CHILD_OFFSETS = torch.tensor(
    [[(c >> 2) & 1, (c >> 1) & 1, c & 1] for c in range(8)], dtype=torch.int16
)


def _level_bytes(
    octrees: torch.Tensor, byte_offsets: torch.Tensor, pyramids: torch.Tensor, level: int
) -> torch.Tensor:
    """The bytes of every octree's level ``level``, octree after octree."""
    starts = byte_offsets + pyramids[:, 1, level].to(torch.int64)
    counts = pyramids[:, 0, level].to(torch.int64)
    if starts.shape[0] == 1:
        return octrees[int(starts[0]) : int(starts[0]) + int(counts[0])]
    return octrees.index_select(0, _ranges(starts, counts).to(octrees.device))


def _ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Concatenated ``arange(start, start + count)``, int64 CPU."""
    total = int(counts.sum())
    shift = starts - (torch.cumsum(counts, 0) - counts)
    return torch.arange(total) + torch.repeat_interleave(shift, counts, output_size=total)


def generate_points(
    octrees: torch.Tensor, pyramids: torch.Tensor, exsum: torch.Tensor
) -> torch.Tensor:
    r"""Decode packed octrees into their point hierarchies.

    Args:
        octrees (torch.ByteTensor): uint8 packed octrees of shape :math:`(\text{num_bytes})`.
        pyramids (torch.IntTensor): int32 of shape
            :math:`(\text{batch_size}, 2, \text{max_level} + 2)`, from :func:`scan_octrees`.
        exsum (torch.IntTensor): int32 of shape :math:`(\text{num_bytes})`, from
            :func:`scan_octrees` (the legacy layout is accepted with a DeprecationWarning).

    Returns:
        (torch.ShortTensor): int16 of shape :math:`(\text{num_points}, 3)` on the device of
        ``octrees``: each octree's levels root first, octree after octree; the children of
        a node are listed in bit order, child ``c`` at ``2 * parent + (c >> 2 & 1,
        c >> 1 & 1, c & 1)``.
    """
    max_level, lengths, _ = checked_structure(octrees, pyramids, exsum, "generate_points")
    pyramids = pyramids.cpu()
    device = octrees.device
    batch = lengths.shape[0]
    byte_offsets = torch.cumsum(lengths, 0) - lengths
    offsets = _CHILD_OFFSETS.to(device)
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    coords = torch.zeros(batch, 3, dtype=torch.int16, device=device)
    per_level = [coords]
    for level in range(max_level):
        node_bytes = _level_bytes(octrees, byte_offsets, pyramids, level)
        has_child = ((node_bytes.unsqueeze(1) >> shifts) & 1).view(-1).nonzero().squeeze(1)
        coords = coords.index_select(0, has_child >> 3) * 2 + offsets.index_select(0, has_child & 7)
        per_level.append(coords)
    points = torch.cat(per_level)
    if batch == 1:
        return points
    # per_level is level-major (all octrees' level l together); Kaolin lists octree after
    # octree. Point k of octree b's level l goes to point_offset[b] + pyramids[b, 1, l] + k.
    totals = pyramids[:, 1, max_level + 1].to(torch.int64)
    point_offsets = torch.cumsum(totals, 0) - totals
    starts = point_offsets.unsqueeze(1) + pyramids[:, 1, : max_level + 1].to(torch.int64)
    counts = pyramids[:, 0, : max_level + 1].to(torch.int64)
    where = _ranges(starts.t().reshape(-1), counts.t().reshape(-1)).to(device)
    out = torch.empty_like(points)
    out[where] = points
    return out


def query_voxels(
    query_coords: torch.Tensor, level: int, with_parents: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The level-``level`` voxel of each query the way Kaolin 0.18 computes it.

    ``query_coords`` (num_query, 3), checked; returns ``(voxels, inside)``: int16
    (num_query, 3) (0 where outside) and bool (num_query,). Integer queries become
    ``(q.float() / 2**level) * 2 - 1`` first. The single-level query floors
    ``0.5 * 2**level * (coord + 1)`` in float32 (float64 for float64 input); the
    multi-level one truncates ``(coord * 0.5 + 0.5) * 2**level`` in float64 toward zero
    (computed as ``(coord + 1) * 2**(level - 1)``: scaling by a power of two commutes with
    rounding, so the two are the same number). A voxel is inside when all three
    coordinates lie in ``[0, 2**level - 1]``; NaN never is (Kaolin leaves NaN and
    coordinates beyond int16 undefined: we call them outside).
    """
    q = query_coords
    if not q.is_floating_point():
        q = (q.float() / (2**level)) * 2.0 - 1.0
    if with_parents:
        v = q.to(torch.float64, copy=True).add_(1.0).mul_(0.5 * 2**level).trunc_()
    else:
        v = q.to(torch.float64 if q.dtype == torch.float64 else torch.float32, copy=True)
        v.add_(1.0).mul_(0.5 * 2**level).floor_()
    half = (2**level - 1) / 2
    ok = v.sub(half).abs_() <= half  # 0 <= v <= 2**level - 1, false for NaN
    inside = ok[:, 0] & ok[:, 1] & ok[:, 2]
    voxels = v.masked_fill_(~inside.unsqueeze(1), 0).to(torch.int16)
    return voxels, inside


def check_query(
    octree: torch.Tensor, exsum: torch.Tensor, query_coords: torch.Tensor, level: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Shared input checks of :func:`unbatched_query`; returns (exsum, query_coords, level)."""
    octree = _checks.check_octree(octree)
    query_coords = _checks.check_query_coords(query_coords)
    level = _checks.check_level(level)
    lengths = torch.tensor([octree.shape[0]], dtype=torch.int64)
    exsum = _checks.current_exsum(exsum, lengths, "unbatched_query")
    expected = _checks.inclusive_exsum(octree, lengths)
    if exsum.device != octree.device or not torch.equal(exsum, expected):
        raise InvalidTensor(
            "exsum: not the inclusive bit sums of octree (on its device); "
            "compute it with scan_octrees"
        )
    if query_coords.device != octree.device:
        raise InvalidTensor(
            f"query_coords: expected device {octree.device} (the "
            f"octree's), got {query_coords.device}"
        )
    depth, _ = _checks.octree_structure(expected, lengths, "octree")
    if level > depth:
        raise InvalidTensor(f"level: the octree has depth {depth}, got level {level}")
    return exsum, query_coords, level


def _rank_table(device: torch.device) -> torch.Tensor:
    """int32 (256, 8): for byte b and child c, popcount(b & ((2 << c) - 1)) when bit c of b
    is set (the child's rank among its siblings, from 1), else a large negative number."""
    byte = torch.arange(256, dtype=torch.int32).unsqueeze(1)
    bits = (byte >> torch.arange(8, dtype=torch.int32)) & 1
    return torch.where(bits == 1, torch.cumsum(bits, dim=1, dtype=torch.int32), -(1 << 30)).to(
        device
    )


def _child_table(octree: torch.Tensor, exsum: torch.Tensor) -> torch.Tensor:
    """int32 ((num_bytes + 1) * 8,): entry ``(j + 1) * 8 + c`` is the point index of node
    j's child c, or -1 when that child is absent; row 0 (for a missing node) is all -1.

    The child's index is ``(0 if j == 0 else exsum[j - 1]) + popcount(byte_j & ((2 << c) - 1))``.
    """
    table = torch.empty((octree.shape[0] + 1) * 8, dtype=torch.int32, device=octree.device)
    table[:8] = -1
    rows = table[8:].view(-1, 8)
    torch.index_select(_rank_table(octree.device), 0, octree.long(), out=rows)
    rows[1:] += exsum[:-1].unsqueeze(1)
    return table.clamp_min_(-1)


def unbatched_query(
    octree: torch.Tensor,
    exsum: torch.Tensor,
    query_coords: torch.Tensor,
    level: int,
    with_parents: bool = False,
) -> torch.Tensor:
    r"""Index in the point hierarchy of the level-``level`` voxel holding each query, or -1.

    Args:
        octree (torch.ByteTensor): uint8 octree of shape :math:`(\text{num_bytes})`.
        exsum (torch.IntTensor): int32 inclusive bit sums of shape :math:`(\text{num_bytes})`
            from :func:`scan_octrees` (the legacy layout is accepted with a warning).
        query_coords (torch.Tensor): shape :math:`(\text{num_query}, 3)`; float16/32/64
            coordinates normalized to :math:`[-1, 1]`, or integer voxel coordinates of
            :math:`[0, 2^{level})`.
        level (int): level to query, at most the octree's depth.
        with_parents (bool): return the index at every level 0..``level``. Default: False.

    Returns:
        (torch.LongTensor): int64 of shape :math:`(\text{num_query})`, or
        :math:`(\text{num_query}, \text{level} + 1)` with ``with_parents``; -1 where the
        voxel is absent (from the first missing level on) or outside the grid.

    Like Kaolin 0.18, the two modes locate a float query differently: the single-level
    query floors ``0.5 * 2**level * (coord + 1)`` in float32 (float64 for float64 input),
    while ``with_parents`` truncates ``(coord * 0.5 + 0.5) * 2**level`` (float64) toward
    zero. So a coordinate slightly below -1 is outside for the first and lands in voxel 0
    for the second. NaN queries, and queries whose voxel lies beyond int16 (where Kaolin is
    undefined), give -1.
    """
    exsum, query_coords, level = check_query(octree, exsum, query_coords, level)
    with_parents = bool(with_parents)
    num_query = query_coords.shape[0]
    shape = (num_query, level + 1) if with_parents else (num_query,)
    out = torch.empty(shape, dtype=torch.int64, device=octree.device)
    table = _child_table(octree, exsum) if level > 0 else None
    # On the CPU, blocks of queries keep each level's temporaries in cache (about 25% faster
    # at 1M queries); on a GPU one block is best. Every block is itself fully vectorised.
    block = _QUERY_BLOCK if octree.device.type == "cpu" else max(num_query, 1)
    for start in range(0, num_query, block):
        _descend(
            table,
            query_coords[start : start + block],
            level,
            with_parents,
            out[start : start + block],
        )
    return out


_QUERY_BLOCK = 1 << 17


def _descend(
    table: torch.Tensor | None,
    query_coords: torch.Tensor,
    level: int,
    with_parents: bool,
    out: torch.Tensor,
) -> None:
    """Write the query results of one block of queries into ``out`` (int64, (n,) or
    (n, level + 1)): the root is node 0 of the table; each level follows one child."""
    voxels, inside = query_voxels(query_coords, level, with_parents)
    node = inside.to(torch.int32) - 1  # the root (0) or -1
    if with_parents:
        out[:, 0] = node
    if table is not None:
        morton = _morton.encode(voxels, torch.int32 if level <= _INT32_LEVELS else torch.int64)
        for depth in range(level - 1, -1, -1):
            child = ((morton >> (3 * depth)) & 7).to(torch.int32)
            node = table.index_select(0, child.bitwise_or_((node + 1) << 3))
            if with_parents:
                out[:, level - depth] = node
    if not with_parents:
        out.copy_(node)


def unbatched_get_level_points(
    point_hierarchy: torch.Tensor, pyramid: torch.Tensor, level: int
) -> torch.Tensor:
    r"""The points of one level of a point hierarchy (a view, no copy).

    Args:
        point_hierarchy (torch.ShortTensor): of shape :math:`(\text{num_points}, 3)` (any
            per-point tensor, e.g. trinkets, works the same).
        pyramid (torch.IntTensor): int32 of shape :math:`(2, \text{max_level} + 2)`.
        level (int): in [0, max_level].

    Returns:
        (torch.ShortTensor): of shape :math:`(\text{num_points_at_level}, 3)`.
    """
    _checks.check_tensor("point_hierarchy", point_hierarchy)
    pyramid = _checks.check_tensor("pyramid", pyramid, (torch.int32,), "torch.int32")
    if pyramid.dim() != 2 or pyramid.shape[0] != 2 or pyramid.shape[1] < 2:
        raise InvalidTensor(
            f"pyramid: expected shape (2, max_level + 2), got {tuple(pyramid.shape)}"
        )
    level = _checks.check_level(level, high=pyramid.shape[1] - 2)
    if point_hierarchy.dim() < 1:
        raise InvalidTensor("point_hierarchy: expected shape (num_points, ...), got ()")
    start, stop = (int(v) for v in pyramid[1, level : level + 2].tolist())
    if not 0 <= start <= stop <= point_hierarchy.shape[0]:
        raise InvalidTensor(
            f"pyramid: level {level} spans points [{start}, {stop}) but point_hierarchy has "
            f"{point_hierarchy.shape[0]}"
        )
    return point_hierarchy[start:stop]


def points_to_corners(points: torch.Tensor) -> torch.Tensor:
    r"""The 8 corners of each voxel, the point itself being corner 0.

    Corner ``c`` is ``point + (c >> 2 & 1, c >> 1 & 1, c & 1)``, in int16 arithmetic (like
    Kaolin, 32767 + 1 wraps).

    Args:
        points (torch.ShortTensor): int16 points of shape :math:`(\text{num_points}, 3)`.

    Returns:
        (torch.ShortTensor): int16 corners of shape :math:`(\text{num_points}, 8, 3)`.
    """
    points = _checks.check_tensor("points", points, (torch.int16,), "torch.int16")
    if points.dim() != 2 or points.shape[1] != 3:
        raise InvalidTensor(f"points: expected shape (num_points, 3), got {tuple(points.shape)}")
    return points.unsqueeze(1) + _CHILD_OFFSETS.to(points.device)
