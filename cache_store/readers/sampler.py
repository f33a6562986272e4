"""``Sampler``: one epoch order for any number of ranks, and a position in it that resumes.

``DistributedSampler`` with ``set_epoch`` gives each world size its own order, and knows
no position inside an epoch. :class:`Sampler` takes the same arguments and deals out
one global sequence, the epoch order of :mod:`cache_store.readers.order` (a pure
function of the samples' ids, the seed and the epoch), the same for 1, 2, 3 or 48 ranks
and any ``num_workers``:

- **Interleaved shares.** Of the positions still to go, ``start, start + 1, ...``, rank
  ``r`` of ``W`` takes ``start + r, start + r + W, start + r + 2W, ...``. A DataLoader
  batching ``B`` of them makes step ``k`` of rank ``r`` hold global positions
  ``start + (kB + i)W + r`` (``i < B``): together the ranks' step ``k`` is exactly the
  contiguous global batch ``[start + kBW, start + (k + 1)BW)``. So the sampler needs
  no batch size: whatever ``W`` and ``B``, the samples consumed after ``k`` steps are
  the first ``kBW`` of the epoch order, and with the same global batch ``BW`` (say 2
  ranks x 6 or 3 ranks x 4) the first ``k`` global batches hold the same samples.
- **The position** is one integer, the samples of the epoch's order consumed by all ranks
  together (``consumed``), so any rank's state resumes every rank of a new job, with
  another world size or ``num_workers``: the new ranks interleave from ``consumed``.
- **The uneven tail.** DDP needs every rank to take the same number of steps. When the
  samples left, ``R``, are not a multiple of ``W``, ``drop_last=False`` pads the end
  with ``(-R) % W`` (< W) samples repeated from the end of the order (so they come from
  the last block read: nothing evicted is fetched again), as ``DistributedSampler`` pads;
  ``drop_last=True`` leaves the last ``R % W`` out instead. Every other sample of the
  epoch is yielded exactly once across the ranks, whatever resumes happened.

Each index it deals is an :class:`~cache_store.readers.variants.EpochIndex`, an ``int``
that carries its epoch to the DataLoader's workers (persistent ones too, which keep the
dataset they started with), so a dataset whose samples have variants reads the variant
of that epoch (:mod:`cache_store.readers.variants`).

``set_epoch(e)`` starts epoch ``e`` from its beginning, except after
``load_state_dict`` of a state of epoch ``e`` (then its next pass resumes where the
state says); it also calls ``dataset.set_epoch(e)`` where the dataset has one.
:meth:`Sampler.state_dict` is the position of what this sampler has handed out, which
is what was consumed where nothing prefetches (``num_workers=0``, or torchdata's
``StatefulDataLoader``, which snapshots it per batch); :class:`~cache_store.readers.loader.DataLoader`
counts the batches it yielded to the user instead.

Read-ahead: over a read-through dataset (``sources=``) the sampler queues this rank's
next ``read_ahead`` samples for the cache's worker as it deals them, so the worker
computes in the order the loaders will ask, and the dataset's own index-order
``warm_ahead`` is turned off (:meth:`CachedDataset.queue_ahead`). Over a remote snapshot
read through ``local_cache``, the same window's parts (a sharded snapshot's; an exported
Zarr snapshot's chunk files) are fetched into the local directory by a thread of the
process that iterates the sampler, in the sampler's order
(:meth:`CachedDataset.prefetch`), so the loaders find them there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.utils.data

from cache_store.errors import ParameterError
from cache_store.readers.order import ORDER_VERSION, epoch_order, id_hashes, sequence_digest
from cache_store.readers.variants import EpochIndex

__all__ = ["STATE_FORMAT", "Position", "Sampler"]

log = logging.getLogger(__name__)

#: ``state_dict()["format"]``: what a sampler state is, and its layout version.
STATE_FORMAT = "spcache.sampler/1"
_UNKNOWN = object()
#: a pass hands out indices in slices of this many (one NumPy take, then plain ints)
_SLICE = 4096


@dataclass(frozen=True)
class Position:
    """A place in the global order: ``consumed`` samples of ``epoch`` are done."""

    epoch: int
    consumed: int


def _distributed() -> tuple[int, int]:
    """(world size, rank) of the initialised default process group, else (1, 0), with a
    warning when a launcher (torchrun's ``WORLD_SIZE``) says there are several."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1:
        log.warning(
            "Sampler: WORLD_SIZE=%s but torch.distributed is not initialised: this process "
            "takes the whole epoch; call init_process_group() before building the "
            "Sampler (or DataLoader), or pass num_replicas and rank",
            launched,
        )
    return 1, 0


def _int_problem(name: str, value: object, low: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return f"{name}: expected an int, got {type(value).__name__} {value!r}"
    if value < low:
        return f"{name}: expected >= {low}, got {value}"
    return None


class _Pass(Iterator[int]):
    """One iteration of a sampler: this rank's share of an epoch from ``start``."""

    def __init__(self, sampler: Sampler, epoch: int, start: int) -> None:
        self.sampler = sampler
        self.epoch = epoch
        self.start = start
        self.total = sampler.local_count(start)  # indices this pass hands out
        self.yielded = 0
        self.finished = False
        self._order: np.ndarray | None = None  # made on the first next(): not before fork
        self._ready: list[int] = []
        self._queued_to = 0  # local positions [0, _queued_to) were read ahead

    def __next__(self) -> int:
        if not self._ready:
            self._fill()
        ahead = self.sampler.read_ahead
        if ahead and self._queued_to < self.total and self._queued_to - self.yielded <= ahead // 2:
            self._read_ahead()
        index = self._ready.pop()
        self.yielded += 1
        return index

    def _fill(self) -> None:
        sampler = self.sampler
        if self.yielded >= self.total:
            if not self.finished:
                self.finished = True
                sampler.pass_ended()
            raise StopIteration
        if self._order is None:
            self._order = sampler.order(self.epoch)
        stop = min(self.yielded + _SLICE, self.total)
        indices = sampler.global_indices(self._order, self.start, self.yielded, stop)
        epoch = self.epoch  # carried by each index to the loader workers (variants)
        self._ready = [EpochIndex(i, epoch) for i in indices[::-1].tolist()]

    def _read_ahead(self) -> None:
        """Queue this rank's samples up to ``read_ahead`` past the last one handed out
        (called when less than half of that window is left queued), and have the
        window's parts fetched into a local cache (the whole window: a prefetch request
        replaces the one before)."""
        sampler = self.sampler
        target = min(self.yielded + sampler.read_ahead, self.total)
        begin = max(self._queued_to, self.yielded)
        assert self._order is not None
        window = sampler.global_indices(self._order, self.start, self.yielded, target).tolist()
        if sampler.reads_through:
            sampler.dataset.queue_ahead(window[begin - self.yielded :])
        if sampler.fetches:
            sampler.dataset.prefetch(window)
        self._queued_to = target

    def __iter__(self) -> _Pass:
        return self


class Sampler(torch.utils.data.Sampler[int]):
    """This rank's share of one epoch order shared by every world size (see the module doc).

    Args:
        dataset: a :class:`~cache_store.readers.dataset.CachedDataset` (what the order
            needs: its ``packed_ids()``, its ``blocks()``, ``set_epoch``).
        seed: the order's seed (any int); the same on every rank.
        num_replicas, rank: the world size and this rank (default: those of the
            initialised ``torch.distributed`` default group, else 1 and 0).
        shuffle: True: a new order each epoch, global over a cache directory or the
            service, block-local over a snapshot read part by part (``dataset.blocks()``);
            False: the index order.
        drop_last: what to do with the ``R % num_replicas`` samples that would leave the
            ranks uneven: False pads with repeats, True leaves them out (module doc).
        window_blocks: block-local order only: blocks whose samples are shuffled
            together (more mixes better; a reader then holds that many blocks at once).
        read_ahead: samples of this rank read ahead of the loaders (0: off): over
            read-through, queued for the cache's worker (off: the dataset's own
            ``warm_ahead`` queues in index order on a miss); over ``local_cache``, their
            parts or chunk files fetched into it (set it to a window, ``window_blocks``
            blocks' samples, for the next window's to arrive while this one is read).

    The order's cost, once per sampler and then once per epoch, in the process that
    iterates it (the training process, never a loader worker): a hash of every id
    (0.3-0.8 s per million ids on a loaded 2-core machine) and a sort of one 64-bit key
    per sample (0.2-0.3 s per million; block-local 0.3-1 s); 16 bytes per sample held
    while the sampler lives (docs/BENCHMARKS.md, ``bench/resume.py``).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        drop_last: bool = False,
        window_blocks: int = 4,
        read_ahead: int = 256,
    ) -> None:
        if num_replicas is None or rank is None:
            world, here = _distributed()
            num_replicas = world if num_replicas is None else num_replicas
            rank = here if rank is None else rank
        problems = [
            p
            for p in (
                _int_problem("seed", seed, -(1 << 63)),
                _int_problem("num_replicas", num_replicas, 1),
                _int_problem("rank", rank, 0),
                _int_problem("window_blocks", window_blocks, 1),
                _int_problem("read_ahead", read_ahead, 0),
            )
            if p is not None
        ]
        if not problems and rank >= num_replicas:
            problems.append(f"rank: expected < num_replicas ({num_replicas}), got {rank}")
        if not callable(getattr(dataset, "packed_ids", None)):
            problems.append(
                f"dataset: a Sampler orders a CachedDataset by its sample ids; "
                f"{type(dataset).__name__} has no packed_ids()"
            )
        if problems:
            raise ParameterError(problems, what="Sampler")
        self.dataset = dataset
        self.seed = int(seed)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.window_blocks = int(window_blocks)
        self.reads_through = getattr(dataset, "on_miss", None) == "compute"
        self.fetches = getattr(dataset, "local_cache", None) is not None
        self.read_ahead = int(read_ahead) if self.reads_through or self.fetches else 0
        if self.read_ahead and self.reads_through:
            dataset.warm_ahead = 0  # this sampler queues ahead, in its own order
        self.epoch = 0
        self._resume = 0  # where the next pass of self.epoch starts
        self._live: _Pass | None = None
        self._hashes: np.ndarray | None = None
        self._blocks: Any = _UNKNOWN  # dataset.blocks(), asked once
        self._orders: tuple[int, np.ndarray, str] | None = None  # epoch, order, digest

    def __repr__(self) -> str:
        return (
            f"Sampler({self.dataset!r}, seed={self.seed}, num_replicas={self.num_replicas}, "
            f"rank={self.rank}, shuffle={self.shuffle}, drop_last={self.drop_last})"
        )

    # -- the order ---------------------------------------------------------------------
    def _ids(self) -> tuple[np.ndarray, Any]:
        """The id hashes, and the dataset's blocks when the order is block-local."""
        if self._hashes is None:
            self._hashes = id_hashes(*self.dataset.packed_ids())
        if self.shuffle and self._blocks is _UNKNOWN:
            self._blocks = self.dataset.blocks()
        return self._hashes, self._blocks if self.shuffle else None

    def mode(self) -> str:
        """``"blocks"`` (block-local shuffle), ``"global"`` or ``"index"`` (no shuffle)."""
        if not self.shuffle:
            return "index"
        return "global" if self._ids()[1] is None else "blocks"

    def order(self, epoch: int) -> np.ndarray:
        """The dataset's positions in the order of ``epoch`` (int64 [len(dataset)])."""
        return self._epoch(epoch)[1]

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray, str]:
        """``(epoch, order, digest of its id sequence)``, kept for the last epoch asked."""
        cached = self._orders
        if cached is not None and cached[0] == epoch:
            return cached
        hashes, blocks = self._ids()
        blob, offsets = self.dataset.packed_ids()
        order = epoch_order(
            hashes,
            self.seed,
            epoch,
            shuffle=self.shuffle,
            ids=_LazyIds(blob, offsets),
            blocks=None if blocks is None else blocks.of_sample,
            block_names=() if blocks is None else blocks.names,
            window_blocks=self.window_blocks,
        )
        self._orders = (epoch, order, sequence_digest(hashes, order))
        return self._orders

    def global_indices(self, order: np.ndarray, start: int, first: int, stop: int) -> np.ndarray:
        """Dataset positions of this rank's local items ``[first, stop)`` of a pass
        starting at global position ``start`` (padding mapped to the order's end)."""
        n = len(order)
        positions = start + self.rank + self.num_replicas * np.arange(first, stop, dtype=np.int64)
        tail = positions >= n
        if tail.any():  # the (-R) % W repeats, taken from the end of the order
            pad = (start - n) % self.num_replicas
            positions[tail] = n - min(n, pad) + (positions[tail] - n) % n
        return order[positions]

    def local_count(self, start: int) -> int:
        """Indices this rank hands out in a pass starting at global position ``start``."""
        remaining = max(len(self.dataset) - start, 0)
        if self.drop_last:
            return remaining // self.num_replicas
        return -(-remaining // self.num_replicas)

    # -- iterating ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        start, self._resume = self._resume, 0
        self._live = _Pass(self, self.epoch, start)
        return self._live

    def __len__(self) -> int:
        live = self._live
        if live is not None and not live.finished and live.epoch == self.epoch:
            return live.total
        return self.local_count(self._resume)

    def pass_ended(self) -> None:
        """Called by a pass when it runs out: the read-ahead handles close, so nothing
        stays open in the training process between epochs."""
        if self.read_ahead:
            self.dataset.close()

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from its start (or, right after
        :meth:`load_state_dict` of a state of that epoch, from its position); also
        ``dataset.set_epoch(epoch)``."""
        problem = _int_problem("epoch", epoch, 0)
        if problem:
            raise ParameterError([problem], what="Sampler.set_epoch")
        if int(epoch) != self.epoch:
            self._resume = 0
        self.epoch = int(epoch)
        hook = getattr(self.dataset, "set_epoch", None)
        if callable(hook):
            hook(self.epoch)

    # -- the state ---------------------------------------------------------------------
    @property
    def next_start(self) -> Position:
        """Where the next pass starts (an epoch's start, or where a loaded state says)."""
        return Position(self.epoch, self._resume)

    @property
    def position(self) -> Position:
        """Where this sampler stands: in a pass, what it has handed out (all ranks
        together, assuming they step together); between passes, where the next starts
        (a pass that ran out leaves its epoch complete)."""
        live = self._live
        n = len(self.dataset)
        if live is not None and live.epoch == self.epoch and self._resume == 0:
            if live.finished:
                return Position(live.epoch, n)
            return self.position_after(live.epoch, live.start, live.yielded)
        return Position(self.epoch, self._resume)

    def position_after(self, epoch: int, start: int, local: int) -> Position:
        """The global position once every rank has consumed ``local`` items of a pass of
        ``epoch`` that started at ``start`` (a whole pass: the epoch complete)."""
        n = len(self.dataset)
        if local >= self.local_count(start):
            return Position(epoch, n)
        return Position(epoch, min(start + local * self.num_replicas, n))

    def state_dict(self, position: Position | None = None) -> dict[str, Any]:
        """The global progress at ``position`` (default: :attr:`position`), as plain
        JSON-able values: ``format``, ``order_version``, ``epoch``, ``consumed`` (samples
        of the epoch's order done by all ranks together), ``samples`` (the dataset's
        size), ``seed``, ``shuffle``, ``mode`` and ``window_blocks`` (what rebuilds the
        order), ``digest`` (of the epoch's id sequence: a resume over other samples is
        refused) and ``failed`` (``on_error="skip"``: each sample the dataset skipped so far, as
        ``[key, id, path, reason, when]`` of ``dataset.failed``, restored into the
        dataset by :meth:`load_state_dict`)."""
        at = self.position if position is None else position
        hashes, _ = self._ids()
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "order_version": ORDER_VERSION,
            "epoch": at.epoch,
            "consumed": at.consumed,
            "samples": len(hashes),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "mode": self.mode(),
            "window_blocks": self.window_blocks,
            "digest": self._epoch(at.epoch)[2],
        }
        failed = getattr(self.dataset, "failed", None)
        if failed:
            state["failed"] = [
                [key, f.sample_id, f.path, f.reason, f.when] for key, f in failed.items()
            ]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state`` (from :meth:`state_dict`, any rank's, any world size): the
        next pass starts at its position, with its seed, shuffle and window; the
        skipped samples it lists are restored into ``dataset.failed``. Raises
        ``ParameterError`` for a state of another format or rule, or when the dataset's
        sequence of ids for that epoch differs from the one the state was saved over
        (unless that epoch was complete)."""
        problems = _state_problems(state)
        if problems:
            raise ParameterError(problems, what="sampler state")
        for name in ("seed", "shuffle", "window_blocks"):
            if state[name] != getattr(self, name):
                log.info(
                    "Sampler: %s=%r from the state (was %r)", name, state[name], getattr(self, name)
                )
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.window_blocks = int(state["window_blocks"])
        self._orders = None
        epoch, consumed, samples = int(state["epoch"]), int(state["consumed"]), state["samples"]
        if consumed < samples:  # mid-epoch: only the same sequence of ids can resume
            self._check_sequence(state)
        self.epoch = epoch
        self._resume = consumed if consumed < samples else len(self.dataset)
        self._live = None
        restore = getattr(self.dataset, "restore_failed", None)
        if state.get("failed") and callable(restore):
            restore(state["failed"])

    def _check_sequence(self, state: Mapping[str, Any]) -> None:
        hashes, _ = self._ids()
        mode = self.mode()
        digest = self._epoch(int(state["epoch"]))[2]
        if len(hashes) == state["samples"] and mode == state["mode"] and digest == state["digest"]:
            return
        raise ParameterError(
            [
                (
                    f"the state is {state['consumed']} samples into epoch {state['epoch']} of "
                    f"{state['samples']} samples ordered {state['mode']!r} (digest "
                    f"{state['digest']}); this dataset has {len(hashes)} samples ordered "
                    f"{mode!r} (digest {digest}): the samples or the store's block layout "
                    f"changed, so the rest of that epoch cannot be told; resume from a "
                    f"state saved at an epoch's end, or call set_epoch() with the next epoch"
                )
            ],
            what="sampler state",
        )


_STATE_TYPES: dict[str, tuple[type, ...]] = {
    "epoch": (int,),
    "consumed": (int,),
    "samples": (int,),
    "seed": (int,),
    "shuffle": (bool,),
    "mode": (str,),
    "window_blocks": (int,),
    "digest": (str,),
}


def _state_problems(state: Mapping[str, Any]) -> list[str]:
    if not isinstance(state, Mapping):
        return [f"expected a dict from Sampler.state_dict(), got {type(state).__name__}"]
    if state.get("format") != STATE_FORMAT:
        return [f"format: expected {STATE_FORMAT!r}, got {state.get('format')!r}"]
    if state.get("order_version") != ORDER_VERSION:
        return [
            (
                f"order_version: this spcache orders by rule {ORDER_VERSION}, the state "
                f"was saved under {state.get('order_version')!r}"
            )
        ]
    problems = []
    for name, types in _STATE_TYPES.items():
        value = state.get(name)
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            problems.append(f"{name}: expected {types[0].__name__}, got {value!r}")
    if not problems and not 0 <= state["consumed"] <= state["samples"]:
        problems.append(f"consumed: expected 0..{state['samples']}, got {state['consumed']}")
    return problems


class _LazyIds:
    """Sample ids as bytes by position, cut from the packed blob only when asked
    (the order reads them only to settle equal id hashes)."""

    def __init__(self, blob: np.ndarray, offsets: np.ndarray) -> None:
        self.blob = blob
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> bytes:
        return self.blob[int(self.offsets[i]) : int(self.offsets[i + 1])].tobytes()
