"""The built-in recipes' computation: ``spc``, ``spc_query`` and ``spc_sdf``.

The built-in recipe classes (:mod:`workers.builtin_recipes`, on the public API of
:mod:`spcache.recipes`) call the functions here from their two halves, so that the engine
can run the first in a CPU process pool ahead of the device:

- ``prepare_*`` (CPU only): normalise the source, draw every random number (surface
  samples, query points) from the per-sample generator, return a dict of NumPy arrays.
- ``compute_*`` (on the device): quantise, build the octree, scan it, generate the point
  hierarchy and run the chunked queries with the ops backend.

Every random number is drawn on the CPU from the sample's generator
(:func:`workers.recipe_run.make_generator`), so a record's tensors are identical on
every device and backend; running any recipe, built-in or plugin, is
:mod:`workers.recipe_run`'s.

Random draws, in order: ``surface_samples`` surface points (meshes only; see
:func:`workers.sampling.sample_surface`), then for ``spc_query`` ``uniform_queries x 3``
float64 uniforms (mapped to ``[-1, 1]``), ``surface_queries`` indices into the shape's
points, and ``surface_queries x 3`` float64 normal deviates scaled by ``surface_sigma``.
Query points are rounded to float32 *before* they are queried, so the stored
``query_points`` reproduce ``query_pidx`` exactly. Surface queries are not clipped to the
cube; ``occupancy`` is ``query_pidx[:, level] >= 0``, so it follows Kaolin's
``with_parents`` rule of truncating toward zero: a query just outside ``[-1, 1]`` (less
than one voxel out on the low side) counts in the border voxel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from cache_store.errors import SourceError, SpcacheError
from cache_store.recipes.api import ChunkBudget
from cache_store.recipes.augment import augment_points, augmentation_set, transform_points
from workers import sdf as sdf_ops
from workers.sampling import compute_normalization, normalize_points, shape_points
from workers.source_load import LoadedSource

__all__ = ["compute_sdf", "compute_spc", "prepare_sdf", "prepare_spc"]


# --- spc and spc_query ---------------------------------------------------------------------


def prepare_spc(
    source: LoadedSource,
    params: Mapping[str, Any],
    generator: torch.Generator,
    *,
    with_queries: bool,
) -> dict[str, np.ndarray]:
    """Normalise and draw all random numbers, on the CPU. Raises SourceError.

    ``points`` float32 ``[P, 3]`` in ``[-1, 1]``; ``center`` float32 ``[3]``, ``scale``
    float32 ``[]`` (normalised = (source - center) / scale); ``queries`` float32 ``[M, 3]``
    with ``with_queries``.
    """
    norm = compute_normalization(source.path, source.used_points())
    points = shape_points(source, norm, int(params["surface_samples"]), generator)
    augmented = augment_points(points, params, generator, source.variant)
    points = torch.from_numpy(augmented.points)
    out = {
        "points": points.to(torch.float32).numpy(),
        "center": norm.center.astype(np.float32),
        "scale": np.array(norm.scale, dtype=np.float32),
    }
    if augmentation_set(params):
        out["augmentation"] = augmented.matrix.astype(np.float32)
    if with_queries:
        out["queries"] = _draw_queries(points, params, generator).numpy()
    return out


def compute_spc(
    prepared: Mapping[str, np.ndarray],
    params: Mapping[str, Any],
    device: torch.device | str,
    ops: Any,
    budget: ChunkBudget,
    *,
    with_queries: bool,
) -> dict[str, torch.Tensor]:
    """The record's tensors, on the CPU, exactly of the declared dtypes and shapes."""
    device = torch.device(device)
    level = int(params["level"])
    out = _build_spc(ops, torch.from_numpy(prepared["points"]).to(device), level)
    out["center"] = torch.from_numpy(np.array(prepared["center"], dtype=np.float32))
    out["scale"] = torch.tensor(float(prepared["scale"]), dtype=torch.float32)
    _pass_augmentation(prepared, out)
    octree, exsum = out.pop("_octree_dev"), out.pop("_exsum_dev")
    if with_queries:
        queries = torch.from_numpy(prepared["queries"])
        pidx = _query(ops, octree, exsum, queries, level, budget, device)
        out["query_points"] = queries
        out["query_pidx"] = pidx
        out["occupancy"] = (pidx[:, level] >= 0).to(torch.uint8)
    return out


def _pass_augmentation(prepared: Mapping[str, np.ndarray], out: dict[str, torch.Tensor]) -> None:
    """The ``augmentation`` field, where ``prepare`` made one (augmentation parameters set)."""
    if "augmentation" in prepared:
        out["augmentation"] = torch.from_numpy(
            np.ascontiguousarray(prepared["augmentation"], dtype=np.float32)
        )


