"""Morton codes of int16 voxel coordinates, shared by the torch backend's modules.

For each bit i of the coordinates, z's bit goes to 3i, y's to 3i+1 and x's to 3i+2 (the
layout of ``kaolin.ops.spc``). No checks here: callers pass valid, non-negative points.
"""

from __future__ import annotations

import torch

# Magic masks that spread the bits of a 16-bit integer three apart (and gather them back).
SPREAD = (
    (16, 0x1F0000FF0000FF),
    (8, 0x100F00F00F00F00F),
    (4, 0x10C30C30C30C30C3),
    (2, 0x1249249249249249),
)
SPREAD32 = ((16, 0x030000FF), (8, 0x0300F00F), (4, 0x030C30C3), (2, 0x09249249))
GATHER = (
    (2, 0x10C30C30C30C30C3),
    (4, 0x100F00F00F00F00F),
    (8, 0x1F0000FF0000FF),
    (16, 0x1F00000000FFFF),
    (32, 0x1FFFFF),
)


def spread_bits(v: torch.Tensor) -> torch.Tensor:
    """Spread bit i of ``v`` to bit 3*i. ``v``: int32 (< 2**10) or int64 (< 2**16)."""
    for shift, mask in SPREAD32 if v.dtype == torch.int32 else SPREAD:
        v = (v | (v << shift)) & mask
    return v


def encode(points: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Morton codes of valid int16 points (n, 3) as ``dtype`` (n,)."""
    xyz = points.to(dtype)
    code = spread_bits(xyz[:, 2].contiguous())
    code |= spread_bits(xyz[:, 1].contiguous()) << 1
    code |= spread_bits(xyz[:, 0].contiguous()) << 2
    return code


def decode(morton: torch.Tensor) -> torch.Tensor:
    """int16 points (n, 3) of int64 Morton codes (n,) in [0, 2**45)."""
    axes = []
    for axis_shift in (2, 1, 0):
        v = (morton >> axis_shift) & 0x1249249249249249
        for shift, mask in GATHER:
            v = (v ^ (v >> shift)) & mask
        axes.append(v.to(torch.int16))
    return torch.stack(axes, dim=1)
