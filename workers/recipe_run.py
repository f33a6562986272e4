"""Running any installed recipe (built-in or plugin) in this process.

:func:`get_recipe` returns a new instance of an installed recipe; :func:`run_recipe`
runs both of its halves on one loaded source; :func:`make_generator` gives each sample
its CPU generator, seeded by ``(fingerprint, sample id, variant)`` (:func:`sample_seed`),
from which every random number of that version of the sample is drawn. That, and device ops that are exact
integer work on float32 inputs, make a record's tensors identical on every device and
backend. ``RECIPES`` maps each installed name to a fresh instance.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import xxhash

from cache_store.recipes.api import ChunkBudget, ReadOnlyParams, Recipe
from cache_store.recipes.registry import get_entry, installed_recipes
from workers.source_load import LoadedSource

__all__ = ["RECIPES", "get_recipe", "make_generator", "run_recipe", "sample_seed"]


def sample_seed(fingerprint: str, sample_id: str, variant: int = 0) -> int:
    """The 63-bit seed of one sample's generator: a hash of ``(fingerprint, sample id)``
    for variant 0 (the seed every record had before variants, so those records stay
    the same), of ``(fingerprint, sample id, variant)`` for the others. The parts are
    joined by NUL, which neither a fingerprint nor a sample id holds."""
    key = f"{fingerprint}\x00{sample_id}" + (f"\x00{variant}" if variant else "")
    return xxhash.xxh3_64_intdigest(key.encode()) & ((1 << 63) - 1)


def make_generator(fingerprint: str, sample_id: str, variant: int = 0) -> torch.Generator:
    """A CPU generator seeded by :func:`sample_seed`; all of the randomness of one
    version (``variant``) of a sample comes from it."""
    return torch.Generator(device="cpu").manual_seed(sample_seed(fingerprint, sample_id, variant))


def get_recipe(name: str) -> Recipe:
    """A new instance of the installed recipe ``name`` (its ``spec`` set); raises
    :class:`UnknownName` listing the known ones."""
    return get_entry(name).new()


def run_recipe(
    recipe: Recipe,
    source: LoadedSource,
    params: Mapping[str, Any],
    *,
    generator: torch.Generator,
    device: torch.device | str,
    ops: Any,
    query_chunk: int | ChunkBudget | None = None,
) -> dict[str, torch.Tensor]:
    """Both halves of ``recipe`` on one loaded source, in this process."""
    if query_chunk is not None:
        recipe.chunks = (
            query_chunk if isinstance(query_chunk, ChunkBudget) else ChunkBudget(query_chunk)
        )
    params = ReadOnlyParams(params)
    prepared = recipe.prepare(source, params, generator)
    return recipe.compute(prepared, params, torch.device(device), ops)


class _Instances(Mapping[str, Recipe]):
    """``RECIPES[name]``: an instance of each installed recipe."""

    def __getitem__(self, name: str) -> Recipe:
        try:
            return installed_recipes().recipes[name].new()
        except KeyError:
            raise KeyError(name) from None

    def __contains__(self, name: object) -> bool:
        return name in installed_recipes().recipes

    def __iter__(self) -> Iterator[str]:
        return iter(installed_recipes().recipes)

    def __len__(self) -> int:
        return len(installed_recipes().recipes)


RECIPES: Mapping[str, Recipe] = _Instances()
