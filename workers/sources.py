"""The names ``workers/recipes.py`` imports from here, now in :mod:`workers.source_load`
and :mod:`workers.sampling`; this module goes once the recipe plugin rework of
``workers/recipes.py`` imports them from there."""

from __future__ import annotations

from workers.sampling import compute_normalization, normalize_points, shape_points
from workers.source_load import LoadedSource

__all__ = ["LoadedSource", "compute_normalization", "normalize_points", "shape_points"]
