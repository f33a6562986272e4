"""The built-in recipes ``spc``, ``spc_query`` and ``spc_sdf``: a plugin like any user's.

Their classes are written on the public recipe API (:mod:`spcache.recipes`) and named by
spcache's own entry points (``pyproject.toml``, group ``spcache.recipes``); the registry
finds them the way it finds every installed recipe. This module is their schema and
imports no torch: ``prepare`` and ``compute`` import their code
(:mod:`workers.builtin_compute`) when they run, which only a worker or loader process
does. The service imports the class to learn its schema, and runs none of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from cache_store.recipes.api import Field, Param, Recipe
from cache_store.recipes.augment import AUGMENTATION_FIELD, AUGMENTATION_PARAMS
from cache_store.recipes.specs import FieldSpec, ParamSpec

__all__ = ["Spc", "SpcQuery", "SpcSdf"]

#: Allowance for a record's safetensors header and metadata.
_HEADER_BYTES = 64 << 10

_SPC_PARAMS = {
    "level": Param(int, 8, 1, 15, "octree depth; points are quantised to 2^level cells per axis"),
    "surface_samples": Param(
        int,
        100_000,
        1,
        50_000_000,
        "points sampled (area-weighted, seeded) from a mesh surface; "
        "point-cloud sources use their own points",
    ),
    **AUGMENTATION_PARAMS,
}
_SPC_FIELDS = {
    "octree": Field(
        "uint8",
        "[num_bytes]",
        "Kaolin SPC octree: one byte per non-leaf node, breadth first, Morton order within a level",
    ),
    "pyramid": Field(
        "int32",
        "[2, level+2]",
        "row 0: points per level; row 1: first index "
        "of each level in point_hierarchy (scan_octrees, batch dim squeezed)",
    ),
    "exsum": Field("int32", "[num_bytes]", "inclusive running sum of set bits per byte"),
    "point_hierarchy": Field(
        "int16", "[num_points, 3]", "all levels' voxel coordinates, root first (generate_points)"
    ),
    "center": Field("float32", "[3]", "normalisation: normalised = (source - center) / scale"),
    "scale": Field("float32", "[]", "normalisation scale (see center)"),
    "augmentation": AUGMENTATION_FIELD,
}
_QUERY_PARAMS = {
    "uniform_queries": Param(
        int, 16_384, 0, 10_000_000, "query points drawn uniformly in [-1, 1]^3"
    ),
    "surface_queries": Param(
        int, 16_384, 0, 10_000_000, "query points jittered around surface samples"
    ),
    "surface_sigma": Param(
        float,
        0.01,
        0.0,
        1.0,
        "std-dev of the Gaussian jitter of surface queries, in normalised units",
    ),
}
_QUERY_FIELDS = {
    "query_points": Field("float32", "[M, 3]", "query coordinates in the normalised [-1, 1] space"),
    "query_pidx": Field(
        "int32",
        "[M, level+1]",
        "unbatched_query(..., with_parents=True): "
        "point_hierarchy index at each level 0..level, -1 where absent",
    ),
    "occupancy": Field("uint8", "[M]", "1 where the query's leaf voxel exists, else 0"),
}

_SDF_PARAMS = {
    "level": Param(
        int,
        8,
        1,
        12,
        "octree depth; points are quantised to 2^level cells per "
        "axis (at most 12 here: the dual octree and trinkets grow with it)",
    ),
    "surface_samples": Param(
        int,
        100_000,
        1,
        500_000,
        "points sampled (area-weighted, seeded) from the mesh surface to "
        "build the octree; the near samples jitter these",
    ),
    "near_samples": Param(
        int,
        50_000,
        0,
        1_000_000,
        "SDF points: surface samples jittered by a Gaussian of std-dev near_sigma",
    ),
    "near_sigma": Param(
        float, 0.01, 0.0, 1.0, "std-dev of the near samples' jitter, in normalised units"
    ),
    "uniform_samples": Param(
        int, 50_000, 0, 1_000_000, "SDF points drawn uniformly in the normalisation cube [-1, 1]^3"
    ),
    **AUGMENTATION_PARAMS,
}
_DUAL_FIELDS = {
    "point_hierarchy_dual": Field(
        "int16",
        "[num_dual_points, 3]",
        "unbatched_make_dual: the "
        "distinct corners of each level's voxels, level by level, "
        "Morton order within a level",
    ),
    "pyramid_dual": Field(
        "int32",
        "[2, level+2]",
        "row 0: dual points per level; row 1: first index of each level in point_hierarchy_dual",
    ),
    "trinkets": Field(
        "int32",
        "[num_points, 8]",
        "unbatched_make_trinkets: each voxel's 8 "
        "corners as indices into its level of the dual (add pyramid_dual[1, level])",
    ),
    "trinket_parents": Field(
        "int32", "[num_points]", "index in point_hierarchy of each voxel's parent, -1 for the root"
    ),
}
_SDF_FIELDS = {
    "sdf_points": Field(
        "float32",
        "[M, 3]",
        "SDF sample points in the normalised frame: "
        "uniform_samples uniform in [-1, 1]^3, then near_samples jittered "
        "surface samples (may lie slightly outside the cube)",
    ),
    "sdf": Field(
        "float32",
        "[M]",
        "signed distance from each sdf_point to the normalised mesh, "
        "negative inside (generalised winding number |w| > 1/2)",
    ),
    "sdf_face": Field("int32", "[M]", "index of the closest mesh face"),
    "sdf_pidx": Field(
        "int32",
        "[M]",
        "unbatched_query(octree, exsum, sdf_points, level): the "
        "point_hierarchy index of each point's leaf voxel, -1 outside the octree",
    ),
    "closed": Field(
        "bool",
        "[]",
        "True when the mesh is closed and consistently oriented (welded by position, every "
        "edge matched by its reverse): the sign of sdf is then exactly inside/outside; "
        "False for open sheets, holes or flipped faces, where it is the winding-number "
        "estimate and abs(sdf) is the safe reading",
    ),
}
_SDF_DOC = (
    "spc plus the dual octree, trinkets and seeded signed-distance samples of a triangle mesh "
    "(point clouds are refused: they have no inside). Sign: the generalised winding number "
    "(|w| > 1/2 is inside): exact on closed meshes (the record's closed field says whether "
    "this one was), robust to small holes; an open sheet has no inside: a flat one is "
    "positive everywhere, a curved one negative only in its hollow. "
    "The sign is computed on the CPU for every device and backend, so it never depends on the "
    "machine; with the Kaolin backend |sdf| is Kaolin's float32 distance (equal to float32 "
    "rounding) and sdf_face is a nearest face (ties may name another). Size: num_points <= sum over levels of "
    "min(8^l, surface_samples), num_dual_points <= 8 num_points (about 3.5 num_points on "
    "surfaces); a record is about 47 B per point, 6 B per dual point and 24 B per SDF sample: "
    "a few MB at the defaults (10.8 MB for the bunny); parameters whose worst case is "
    "over the record size limit are refused."
)


def _level_points(level: int, samples: int) -> list[int]:
    """Upper bound of the occupied voxels at each level 0..level: at most one per sampled
    point, and at most 8^l."""
    return [min(samples, 8**lv) for lv in range(level + 1)]


def _spc_bytes(p: Mapping[str, Any]) -> int:
    points = _level_points(int(p["level"]), int(p["surface_samples"]))
    nodes = sum(points[:-1])  # octree: one byte per non-leaf node; exsum: int32 per byte
    return nodes + 4 * nodes + 6 * sum(points) + 8 * (int(p["level"]) + 2) + 16 + _HEADER_BYTES


def _query_bytes(p: Mapping[str, Any]) -> int:
    queries = int(p["uniform_queries"]) + int(p["surface_queries"])
    return _spc_bytes(p) + queries * (12 + 4 * (int(p["level"]) + 1) + 1)


_SPC_BOUND = (
    "octree + exsum: 5 x sum over levels l < L of min(S, 8^l); point_hierarchy: "
    "6 x sum over l <= L of min(S, 8^l); S = surface_samples, or a point cloud's "
    "own point count"
)
_QUERY_BOUND = _SPC_BOUND + "; plus (uniform_queries + surface_queries) x (13 + 4 (L + 1))"


def _sdf_bytes(p: Mapping[str, Any]) -> int:
    level = int(p["level"])
    points = _level_points(level, int(p["surface_samples"]))
    dual = [min(8 * n, (2**lv + 1) ** 3) for lv, n in enumerate(points)]
    samples = int(p["near_samples"]) + int(p["uniform_samples"])
    # trinkets int32 [P, 8] + trinket_parents int32 [P]; dual int16 [D, 3]; pyramid_dual;
    # sdf_points float32 [M, 3] + sdf float32 + sdf_face int32 + sdf_pidx int32; closed
    return _spc_bytes(p) + 36 * sum(points) + 6 * sum(dual) + 8 * (level + 2) + 24 * samples + 1


_SDF_BOUND = (
    _SPC_BOUND + "; plus 36 x (points of all levels) for trinkets and parents, "
    "6 x sum over l <= L of min(8 x points at l, (2^l + 1)^3) dual points, and "
    "24 x (near_samples + uniform_samples)"
)


class Spc(Recipe):
    """Structured point cloud (sparse octree) of the normalised shape."""

    name = "spc"
    version = 1
    params: ClassVar[Mapping[str, ParamSpec]] = _SPC_PARAMS
    fields: ClassVar[Mapping[str, FieldSpec]] = _SPC_FIELDS
    doc = "structured point cloud (sparse octree) of the normalised shape"
    record_bytes = staticmethod(_spc_bytes)
    record_bytes_doc = _SPC_BOUND
    code_modules = ("workers.builtin_compute", "workers.sampling", "cache_store.recipes.augment")
    with_queries = False

    def prepare(self, source: Any, params: Mapping[str, Any], generator: Any) -> dict[str, Any]:
        from workers.builtin_compute import prepare_spc

        return prepare_spc(source, params, generator, with_queries=self.with_queries)

    def compute(
        self, prepared: dict[str, Any], params: Mapping[str, Any], device: Any, ops: Any
    ) -> dict[str, Any]:
        from workers.builtin_compute import compute_spc

        return compute_spc(
            prepared, params, device, ops, self.chunks, with_queries=self.with_queries
        )


class SpcQuery(Spc):
    """spc plus seeded query points with their octree indices and occupancy."""

    name = "spc_query"
    params: ClassVar[Mapping[str, ParamSpec]] = {**_SPC_PARAMS, **_QUERY_PARAMS}
    fields: ClassVar[Mapping[str, FieldSpec]] = {**_SPC_FIELDS, **_QUERY_FIELDS}
    doc = "spc plus seeded query points with their octree indices and occupancy"
    record_bytes = staticmethod(_query_bytes)
    record_bytes_doc = _QUERY_BOUND
    with_queries = True


class SpcSdf(Recipe):
    """spc plus the dual octree, trinkets and seeded signed-distance samples of a mesh."""

    name = "spc_sdf"
    version = 2  # 2: the closed field
    params: ClassVar[Mapping[str, ParamSpec]] = _SDF_PARAMS
    fields: ClassVar[Mapping[str, FieldSpec]] = {**_SPC_FIELDS, **_DUAL_FIELDS, **_SDF_FIELDS}
    doc = _SDF_DOC
    record_bytes = staticmethod(_sdf_bytes)
    record_bytes_doc = _SDF_BOUND
    code_modules = (
        "workers.builtin_compute",
        "workers.sampling",
        "workers.sdf",
        "cache_store.recipes.augment",
    )

    def prepare(self, source: Any, params: Mapping[str, Any], generator: Any) -> dict[str, Any]:
        from workers.builtin_compute import prepare_sdf

        return prepare_sdf(source, params, generator)

    def compute(
        self, prepared: dict[str, Any], params: Mapping[str, Any], device: Any, ops: Any
    ) -> dict[str, Any]:
        from workers.builtin_compute import compute_sdf

        return compute_sdf(prepared, params, device, ops, self.chunks)
