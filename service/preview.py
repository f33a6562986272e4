"""Pictures of records: one octree level as shaded cubes, rendered with NumPy on the CPU.

No torch and no GPU: the record is decoded with :func:`cache_store.format.decode.decode_arrays`.
The camera is fixed per view (orthographic, the whole normalised cube ``[-1, 1]^3`` in
frame), so pictures of different records and levels line up. Every voxel of a level is
the same cube, so its projection is one pixel *template* (offsets, face, shade) computed
once per picture and stamped at every voxel centre; the nearest voxel wins each pixel
(voxels sorted by depth; the smallest splat number per pixel wins). Query points of ``spc_query``
records are drawn on top: green where the query's voxel at that level is occupied
(``query_pidx[:, level] >= 0``), red where it is not, hidden behind nearer voxels.

Bad requests raise :class:`ParameterError` (the service answers 422).
"""

from __future__ import annotations

import logging
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from cache_store.errors import CorruptRecord, ParameterError
from cache_store.format.decode import decode_arrays
from cache_store.format.header import read_header

__all__ = [
    "VIEWS",
    "MAX_SIZE",
    "MIN_SIZE",
    "MAX_SPLATS",
    "MAX_QUERY_POINTS",
    "PreviewRequest",
    "level_voxels",
    "render_voxels",
    "render_record",
    "drawn_fields",
    "encode_png",
    "decode_png_rgb",
    "record_levels",
]

log = logging.getLogger(__name__)

MIN_SIZE = 16
MAX_SIZE = 1024
#: Voxels x template pixels one picture may stamp (bounds the time: ~0.1 s per million).
MAX_SPLATS = 12_000_000
#: At most this many query points are drawn (an even stride through them).
MAX_QUERY_POINTS = 20_000

BACKGROUND = np.array([248, 248, 246], dtype=np.uint8)
BASE_COLOUR = np.array([0.36, 0.56, 0.86])
_HIT_COLOUR = np.array([30, 160, 60], dtype=np.uint8)
_MISS_COLOUR = np.array([215, 50, 40], dtype=np.uint8)
#: Light direction in view space (x right, y up, z towards the viewer): upper left, front.
#: Splat keys: distance from the camera quantised to _DEPTH_BITS over +-_DEPTH_RANGE,
#: above _SPLAT_BITS of splat number (MAX_SPLATS must fit).
_DEPTH_BITS, _SPLAT_BITS, _DEPTH_RANGE = 22, 40, 1.8
_LIGHT = np.array([-0.3, 0.6, 0.74]) / np.linalg.norm([-0.3, 0.6, 0.74])


def _rotation(yaw_deg: float, pitch_deg: float) -> np.ndarray:
    """World -> view rotation (rows: screen right, screen up, towards the viewer) of a
    camera turned ``yaw`` about world +y and tilted down by ``pitch``."""
    yaw, pitch = np.radians(yaw_deg), np.radians(pitch_deg)
    cy, sy, cp, sp = np.cos(yaw), np.sin(yaw), np.cos(pitch), np.sin(pitch)
    right = np.array([cy, 0.0, -sy])
    forward = np.array([sy * cp, sp, cy * cp])  # from the origin towards the camera
    up = np.cross(forward, right)
    return np.stack([right, up, forward])


#: View name -> world-to-view rotation. World +y is up; ``front`` looks down -z.
VIEWS: dict[str, np.ndarray] = {
    "front": _rotation(0.0, 0.0),
    "side": _rotation(90.0, 0.0),
    "top": _rotation(0.0, 90.0),
    "iso": _rotation(45.0, float(np.degrees(np.arctan(1 / np.sqrt(2))))),
}


@dataclass(frozen=True)
class PreviewRequest:
    """What to draw: one octree ``level``, from ``view``, ``size`` x ``size`` pixels."""

    level: int
    view: str = "iso"
    size: int = 512
    queries: bool = True

    def check(self) -> None:
        problems = []
        if self.view not in VIEWS:
            problems.append(f"view: unknown view {self.view!r} (known: {', '.join(VIEWS)})")
        if not MIN_SIZE <= self.size <= MAX_SIZE:
            problems.append(f"size: {self.size} is outside {MIN_SIZE}..{MAX_SIZE}")
        if self.level < 0:
            problems.append(f"level: {self.level} is negative")
        if problems:
            raise ParameterError(problems, what="preview request")

    def as_tag(self) -> str:
        return f"l{self.level}-{self.view}-{self.size}-q{int(self.queries)}"


def half_extent(rotation: np.ndarray) -> float:
    """Largest |screen coordinate| of the corners of [-1, 1]^3 (same for every record)."""
    corners = np.array([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)], float)
    return float(np.abs(corners @ rotation[:2].T).max())


