"""The epoch order (cache_store/readers/order.py): a pure function of the ids, the seed
and the epoch, global or block-local."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_store.format.ids import pack_ids
from cache_store.readers.order import epoch_order, id_hashes, sequence_digest


def _order(ids: list[str], seed: int = 0, epoch: int = 0, **kw: object) -> list[str]:
    blob, offsets = pack_ids(ids)
    raw = [s.encode() for s in ids]
    positions = epoch_order(id_hashes(blob, offsets), seed, epoch, shuffle=True, ids=raw, **kw)  # type: ignore[arg-type]
    assert sorted(positions.tolist()) == list(range(len(ids)))  # a permutation
    return [ids[p] for p in positions]


IDS = [f"meshes/chair_{i:04d}" for i in range(500)]


def test_same_ids_same_order_wherever_they_sit_in_the_index() -> None:
    shuffled = list(np.random.default_rng(3).permutation(IDS))
    assert _order(shuffled, seed=7, epoch=2) == _order(IDS, seed=7, epoch=2)


def test_a_grown_dataset_keeps_its_old_samples_in_their_relative_order() -> None:
    grown = IDS + [f"meshes/table_{i:04d}" for i in range(200)]
    old = set(IDS)
    assert [s for s in _order(grown, epoch=1) if s in old] == _order(IDS, epoch=1)


def test_epochs_and_seeds_give_other_orders() -> None:
    base = _order(IDS, seed=0, epoch=0)
    assert _order(IDS, seed=0, epoch=0) == base  # deterministic
    assert _order(IDS, seed=0, epoch=1) != base
    assert _order(IDS, seed=1, epoch=0) != base
    # and no trace of the index order is left: few samples keep their neighbour
    neighbours = sum(IDS.index(a) + 1 == IDS.index(b) for a, b in itertools.pairwise(base))
    assert neighbours < 10


def test_no_shuffle_is_the_index_order() -> None:
    blob, offsets = pack_ids(IDS)
    positions = epoch_order(id_hashes(blob, offsets), 5, 3, shuffle=False, ids=[])
    assert positions.tolist() == list(range(len(IDS)))


def test_the_rule_is_pinned() -> None:
    """The order is part of every checkpoint (a position means something only under the
    rule that made it): ORDER_VERSION 1 gives exactly this, on every machine."""
    expected = ["s3", "s2", "s6", "s0", "s5", "s1", "s7", "s4"]
    assert _order([f"s{i}" for i in range(8)], seed=0, epoch=0) == expected


def test_equal_id_hashes_are_ordered_by_the_ids() -> None:
    hashes = np.array([5, 9, 5, 5, 1], dtype=np.uint64)  # three ids with one hash
    ids = [b"c", b"x", b"a", b"b", b"y"]
    for epoch in range(5):
        positions = epoch_order(hashes, 0, epoch, shuffle=True, ids=ids).tolist()
        run = [ids[p] for p in positions if hashes[p] == 5]
        assert run == [b"a", b"b", b"c"]
        swapped = [ids[i] for i in (2, 1, 0, 3, 4)]  # same ids, other positions
        moved = epoch_order(hashes, 0, epoch, shuffle=True, ids=swapped).tolist()
        assert [swapped[p] for p in moved] == [ids[p] for p in positions]


def _blocks(n: int, size: int) -> tuple[np.ndarray, tuple[str, ...]]:
    of_sample = np.arange(n) // size
    return of_sample, tuple(f"part-{b:03d}" for b in range(int(of_sample.max()) + 1))


@pytest.mark.parametrize("window", [1, 3])
def test_block_local_order_reads_each_block_in_one_window(window: int) -> None:
    of_sample, names = _blocks(len(IDS), 37)
    ordered = _order(IDS, epoch=4, blocks=of_sample, block_names=names, window_blocks=window)
    block = {sid: int(of_sample[i]) for i, sid in enumerate(IDS)}
    runs = [block[s] for s in ordered]
    # each block's samples lie inside one stretch of `window` blocks' samples ...
    windows: list[set[int]] = []
    for b in runs:
        if not windows or (b not in windows[-1] and len(windows[-1]) == window):
            windows.append(set())
        windows[-1].add(b)
    assert sorted(b for w in windows for b in w) == list(range(len(names)))
    # ... and the blocks come in another order than their names'
    assert [min(w) for w in windows] != sorted(min(w) for w in windows)


def test_block_local_order_is_a_function_of_ids_and_block_names() -> None:
    of_sample, names = _blocks(len(IDS), 50)
    perm = np.random.default_rng(1).permutation(len(IDS))
    moved_ids = [IDS[p] for p in perm]
    first = _order(IDS, epoch=2, blocks=of_sample, block_names=names)
    again = _order(moved_ids, epoch=2, blocks=of_sample[perm], block_names=names)
    assert first == again


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=60, unique=True))
def test_sequence_digest_tells_sequences_apart(ids: list[str]) -> None:
    blob, offsets = pack_ids(ids)
    hashes = id_hashes(blob, offsets)
    order = epoch_order(hashes, 0, 0, shuffle=True, ids=[s.encode() for s in ids])
    assert sequence_digest(hashes, order) == sequence_digest(hashes, order.copy())
    if len(ids) > 1:
        assert sequence_digest(hashes, order) != sequence_digest(hashes, order[::-1].copy())
