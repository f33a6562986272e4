"""Input checks shared by both SPC backends.

Every check raises :class:`~cache_store.errors.TensorTypeError` (a ``TypeError``) for a
wrong type or dtype and :class:`~cache_store.errors.InvalidTensor` (a ``ValueError``) for a
wrong shape, range or content. Messages name the argument, what was expected and what
was found. Both backends run the same checks, so bad input fails the same way whichever
backend is asked.

The structural checks of octrees live here too (:func:`octree_structure`): they walk the
levels of each packed octree the way Kaolin's ``scan_octrees`` does and refuse octrees
whose bytes do not add up to their lengths, instead of letting a kernel read past them.
"""

from __future__ import annotations

import operator
import warnings
from typing import SupportsIndex, cast

import torch

from cache_store.errors import InvalidTensor, TensorTypeError

__all__ = [
    "MAX_LEVEL",
    "check_tensor",
    "check_level",
    "check_points",
    "check_float_coords",
    "check_morton",
    "check_morton_points",
    "check_octree",
    "check_lengths",
    "check_query_coords",
    "check_pyramids",
    "current_exsum",
    "popcount_u8",
    "inclusive_exsum",
    "octree_structure",
]

MAX_LEVEL = 15
"""Deepest level whose coordinates fit int16 points (``2**15 - 1`` is int16's maximum)."""

_FLOAT_DTYPES = (torch.float16, torch.float32, torch.float64)


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def check_tensor(
    name: str, value: object, dtypes: tuple[torch.dtype, ...] | None = None, expected: str = ""
) -> torch.Tensor:
    """``value`` must be a tensor (of one of ``dtypes`` when given)."""
    if not isinstance(value, torch.Tensor):
        raise TensorTypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        want = expected or " or ".join(str(d) for d in dtypes)
        raise TensorTypeError(f"{name}: expected dtype {want}, got {value.dtype}")
    return value


def check_level(level: object, name: str = "level", low: int = 0, high: int = MAX_LEVEL) -> int:
    """``level`` must be a Python (or 0-d tensor) integer in ``[low, high]``."""
    if isinstance(level, bool) or (isinstance(level, torch.Tensor) and level.dim() != 0):
        raise TensorTypeError(f"{name}: expected an int, got {type(level).__name__}")
    try:
        level = operator.index(cast(SupportsIndex, level))  # int, numpy ints, 0-d int tensors
    except TypeError:
        raise TensorTypeError(f"{name}: expected an int, got {type(level).__name__}") from None
    if not low <= level <= high:
        raise InvalidTensor(
            f"{name}: expected an integer in [{low}, {high}] "
            f"(int16 coordinates allow at most {MAX_LEVEL}), got {level}"
        )
    return level


def _first_bad_row(points: torch.Tensor, bad: torch.Tensor) -> str:
    rows = bad.reshape(points.shape[0], -1).any(dim=1).nonzero()
    row = int(rows[0, 0])
    return f"row {row}: {tuple(int(v) for v in points[row].tolist())}"


def check_points(
    points: object, level: int | None = None, name: str = "points", allow_empty: bool = False
) -> torch.Tensor:
    """Quantized points: int16 of shape (num_points, 3), coordinates in [0, 2**level).

    Without ``level`` only negative coordinates are refused (any non-negative int16 fits
    the 15 levels a Morton code holds).
    """
    points = check_tensor(name, points, (torch.int16,), "torch.int16")
    if points.dim() != 2 or points.shape[1] != 3:
        raise InvalidTensor(f"{name}: expected shape (num_points, 3), got {_shape(points)}")
    if points.shape[0] == 0:
        if allow_empty:
            return points
        raise InvalidTensor(f"{name}: expected at least one point, got an empty point set")
    high = (1 << level) if level is not None else (1 << MAX_LEVEL)
    # every non-negative int16 is below 2**15: only lower levels need the upper bound
    bad = (points < 0) | (points >= high) if high <= 32767 else points < 0
    if bool(bad.any()):
        lo, hi = int(points.min()), int(points.max())
        where = f"for level {level}" if level is not None else "for int16 Morton codes"
        raise InvalidTensor(
            f"{name}: coordinates must lie in [0, {high}) {where}; got values "
            f"in [{lo}, {hi}] (first offending {_first_bad_row(points, bad)})"
        )
    return points


