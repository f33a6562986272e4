"""``spcache.Sampler``: a sampler that deals each index with the epoch it belongs to.

It is :class:`torch.utils.data.DistributedSampler` (this rank's share of a shuffle all
ranks agree on; one rank, the whole dataset, when no process group is running), with
two additions for a dataset whose samples have variants
(:mod:`cache_store.readers.variants`):

- each index it yields is an :class:`~cache_store.readers.variants.EpochIndex`, an
  ``int`` carrying its epoch, so the DataLoader's worker processes (persistent ones
  too, which keep the dataset they started with) read the variant of that epoch;
- :meth:`Sampler.set_epoch` also calls the dataset's ``set_epoch`` (``CachedDataset``
  has one), for reads in this process.

So a training loop that calls ``sampler.set_epoch(epoch)`` each epoch, as it would for
``DistributedSampler``, reads a fresh, reproducible variant per sample each epoch: the
same on every rank, and again after a resume at that epoch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch.distributed as dist
from torch.utils.data import DistributedSampler

from cache_store.readers.variants import EpochIndex

__all__ = ["Sampler"]


class Sampler(DistributedSampler[int]):
    """``DistributedSampler`` dealing :class:`EpochIndex` values (see the module).

    Args:
        dataset: the dataset (its length; its ``set_epoch``, when it has one).
        shuffle, seed, drop_last: as ``DistributedSampler``'s.
        num_replicas, rank: as ``DistributedSampler``'s; default: the process group's,
            or 1 and 0 when none is running.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        grouped = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if grouped else 1
        if rank is None:
            rank = dist.get_rank() if grouped else 0
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch
        for index in super().__iter__():
            yield EpochIndex(index, epoch)

    def set_epoch(self, epoch: int) -> None:
        """The epoch dealt next (the shuffle's and the variants'), also set on the dataset."""
        super().set_epoch(epoch)
        set_on: Any = getattr(self.dataset, "set_epoch", None)
        if callable(set_on):
            set_on(epoch)
