"""Recipe schemas: names, versions, parameters and output fields.

A recipe's *schema* is public contract shared by every process: the service validates
warm-up parameters with it, ``CachedDataset`` resolves ``("spc_query", level=8)`` to a
fingerprint with it, and the worker computes what it declares. The computation itself
lives in ``workers.recipes`` (the only package that may touch a GPU); this module is
pure data and imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cache_store.errors import ParameterError, UnknownName

__all__ = ["ParamSpec", "FieldSpec", "RecipeSpec", "RECIPE_SPECS", "get_recipe_spec",
           "MAX_RECORD_BYTES"]

#: Largest record a recipe's parameters may call for (worst case, from the parameters):
#: a request above it is refused, so one record always fits one response of the service.
MAX_RECORD_BYTES = 256 << 20
#: Allowance for a record's safetensors header and metadata.
_HEADER_BYTES = 64 << 10


@dataclass(frozen=True)
class ParamSpec:
    """One recipe parameter: its type, default and inclusive bounds."""

    type: type
    default: Any
    minimum: float | None = None
    maximum: float | None = None
    doc: str = ""

    def check(self, name: str, value: Any) -> tuple[Any, str | None]:
        """Return ``(coerced value, None)`` or ``(None, problem)``."""
        if self.type is int:
            if isinstance(value, bool) or not isinstance(value, int):
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                else:
                    return None, f"{name}: expected an integer, got {value!r}"
        elif self.type is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                return None, f"{name}: expected a number, got {value!r}"
            value = float(value)
            if not math.isfinite(value):
                return None, f"{name}: expected a finite number, got {value!r}"
        if self.minimum is not None and value < self.minimum:
            return None, f"{name}: {value!r} is below the minimum {self.minimum!r}"
        if self.maximum is not None and value > self.maximum:
            return None, f"{name}: {value!r} is above the maximum {self.maximum!r}"
        return value, None

    def as_json(self) -> dict[str, Any]:
        return {"type": self.type.__name__, "default": self.default,
                "minimum": self.minimum, "maximum": self.maximum, "doc": self.doc}


@dataclass(frozen=True)
class FieldSpec:
    """One output tensor: dtype name (as in torch), symbolic shape, and meaning."""

    dtype: str
    shape: str
    meaning: str

    def as_json(self) -> dict[str, str]:
        return {"dtype": self.dtype, "shape": self.shape, "meaning": self.meaning}


@dataclass(frozen=True)
class RecipeSpec:
    name: str
    version: int
    params: Mapping[str, ParamSpec]
    fields: Mapping[str, FieldSpec]
    doc: str = ""
    #: Worst-case record bytes for resolved parameters (None: not bounded here).
    record_bytes: Callable[[Mapping[str, Any]], int] | None = None
    record_bytes_doc: str = ""

    def resolve(self, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Validate ``params`` and fill defaults; raises :class:`ParameterError`."""
        params = dict(params or {})
        problems = [f"{name}: unknown parameter (known: {', '.join(sorted(self.params))})"
                    for name in sorted(params) if name not in self.params]
        resolved: dict[str, Any] = {}
        for name, spec in self.params.items():
            value, problem = spec.check(name, params.get(name, spec.default))
            if problem:
                problems.append(problem)
            resolved[name] = value
        if not problems and self.record_bytes is not None:
            worst = self.record_bytes(resolved)
            if worst > MAX_RECORD_BYTES:
                problems.append(
                    f"these parameters allow records of up to {worst} bytes, over the "
                    f"{MAX_RECORD_BYTES}-byte record limit ({self.record_bytes_doc}); "
                    "lower them")
        if problems:
            raise ParameterError(problems, what=f"parameters for recipe {self.name!r}")
        return resolved

    def worst_case_record_bytes(self, params: Mapping[str, Any] | None = None) -> int | None:
        """The largest record ``params`` (defaults filled in) can produce, or None."""
        if self.record_bytes is None:
            return None
        full = {name: spec.default for name, spec in self.params.items()}
        full.update(params or {})
        return self.record_bytes(full)

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "doc": self.doc,
                "params": {k: v.as_json() for k, v in self.params.items()},
                "fields": {k: v.as_json() for k, v in self.fields.items()},
                "max_record_bytes": MAX_RECORD_BYTES,
                "record_bytes_bound": self.record_bytes_doc,
                "default_worst_case_record_bytes": self.worst_case_record_bytes()}


