"""A recipe from plain functions: :func:`recipe` (public as ``spcache.recipe``).

A user with one function and nothing to install writes::

    @spcache.recipe(fields={"extent": Field("float32", "[3]", "bounding box size")})
    def extent(source, params, generator):
        v = source.vertices
        return {"extent": (v.max(0) - v.min(0)).astype("float32")}

    result = spcache.precompute("meshes/", extent, "cache")

The function is the recipe's ``prepare`` (CPU: the loaded source, the resolved
parameters, the sample's seeded generator; it returns a dict of NumPy arrays); without a
``compute`` the arrays themselves are the record's fields (as CPU tensors). With
``compute=`` (``compute(prepared, params, device, ops)``, the device half of the
contract, :class:`~cache_store.recipes.api.Recipe`) the pair is the recipe.

What :func:`recipe` returns is a :class:`~cache_store.recipes.api.Recipe` subclass,
registered in this process only (:func:`~cache_store.recipes.registry.add_local_recipe`):
``spcache.precompute`` and ``CachedDataset`` take it (or any ``Recipe`` subclass, a
class written in a notebook) in place of a recipe's name. Its code digest is the source
of its functions (:attr:`FunctionRecipe.code_functions`), tracked in its records as an
installed recipe's module source is. Nothing outside this process can import it: the
engine prepares its samples in this process (no loader processes), and where another
process must run it (the service's worker computing a read-through miss, Ray actors)
the error says how to install it instead (:func:`~cache_store.recipes.registry.
require_installed`).

This module imports no torch at import time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from cache_store.errors import ParameterError
from cache_store.recipes.api import Recipe, contract_problems
from cache_store.recipes.specs import FieldSpec, ParamSpec

__all__ = ["FunctionRecipe", "recipe"]

_NAME = re.compile(r"[a-z][a-z0-9_]*")


class FunctionRecipe(Recipe):
    """A recipe made by :func:`recipe` from plain functions (its subclasses are)."""

    #: ``(prepare,)`` or ``(prepare, compute)``: the functions whose source is the code
    #: digest (:func:`~cache_store.recipes.api.code_digest`)
    code_functions: ClassVar[tuple[Callable[..., Any], ...]] = ()
    _prepare_fn: ClassVar[Callable[..., Any] | None] = None
    _compute_fn: ClassVar[Callable[..., Any] | None] = None

    def prepare(self, source: Any, params: Mapping[str, Any], generator: Any) -> Any:
        fn = type(self)._prepare_fn
        assert fn is not None
        return fn(source, params, generator)

    def compute(self, prepared: Any, params: Mapping[str, Any], device: Any, ops: Any) -> Any:
        fn = type(self)._compute_fn
        if fn is not None:
            return fn(prepared, params, device, ops)
        import numpy as np
        import torch

        # the prepared arrays are the fields (each copied: a record owns its tensors)
        return {name: torch.from_numpy(np.array(value)) for name, value in prepared.items()}


def recipe(
    prepare: Callable[..., Any] | None = None,
    *,
    fields: Mapping[str, FieldSpec],
    params: Mapping[str, ParamSpec] | None = None,
    compute: Callable[..., Any] | None = None,
    name: str | None = None,
    version: int = 1,
    doc: str = "",
) -> Any:
    """A recipe from a function (or a ``prepare`` and ``compute`` pair); see the module.

    Use it as a decorator (``@spcache.recipe(fields=...)`` over ``def name(source,
    params, generator)``) or call it (``spcache.recipe(prepare_fn, compute=compute_fn,
    fields=..., name="x")``).

    Args:
        prepare: ``prepare(source, params, generator) -> {name: np.ndarray}`` (CPU).
        fields: ``{name: Field(...)}``, exactly what the record holds.
        params: ``{name: Param(...)}``, the recipe's parameters (default: none).
        compute: ``compute(prepared, params, device, ops) -> {name: torch.Tensor}``;
            None: the prepared arrays are the fields.
        name: the recipe's name (default: ``prepare``'s ``__name__``).
        version: bump it when the output changes (a new fingerprint).
        doc: one line for listings (default: the first line of ``prepare``'s docstring).

    Returns:
        The recipe class (a :class:`FunctionRecipe`), registered in this process; or,
        without ``prepare``, a decorator that makes it.

    Raises:
        ParameterError: a name or schema the recipe contract refuses, or the name of an
            installed recipe (each line says which).
    """
    if prepare is None:
        return lambda fn: recipe(
            fn,
            fields=fields,
            params=params,
            compute=compute,
            name=name,
            version=version,
            doc=doc,
        )
    if not callable(prepare) or (compute is not None and not callable(compute)):
        raise ParameterError(["prepare and compute must be functions"], what="recipe")
    recipe_name = name if name is not None else getattr(prepare, "__name__", "")
    if not isinstance(recipe_name, str) or not _NAME.fullmatch(recipe_name):
        raise ParameterError(
            [f"name {recipe_name!r}: lowercase letters, digits and _ expected (pass name=...)"],
            what="recipe",
        )
    first_line = (getattr(prepare, "__doc__", None) or "").strip().split("\n")[0]
    functions = (prepare,) if compute is None else (prepare, compute)
    namespace: dict[str, Any] = {
        "name": recipe_name,
        "version": version,
        "params": dict(params or {}),
        "fields": dict(fields),
        "doc": doc or first_line or f"function recipe {recipe_name}",
        "code_functions": functions,
        "_prepare_fn": staticmethod(prepare),
        "_compute_fn": None if compute is None else staticmethod(compute),
        "__module__": getattr(prepare, "__module__", __name__),
        "__qualname__": getattr(prepare, "__qualname__", recipe_name),
    }
    cls = type(f"FunctionRecipe_{recipe_name}", (FunctionRecipe,), namespace)
    problems = contract_problems(cls)
    if problems:
        raise ParameterError(problems, what=f"recipe {recipe_name!r}")
    from cache_store.recipes.registry import add_local_recipe

    add_local_recipe(cls)
    return cls
