"""Which dataset a fingerprint, or a recipe name and parameters, selects in a store.

:func:`resolve_index` is the one rule :class:`~cache_store.readers.dataset.CachedDataset`
(and everything built on it) follows: a fingerprint names its index; a recipe selects
the indexes of its current version whose parameters equal every given one, the given
values checked by the recipe's schema first (the store compares values as given). One
match is the answer; none or several raise :class:`FingerprintLookupError` listing the
candidates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cache_store.errors import FingerprintLookupError, ParameterError
from cache_store.format.index import DatasetIndex
from cache_store.keys import canonical_json, is_fingerprint
from cache_store.recipes.registry import RECIPE_SPECS, get_recipe_spec
from cache_store.stores.base import Store

__all__ = ["describe_dataset", "resolve_index"]


def describe_dataset(index: DatasetIndex) -> str:
    """One line naming a dataset: fingerprint, recipe and version, parameters, samples."""
    return (
        f"{index.fingerprint} ({index.recipe} v{index.recipe_version}, "
        f"{canonical_json(dict(index.params))}, {len(index)} samples)"
    )


def _schema_values(recipe: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` checked by ``recipe``'s schema (``level=numpy.int64(8)`` -> ``8``), so
    that they compare equal to the resolved values an index records; an unknown
    parameter or a value the schema refuses (``level=8.0``) raises ``ParameterError``
    naming each."""
    spec = RECIPE_SPECS[recipe]
    problems, wanted = [], {}
    for name, value in params.items():
        if name not in spec.params:
            problems.append(f"{name}: unknown parameter (known: {', '.join(sorted(spec.params))})")
            continue
        wanted[name], problem = spec.params[name].check(name, value)
        if problem:
            problems.append(problem)
    if problems:
        raise ParameterError(problems, what=f"parameters for recipe {recipe!r}")
    return wanted


def resolve_index(store: Store, fingerprint_or_recipe: str, **params: Any) -> DatasetIndex:
    """The one index that a fingerprint, or a recipe name plus parameters, selects.

    A recipe (installed here) selects the indexes recorded in the store of its current
    version whose parameters equal every given one; a parameter not given matches any
    stored value (its default is not filled in). Exactly one match is the answer; there
    is no tie-break: several raise :class:`FingerprintLookupError` listing each
    candidate (fingerprint, version, parameters, samples; ``exc.candidates``), and none
    raises it listing the datasets of that recipe in the store.
    """
    if is_fingerprint(fingerprint_or_recipe):
        if params:
            raise ParameterError(
                [
                    f"{name}: parameters select a fingerprint by recipe name; "
                    f"{fingerprint_or_recipe} is already one"
                    for name in params
                ]
            )
        return store.get_index(fingerprint_or_recipe)
    recipe = fingerprint_or_recipe
    if recipe not in RECIPE_SPECS:
        get_recipe_spec(recipe)  # raises UnknownName listing the known recipes
    matches = store.find_fingerprints(recipe, **_schema_values(recipe, params))
    current = [i for i in matches if i.recipe_version == RECIPE_SPECS[recipe].version]
    if len(current) == 1:
        return current[0]
    wanted = f"recipe {recipe!r}" + (f" with {canonical_json(params)}" if params else "")
    if current:
        raise FingerprintLookupError(
            f"{wanted} matches {len(current)} datasets in {store.location} (a parameter "
            f"left out matches any stored value); give more parameters or a fingerprint: "
            + "; ".join(describe_dataset(i) for i in current),
            [i.fingerprint for i in current],
        )
    others = matches or store.find_fingerprints(recipe)
    listed = "; ".join(describe_dataset(i) for i in others) or "none"
    raise FingerprintLookupError(
        f"{wanted} (version {RECIPE_SPECS[recipe].version}) matches no dataset in "
        f"{store.location}; datasets of this recipe there: {listed}",
        [i.fingerprint for i in others],
    )