_SPC_PARAMS = {
    "level": ParamSpec(int, 8, 1, 15, "octree depth; points are quantised to 2^level cells per axis"),
    "surface_samples": ParamSpec(int, 100_000, 1, 50_000_000,
                                 "points sampled (area-weighted, seeded) from a mesh surface; "
                                 "point-cloud sources use their own points"),
}
_SPC_FIELDS = {
    "octree": FieldSpec("uint8", "[num_bytes]", "Kaolin SPC octree: one byte per non-leaf node, "
                        "breadth first, Morton order within a level"),
    "pyramid": FieldSpec("int32", "[2, level+2]", "row 0: points per level; row 1: first index "
                         "of each level in point_hierarchy (scan_octrees, batch dim squeezed)"),
    "exsum": FieldSpec("int32", "[num_bytes]", "inclusive running sum of set bits per byte"),
    "point_hierarchy": FieldSpec("int16", "[num_points, 3]", "all levels' voxel coordinates, "
                                 "root first (generate_points)"),
    "center": FieldSpec("float32", "[3]", "normalisation: normalised = (source - center) / scale"),
    "scale": FieldSpec("float32", "[]", "normalisation scale (see center)"),
}
_QUERY_PARAMS = {
    "uniform_queries": ParamSpec(int, 16_384, 0, 10_000_000,
                                 "query points drawn uniformly in [-1, 1]^3"),
    "surface_queries": ParamSpec(int, 16_384, 0, 10_000_000,
                                 "query points jittered around surface samples"),
    "surface_sigma": ParamSpec(float, 0.01, 0.0, 1.0,
                               "std-dev of the Gaussian jitter of surface queries, in normalised units"),
}
_QUERY_FIELDS = {
    "query_points": FieldSpec("float32", "[M, 3]", "query coordinates in the normalised [-1, 1] space"),
    "query_pidx": FieldSpec("int32", "[M, level+1]", "unbatched_query(..., with_parents=True): "
                            "point_hierarchy index at each level 0..level, -1 where absent"),
    "occupancy": FieldSpec("uint8", "[M]", "1 where the query's leaf voxel exists, else 0"),
}

_SDF_PARAMS = {
    "level": ParamSpec(int, 8, 1, 12, "octree depth; points are quantised to 2^level cells per "
                       "axis (at most 12 here: the dual octree and trinkets grow with it)"),
    "surface_samples": ParamSpec(int, 100_000, 1, 500_000,
                                 "points sampled (area-weighted, seeded) from the mesh surface to "
                                 "build the octree; the near samples jitter these"),
    "near_samples": ParamSpec(int, 50_000, 0, 1_000_000,
                              "SDF points: surface samples jittered by a Gaussian of std-dev near_sigma"),
    "near_sigma": ParamSpec(float, 0.01, 0.0, 1.0,
                            "std-dev of the near samples' jitter, in normalised units"),
    "uniform_samples": ParamSpec(int, 50_000, 0, 1_000_000,
                                 "SDF points drawn uniformly in the normalisation cube [-1, 1]^3"),
}
_DUAL_FIELDS = {
    "point_hierarchy_dual": FieldSpec("int16", "[num_dual_points, 3]", "unbatched_make_dual: the "
                                      "distinct corners of each level's voxels, level by level, "
                                      "Morton order within a level"),
    "pyramid_dual": FieldSpec("int32", "[2, level+2]", "row 0: dual points per level; row 1: first "
                              "index of each level in point_hierarchy_dual"),
    "trinkets": FieldSpec("int32", "[num_points, 8]", "unbatched_make_trinkets: each voxel's 8 "
                          "corners as indices into its level of the dual (add pyramid_dual[1, level])"),
    "trinket_parents": FieldSpec("int32", "[num_points]", "index in point_hierarchy of each voxel's "
                                 "parent, -1 for the root"),
}
_SDF_FIELDS = {
    "sdf_points": FieldSpec("float32", "[M, 3]", "SDF sample points in the normalised frame: "
                            "uniform_samples uniform in [-1, 1]^3, then near_samples jittered "
                            "surface samples (may lie slightly outside the cube)"),
    "sdf": FieldSpec("float32", "[M]", "signed distance from each sdf_point to the normalised mesh, "
                     "negative inside (generalised winding number |w| > 1/2)"),
    "sdf_face": FieldSpec("int32", "[M]", "index of the closest mesh face"),
    "sdf_pidx": FieldSpec("int32", "[M]", "unbatched_query(octree, exsum, sdf_points, level): the "
                          "point_hierarchy index of each point's leaf voxel, -1 outside the octree"),
}
_SDF_DOC = (
    "spc plus the dual octree, trinkets and seeded signed-distance samples of a triangle mesh "
    "(point clouds are refused: they have no inside). Sign: the generalised winding number "
    "(|w| > 1/2 is inside): exact on closed meshes, robust to small holes; on open sheets the "
    "sign says which side of the sheet a point lies on near it and is positive far from it. "
    "The CUDA path with Kaolin signs by ray parity (check_sign), which equals it on closed "
    "meshes except within 1e-4 of the surface. Size: num_points <= sum over levels of "
    "min(8^l, surface_samples), num_dual_points <= 8 num_points (about 3.5 num_points on "
    "surfaces); a record is about 47 B per point, 6 B per dual point and 24 B per SDF sample: "
    "a few MB at the defaults (10.8 MB for the bunny); parameters whose worst case is "
    "over the record size limit are refused.")


