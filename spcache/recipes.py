"""The public recipe API: write your own features as a recipe in your own package.

::

    import numpy as np
    from spcache.recipes import Recipe, Param, Field

    class VoxelNormals(Recipe):
        name = "voxel_normals"
        version = 1                        # bump to invalidate old records
        params = {"level": Param(int, 6, minimum=1, maximum=10, doc="octree depth")}
        fields = {"voxels": Field("int16", "[N, 3]", "occupied voxels at level"),
                  "normals": Field("float32", "[N, 3]", "mean face normal", finite=True)}

        def prepare(self, source, params, generator):      # CPU; dict of NumPy arrays
            ...

        def compute(self, prepared, params, device, ops):  # device; dict of CPU tensors
            ...

and register it in your ``pyproject.toml``::

    [project.entry-points."spcache.recipes"]
    voxel_normals = "mypkg.recipes:VoxelNormals"

(or, for a module that is not installed, ``SPCACHE_RECIPES=mymodule:VoxelNormals``).
The contract is in :class:`Recipe`; how recipes are found, in
:mod:`cache_store.recipes.registry`. ``prepare`` raises :class:`SourceError` for a source
the recipe cannot use (that sample fails with the reason). Importing this module imports
no torch.
"""

from __future__ import annotations

from cache_store.errors import SourceError
from cache_store.recipes.api import (
    FIELD_DTYPES,
    RESERVED_PARAM_NAMES,
    ChunkBudget,
    Field,
    Param,
    ReadOnlyParams,
    Recipe,
    check_outputs,
    code_digest,
)
from cache_store.recipes.registry import (
    ENTRY_POINT_GROUP,
    ENV_VAR,
    RecipeEntry,
    Registry,
    installed_recipes,
)
from cache_store.recipes.specs import MAX_RECORD_BYTES, RecipeSpec

__all__ = [
    "Recipe",
    "Param",
    "Field",
    "ChunkBudget",
    "ReadOnlyParams",
    "SourceError",
    "RecipeSpec",
    "RecipeEntry",
    "Registry",
    "installed_recipes",
    "check_outputs",
    "code_digest",
    "ENTRY_POINT_GROUP",
    "ENV_VAR",
    "FIELD_DTYPES",
    "MAX_RECORD_BYTES",
    "RESERVED_PARAM_NAMES",
]