def level_voxels(
    point_hierarchy: np.ndarray, pyramid: np.ndarray, level: int, *, key: str = ""
) -> np.ndarray:
    """The voxel coordinates of one level.

    Args:
        point_hierarchy: int16 of shape (num_points, 3), every level's points, root first.
        pyramid: int32 of shape (2, max_level + 2): counts per level and first indices.
        level: 0 .. max_level.

    Returns:
        int16 of shape (pyramid[0, level], 3), each in ``[0, 2^level)``.

    Raises:
        ParameterError: ``level`` is not one of the record's levels.
        CorruptRecord: the pyramid does not fit the point hierarchy.
    """
    if pyramid.ndim != 2 or pyramid.shape[0] != 2 or pyramid.shape[1] < 2:
        raise CorruptRecord(key, f"pyramid of shape {tuple(pyramid.shape)}, expected (2, L+2)")
    max_level = pyramid.shape[1] - 2
    if not 0 <= level <= max_level:
        raise ParameterError(
            [f"level: {level} is outside this record's levels 0..{max_level}"],
            what="preview request",
        )
    count, start = int(pyramid[0, level]), int(pyramid[1, level])
    if count < 0 or start < 0 or start + count > len(point_hierarchy):
        raise CorruptRecord(
            key,
            f"pyramid level {level} ({start}+{count}) exceeds the "
            f"{len(point_hierarchy)} points of point_hierarchy",
        )
    voxels = point_hierarchy[start : start + count]
    if len(voxels) and (int(voxels.min()) < 0 or int(voxels.max()) >= 1 << level):
        raise CorruptRecord(
            key, f"point_hierarchy level {level} has coordinates outside 0..{(1 << level) - 1}"
        )
    return voxels


def splat_template(rotation: np.ndarray, half: float, scale: float) -> tuple[np.ndarray, ...]:
    """Pixels covered by one cube of half-size ``half`` (world) at ``scale`` px per unit.

    Returns ``(dx, dy, shade)``: pixel offsets from the projected centre (image y down)
    and the brightness of the face each pixel sees (with an edge line on big cubes).
    The cube is grown by half a pixel so that neighbours, rounded to whole pixels,
    leave no gaps.
    """
    grown = half + 0.5 / scale
    reach = int(np.ceil(grown * scale * np.abs(rotation[:2]).sum(axis=1).max())) + 1
    dy, dx = np.mgrid[-reach : reach + 1, -reach : reach + 1]
    dx, dy = dx.ravel(), dy.ravel()
    origin_view = np.stack([dx / scale, -dy / scale, np.full(dx.shape, 4.0)], axis=1)
    origin = origin_view @ rotation  # view -> world (rotation is orthonormal)
    direction = -rotation[2]
    with np.errstate(divide="ignore", invalid="ignore"):
        t1 = (-grown - origin) / direction
        t2 = (grown - origin) / direction
    parallel = np.abs(direction) < 1e-12
    inside = np.abs(origin) <= grown
    lo = np.where(parallel, np.where(inside, -np.inf, np.inf), np.minimum(t1, t2))
    hi = np.where(parallel, np.where(inside, np.inf, -np.inf), np.maximum(t1, t2))
    t_near, t_far = lo.max(axis=1), hi.min(axis=1)
    hit = t_near <= t_far
    axis = lo.argmax(axis=1)
    rows = np.arange(len(axis))
    normal = np.zeros((len(axis), 3))
    normal[rows, axis] = -np.sign(direction[axis])
    shade = 0.45 + 0.55 * np.clip((normal @ rotation.T) @ _LIGHT, 0.0, 1.0)
    if half * scale >= 3.0:  # big enough to draw the cube's edges
        point = origin + np.where(hit, t_near, 0.0)[:, None] * direction
        across = np.abs(point)
        across[rows, axis] = 0.0
        edge = (grown - across.max(axis=1)) * scale < 1.0
        shade = np.where(edge, shade * 0.72, shade)
    return dx[hit], dy[hit], shade[hit]


