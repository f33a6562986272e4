"""Recipes: the computation behind each schema in :mod:`cache_store.recipes.specs`.

A :class:`Recipe` pairs a :class:`~cache_store.recipes.specs.RecipeSpec` (name, version,
parameters, output fields: public contract, defined without torch) with the code that
produces those fields. It works in two halves so that the engine can run the first in a
CPU process pool ahead of the device:

- :meth:`Recipe.prepare` (CPU only): normalise the source, draw every random number
  (surface samples, query points) from the per-sample generator, return a
  :class:`Prepared` of NumPy arrays.
- :meth:`Recipe.compute_prepared` (on the device): quantise, build the octree, scan it,
  generate the point hierarchy and run the chunked queries with the ops backend.

:meth:`Recipe.compute` runs both. Because every random number is drawn on the CPU from a
generator seeded by ``(fingerprint, sample id)`` (:func:`make_generator`) and the device
ops are exact integer work on float32 inputs, a record's tensors are identical on every
device and backend.

Random draws, in order: ``surface_samples`` surface points (meshes only; see
:func:`workers.sources.sample_surface`), then for ``spc_query`` ``uniform_queries x 3``
float64 uniforms (mapped to ``[-1, 1]``), ``surface_queries`` indices into the shape's
points, and ``surface_queries x 3`` float64 normal deviates scaled by ``surface_sigma``.
Query points are rounded to float32 *before* they are queried, so the stored
``query_points`` reproduce ``query_pidx`` exactly. Surface queries are not clipped to the
cube; ``occupancy`` is ``query_pidx[:, level] >= 0``, so it follows Kaolin's
``with_parents`` rule of truncating toward zero: a query just outside ``[-1, 1]`` (less
than one voxel out on the low side) counts in the border voxel.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from cache_store.errors import SourceError, SpcacheError, UnknownName
from cache_store.recipes.specs import RECIPE_SPECS, RecipeSpec
from workers import sdf as sdf_ops
from workers.sources import LoadedSource, compute_normalization, normalize_points, shape_points

__all__ = [
    "OOM_ERRORS",
    "ChunkBudget",
    "Prepared",
    "Recipe",
    "SdfRecipe",
    "RECIPES",
    "get_recipe",
    "sample_seed",
    "make_generator",
    "check_outputs",
]

logger = logging.getLogger(__name__)

#: Errors the query loop treats as "out of device memory": back off and retry.
OOM_ERRORS: tuple[type[BaseException], ...] = (torch.cuda.OutOfMemoryError,)


def sample_seed(fingerprint: str, sample_id: str) -> int:
    """The 63-bit seed of one sample's generator: a hash of ``(fingerprint, sample id)``."""
    key = f"{fingerprint}\x00{sample_id}".encode()
    return xxhash.xxh3_64_intdigest(key) & ((1 << 63) - 1)


def make_generator(fingerprint: str, sample_id: str) -> torch.Generator:
    """A CPU generator seeded by :func:`sample_seed`; all of a sample's randomness comes from it."""
    return torch.Generator(device="cpu").manual_seed(sample_seed(fingerprint, sample_id))


class ChunkBudget:
    """The query chunk size, shared by the samples of a run; halves on out-of-memory.

    :meth:`run` applies a step to ``[start, stop)`` ranges of at most ``size`` items. When
    a step raises one of :data:`OOM_ERRORS`, the device cache is emptied, ``size`` is
    halved (and stays halved for later samples) and the same range is retried; when
    ``size`` would drop below ``minimum`` the error propagates, so the sample fails with
    a recorded reason while the run goes on.

    Args:
        size: first chunk size (> 0).
        minimum: smallest chunk worth trying (> 0).
        before_query_chunk: called with the chunk size before every attempt; tests make
            it raise an out-of-memory error to prove the back-off without a GPU.
    """

    def __init__(self, size: int, *, minimum: int = 256,
                 before_query_chunk: Callable[[int], None] | None = None) -> None:
        if size < 1 or minimum < 1:
            raise ValueError(f"chunk size and minimum must be positive, got {size}, {minimum}")
        self.size = int(size)
        self.minimum = min(int(minimum), self.size)
        self.before_query_chunk = before_query_chunk
        self.backoffs = 0

    def run(self, total: int, step: Callable[[int, int], torch.Tensor],
            device: torch.device) -> list[torch.Tensor]:
        """Results of ``step(start, stop)`` over ``[0, total)``, in order."""
        parts: list[torch.Tensor] = []
        start = 0
        while start < total:
            stop = min(total, start + self.size)
            try:
                if self.before_query_chunk is not None:
                    self.before_query_chunk(stop - start)
                parts.append(step(start, stop))
            except OOM_ERRORS:
                _free_device_cache(device)
                if self.size // 2 < self.minimum:
                    raise
                self.size //= 2
                self.backoffs += 1
                logger.warning("out of device memory on a %d-query chunk; retrying with %d",
                               stop - start, self.size)
                continue
            start = stop
        return parts