def check_float_coords(x: object, name: str = "x") -> torch.Tensor:
    """Floating point coordinates of shape (..., 3), without NaN."""
    x = check_tensor(name, x, _FLOAT_DTYPES, "float16, float32 or float64")
    if x.dim() == 0 or x.shape[-1] != 3:
        raise InvalidTensor(f"{name}: expected shape (..., 3), got {_shape(x)}")
    if x.numel() and bool(torch.isnan(x).any()):
        raise InvalidTensor(f"{name}: contains NaN coordinates")
    return x


def check_morton_points(points: object, name: str = "points") -> torch.Tensor:
    """The int16 points of ``points_to_morton``: shape (..., num_points, 3).

    A lone point of shape (3,) is refused in both backends: Kaolin 0.18 reshapes its codes
    to ``points.shape[:-1]``, which for (3,) is ``reshape()`` with no size, a TypeError."""
    points = check_tensor(name, points, (torch.int16,), "torch.int16")
    if points.dim() < 2 or points.shape[-1] != 3:
        raise InvalidTensor(
            f"{name}: expected shape (..., num_points, 3), got {_shape(points)}"
            + (" (one point is [[x, y, z]], shape (1, 3))" if points.dim() == 1 else "")
        )
    return points


def check_morton(morton: object, name: str = "morton") -> torch.Tensor:
    """Morton codes: int64 of any shape, each in [0, 2**45) (15 levels of 3 bits)."""
    morton = check_tensor(name, morton, (torch.int64,), "torch.int64")
    if morton.numel() and bool(((morton < 0) | (morton >= (1 << (3 * MAX_LEVEL)))).any()):
        raise InvalidTensor(
            f"{name}: Morton codes must lie in [0, 2**{3 * MAX_LEVEL}); got values "
            f"in [{int(morton.min())}, {int(morton.max())}]"
        )
    return morton


def check_octree(octree: object, name: str = "octree") -> torch.Tensor:
    """Octree bytes: uint8 of shape (num_bytes,), at least one byte."""
    octree = check_tensor(name, octree, (torch.uint8,), "torch.uint8")
    if octree.dim() != 1:
        raise InvalidTensor(f"{name}: expected shape (num_bytes,), got {_shape(octree)}")
    if octree.shape[0] == 0:
        raise InvalidTensor(f"{name}: expected at least one byte, got an empty octree")
    return octree


_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def check_lengths(lengths: object, num_bytes: int, name: str = "lengths") -> torch.Tensor:
    """Bytes per packed octree: integer of shape (batch_size,), each >= 1, summing to num_bytes.

    Returns the lengths as an int64 CPU tensor.
    """
    lengths = check_tensor(name, lengths, _INT_DTYPES, "an integer dtype (torch.int32)")
    if lengths.dim() != 1 or lengths.shape[0] == 0:
        raise InvalidTensor(
            f"{name}: expected shape (batch_size,) with batch_size >= 1, got {_shape(lengths)}"
        )
    lengths = lengths.to(device="cpu", dtype=torch.int64)
    if bool((lengths < 1).any()):
        raise InvalidTensor(f"{name}: every octree needs at least one byte; got {lengths.tolist()}")
    total = int(lengths.sum())
    if total != num_bytes:
        raise InvalidTensor(
            f"{name}: octree lengths sum to {total} but octrees holds {num_bytes} bytes"
        )
    return lengths


