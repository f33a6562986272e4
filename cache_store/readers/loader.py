"""``DataLoader``: torch's DataLoader, whose place in the epoch is a state to save and load.

It takes torch's arguments, all of them, and builds a
:class:`~cache_store.readers.sampler.Sampler` where none is given (``shuffle`` and
``drop_last`` passed on; the world size and rank from ``torch.distributed``), so the
order is the same for every world size. What it adds:

- ``state_dict()``: the sampler's state at the batches **yielded to the user** by this
  loader's latest iteration, not at what the workers prefetched: the ``k``-th batch
  holds the indices ``[kB, (k + 1)B)`` of this rank's pass (``in_order``, which it
  requires), so after ``k`` batches every rank has consumed ``kB`` of its share and the
  global position is ``start + kB * num_replicas`` (see the sampler's module doc). Any
  rank's state, saved with the checkpoint, resumes every rank of the next job, with any
  world size, ``num_workers``, ``collate_fn`` or batch size; samples that
  ``on_error="skip"`` left out count as consumed and stay in ``dataset.failed``.
- ``load_state_dict(state)``: the next iteration resumes there (``set_epoch`` with the
  state's epoch keeps it).
- ``set_epoch(epoch)``: the sampler's.

A loader over a sampler it cannot count (``batch_sampler`` other than a
``torch.utils.data.BatchSampler`` over a :class:`Sampler`, or a sampler of another
kind) iterates as torch's does; its ``state_dict`` raises ``ParameterError``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch.utils.data

from cache_store.errors import ParameterError
from cache_store.readers.sampler import Position, Sampler

__all__ = ["DataLoader"]

_TORCH_INIT = inspect.signature(torch.utils.data.DataLoader.__init__)


@dataclass
class _Progress:
    """One iteration of the loader: its pass (epoch, global start) and what it yielded."""

    sampler: Sampler
    epoch: int
    start: int
    batch: int  # indices per yielded batch (1 without automatic batching)
    batches: int = 0
    finished: bool = False


class _Counted(Iterator[Any]):
    """The loader's iterator, counting the batches it hands to the user."""

    def __init__(self, inner: Iterator[Any], progress: _Progress) -> None:
        self.inner = inner
        self.progress = progress

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self.inner)
        except StopIteration:
            self.progress.finished = True
            raise
        self.progress.batches += 1
        return batch

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


class DataLoader(torch.utils.data.DataLoader[Any]):
    """``torch.utils.data.DataLoader`` with a resumable position (see the module doc).

    Same arguments as torch's. Without ``sampler`` and ``batch_sampler`` it builds
    ``Sampler(dataset, shuffle=bool(shuffle), drop_last=drop_last)`` (seed 0; pass your
    own :class:`Sampler` for another seed, ``window_blocks`` or ``read_ahead``), after
    ``torch.distributed.init_process_group`` where there is one. ``in_order=False`` is
    refused: batches arriving out of order make no prefix of the epoch to resume from.
    """

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = _TORCH_INIT.bind(self, dataset, *args, **kwargs)
        except TypeError as exc:
            raise ParameterError([str(exc)], what="DataLoader") from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.pop("self")
        if arguments["in_order"] is False:
            raise ParameterError(
                [
                    (
                        "in_order=False: batches would arrive out of order, so what was "
                        "consumed is no prefix of the epoch to resume from"
                    )
                ],
                what="DataLoader",
            )
        if arguments["sampler"] is None and arguments["batch_sampler"] is None:
            arguments["sampler"] = Sampler(
                dataset,
                shuffle=bool(arguments["shuffle"]),
                drop_last=bool(arguments["drop_last"]),
            )
            arguments["shuffle"] = None
        super().__init__(**arguments)
        self._progress: _Progress | None = None

    def _counted(self) -> tuple[Sampler, int] | None:
        """The spcache sampler behind this loader and the indices per batch, or None."""
        if self.batch_sampler is None:  # no automatic batching: one index per item
            return (self.sampler, 1) if isinstance(self.sampler, Sampler) else None
        inner = getattr(self.batch_sampler, "sampler", None)
        if isinstance(self.batch_sampler, torch.utils.data.BatchSampler) and isinstance(
            inner, Sampler
        ):
            return inner, int(self.batch_sampler.batch_size)
        return None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        counted = self._counted()
        if counted is None:
            return super().__iter__()
        sampler, batch = counted
        at = sampler.next_start  # read before torch starts the pass (workers prefetch)
        self._progress = _Progress(sampler, at.epoch, at.consumed, batch)
        return _Counted(super().__iter__(), self._progress)

    def set_epoch(self, epoch: int) -> None:
        """``sampler.set_epoch(epoch)``."""
        self._sampler_or_raise().set_epoch(epoch)

    def _sampler_or_raise(self) -> Sampler:
        counted = self._counted()
        if counted is None:
            raise ParameterError(
                [
                    (
                        "this DataLoader draws its indices from "
                        f"{type(self.batch_sampler or self.sampler).__name__}, not from a "
                        "spcache Sampler (directly or through torch's BatchSampler): its "
                        "position cannot be counted"
                    )
                ],
                what="DataLoader",
            )
        return counted[0]

    def state_dict(self) -> dict[str, Any]:
        """The position after the batches this loader yielded, as
        :meth:`Sampler.state_dict` gives it (plain JSON-able values; save it with the
        checkpoint, from any rank)."""
        sampler = self._sampler_or_raise()
        progress = self._progress
        if progress is None or progress.sampler is not sampler or progress.epoch != sampler.epoch:
            return sampler.state_dict(sampler.next_start)
        if progress.finished:
            position = Position(progress.epoch, len(self.dataset))  # type: ignore[arg-type]
        else:
            position = sampler.position_after(
                progress.epoch, progress.start, progress.batches * progress.batch
            )
        return sampler.state_dict(position)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state`` (from :meth:`state_dict` or :meth:`Sampler.state_dict`):
        the next iteration starts there."""
        self._sampler_or_raise().load_state_dict(state)
        self._progress = None