def _free_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Prepared:
    """The CPU half of a sample, ready for the device.

    Attributes:
        points: float32 ``[P, 3]``, the shape's points in ``[-1, 1]``.
        center: float32 ``[3]``; scale: float32 ``[]`` (normalised = (source - center) / scale).
        queries: float32 ``[M, 3]`` for query recipes (``spc_sdf``: the SDF points), else None.
        mesh_vertices: float64 ``[N, 3]`` normalised mesh vertices (``spc_sdf``), else None.
        mesh_faces: int64 ``[F, 3]`` (``spc_sdf``), else None.
    """

    sample_id: str
    path: str
    source_hash: str
    points: np.ndarray
    center: np.ndarray
    scale: np.float32  # a 0-d scalar
    queries: np.ndarray | None = None
    mesh_vertices: np.ndarray | None = None
    mesh_faces: np.ndarray | None = None


class Recipe:
    """A recipe's computation. ``spec`` is its public schema."""

    def __init__(self, spec: RecipeSpec, *, with_queries: bool) -> None:
        self.spec = spec
        self.with_queries = with_queries

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def version(self) -> int:
        return self.spec.version

    def __repr__(self) -> str:
        return f"Recipe({self.spec.name!r}, version={self.spec.version})"

    def prepare(self, source: LoadedSource, sample_id: str, params: Mapping[str, Any],
                generator: torch.Generator) -> Prepared:
        """Normalise and draw all random numbers, on the CPU. Raises SourceError."""
        norm = compute_normalization(source.path, source.used_points())
        points = shape_points(source, norm, int(params["surface_samples"]), generator)
        queries = None
        if self.with_queries:
            queries = _draw_queries(points, params, generator).numpy()
        return Prepared(sample_id, source.path, source.source_hash,
                        points.to(torch.float32).numpy(),
                        norm.center.astype(np.float32), np.float32(norm.scale), queries)

    def compute_prepared(self, prepared: Prepared, params: Mapping[str, Any], *,
                         device: torch.device | str, ops: Any,
                         query_chunk: int | ChunkBudget) -> dict[str, torch.Tensor]:
        """The record's tensors, on the CPU, exactly of the declared dtypes and shapes."""
        device = torch.device(device)
        level = int(params["level"])
        out = _build_spc(ops, torch.from_numpy(prepared.points).to(device), level)
        out["center"] = torch.from_numpy(np.array(prepared.center, dtype=np.float32))
        out["scale"] = torch.tensor(float(prepared.scale), dtype=torch.float32)
        if self.with_queries:
            budget = query_chunk if isinstance(query_chunk, ChunkBudget) else ChunkBudget(query_chunk)
            queries = torch.from_numpy(prepared.queries)
            octree, exsum = out.pop("_octree_dev"), out.pop("_exsum_dev")
            pidx = _query(ops, octree, exsum, queries, level, budget, device)
            out["query_points"] = queries
            out["query_pidx"] = pidx
            out["occupancy"] = (pidx[:, level] >= 0).to(torch.uint8)
        else:
            out.pop("_octree_dev"), out.pop("_exsum_dev")
        return out

    def compute(self, source: LoadedSource, params: Mapping[str, Any], *,
                generator: torch.Generator, device: torch.device | str, ops: Any,
                query_chunk: int | ChunkBudget = 1 << 20,
                sample_id: str = "") -> dict[str, torch.Tensor]:
        """:meth:`prepare` then :meth:`compute_prepared`."""
        prepared = self.prepare(source, sample_id, params, generator)
        return self.compute_prepared(prepared, params, device=device, ops=ops,
                                     query_chunk=query_chunk)


def _draw_queries(points: torch.Tensor, params: Mapping[str, Any],
                  generator: torch.Generator) -> torch.Tensor:
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


def _query(ops: Any, octree: torch.Tensor, exsum: torch.Tensor, queries: torch.Tensor,
           level: int, budget: ChunkBudget, device: torch.device) -> torch.Tensor:
    """int32 ``[M, level + 1]``: ``unbatched_query(..., with_parents=True)`` in chunks."""
    if len(queries) == 0:
        return torch.empty(0, level + 1, dtype=torch.int32)

    def step(start: int, stop: int) -> torch.Tensor:
        chunk = queries[start:stop].to(device)
        pidx = ops.unbatched_query(octree, exsum, chunk, level, with_parents=True)
        return pidx.to("cpu", torch.int32)

    return torch.cat(budget.run(len(queries), step, device))