def check_query_coords(query_coords: object, name: str = "query_coords") -> torch.Tensor:
    """Query coordinates of shape (num_query, 3): float (normalized) or integer (voxels)."""
    q = check_tensor(name, query_coords)
    if q.dtype not in _FLOAT_DTYPES and q.dtype not in _INT_DTYPES:
        raise TensorTypeError(f"{name}: expected a float16/32/64 or integer dtype, got {q.dtype}")
    if q.dim() != 2 or q.shape[1] != 3:
        raise InvalidTensor(f"{name}: expected shape (num_query, 3), got {_shape(q)}")
    return q


def check_pyramids(pyramids: object, name: str = "pyramids") -> torch.Tensor:
    """Pyramids: int32 of shape (batch_size, 2, max_level + 2); returned on the CPU."""
    pyramids = check_tensor(name, pyramids, (torch.int32,), "torch.int32")
    if pyramids.dim() != 3 or pyramids.shape[1] != 2 or pyramids.shape[2] < 2:
        raise InvalidTensor(
            f"{name}: expected shape (batch_size, 2, max_level + 2), got {_shape(pyramids)}"
        )
    return pyramids.cpu()


def popcount_u8(octree: torch.Tensor) -> torch.Tensor:
    """Set bits of each byte. ``octree`` uint8 (n,) -> uint8 (n,)."""
    x = octree - ((octree >> 1) & 0x55)
    x = (x & 0x33) + ((x >> 2) & 0x33)
    return (x + (x >> 4)) & 0x0F