def render_voxels(
    voxels: np.ndarray,
    level: int,
    view: str,
    size: int,
    query_points: np.ndarray | None = None,
    query_hits: np.ndarray | None = None,
) -> np.ndarray:
    """Draw occupied voxels as shaded cubes (and query points as dots).

    Args:
        voxels: integer array of shape (num_voxels, 3), coordinates in ``[0, 2^level)``.
        level: the octree level the coordinates belong to.
        view: one of :data:`VIEWS`.
        size: the picture's width and height in pixels.
        query_points: float32 of shape (num_queries, 3) in ``[-1, 1]``, or None.
        query_hits: bool of shape (num_queries,): the query's voxel is occupied.

    Returns:
        uint8 of shape (size, size, 3), RGB.

    Raises:
        ParameterError: too many voxels to draw at this size (see :data:`MAX_SPLATS`).
    """
    rotation = VIEWS[view]
    scale = (size / 2) * 0.94 / half_extent(rotation)
    half = 1.0 / (1 << level)
    image = np.empty((size * size, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    depth = np.full(size * size, -np.inf)
    if len(voxels):
        _draw_voxels(image, depth, voxels, rotation, scale, size, half, level)
    if query_points is not None and len(query_points):
        _draw_queries(image, depth, rotation, scale, size, half, query_points, query_hits)
    return image.reshape(size, size, 3)


def _project(points: np.ndarray, rotation: np.ndarray, half: float | None) -> list[np.ndarray]:
    """View coordinates (x, y, z: three float32 arrays) of voxel centres (``half`` = the
    voxels' half-size) or, with ``half=None``, of points in ``[-1, 1]^3``. Column by
    column: a (N, 3) @ (3, 3) matmul goes through BLAS threads, slower here."""
    cols = [points[:, i].astype(np.float32) for i in range(3)]
    if half is not None:
        cols = [(c + np.float32(0.5)) * np.float32(2.0 * half) - np.float32(1.0) for c in cols]
    return [
        cols[0] * np.float32(r[0]) + cols[1] * np.float32(r[1]) + cols[2] * np.float32(r[2])
        for r in rotation
    ]


def _draw_voxels(
    image: np.ndarray,
    depth: np.ndarray,
    voxels: np.ndarray,
    rotation: np.ndarray,
    scale: float,
    size: int,
    half: float,
    level: int,
) -> None:
    dx, dy, shade = splat_template(rotation, half, scale)
    count = len(voxels) * len(dx)
    if count > MAX_SPLATS:
        raise ParameterError(
            [
                (
                    f"level: {len(voxels)} voxels at level {level} are too many "
                    f"to draw at size {size}; pick a lower level or size"
                )
            ],
            what="preview request",
        )
    # Stamp on a canvas padded by the template's reach, so that no splat needs a bounds
    # test (every voxel centre lies inside the picture), then crop.
    pad = int(max(np.abs(dx).max(), np.abs(dy).max())) + 1
    width = size + 2 * pad
    view_xyz = _project(voxels, rotation, half)
    cx = np.rint(pad + size / 2 + scale * view_xyz[0]).astype(np.int64)
    cy = np.rint(pad + size / 2 - scale * view_xyz[1]).astype(np.int64)
    # One int64 per splat: quantised distance (high bits) then splat number (voxel-major):
    # the smallest per pixel is the nearest voxel's, with no sort of the voxels.
    distance = np.rint(
        (_DEPTH_RANGE - view_xyz[2]) * ((1 << _DEPTH_BITS) - 1) / (2 * _DEPTH_RANGE)
    ).astype(np.int64)
    first_splat = np.arange(len(voxels), dtype=np.int64) * len(dx)
    voxel_key = (distance << _SPLAT_BITS) + first_splat
    splat_key = (voxel_key[:, None] + np.arange(len(dx), dtype=np.int64)[None, :]).ravel()
    where = ((cy * width + cx)[:, None] + (dy * width + dx)[None, :]).ravel()
    empty = np.iinfo(np.int64).max
    nearest = np.full(width * width, empty, dtype=np.int64)
    np.minimum.at(nearest, where, splat_key)
    nearest = nearest.reshape(width, width)[pad : pad + size, pad : pad + size].ravel()
    pixels = np.flatnonzero(nearest != empty)
    chosen = nearest[pixels] & ((1 << _SPLAT_BITS) - 1)
    z = view_xyz[2][chosen // len(dx)]
    cue = 0.72 + 0.28 * (z + 1.8) / 3.6  # fixed depth cue, the same for every record
    light = shade[chosen % len(dx)] * cue
    image[pixels] = np.clip(light[:, None] * BASE_COLOUR * 255.0, 0, 255).astype(np.uint8)
    depth[pixels] = z


def _draw_queries(
    image: np.ndarray,
    depth: np.ndarray,
    rotation: np.ndarray,
    scale: float,
    size: int,
    half: float,
    points: np.ndarray,
    hits: np.ndarray | None,
) -> None:
    stride = max(1, -(-len(points) // MAX_QUERY_POINTS))
    points = np.asarray(points[::stride], dtype=np.float64)
    hits = np.zeros(len(points), bool) if hits is None else np.asarray(hits[::stride], bool)
    finite = np.isfinite(points).all(axis=1)
    points, hits = points[finite], hits[finite]
    vx, vy, vz = _project(points, rotation, None)
    cx = np.rint(size / 2 + scale * vx).astype(np.int64)
    cy = np.rint(size / 2 - scale * vy).astype(np.int64)
    radius = 1 if size >= 384 else 0
    tolerance = 2.0 * half  # a point inside a surface voxel still shows
    for ox in range(-radius, radius + 1):
        for oy in range(-radius, radius + 1):
            x, y = cx + ox, cy + oy
            ok = (x >= 0) & (x < size) & (y >= 0) & (y < size)
            flat = y[ok] * size + x[ok]
            visible = vz[ok] + tolerance >= depth[flat]
            image[flat[visible]] = np.where(hits[ok][visible, None], _HIT_COLOUR, _MISS_COLOUR)


def record_levels(value: bytes, *, key: str = "") -> int:
    """The deepest level of a record (from its header: ``pyramid`` is (2, L+2))."""
    header = read_header(value, key=key)
    info = header.tensors.get("pyramid")
    if info is None or len(info.shape) != 2 or "point_hierarchy" not in header.tensors:
        raise _no_octree(header, key)
    return int(info.shape[1]) - 2


def _no_octree(header: Any, key: str) -> ParameterError:
    """The 422 for a record of a recipe without an octree (a plugin's features)."""
    fields = ", ".join(sorted(header.tensors))
    return ParameterError(
        [
            (
                f"{key or 'record'}: no octree in this record (a picture needs "
                f"point_hierarchy and pyramid; its fields: {fields})"
            )
        ],
        what="preview request",
    )


def drawn_fields(value: Any, request: PreviewRequest, *, key: str = "") -> tuple[list[str], int]:
    """The fields a picture of ``request`` reads from a record, and their bytes (from the
    header: nothing else of the record is read)."""
    header = read_header(value, key=key)
    if any(f not in header.tensors for f in ("point_hierarchy", "pyramid")):
        raise _no_octree(header, key)
    fields = ["point_hierarchy", "pyramid"]
    if request.queries and "query_points" in header.tensors:
        fields += ["query_points"] + (["query_pidx"] if "query_pidx" in header.tensors else [])
    return fields, sum(header.tensors[f].end - header.tensors[f].begin for f in fields)


def render_record(value: Any, request: PreviewRequest, *, key: str = "") -> bytes:
    """PNG bytes of one level of a record (``spc`` or ``spc_query``); only the fields
    drawn are decoded (:func:`drawn_fields`)."""
    request.check()
    fields, _ = drawn_fields(value, request, key=key)
    with_queries = "query_points" in fields
    arrays, _ = decode_arrays(value, key=key, fields=fields)
    voxels = level_voxels(arrays["point_hierarchy"], arrays["pyramid"], request.level, key=key)
    points = hits = None
    if with_queries:
        points = arrays["query_points"]
        pidx = arrays.get("query_pidx")
        if (
            pidx is not None
            and pidx.ndim == 2
            and request.level < pidx.shape[1]
            and len(pidx) == len(points)
        ):
            hits = pidx[:, request.level] >= 0
    image = render_voxels(voxels, request.level, request.view, request.size, points, hits)
    return encode_png(image)


def encode_png(image: np.ndarray, *, compression: int = 6) -> bytes:
    """A PNG (8-bit RGB, no interlace) of ``image``, uint8 of shape (height, width, 3)."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ParameterError(
            [(f"image: expected uint8 (H, W, 3), got {image.dtype} {tuple(image.shape)}")],
            what="PNG image",
        )
    height, width = image.shape[:2]
    rows = np.empty((height, 1 + width * 3), dtype=np.uint8)
    rows[:, 0] = 0  # filter: none
    rows[:, 1:] = image.reshape(height, width * 3)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), compression))
        + chunk(b"IEND", b"")
    )


def decode_png_rgb(data: bytes) -> np.ndarray:
    """Inverse of :func:`encode_png` for its own output (filter 0, RGB 8-bit): for tests
    and benchmarks, not a general PNG reader."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ParameterError(["not a PNG signature"], what="PNG")
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if (
            zlib.crc32(kind + body) & 0xFFFFFFFF
            != struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])[0]
        ):
            raise ParameterError([f"chunk {kind!r}: CRC mismatch"], what="PNG")
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, 1 + width * 3)
    if (rows[:, 0] != 0).any():
        raise ParameterError(["only filter type 0 is read"], what="PNG")
    return rows[:, 1:].reshape(height, width, 3).copy()
