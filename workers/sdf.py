"""Signed distances from points to triangle meshes, for the ``spc_sdf`` recipe.

Two exact ways to the same numbers:

- :func:`signed_distance` (CPU): libigl's AABB-tree point-to-triangle distance
  (:func:`unsigned_distance`, float64, exact up to rounding) with the closest face, signed
  by :func:`winding_inside` (libigl's fast generalised winding number, and its exact one
  where the fast one is near the threshold).
- :func:`brute_force_distance` / :func:`brute_force_winding_number` (torch, any device):
  every point against every triangle, written from the definitions. Quadratic: the
  reference the tests and ``bench/sdf.py`` measure the fast path against.

Sign rule: a point is *inside* (negative distance) when the generalised winding number
of the mesh around it has magnitude above 1/2. On a closed, consistently oriented mesh
that is exactly the inside; on a mesh with small holes the winding number is still close
to 1 inside and 0 outside, so the sign stays right away from the holes; on an open sheet
(a single surface patch) points near it get winding numbers around +-1/2 and the sign
follows which side of the sheet they are on, within the patch's "shadow". Orientation
does not matter (the magnitude is used), so inverted meshes are handled too.

The sign is one computation on every device and backend: :func:`winding_inside`, on the
CPU. The ``spc_sdf`` recipe runs it in its ``prepare`` half
(:func:`workers.builtin_compute.prepare_sdf`, in the loader processes), so a record's
signs never depend on the machine that computed it. Kaolin's ``check_sign`` (parity of
a ray along +x) is not used: on open or non-manifold meshes it disagrees with the
winding number far from the surface.

The Kaolin path (:func:`signed_distance_kaolin`, CUDA) takes distances and closest faces
from Kaolin's ``point_to_mesh_distance`` and the sign from the caller. What the two paths
promise (``sdf``/``sdf_face`` of a record):

- the sign: identical (same code, same inputs);
- ``|sdf|``: the distance to the mesh; the CPU path computes it in float64, Kaolin in
  float32 (its kernel keeps the squared distance in a ``float`` even for float64 input),
  so on CUDA it is within float32 rounding (about 1e-6 for the normalised [-1, 1] cube)
  of the CPU value, not bit-identical;
- ``sdf_face``: *a* nearest face. Where several faces are equally near (a point closest
  to a shared edge or vertex), Kaolin picks the lowest face index and libigl's AABB tree
  whichever it reaches first, so the two may name different, equally near faces.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch

from cache_store.errors import BackendUnavailable

__all__ = [
    "brute_force_distance",
    "brute_force_winding_number",
    "brute_force_signed_distance",
    "mesh_is_closed",
    "signed_distance",
    "signed_distance_kaolin",
    "unsigned_distance",
    "winding_inside",
]

logger = logging.getLogger(__name__)


def _segment_sq_distance(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Squared distance of points ``p`` [M, 1, 3] to segments ``a``-``b`` [1, F, 3] -> [M, F]."""
    ab = b - a
    length2 = (ab * ab).sum(-1)
    t = ((p - a) * ab).sum(-1) / torch.where(length2 > 0, length2, torch.ones_like(length2))
    t = t.clamp(0.0, 1.0).unsqueeze(-1)
    d = p - (a + t * ab)
    return (d * d).sum(-1)


def _triangle_sq_distance(
    p: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor
) -> torch.Tensor:
    """Exact squared distance of points [M, 1, 3] to triangles [1, F, 3] -> [M, F].

    The projection onto the plane when it falls inside the triangle, else the nearest of
    the three edges (which also covers degenerate triangles)."""
    edges = torch.minimum(
        torch.minimum(_segment_sq_distance(p, a, b), _segment_sq_distance(p, b, c)),
        _segment_sq_distance(p, c, a),
    )
    ab, ac = b - a, c - a
    n = torch.linalg.cross(ab, ac)
    n2 = (n * n).sum(-1)
    # A triangle whose normal is rounding noise (sin^2 of its angle at a under 1e-20: two
    # corners equal, or all three on a line) has no plane: its edges are the triangle. A
    # test against `n2 > 0` is not enough: a fused multiply-add leaves a cross product of
    # two equal vectors at 1e-18, not 0, and the "plane" of that noise put points at 0.
    flat = n2 <= 1e-20 * (ab * ab).sum(-1) * (ac * ac).sum(-1)
    ap, bp, cp = p - a, p - b, p - c
    # inside when p's projection is on the inner side of all three edges
    inside = (
        ((torch.linalg.cross(ab, ap) * n).sum(-1) >= 0)
        & ((torch.linalg.cross(c - b, bp) * n).sum(-1) >= 0)
        & ((torch.linalg.cross(a - c, cp) * n).sum(-1) >= 0)
        & ~flat
    )
    plane = (ap * n).sum(-1) ** 2 / torch.where(flat, torch.ones_like(n2), n2)
    return torch.where(inside, torch.minimum(plane, edges), edges)