def _level_points(level: int, samples: int) -> list[int]:
    """Upper bound of the occupied voxels at each level 0..level: at most one per sampled
    point, and at most 8^l."""
    return [min(samples, 8 ** lv) for lv in range(level + 1)]


def _spc_bytes(p: Mapping[str, Any]) -> int:
    points = _level_points(int(p["level"]), int(p["surface_samples"]))
    nodes = sum(points[:-1])  # octree: one byte per non-leaf node; exsum: int32 per byte
    return (nodes + 4 * nodes + 6 * sum(points) + 8 * (int(p["level"]) + 2) + 16
            + _HEADER_BYTES)


def _query_bytes(p: Mapping[str, Any]) -> int:
    queries = int(p["uniform_queries"]) + int(p["surface_queries"])
    return _spc_bytes(p) + queries * (12 + 4 * (int(p["level"]) + 1) + 1)


_SPC_BOUND = ("octree + exsum: 5 x sum over levels l < L of min(S, 8^l); point_hierarchy: "
              "6 x sum over l <= L of min(S, 8^l); S = surface_samples, or a point cloud's "
              "own point count")
_QUERY_BOUND = _SPC_BOUND + "; plus (uniform_queries + surface_queries) x (13 + 4 (L + 1))"


def _sdf_bytes(p: Mapping[str, Any]) -> int:
    level = int(p["level"])
    points = _level_points(level, int(p["surface_samples"]))
    dual = [min(8 * n, (2 ** lv + 1) ** 3) for lv, n in enumerate(points)]
    samples = int(p["near_samples"]) + int(p["uniform_samples"])
    # trinkets int32 [P, 8] + trinket_parents int32 [P]; dual int16 [D, 3]; pyramid_dual;
    # sdf_points float32 [M, 3] + sdf float32 + sdf_face int32 + sdf_pidx int32
    return (_spc_bytes(p) + 36 * sum(points) + 6 * sum(dual) + 8 * (level + 2)
            + 24 * samples)


_SDF_BOUND = (_SPC_BOUND + "; plus 36 x (points of all levels) for trinkets and parents, "
              "6 x sum over l <= L of min(8 x points at l, (2^l + 1)^3) dual points, and "
              "24 x (near_samples + uniform_samples)")

RECIPE_SPECS: dict[str, RecipeSpec] = {
    "spc": RecipeSpec("spc", 1, _SPC_PARAMS, _SPC_FIELDS,
                      "structured point cloud (sparse octree) of the normalised shape",
                      _spc_bytes, _SPC_BOUND),
    "spc_query": RecipeSpec("spc_query", 1, {**_SPC_PARAMS, **_QUERY_PARAMS},
                            {**_SPC_FIELDS, **_QUERY_FIELDS},
                            "spc plus seeded query points with their octree indices and occupancy",
                            _query_bytes, _QUERY_BOUND),
    "spc_sdf": RecipeSpec("spc_sdf", 1, _SDF_PARAMS, {**_SPC_FIELDS, **_DUAL_FIELDS, **_SDF_FIELDS},
                          _SDF_DOC, _sdf_bytes, _SDF_BOUND),
}


def get_recipe_spec(name: str) -> RecipeSpec:
    try:
        return RECIPE_SPECS[name]
    except KeyError:
        raise UnknownName("recipe", name, RECIPE_SPECS) from None