# --- spc_sdf ---------------------------------------------------------------------------------


class SdfRecipe(Recipe):
    """``spc_sdf``: ``spc`` of a triangle mesh, its dual octree and trinkets, and seeded
    signed-distance samples.

    Random draws, in order: ``surface_samples`` surface points (as ``spc``), then
    ``uniform_samples x 3`` float64 uniforms (mapped to ``[-1, 1]``), ``near_samples``
    indices into the surface points and ``near_samples x 3`` normal deviates scaled by
    ``near_sigma``. SDF points are rounded to float32 before anything is computed from
    them, so the stored ``sdf_points`` reproduce ``sdf`` and ``sdf_pidx``.

    Distances: with the Kaolin ops backend (CUDA), Kaolin's ``point_to_mesh_distance``
    and ``check_sign`` in chunks of the query budget; otherwise libigl on the CPU
    (:func:`workers.sdf.signed_distance`). Both are float64 and agree within 1e-5.
    """

    def __init__(self, spec: RecipeSpec) -> None:
        super().__init__(spec, with_queries=True)

    def prepare(self, source: LoadedSource, sample_id: str, params: Mapping[str, Any],
                generator: torch.Generator) -> Prepared:
        """Normalise, sample the surface and draw the SDF points. Raises SourceError
        for a point cloud (a signed distance needs a mesh's inside)."""
        if source.faces is None:
            raise SourceError(source.path, "recipe 'spc_sdf' needs a triangle mesh, and this "
                                           "file is a point cloud (no faces: no inside to sign "
                                           "distances by)")
        norm = compute_normalization(source.path, source.used_points())
        points = shape_points(source, norm, int(params["surface_samples"]), generator)
        queries = _draw_queries(points, {
            "uniform_queries": params["uniform_samples"], "surface_queries": params["near_samples"],
            "surface_sigma": params["near_sigma"]}, generator)
        return Prepared(sample_id, source.path, source.source_hash,
                        points.to(torch.float32).numpy(),
                        norm.center.astype(np.float32), np.float32(norm.scale),
                        queries.numpy(), normalize_points(source.vertices, norm),
                        np.ascontiguousarray(source.faces, dtype=np.int64))

    def compute_prepared(self, prepared: Prepared, params: Mapping[str, Any], *,
                         device: torch.device | str, ops: Any,
                         query_chunk: int | ChunkBudget) -> dict[str, torch.Tensor]:
        device = torch.device(device)
        level = int(params["level"])
        out = _build_spc(ops, torch.from_numpy(prepared.points).to(device), level)
        octree, exsum = out.pop("_octree_dev"), out.pop("_exsum_dev")
        out["center"] = torch.from_numpy(np.array(prepared.center, dtype=np.float32))
        out["scale"] = torch.tensor(float(prepared.scale), dtype=torch.float32)
        hierarchy = out["point_hierarchy"].to(device)
        pyramid = out["pyramid"]
        dual, pyramid_dual = ops.unbatched_make_dual(hierarchy, pyramid)
        trinkets, parents = ops.unbatched_make_trinkets(hierarchy, pyramid, dual, pyramid_dual)
        out["point_hierarchy_dual"] = dual.to("cpu", torch.int16)
        out["pyramid_dual"] = pyramid_dual.to("cpu", torch.int32)
        out["trinkets"] = trinkets.to("cpu", torch.int32)
        out["trinket_parents"] = parents.to("cpu", torch.int32)
        budget = query_chunk if isinstance(query_chunk, ChunkBudget) else ChunkBudget(query_chunk)
        queries = torch.from_numpy(prepared.queries)
        out["sdf_points"] = queries
        out["sdf_pidx"] = _query_leaf(ops, octree, exsum, queries, level, budget, device)
        sdf, face = _signed_distance(prepared, queries, ops, budget, device)
        out["sdf"] = sdf.to(torch.float32)
        out["sdf_face"] = face.to(torch.int32)
        return out


def _query_leaf(ops: Any, octree: torch.Tensor, exsum: torch.Tensor, queries: torch.Tensor,
                level: int, budget: ChunkBudget, device: torch.device) -> torch.Tensor:
    """int32 ``[M]``: ``unbatched_query(octree, exsum, queries, level)`` in chunks."""
    if len(queries) == 0:
        return torch.empty(0, dtype=torch.int32)

    def step(start: int, stop: int) -> torch.Tensor:
        pidx = ops.unbatched_query(octree, exsum, queries[start:stop].to(device), level)
        return pidx.to("cpu", torch.int32)

    return torch.cat(budget.run(len(queries), step, device))