def _triangles(vertices: torch.Tensor, faces: torch.Tensor) -> tuple[torch.Tensor, ...]:
    v = vertices.to(torch.float64)
    return tuple(v[faces[:, k]].unsqueeze(0) for k in range(3))


def brute_force_distance(
    points: torch.Tensor, vertices: torch.Tensor, faces: torch.Tensor, chunk: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact distance from each point to the nearest triangle, by trying every triangle.

    Args:
        points: float ``[M, 3]``.
        vertices: float ``[N, 3]``.
        faces: int64 ``[F, 3]`` (F >= 1).
        chunk: points per block (memory is ``chunk x F x 3`` float64 several times).

    Returns:
        float64 ``[M]`` distances and int64 ``[M]`` closest faces (the lowest index among
        equally near faces), on the device of ``points``.
    """
    a, b, c = _triangles(vertices.to(points.device), faces.to(points.device))
    dist, face = [], []
    for start in range(0, len(points), chunk):
        p = points[start : start + chunk].to(torch.float64).unsqueeze(1)
        d2 = _triangle_sq_distance(p, a, b, c)
        best, which = d2.min(dim=1)
        dist.append(best.sqrt())
        face.append(which)
    if not dist:
        return (
            torch.empty(0, dtype=torch.float64, device=points.device),
            torch.empty(0, dtype=torch.int64, device=points.device),
        )
    return torch.cat(dist), torch.cat(face)


def brute_force_winding_number(
    points: torch.Tensor, vertices: torch.Tensor, faces: torch.Tensor, chunk: int = 256
) -> torch.Tensor:
    """The generalised winding number of the mesh around each point (float64 ``[M]``).

    Sum over triangles of their signed solid angle seen from the point (Van Oosterom and
    Strackee's formula), divided by 4 pi. 1 inside a closed outward-oriented mesh, 0
    outside."""
    a, b, c = _triangles(vertices.to(points.device), faces.to(points.device))
    out = []
    for start in range(0, len(points), chunk):
        p = points[start : start + chunk].to(torch.float64).unsqueeze(1)
        x, y, z = a - p, b - p, c - p
        lx, ly, lz = x.norm(dim=-1), y.norm(dim=-1), z.norm(dim=-1)
        det = (x * torch.linalg.cross(y, z)).sum(-1)
        den = lx * ly * lz + (x * y).sum(-1) * lz + (y * z).sum(-1) * lx + (z * x).sum(-1) * ly
        out.append((2.0 * torch.atan2(det, den)).sum(dim=1) / (4.0 * math.pi))
    if not out:
        return torch.empty(0, dtype=torch.float64, device=points.device)
    return torch.cat(out)


def brute_force_signed_distance(
    points: torch.Tensor, vertices: torch.Tensor, faces: torch.Tensor, chunk: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`brute_force_distance` signed by the winding-number rule (float64, int64)."""
    dist, face = brute_force_distance(points, vertices, faces, chunk)
    inside = brute_force_winding_number(points, vertices, faces, chunk).abs() > 0.5
    return torch.where(inside, -dist, dist), face


def _igl() -> Any:
    try:
        import igl
    except ImportError as exc:
        raise BackendUnavailable(
            "libigl", f"cannot import igl ({exc}); pip install libigl"
        ) from exc
    return igl


#: Points whose fast winding number lies within this of 1/2 get the exact one (libigl's
#: fast winding number errs by a few 1e-3 on the shared meshes).
WINDING_MARGIN = 0.05

#: :func:`mesh_is_closed` welds vertices closer than this fraction of the mesh's
#: bounding box diagonal.
WELD_RELATIVE = 1e-9


def _weld(vertices: np.ndarray, relative: float) -> np.ndarray | None:
    """int64 ``[V]``: one label per group of vertices joined by steps shorter than
    ``relative`` x the bounding box diagonal; None when that diagonal is 0 or not finite."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components
    from scipy.spatial import cKDTree

    diagonal = float(np.linalg.norm(vertices.max(axis=0) - vertices.min(axis=0)))
    if not (math.isfinite(diagonal) and diagonal > 0):
        return None
    # exact copies first (+ 0.0 makes -0.0 equal 0.0), then near ones among what is left
    unique, exact = np.unique(vertices + 0.0, axis=0, return_inverse=True)
    pairs = cKDTree(unique).query_pairs(diagonal * relative, output_type="ndarray")
    if len(pairs) == 0:
        return exact.reshape(-1).astype(np.int64)
    ones = np.ones(len(pairs), dtype=np.int8)
    graph = coo_matrix((ones, (pairs[:, 0], pairs[:, 1])), shape=(len(unique), len(unique)))
    _, near = connected_components(graph, directed=False)
    return near[exact.reshape(-1)].astype(np.int64)


def mesh_is_closed(vertices: np.ndarray, faces: np.ndarray) -> bool:
    """True when the triangle mesh is closed: a watertight, edge-manifold surface with its
    faces oriented consistently, so the winding number away from it is an integer and
    :func:`winding_inside` is exactly inside/outside.

    Vertices closer than ``WELD_RELATIVE`` of the bounding box diagonal are welded first
    (STL repeats every vertex per face, and exporters round the copies differently), and
    faces that collapse to a line or a point are dropped (they bound nothing). Then every
    edge must be shared by exactly two faces that run along it in opposite directions.
    All faces flipped is still closed. False for an open sheet, a mesh with holes, faces
    flipped against their neighbours, an edge shared by more than two faces (touching
    parts, or faces doubled back to back, which cancel each other's winding), and a mesh
    with no face left: there the sign is the winding-number estimate the module
    docstring describes.
    """
    faces = np.asarray(faces, dtype=np.int64).reshape(-1, 3)
    vertices = np.asarray(vertices, dtype=np.float64).reshape(-1, 3)
    if len(faces) == 0 or len(vertices) == 0:
        return False
    welded = _weld(vertices, WELD_RELATIVE)
    if welded is None:
        return False
    f = welded.reshape(-1)[faces]
    f = f[(f[:, 0] != f[:, 1]) & (f[:, 1] != f[:, 2]) & (f[:, 2] != f[:, 0])]
    if len(f) == 0:
        return False
    heads = f.reshape(-1)
    tails = f[:, [1, 2, 0]].reshape(-1)
    count = int(welded.max()) + 1
    forward = np.sort(heads * count + tails)
    backward = np.sort(tails * count + heads)
    # no directed edge twice, and each one's reverse present: every edge has exactly two
    # faces, running along it in opposite directions
    return bool(np.all(forward[1:] != forward[:-1]) and np.array_equal(forward, backward))


def winding_inside(points: np.ndarray, vertices: np.ndarray, faces: np.ndarray) -> np.ndarray:
    """bool ``[M]``: the sign rule of the module (|generalised winding number| > 1/2), on
    the CPU with libigl.

    libigl's fast winding number, and its exact ``winding_number`` for the points where the
    fast one is within :data:`WINDING_MARGIN` of 1/2, so the rule is the exact one wherever
    it matters.

    Args:
        points: float ``[M, 3]``.
        vertices: float ``[N, 3]``.
        faces: integer ``[F, 3]``, F >= 1.
    """
    igl = _igl()
    p = np.ascontiguousarray(points, dtype=np.float64)
    if len(p) == 0:
        return np.empty(0, bool)
    v = np.ascontiguousarray(vertices, dtype=np.float64)
    f = np.ascontiguousarray(faces, dtype=np.int64)
    winding = np.abs(igl.fast_winding_number(v, f, p))
    unsure = np.flatnonzero(np.abs(winding - 0.5) < WINDING_MARGIN)
    if len(unsure):
        winding[unsure] = np.abs(igl.winding_number(v, f, np.ascontiguousarray(p[unsure])))
    return winding > 0.5


def unsigned_distance(
    points: np.ndarray, vertices: np.ndarray, faces: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``[M]`` distances to a triangle mesh and int64 ``[M]`` closest faces, on the
    CPU: libigl's AABB tree (``signed_distance`` with ``SIGNED_DISTANCE_TYPE_UNSIGNED``:
    exact point-to-triangle distances; its winding-number modes cut the search short and
    are off by up to 1e-2 on the bunny). Arguments as :func:`winding_inside`."""
    igl = _igl()
    p = np.ascontiguousarray(points, dtype=np.float64)
    if len(p) == 0:
        return np.empty(0, np.float64), np.empty(0, np.int64)
    v = np.ascontiguousarray(vertices, dtype=np.float64)
    f = np.ascontiguousarray(faces, dtype=np.int64)
    dist, face, _, _ = igl.signed_distance(p, v, f, sign_type=igl.SIGNED_DISTANCE_TYPE_UNSIGNED)
    return np.abs(np.asarray(dist, dtype=np.float64)), np.asarray(face, dtype=np.int64)


def signed_distance(
    points: np.ndarray, vertices: np.ndarray, faces: np.ndarray, inside: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Signed distance of each point to a triangle mesh, on the CPU (libigl):
    :func:`unsigned_distance` signed by :func:`winding_inside` (or by ``inside``, that
    rule's answer computed earlier).

    Args:
        points: float ``[M, 3]``.
        vertices: float ``[N, 3]``.
        faces: integer ``[F, 3]``, F >= 1.
        inside: bool ``[M]`` from :func:`winding_inside` for the same mesh, or None.

    Returns:
        float64 ``[M]`` signed distances (negative inside) and int64 ``[M]`` closest faces.
    """
    dist, face = unsigned_distance(points, vertices, faces)
    if inside is None:
        inside = winding_inside(points, vertices, faces)
    return np.where(inside, -dist, dist), face


def _kaolin_point_to_mesh_distance() -> Any:
    from workers.ops.kaolin_spc import guarded_import

    try:
        return guarded_import("kaolin.metrics.trianglemesh").point_to_mesh_distance
    except (Exception, SystemExit) as exc:  # any broken install: unavailable
        raise BackendUnavailable(
            "kaolin", f"cannot import Kaolin's mesh distance ({type(exc).__name__}: {exc})"
        ) from exc


def signed_distance_kaolin(
    points: torch.Tensor, vertices: torch.Tensor, faces: torch.Tensor, inside: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed distance of each point to a triangle mesh with Kaolin's CUDA kernel.

    Distances and closest faces come from ``kaolin.metrics.trianglemesh.
    point_to_mesh_distance``, which computes the squared distance in float32 whatever the
    input dtype and picks the lowest face index among equally near faces (see the module
    docstring for what that means next to the CPU path). The sign is ``inside``, the
    module's winding-number rule computed by :func:`winding_inside`.

    Args:
        points: float ``[M, 3]`` on a CUDA device (M >= 1).
        vertices: float ``[N, 3]`` on the same device.
        faces: int64 ``[F, 3]`` on the same device.
        inside: bool ``[M]`` (any device): which points are inside.

    Returns:
        float64 ``[M]`` signed distances (float32 precision) and int64 ``[M]`` closest
        faces, on the device.
    """
    point_to_mesh_distance = _kaolin_point_to_mesh_distance()
    p = points.to(torch.float64).unsqueeze(0)
    face_vertices = vertices.to(torch.float64)[faces].unsqueeze(0)
    sq_dist, face, _ = point_to_mesh_distance(p, face_vertices)
    dist = sq_dist[0].clamp_min(0).sqrt()
    return torch.where(inside.to(dist.device), -dist, dist), face[0].to(torch.int64)
