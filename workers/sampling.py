"""Normalising a loaded source into ``[-1, 1]^3`` and sampling mesh surfaces.

Normalisation (:func:`compute_normalization`) maps a shape into ``[-1, 1]^3``:
``normalised = (source - center) / scale`` where ``center`` is the midpoint of the
bounding box of the used points (a mesh's referenced vertices, or the cloud's points)
rounded to float32, and ``scale`` is the smallest float32 not below the largest
per-axis distance of any used point from that center; for ordinary inputs this is half
the largest bounding-box extent. Both are float32 because the record stores them as
float32; the arithmetic is float64, so coordinates near 1e30 neither overflow nor lose
the shape. A shape whose points all coincide cannot be normalised and is a SourceError.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cache_store.errors import SourceError
from workers.source_load import LoadedSource

__all__ = [
    "Normalization",
    "compute_normalization",
    "normalize_points",
    "face_areas",
    "sample_surface",
    "shape_points",
]


@dataclass(frozen=True)
class Normalization:
    """``normalised = (source - center) / scale``; both exactly representable in float32."""

    center: np.ndarray  # float64 [3], values exactly representable as float32
    scale: float  # > 0, exactly representable as float32


def compute_normalization(path: str | Path, points: np.ndarray) -> Normalization:
    """The normalisation of ``points`` (float64 ``[N, 3]``, finite, N >= 1) into ``[-1, 1]``.

    ``center`` = bounding-box midpoint rounded to float32; ``scale`` = smallest float32
    not below ``max |points - center|``. Raises SourceError when every point coincides,
    when the values do not fit float32, or when the shape is so small for its distance
    from the origin that the float32 center misses it by more than half its size.
    """
    points = np.asarray(points, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        low, high = points.min(axis=0), points.max(axis=0)
        center = (low * 0.5 + high * 0.5).astype(np.float32)
        if not np.isfinite(center).all():
            raise SourceError(
                path, "coordinates are beyond float32 range; cannot store the normalisation"
            )
        center64 = center.astype(np.float64)
        reach = float(np.max(np.maximum(high - center64, center64 - low)))
    if not np.isfinite(reach) or reach > float(np.finfo(np.float32).max):
        raise SourceError(
            path, "shape extent is beyond float32 range; cannot store the normalisation"
        )
    half_extent = float(np.max(high - low)) * 0.5  # finite: reach passed the check above
    if half_extent == 0.0:
        raise SourceError(
            path,
            f"all {len(points)} points coincide; a shape with no extent "
            "cannot be normalised into [-1, 1]",
        )
    if reach < float(np.finfo(np.float32).tiny):
        raise SourceError(
            path,
            f"shape extent {2 * half_extent:.3g} is below float32 range; "
            "cannot store the normalisation scale",
        )
    if half_extent < 0.5 * reach:
        # The float32 center is off by more than the shape is wide: the record would squash
        # the shape into a corner of the cube. Refuse rather than store a useless record.
        raise SourceError(
            path,
            f"shape extent {2 * half_extent:.3g} is too small for its distance "
            f"from the origin ({float(np.abs(center64).max()):.3g}) to store "
            "its center as float32; translate it closer to the origin",
        )
    scale = np.float32(reach)
    if float(scale) < reach:
        scale = np.nextafter(scale, np.float32(np.inf))
    return Normalization(center64, float(scale))


def normalize_points(points: np.ndarray, norm: Normalization) -> np.ndarray:
    """``(points - center) / scale`` in float64, clipped to ``[-1, 1]`` (a rounding guard).

    Args:
        points: float64 ``[N, 3]``.
    Returns:
        float64 ``[N, 3]``.
    """
    out = (np.asarray(points, dtype=np.float64) - norm.center) / norm.scale
    return np.clip(out, -1.0, 1.0, out=out)


def face_areas(vertices: torch.Tensor, faces: torch.Tensor) -> torch.Tensor:
    """Area of each triangle.

    Args:
        vertices: float64 ``[N, 3]``.
        faces: int64 ``[F, 3]``.
    Returns:
        float64 ``[F]``.
    """
    a, b, c = vertices[faces[:, 0]], vertices[faces[:, 1]], vertices[faces[:, 2]]
    return 0.5 * torch.linalg.vector_norm(torch.linalg.cross(b - a, c - a), dim=1)


def sample_surface(
    vertices: torch.Tensor, faces: torch.Tensor, count: int, generator: torch.Generator
) -> torch.Tensor:
    """Seeded, area-weighted uniform samples of a triangle mesh's surface, on the CPU.

    Faces are chosen with probability proportional to their area (inverse CDF over the
    cumulative areas, so zero-area faces are never chosen), then a point uniform in the
    triangle (reflected barycentric coordinates). Draws, in order: ``count`` float64
    uniforms for the faces, then ``count x 2`` for the barycentrics.

    Args:
        vertices: float64 ``[N, 3]``, CPU.
        faces: int64 ``[F, 3]``, CPU, total area > 0.
        count: number of samples.
        generator: a CPU ``torch.Generator``.
    Returns:
        float64 ``[count, 3]``.
    Raises:
        ValueError: when the faces have zero total area.
    """
    cdf = torch.cumsum(face_areas(vertices, faces), dim=0)
    total = cdf[-1]
    if not bool(total > 0):
        raise ValueError("mesh has zero surface area")
    pick = torch.rand(count, dtype=torch.float64, generator=generator) * total
    face = torch.searchsorted(cdf, pick, right=True).clamp_(max=len(faces) - 1)
    uv = torch.rand(count, 2, dtype=torch.float64, generator=generator)
    flip = uv.sum(dim=1) > 1.0
    uv[flip] = 1.0 - uv[flip]
    tri = faces[face]
    a, b, c = vertices[tri[:, 0]], vertices[tri[:, 1]], vertices[tri[:, 2]]
    return a + uv[:, :1] * (b - a) + uv[:, 1:] * (c - a)


def shape_points(
    source: LoadedSource, norm: Normalization, count: int, generator: torch.Generator
) -> torch.Tensor:
    """The points a shape is represented by, in the normalised space, on the CPU.

    A point cloud gives its own points (no random draws); a mesh gives ``count`` seeded,
    area-weighted surface samples (:func:`sample_surface`) of its normalised surface.

    Returns:
        float64 ``[P, 3]`` with every coordinate in ``[-1, 1]``.
    Raises:
        SourceError: a mesh whose faces all have zero area.
    """
    if source.faces is None:
        return torch.from_numpy(normalize_points(source.vertices, norm))
    vertices = torch.from_numpy(normalize_points(source.vertices, norm))
    faces = torch.from_numpy(source.faces)
    if not bool(face_areas(vertices, faces).sum() > 0):
        raise SourceError(
            source.path, f"mesh has zero surface area (all {len(faces)} faces are degenerate)"
        )
    return sample_surface(vertices, faces, count, generator)
