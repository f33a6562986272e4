"""Which variant of a sample a reader reads in an epoch.

A cache whose samples have K variants (a run asked for ``variants=K``: variant 0, the
unaugmented sample, and K-1 augmented ones, see :mod:`cache_store.recipes.augment`) is
read one variant per sample per epoch: :func:`pick_variant` is a pure function of
``(seed, epoch, sample id, count)``, so every process, every rank and a resumed job pick
the same one, and each epoch sees a fresh draw.

The epoch must reach the process that reads. ``CachedDataset.set_epoch(e)`` sets it in
the process that calls it; a DataLoader's worker processes keep the copy of the dataset
they started with (all their lives with ``persistent_workers=True``), so the epoch also
travels with each index: a sampler that yields :class:`EpochIndex` values (``int`` s
that carry their epoch, and pickle with it through the DataLoader's index queue) makes
every read use the epoch that index was dealt in. :class:`spcache.Sampler` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xxhash

from cache_store.errors import ParameterError
from cache_store.keys import validate_variant, validate_variant_count

__all__ = ["EpochIndex", "VariantChoice", "epoch_of", "pick_variant", "variant_problems"]


class EpochIndex(int):
    """A dataset index (an ``int``) that carries the epoch it was dealt in.

    ``EpochIndex(7, epoch=3)`` is 7 wherever an int is expected (batching, NumPy
    indexing, comparisons); ``CachedDataset`` reads ``.epoch`` to pick each sample's
    variant (:func:`epoch_of`). It pickles as itself, so it reaches a DataLoader's
    worker processes, persistent ones included.
    """

    epoch: int

    def __new__(cls, index: int, epoch: int) -> EpochIndex:
        obj = super().__new__(cls, index)
        obj.epoch = int(epoch)
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (EpochIndex, (int(self), self.epoch))

    def __repr__(self) -> str:
        return f"EpochIndex({int(self)}, epoch={self.epoch})"


@dataclass(frozen=True)
class VariantChoice:
    """A reader's choice of variants (``CachedDataset``'s ``variant``, ``variants`` and
    ``variant_seed``, checked by :func:`variant_problems`).

    ``variant``: None picks one per sample per epoch (:func:`pick_variant` of ``(seed,
    epoch, sample id)``) among the variants the sample has stored (the index says), or
    among ``variants`` when given; an int pins that variant (0: the unaugmented sample).
    ``variants`` is also how many a read-through miss computes of a sample.
    """

    variant: int | None = None
    variants: int | None = None
    seed: int = 0

    def pick(self, sample_id: str, epoch: int, stored: int) -> int:
        """The variant of ``sample_id`` read in ``epoch`` (``stored``: its count)."""
        if self.variant is not None:
            return self.variant
        return pick_variant(self.seed, epoch, sample_id, self.variants or stored)

    @property
    def computed(self) -> int:
        """Records a read-through miss asks for per sample."""
        return max(self.variants or 1, (self.variant or 0) + 1)


def epoch_of(index: Any, default: int) -> int:
    """The epoch an index was dealt in (:class:`EpochIndex`), else ``default``."""
    epoch = getattr(index, "epoch", None)
    return default if epoch is None else int(epoch)


def pick_variant(seed: int, epoch: int, sample_id: str, count: int) -> int:
    """The variant (``0 .. count - 1``) of ``sample_id`` read in ``epoch``: xxh3-64 of
    ``"<seed>\\0<epoch>\\0<sample id>"`` modulo ``count`` (0 when ``count`` is 1)."""
    if count <= 1:
        return 0
    key = f"{int(seed)}\x00{int(epoch)}\x00{sample_id}".encode()
    return xxhash.xxh3_64_intdigest(key) % count


def variant_problems(variant: object, variants: object, seed: object) -> list[str]:
    """What is wrong with a reader's ``variant``, ``variants`` and ``variant_seed`` (the
    rules of :func:`~cache_store.keys.validate_variant` and
    :func:`~cache_store.keys.validate_variant_count`)."""
    problems = []
    for value, check in ((variant, validate_variant), (variants, validate_variant_count)):
        if value is not None:
            try:
                check(value)
            except ParameterError as exc:
                problems += exc.problems
    if isinstance(variant, int) and isinstance(variants, int) and variant >= variants:
        problems.append(
            f"variant: {variant} is not one of the {variants} variants (0 .. {variants - 1})"
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        problems.append(f"variant_seed: expected an integer, got {seed!r}")
    return problems