def _draw_queries(
    points: torch.Tensor, params: Mapping[str, Any], generator: torch.Generator
) -> torch.Tensor:
    """float32 ``[uniform + surface, 3]``: uniform in the cube, then jittered shape points."""
    n_uniform, n_surface = int(params["uniform_queries"]), int(params["surface_queries"])
    sigma = float(params["surface_sigma"])
    uniform = torch.rand(n_uniform, 3, dtype=torch.float64, generator=generator) * 2.0 - 1.0
    pick = torch.randint(0, len(points), (n_surface,), generator=generator)
    noise = torch.randn(n_surface, 3, dtype=torch.float64, generator=generator) * sigma
    surface = points[pick] + noise
    return torch.cat([uniform, surface]).to(torch.float32)


def _build_spc(ops: Any, points: torch.Tensor, level: int) -> dict[str, torch.Tensor]:
    quantized = ops.quantize_points(points, level)
    octree = ops.unbatched_points_to_octree(quantized, level)
    lengths = torch.tensor([octree.numel()], dtype=torch.int32)
    max_level, pyramids, exsum = ops.scan_octrees(octree, lengths)
    if int(max_level) != level:
        raise SpcacheError(f"scan_octrees reported depth {max_level}, expected {level}")
    point_hierarchy = ops.generate_points(octree, pyramids, exsum)
    return {
        "octree": octree.cpu(),
        "pyramid": pyramids[0].to("cpu", torch.int32),
        "exsum": exsum.to("cpu", torch.int32),
        "point_hierarchy": point_hierarchy.to("cpu", torch.int16),
        "_octree_dev": octree,
        "_exsum_dev": exsum,
    }


def _query(
    ops: Any,
    octree: torch.Tensor,
    exsum: torch.Tensor,
    queries: torch.Tensor,
    level: int,
    budget: ChunkBudget,
    device: torch.device,
) -> torch.Tensor:
    """int32 ``[M, level + 1]``: ``unbatched_query(..., with_parents=True)`` in chunks."""
    if len(queries) == 0:
        return torch.empty(0, level + 1, dtype=torch.int32)

    def step(start: int, stop: int) -> torch.Tensor:
        chunk = queries[start:stop].to(device)
        pidx = ops.unbatched_query(octree, exsum, chunk, level, with_parents=True)
        return pidx.to("cpu", torch.int32)

    return torch.cat(budget.run(len(queries), step, device))


# --- spc_sdf ---------------------------------------------------------------------------------
#
# ``spc`` of a triangle mesh, its dual octree and trinkets, and seeded signed-distance
# samples. Random draws, in order: ``surface_samples`` surface points (as ``spc``), then
# ``uniform_samples x 3`` float64 uniforms (mapped to ``[-1, 1]``), ``near_samples``
# indices into the surface points and ``near_samples x 3`` normal deviates scaled by
# ``near_sigma``. SDF points are rounded to float32 before anything is computed from
# them, so the stored ``sdf_points`` reproduce ``sdf`` and ``sdf_pidx``.
#
# Signs: the generalised winding number rule (:func:`workers.sdf.winding_inside`),
# computed in ``prepare_sdf`` on the CPU whatever the device and backend (``sdf_inside``
# of the prepared dict), so they are identical on every machine. Distances and closest
# faces: with the Kaolin ops backend (CUDA), Kaolin's ``point_to_mesh_distance`` in chunks
# of the query budget (float32 arithmetic, lowest index among equally near faces);
# otherwise libigl on the CPU (float64). Both are stored as float32 and agree to float32
# rounding; :mod:`workers.sdf` says what ``sdf_face`` promises. ``closed`` (recipe
# version 2) records whether that sign is exact: :func:`workers.sdf.mesh_is_closed`.


def prepare_sdf(
    source: LoadedSource, params: Mapping[str, Any], generator: torch.Generator
) -> dict[str, np.ndarray]:
    """Normalise, sample the surface and draw the SDF points. Raises SourceError for a
    point cloud (a signed distance needs a mesh's inside)."""
    if source.faces is None:
        raise SourceError(
            source.path,
            "recipe 'spc_sdf' needs a triangle mesh, and this "
            "file is a point cloud (no faces: no inside to sign "
            "distances by)",
        )
    norm = compute_normalization(source.path, source.used_points())
    points = shape_points(source, norm, int(params["surface_samples"]), generator)
    augmented = augment_points(points, params, generator, source.variant)
    points = torch.from_numpy(augmented.points)
    queries = _draw_queries(
        points,
        {
            "uniform_queries": params["uniform_samples"],
            "surface_queries": params["near_samples"],
            "surface_sigma": params["near_sigma"],
        },
        generator,
    ).numpy()
    vertices = normalize_points(source.vertices, norm)
    if source.variant:  # the mesh goes where its surface samples went (no jitter)
        vertices = transform_points(augmented.matrix, vertices)
    faces = np.ascontiguousarray(source.faces, dtype=np.int64)
    extra = (
        {"augmentation": augmented.matrix.astype(np.float32)} if augmentation_set(params) else {}
    )
    return {
        **extra,
        "points": points.to(torch.float32).numpy(),
        "center": norm.center.astype(np.float32),
        "scale": np.array(norm.scale, dtype=np.float32),
        "queries": queries,
        "mesh_vertices": vertices,
        "mesh_faces": faces,
        # the sign of every SDF point, here on the CPU for every device and backend
        "sdf_inside": sdf_ops.winding_inside(queries, vertices, faces),
        # welded on the source's own coordinates: normalising could merge or split them
        "closed": np.array(sdf_ops.mesh_is_closed(source.vertices, faces)),
    }


