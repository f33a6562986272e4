"""Recipes written only against the public API (``spcache.recipes``), for the plugin tests.

``Probe`` voxelises a shape's own points; its ``mode`` parameter makes it misbehave, on
meshes only (point clouds still succeed), so a test sees one sample fail alone while the
run goes on. The other classes break the contract or collide on names. The tests name
them through ``SPCACHE_RECIPES`` (``tests.workers.plugin_recipes:Probe``).
"""

from __future__ import annotations

import os

import numpy as np

from spcache.recipes import Field, Param, Recipe

MODES = (
    "ok",
    "dtype",
    "missing",
    "extra",
    "rank",
    "nan",
    "meta",
    "prepare",
    "compute",
    "not_a_dict",
    "oom",
    "crash",
)


class Probe(Recipe):
    """Occupied voxels of a shape's own points, and its bounding-box extent."""

    name = "probe"
    version = 1
    params = {
        "level": Param(int, 3, minimum=1, maximum=8, doc="voxel grid depth"),
        "mode": Param(str, "ok", doc="how to misbehave on meshes: " + ", ".join(MODES)),
    }
    fields = {
        "voxels": Field("int16", "[N, 3]", "occupied voxels at level, sorted"),
        "extent": Field("float32", "[3]", "bounding-box size in source units", finite=True),
    }

    def prepare(self, source, params, generator):
        if params["mode"] not in MODES:
            raise ValueError(f"unknown mode {params['mode']!r}")
        mesh = source.faces is not None
        if mesh and params["mode"] == "prepare":
            raise RuntimeError("probe's prepare refuses meshes")
        if mesh and params["mode"] == "not_a_dict":
            return [1, 2, 3]
        if mesh and params["mode"] == "crash":  # as a parser that segfaults: in a loader only
            os._exit(70)
        v = source.vertices
        lo, hi = v.min(axis=0), v.max(axis=0)
        half = max(float((hi - lo).max()) / 2, 1e-12)
        return {
            "points": ((v - (lo + hi) / 2) / half).astype(np.float32),
            "extent": (hi - lo).astype(np.float32),
            "mesh": np.array(mesh),
        }

    def compute(self, prepared, params, device, ops):
        import torch

        points = torch.from_numpy(prepared["points"]).to(device)
        voxels = torch.unique(ops.quantize_points(points, params["level"]), dim=0)
        out = {
            "voxels": voxels.to("cpu", torch.int16),
            "extent": torch.from_numpy(prepared["extent"]),
        }
        if not bool(prepared["mesh"]):
            return out
        mode = params["mode"]
        if mode == "compute":
            raise RuntimeError("probe's compute failed on purpose")
        if mode == "oom":  # device memory running out outside any ChunkBudget
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        if mode == "dtype":
            out["extent"] = out["extent"].double()
        elif mode == "missing":
            del out["extent"]
        elif mode == "extra":
            out["bonus"] = torch.zeros(1)
        elif mode == "rank":
            out["voxels"] = out["voxels"].reshape(-1)
        elif mode == "nan":
            out["extent"] = torch.full((3,), float("nan"))
        elif mode == "meta":  # a tensor not on the CPU (what a forgotten .cpu() leaves)
            out["extent"] = torch.empty(3, device="meta")
        return out


class ProbeV2(Probe):
    """``probe`` with its version bumped."""

    version = 2


class OtherProbe(Probe):
    """A second class claiming the name ``probe``."""


class NoCompute(Recipe):
    """Declares a schema but never implements ``compute``."""

    name = "no_compute"
    version = 1
    fields = {"x": Field("float32", "[3]", "nothing")}

    def prepare(self, source, params, generator):
        return {}


class BadField(Recipe):
    """Declares a dtype records cannot hold."""

    name = "bad_field"
    version = 1
    fields = {"x": Field("complex64", "[3]", "not storable")}

    def prepare(self, source, params, generator):
        return {}

    def compute(self, prepared, params, device, ops):
        return {}


class PowerGrid(Recipe):
    """Declares a dimension that is an expression spcache does not evaluate."""

    name = "power_grid"
    version = 1
    params = {"grid": Param(int, 5, minimum=1, maximum=8)}
    fields = {"occupancy": Field("uint8", "[2**grid, 2**grid, 2**grid]", "dense grid")}

    def prepare(self, source, params, generator):
        return {}

    def compute(self, prepared, params, device, ops):
        return {}


class OffsetVariable(PowerGrid):
    """A variable dimension with an offset: neither fixed nor a variable dimension."""

    name = "offset_variable"
    fields = {"points": Field("float32", "[N+1, 3]", "points and one more")}


class FloatDimension(PowerGrid):
    """A dimension sized by a float parameter."""

    name = "float_dimension"
    params = {"grid": Param(int, 5, minimum=1), "spacing": Param(float, 0.5)}
    fields = {"row": Field("float32", "[spacing]", "a row")}


class Shadow(Probe):
    """A plugin claiming a built-in recipe's name."""

    name = "spc"


class Tagged(Probe):
    """``probe`` with a string and a bool parameter it only carries (into the fingerprint)."""

    name = "tagged"
    params = {
        **Probe.params,
        "tag": Param(str, "", doc="a label"),
        "flip": Param(bool, False, doc="a switch"),
    }


class EmptyFieldName(Probe):
    """A field named ``""``: no record could hold it."""

    name = "empty_field_name"
    fields = {"": Field("float32", "[3]", "unnamed"), **Probe.fields}


class PathFieldName(Probe):
    """A field named like a path, with a space."""

    name = "path_field_name"
    fields = {"a b/..": Field("float32", "[3]", "oddly named"), **Probe.fields}


class ReservedParam(Probe):
    """A parameter ``spcache.precompute`` takes itself (``device``)."""

    name = "reserved_param"
    params = {**Probe.params, "device": Param(str, "cpu", doc="shadowed")}
