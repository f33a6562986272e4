"""Slow, obviously-correct reference SPC ops in plain Python, for the property tests.

Written straight from the definitions in docs/SPC_SEMANTICS.md: sets of voxels per level,
sorted by Morton code, with loops everywhere. Only for small inputs.
"""

from __future__ import annotations

import math

import numpy as np

Point = tuple[int, int, int]


def morton(p: Point) -> int:
    x, y, z = p
    code = 0
    for i in range(15):
        code |= ((z >> i) & 1) << (3 * i)
        code |= ((y >> i) & 1) << (3 * i + 1)
        code |= ((x >> i) & 1) << (3 * i + 2)
    return code


def unmorton(code: int) -> Point:
    x = y = z = 0
    for i in range(15):
        z |= ((code >> (3 * i)) & 1) << i
        y |= ((code >> (3 * i + 1)) & 1) << i
        x |= ((code >> (3 * i + 2)) & 1) << i
    return (x, y, z)


def levels(points: list[Point], level: int) -> list[list[Point]]:
    """The occupied voxels of every level 0..level, each level sorted by Morton code."""
    out = []
    for lvl in range(level + 1):
        shift = level - lvl
        voxels = {(x >> shift, y >> shift, z >> shift) for x, y, z in points}
        out.append(sorted(voxels, key=morton))
    return out


def child_bit(child: Point) -> int:
    return ((child[0] & 1) << 2) | ((child[1] & 1) << 1) | (child[2] & 1)


def octree(points: list[Point], level: int) -> list[int]:
    per_level = levels(points, level)
    out = []
    for lvl in range(level):
        below = set(per_level[lvl + 1])
        for node in per_level[lvl]:
            byte = 0
            for c in range(8):
                child = (
                    2 * node[0] + (c >> 2 & 1),
                    2 * node[1] + (c >> 1 & 1),
                    2 * node[2] + (c & 1),
                )
                if child in below:
                    byte |= 1 << c
            out.append(byte)
    return out


def point_hierarchy(points: list[Point], level: int) -> list[Point]:
    return [p for lvl in levels(points, level) for p in lvl]


def pyramid(points: list[Point], level: int) -> list[list[int]]:
    counts = [len(lvl) for lvl in levels(points, level)]
    starts = [sum(counts[:i]) for i in range(level + 2)]
    return [counts + [0], starts]


def exsum(octree_bytes: list[int]) -> list[int]:
    total, out = 0, []
    for byte in octree_bytes:
        total += bin(byte).count("1")
        out.append(total)
    return out


def voxel(coord: float, level: int, dtype: type, with_parents: bool) -> int | None:
    """Kaolin's voxel of one normalized coordinate, or None when undefined (NaN, inf)."""
    if with_parents:
        value = (float(coord) * 0.5 + 0.5) * 2**level
        return math.trunc(value) if math.isfinite(value) else None
    if dtype is np.float64:
        value = 2.0**level * 0.5 * (float(coord) + 1.0)
        return math.floor(value) if math.isfinite(value) else None
    c = np.float32(coord)
    value = np.floor(np.float32(0.5 * 2**level) * (c + np.float32(1.0)))
    return int(value) if np.isfinite(value) else None


def query(
    points: list[Point],
    depth: int,
    coords: list[tuple[float, float, float]],
    level: int,
    dtype: type = np.float32,
    with_parents: bool = False,
) -> list:
    """Indices in the point hierarchy of the octree of ``points`` (depth ``depth``)."""
    per_level = levels(points, depth)
    starts = [sum(len(lvl) for lvl in per_level[:i]) for i in range(depth + 1)]
    rank = [{p: i for i, p in enumerate(lvl)} for lvl in per_level]
    results = []
    for coord in coords:
        vox = [voxel(c, level, dtype, with_parents) for c in coord]
        inside = all(v is not None and 0 <= v < 2**level for v in vox)
        row = []
        for lvl in range(level + 1):
            node = tuple(v >> (level - lvl) for v in vox) if inside else None
            found = node is not None and node in rank[lvl] and (not row or row[-1] >= 0)
            row.append(starts[lvl] + rank[lvl][node] if found else -1)
        results.append(row if with_parents else row[-1])
    return results
