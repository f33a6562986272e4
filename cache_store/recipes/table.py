"""The recipes' parameters as text, generated from their schemas (``cache_store.recipes.specs``).

``spcache precompute --help`` and ``spcache recipes`` print :func:`recipe_table`, so the
defaults and bounds a user reads are the ones the schema enforces.
"""

from __future__ import annotations

from collections.abc import Iterable

from cache_store.recipes.specs import ParamSpec, RecipeSpec
from cache_store.recipes.registry import RECIPE_SPECS

__all__ = ["recipe_table", "param_bounds"]


def param_bounds(spec: ParamSpec) -> str:
    """``"1..15"``, ``">= 0"``, ``"<= 1"`` or ``""``."""
    lo, hi = spec.minimum, spec.maximum
    if lo is not None and hi is not None:
        return f"{_num(lo, spec)}..{_num(hi, spec)}"
    if lo is not None:
        return f">= {_num(lo, spec)}"
    if hi is not None:
        return f"<= {_num(hi, spec)}"
    return ""


def _num(value: float, spec: ParamSpec) -> str:
    return str(int(value)) if spec.type is int else f"{value:g}"


def recipe_table(specs: Iterable[RecipeSpec] | None = None, *, indent: str = "  ") -> str:
    """One block per recipe: its name, version and doc, then one line per parameter
    (``name  type  default  bounds  meaning``)."""
    blocks = []
    for spec in RECIPE_SPECS.values() if specs is None else specs:
        lines = [f"{spec.name} (version {spec.version}): {spec.doc}"]
        rows = [
            (name, p.type.__name__, repr(p.default), param_bounds(p), p.doc)
            for name, p in spec.params.items()
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(4)] if rows else []
        for row in rows:
            cells = [cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)]
            lines.append(f"{indent}{'  '.join(cells)}  {row[4]}".rstrip())
        blocks.append("\n".join(lines))
    return "\n".join(blocks)