def inclusive_exsum(octrees: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-octree inclusive running sum of set bits.

    ``octrees`` uint8 (num_bytes,), ``lengths`` int64 CPU (batch_size,) ->
    int32 (num_bytes,) on the device of ``octrees``.
    """
    exsum = torch.cumsum(popcount_u8(octrees), dim=0, dtype=torch.int32)
    if lengths.shape[0] > 1:
        ends = torch.cumsum(lengths, 0)[:-1].to(octrees.device)
        bases = torch.cat([exsum.new_zeros(1), exsum[ends - 1]])
        exsum -= torch.repeat_interleave(
            bases, lengths.to(octrees.device), output_size=octrees.shape[0]
        )
    return exsum


def current_exsum(
    exsum: object, lengths: torch.Tensor, caller: str, name: str = "exsum"
) -> torch.Tensor:
    """``exsum`` int32 in the current layout (num_bytes,); the legacy layout
    (num_bytes + batch_size, a leading 0 per octree) is converted with a DeprecationWarning,
    as Kaolin 0.18 does."""
    exsum = check_tensor(name, exsum, (torch.int32,), "torch.int32")
    num_bytes, batch = int(lengths.sum()), lengths.shape[0]
    if exsum.dim() != 1 or exsum.shape[0] not in (num_bytes, num_bytes + batch):
        raise InvalidTensor(
            f"{name}: expected shape ({num_bytes},) for {num_bytes} octree bytes "
            f"(or the legacy ({num_bytes + batch},)), got {_shape(exsum)}"
        )
    if exsum.shape[0] == num_bytes:
        return exsum
    warnings.warn(
        f"{caller} received a legacy exsum of length num_bytes + batch_size; the "
        "current layout (inclusive sums, length num_bytes) is expected",
        DeprecationWarning,
        stacklevel=3,
    )
    return from_legacy_exsum(exsum, lengths)


def _legacy_starts(lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
    lengths = lengths.to(device="cpu", dtype=torch.int64)
    return (torch.cumsum(lengths + 1, 0) - (lengths + 1)).to(device)


def from_legacy_exsum(exsum: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The current exsum layout (per-octree inclusive sums, ``num_bytes``) from the legacy
    one (a leading 0 per octree, ``num_bytes + batch_size``), as released Kaolin 0.18.0
    wheels still return and take it."""
    keep = torch.ones(exsum.shape[0], dtype=torch.bool, device=exsum.device)
    keep[_legacy_starts(lengths, exsum.device)] = False
    return exsum[keep]


def to_legacy_exsum(exsum: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The legacy exsum layout (a leading 0 per octree) from the current one."""
    out = exsum.new_zeros(exsum.shape[0] + lengths.shape[0])
    keep = torch.ones(out.shape[0], dtype=torch.bool, device=exsum.device)
    keep[_legacy_starts(lengths, exsum.device)] = False
    out[keep] = exsum
    return out


def octree_structure(
    exsum: torch.Tensor, lengths: torch.Tensor, name: str = "octrees"
) -> tuple[int, torch.Tensor]:
    """Walk the levels of each packed octree; return ``(max_level, pyramids)``.

    ``exsum``: int32 (num_bytes,), the per-octree inclusive sums of a *correct* bit count
    (see :func:`inclusive_exsum`); ``lengths``: int64 CPU (batch_size,). Pyramids come back
    as int32 CPU (batch_size, 2, max_level + 2).

    The walk follows Kaolin: level ``l + 1`` starts right after level ``l`` and holds as
    many points as level ``l``'s bytes have set bits. An octree is consistent when a level
    starts exactly at its byte count (every earlier point owns a byte, no later one does),
    every level is non-empty, and it is at most :data:`MAX_LEVEL` deep. All octrees of a
    batch must share one depth: Kaolin 0.18 sizes the pyramids by the last octree's depth
    and its ``generate_points`` mis-reads shallower ones, so a mixed batch is refused.
    """
    ex = exsum.to(device="cpu", dtype=torch.int64)
    batch = lengths.shape[0]
    offsets = torch.cumsum(lengths, 0) - lengths
    counts = [torch.ones(batch, dtype=torch.int64)]
    starts = [torch.zeros(batch, dtype=torch.int64), torch.ones(batch, dtype=torch.int64)]
    prev_sum = torch.zeros(batch, dtype=torch.int64)
    level = 1
    while True:
        start = starts[level]
        over = start > lengths
        if bool(over.any()):
            b = int(over.nonzero()[0, 0])
            raise InvalidTensor(
                f"{name}: octree {b}'s bytes do not add up to its length {int(lengths[b])}: "
                f"its level {level - 1} holds points {int(starts[level - 1][b])} to "
                f"{int(start[b]) - 1}, so some but not all of them own a byte"
            )
        at_end = start == lengths
        if level > MAX_LEVEL:
            raise InvalidTensor(
                f"{name}: an octree deeper than {MAX_LEVEL} levels (the most "
                f"int16 points allow); its bytes may not add up to its length"
            )
        if bool(at_end.any()) and not bool(at_end.all()):
            b, c = int(at_end.nonzero()[0, 0]), int((~at_end).nonzero()[0, 0])
            raise InvalidTensor(
                f"{name}: octrees in one batch must share one depth (Kaolin 0.18 sizes pyramids "
                f"by the last one): octree {b} has depth {level}, octree {c} is deeper"
            )
        cur_sum = ex[offsets + start - 1]
        count = cur_sum - prev_sum
        if bool((count < 1).any()):
            b = int((count < 1).nonzero()[0, 0])
            raise InvalidTensor(
                f"{name}: octree {b} has no points at level {level}: the bytes "
                f"of level {level - 1} have no bits set"
            )
        counts.append(count)
        if bool(at_end.all()):
            break
        starts.append(start + count)
        prev_sum = cur_sum
        level += 1
    max_level = level
    # counts[l] and starts[l] for l = 0..max_level; the last column is (0, total points).
    row0 = torch.stack(counts + [torch.zeros(batch, dtype=torch.int64)], dim=1)
    row1 = torch.stack(starts + [starts[max_level] + counts[max_level]], dim=1)
    pyramids = torch.stack([row0, row1], dim=1).to(torch.int32)
    return max_level, pyramids