def _signed_distance(prepared: Prepared, queries: torch.Tensor, ops: Any, budget: ChunkBudget,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``[M]`` signed distances and int64 ``[M]`` closest faces, on the CPU."""
    assert (prepared.queries is not None and prepared.mesh_vertices is not None
            and prepared.mesh_faces is not None), "prepared without its mesh (spc_sdf's prepare)"
    if getattr(ops, "name", "") != "kaolin" or device.type != "cuda" or len(queries) == 0:
        sdf, face = sdf_ops.signed_distance(prepared.queries, prepared.mesh_vertices,
                                            prepared.mesh_faces)
        return torch.from_numpy(sdf), torch.from_numpy(face)
    vertices = torch.from_numpy(prepared.mesh_vertices).to(device)
    faces = torch.from_numpy(prepared.mesh_faces).to(device)

    def step(start: int, stop: int) -> torch.Tensor:
        sdf, face = sdf_ops.signed_distance_kaolin(queries[start:stop].to(device), vertices, faces)
        return torch.stack([sdf.cpu(), face.cpu().to(torch.float64)], dim=1)

    both = torch.cat(budget.run(len(queries), step, device))
    return both[:, 0].contiguous(), both[:, 1].to(torch.int64)


# --- output checking -----------------------------------------------------------------------

_DTYPES = {"uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32,
           "int64": torch.int64, "float32": torch.float32, "float64": torch.float64}
_DIM_EXPR = re.compile(r"^([A-Za-z_]\w*)\s*([+-])\s*(\d+)$")


def check_outputs(spec: RecipeSpec, tensors: Mapping[str, torch.Tensor],
                  params: Mapping[str, Any]) -> None:
    """Raise SpcacheError unless ``tensors`` are exactly ``spec``'s fields.

    Shapes are checked against the symbolic shapes of the spec: integers, parameter
    expressions such as ``level+2``, and symbols (``M``, ``num_bytes``) that must take the
    same value wherever they appear.
    """
    problems: list[str] = []
    if set(tensors) != set(spec.fields):
        problems.append(f"fields {sorted(tensors)} != declared {sorted(spec.fields)}")
    symbols: dict[str, int] = {}
    if "uniform_queries" in params and "surface_queries" in params:
        symbols["M"] = int(params["uniform_queries"]) + int(params["surface_queries"])
    if "uniform_samples" in params and "near_samples" in params:
        symbols["M"] = int(params["uniform_samples"]) + int(params["near_samples"])
    for name, field in spec.fields.items():
        tensor = tensors.get(name)
        if tensor is None:
            continue
        if tensor.dtype != _DTYPES[field.dtype]:
            problems.append(f"{name}: dtype {tensor.dtype}, declared {field.dtype}")
        if tensor.device.type != "cpu":
            problems.append(f"{name}: on {tensor.device}, expected cpu")
        dims = [d.strip() for d in field.shape.strip("[]").split(",") if d.strip()]
        if len(dims) != tensor.dim():
            problems.append(f"{name}: shape {tuple(tensor.shape)}, declared {field.shape}")
            continue
        for dim, size in zip(dims, tensor.shape, strict=True):
            want = _dim_value(dim, params, symbols, size)
            if want != size:
                problems.append(f"{name}: shape {tuple(tensor.shape)}, declared {field.shape}")
                break
    if problems:
        raise SpcacheError(f"recipe {spec.name!r} produced the wrong outputs: " + "; ".join(problems))


def _dim_value(dim: str, params: Mapping[str, Any], symbols: dict[str, int], size: int) -> int:
    if dim.isdigit():
        return int(dim)
    match = _DIM_EXPR.match(dim)
    if match and match.group(1) in params:
        base, sign, offset = params[match.group(1)], match.group(2), int(match.group(3))
        return int(base) + offset if sign == "+" else int(base) - offset
    if dim in params:
        return int(params[dim])
    return symbols.setdefault(dim, size)


RECIPES: dict[str, Recipe] = {
    "spc": Recipe(RECIPE_SPECS["spc"], with_queries=False),
    "spc_query": Recipe(RECIPE_SPECS["spc_query"], with_queries=True),
    "spc_sdf": SdfRecipe(RECIPE_SPECS["spc_sdf"]),
}


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; raises :class:`UnknownName` listing the known ones."""
    try:
        return RECIPES[name]
    except KeyError:
        raise UnknownName("recipe", name, RECIPES) from None
