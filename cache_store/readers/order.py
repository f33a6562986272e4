"""The epoch order: which sample comes where in an epoch, as a pure function of the
samples' ids, a seed and the epoch (and, for a block-structured store, which block holds
each sample). :class:`~cache_store.readers.sampler.Sampler` deals this order out to
ranks; nothing here knows about ranks, workers or batches.

The rule (``ORDER_VERSION`` 1; a change to it is a new version, since a checkpoint's
position means something only under the rule that made it):

- every sample id is hashed once (xxh3-64 of its UTF-8 bytes: :func:`id_hashes`);
- an epoch's key is ``mix(mix(seed) ^ epoch)`` and a sample's key in that epoch is
  ``mix(id hash ^ epoch key)``, ``mix`` being SplitMix64's finaliser (a bijection of
  64-bit integers);
- **global** order (a store that reads any record as cheaply as any other: a cache
  directory, the service): the samples sorted by their key;
- **block-local** order (a store read block by block: the parts of a sharded snapshot,
  the chunk ranges of a Zarr snapshot): the blocks sorted by their key (the block name
  hashed the same way, under a key derived from the epoch's), cut into windows of
  ``window_blocks`` consecutive blocks, and the samples of each window sorted by their
  key: one window's blocks are read, then the next window's, and no block twice;
- no shuffle: the dataset's index order.

Two samples whose id hashes are equal (distinct ids, about one pair in 2**64 draws) are
ordered by their ids' bytes, so the order depends on the ids alone, never on where they
sit in the index: the same ids give the same order, and a dataset that grows keeps its
old samples in the same relative order, the new ones falling in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import xxhash
import itertools

__all__ = [
    "ORDER_VERSION",
    "block_hashes",
    "epoch_key",
    "epoch_order",
    "id_hashes",
    "sequence_digest",
]

#: The version of the rule above; part of every sampler state.
ORDER_VERSION = 1

_MASK = (1 << 64) - 1
# a constant that separates block keys from sample keys of the same epoch
_BLOCK_SALT = 0x6A09E667F3BCC909


def _mix_int(x: int) -> int:
    """SplitMix64's finaliser on a Python int (taken modulo 2**64)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, element-wise on uint64 (wrapping arithmetic)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def id_hashes(id_bytes: np.ndarray, id_offsets: np.ndarray) -> np.ndarray:
    """xxh3-64 of each packed sample id.

    Args:
        id_bytes (np.ndarray): uint8 of shape (total_bytes,), the ids' UTF-8 end to end.
        id_offsets (np.ndarray): int64 of shape (n + 1,), id i at ``[o[i], o[i + 1])``.

    Returns:
        np.ndarray: uint64 of shape (n,). About a microsecond per id, once per sampler.
    """
    view = memoryview(np.ascontiguousarray(id_bytes, dtype=np.uint8).data)
    bounds = np.asarray(id_offsets, dtype=np.int64).tolist()
    digest = xxhash.xxh3_64_intdigest
    return np.fromiter(
        (digest(view[a:b]) for a, b in itertools.pairwise(bounds)),
        dtype=np.uint64,
        count=len(bounds) - 1,
    )


def block_hashes(names: Sequence[str]) -> np.ndarray:
    """xxh3-64 of each block name (uint64 of shape (len(names),))."""
    return np.array([xxhash.xxh3_64_intdigest(n.encode("utf-8")) for n in names], dtype=np.uint64)


def epoch_key(seed: int, epoch: int) -> int:
    """The 64-bit key of ``epoch`` under ``seed`` (both taken modulo 2**64)."""
    return _mix_int(_mix_int(seed & _MASK) ^ (epoch & _MASK))


class Ids(Protocol):
    """Sample ids as bytes, by position."""

    def __getitem__(self, position: int, /) -> bytes: ...


def _sorted_by_key(keys: np.ndarray, tie_break: Ids | Sequence[bytes]) -> np.ndarray:
    """Positions sorted by ``keys``; runs of equal keys sorted by ``tie_break``."""
    order = np.argsort(keys, kind="stable")
    ranked = keys[order]
    equal = np.flatnonzero(ranked[1:] == ranked[:-1])
    if equal.size:  # an id-hash collision: settle it by the ids themselves
        starts = equal[np.r_[True, np.diff(equal) > 1]]
        for start in starts.tolist():
            stop = start + 1
            while stop < len(ranked) and ranked[stop] == ranked[start]:
                stop += 1
            run = order[start:stop]
            order[start:stop] = sorted(run.tolist(), key=lambda p: tie_break[p])
    return order


def epoch_order(
    hashes: np.ndarray,
    seed: int,
    epoch: int,
    *,
    shuffle: bool,
    ids: Ids | Sequence[bytes],
    blocks: np.ndarray | None = None,
    block_names: Sequence[str] = (),
    window_blocks: int = 1,
) -> np.ndarray:
    """The positions of the dataset's samples in the order of ``epoch``.

    Args:
        hashes (np.ndarray): uint64 of shape (n,), :func:`id_hashes` of the samples.
        seed, epoch: the sampler's seed and the epoch (ints, taken modulo 2**64).
        shuffle: False gives the index order, ``arange(n)``.
        ids: the samples' ids as bytes, indexable by position (read only to settle
            equal id hashes).
        blocks (np.ndarray | None): int of shape (n,), the block number of each
            sample, indexing ``block_names``; None for the global order.
        block_names: each block's stable name (a part's name, a chunk range).
        window_blocks: blocks shuffled together (block-local order only).

    Returns:
        np.ndarray: int64 of shape (n,), a permutation of ``range(n)``.
    """
    n = len(hashes)
    if not shuffle or n == 0:
        return np.arange(n, dtype=np.int64)
    key = epoch_key(seed, epoch)
    sample_keys = _mix(hashes ^ np.uint64(key))
    if blocks is None:
        return _sorted_by_key(sample_keys, ids).astype(np.int64)
    names = [name.encode("utf-8") for name in block_names]
    block_keys = _mix(block_hashes(block_names) ^ np.uint64(_mix_int(key ^ _BLOCK_SALT)))
    block_rank = np.empty(len(names), dtype=np.int64)
    block_rank[_sorted_by_key(block_keys, names)] = np.arange(len(names), dtype=np.int64)
    window = block_rank[np.asarray(blocks, dtype=np.int64)] // max(int(window_blocks), 1)
    within = _sorted_by_key(sample_keys, ids)  # global key order ...
    # ... then stably grouped by window: each window's samples keep their key order
    return within[np.argsort(window[within], kind="stable")].astype(np.int64)


def sequence_digest(hashes: np.ndarray, order: np.ndarray) -> str:
    """xxh3-64 (hex) of the id hashes in ``order``: equal when two datasets' epochs
    visit the same ids in the same sequence (what a resumed position refers to)."""
    ordered = np.ascontiguousarray(hashes[order], dtype="<u8")
    return xxhash.xxh3_64_hexdigest(ordered.view(np.uint8).data)