def compute_sdf(
    prepared: Mapping[str, np.ndarray],
    params: Mapping[str, Any],
    device: torch.device | str,
    ops: Any,
    budget: ChunkBudget,
) -> dict[str, torch.Tensor]:
    device = torch.device(device)
    level = int(params["level"])
    out = _build_spc(ops, torch.from_numpy(prepared["points"]).to(device), level)
    octree, exsum = out.pop("_octree_dev"), out.pop("_exsum_dev")
    out["center"] = torch.from_numpy(np.array(prepared["center"], dtype=np.float32))
    out["scale"] = torch.tensor(float(prepared["scale"]), dtype=torch.float32)
    _pass_augmentation(prepared, out)
    hierarchy = out["point_hierarchy"].to(device)
    pyramid = out["pyramid"]
    dual, pyramid_dual = ops.unbatched_make_dual(hierarchy, pyramid)
    trinkets, parents = ops.unbatched_make_trinkets(hierarchy, pyramid, dual, pyramid_dual)
    out["point_hierarchy_dual"] = dual.to("cpu", torch.int16)
    out["pyramid_dual"] = pyramid_dual.to("cpu", torch.int32)
    out["trinkets"] = trinkets.to("cpu", torch.int32)
    out["trinket_parents"] = parents.to("cpu", torch.int32)
    queries = torch.from_numpy(prepared["queries"])
    out["sdf_points"] = queries
    out["sdf_pidx"] = _query_leaf(ops, octree, exsum, queries, level, budget, device)
    sdf, face = _signed_distance(prepared, queries, ops, budget, device)
    out["sdf"] = sdf.to(torch.float32)
    out["sdf_face"] = face.to(torch.int32)
    out["closed"] = torch.tensor(bool(prepared["closed"]))
    return out


def _query_leaf(
    ops: Any,
    octree: torch.Tensor,
    exsum: torch.Tensor,
    queries: torch.Tensor,
    level: int,
    budget: ChunkBudget,
    device: torch.device,
) -> torch.Tensor:
    """int32 ``[M]``: ``unbatched_query(octree, exsum, queries, level)`` in chunks."""
    if len(queries) == 0:
        return torch.empty(0, dtype=torch.int32)

    def step(start: int, stop: int) -> torch.Tensor:
        pidx = ops.unbatched_query(octree, exsum, queries[start:stop].to(device), level)
        return pidx.to("cpu", torch.int32)

    return torch.cat(budget.run(len(queries), step, device))


def _signed_distance(
    prepared: Mapping[str, np.ndarray],
    queries: torch.Tensor,
    ops: Any,
    budget: ChunkBudget,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``[M]`` signed distances and int64 ``[M]`` closest faces, on the CPU; the
    signs are ``prepared["sdf_inside"]`` on every path."""
    inside = prepared["sdf_inside"]
    if getattr(ops, "name", "") != "kaolin" or device.type != "cuda" or len(queries) == 0:
        sdf, face = sdf_ops.signed_distance(
            prepared["queries"], prepared["mesh_vertices"], prepared["mesh_faces"], inside
        )
        return torch.from_numpy(sdf), torch.from_numpy(face)
    vertices = torch.from_numpy(prepared["mesh_vertices"]).to(device)
    faces = torch.from_numpy(prepared["mesh_faces"]).to(device)
    signs = torch.from_numpy(inside)

    def step(start: int, stop: int) -> torch.Tensor:
        sdf, face = sdf_ops.signed_distance_kaolin(
            queries[start:stop].to(device), vertices, faces, signs[start:stop]
        )
        return torch.stack([sdf.cpu(), face.cpu().to(torch.float64)], dim=1)

    both = torch.cat(budget.run(len(queries), step, device))
    return both[:, 0].contiguous(), both[:, 1].to(torch.int64)
