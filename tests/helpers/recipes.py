"""What a test may assume about the recipes installed where it runs.

A user's own recipe plugin may be installed in the same environment (the README's
``point_count``, say, or ``examples/voxel_normals``): a test names the recipes it relies
on (the built-ins, or the ones it installed itself) and never assumes they are all
there is, nor where they sort among the others.
"""

from __future__ import annotations

import re

__all__ = ["BUILTINS", "known_names", "recipe_plugin_modules"]

#: the recipes spcache itself ships
BUILTINS = frozenset({"spc", "spc_query", "spc_sdf"})


def known_names(message: str) -> set[str]:
    """The names an ``UnknownName`` message lists after ``known: ``."""
    match = re.search(r"known: ([\w, .-]+)", message)
    assert match, f"no 'known: ...' list in {message!r}"
    return {name.strip() for name in match.group(1).split(",") if name.strip()}


def recipe_plugin_modules() -> set[str]:
    """The modules the registry imports to read the installed recipes' schemas (every
    entry point of ``spcache.recipes``: the built-ins' ``workers.builtin_recipes`` among
    them) and their parent packages. Code that looks a recipe up loads them at run time,
    as it would any plugin's, never through an import of its own (the arrows in the
    source: tests/test_import_graph.py)."""
    from importlib.metadata import entry_points

    out = set()
    for ep in entry_points(group="spcache.recipes"):
        parts = ep.module.split(".")
        out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return out
