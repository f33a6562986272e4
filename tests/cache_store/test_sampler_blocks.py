"""Block-local order over snapshots read block by block: a sharded snapshot's parts and a
Zarr snapshot's chunk ranges (``CachedDataset.blocks()``, ``Store.block_layout``); an
epoch reads each block in one window, resumes stay exact, and a state saved over one
layout is refused mid-epoch over another."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cache_store.format.index import DatasetIndex
from cache_store.snapshot.sharded import ShardedSnapshot
from spcache import CachedDataset, DataLoader, ParameterError, Sampler, collate_spc
from tests.helpers.procs import run_spcache
from tests.helpers.resume import FP, assert_exactly_once, sample_ids, write_cache
from tests.helpers.synthetic import make_record

PARTS, PER_PART = 7, 9
IDS = sample_ids(PARTS * PER_PART)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> str:
    location = str(tmp_path_factory.mktemp("blocks") / "snap.zarr")
    snap = ShardedSnapshot(location, readonly=False)
    for p in range(PARTS):  # one put_many, one committed part
        part = IDS[p * PER_PART : (p + 1) * PER_PART]
        snap.put_many(
            (f"{FP}/{sid}", make_record(FP, sid, seed=i, level=4)) for i, sid in enumerate(part)
        )
    snap.put_index(
        DatasetIndex(FP, "spc", 1, {"level": 4, "surface_samples": 100_000}, np.array(IDS))
    )
    snap.close()
    return location


def _runs(labels: list[str]) -> list[str]:
    """The labels in order of first appearance, one per run of equal labels."""
    return [label for i, label in enumerate(labels) if i == 0 or labels[i - 1] != label]


def test_a_sharded_snapshot_is_read_part_by_part(sharded: str) -> None:
    ds = CachedDataset(sharded, FP)
    layout = ds.blocks()
    assert layout is not None and len(layout.names) == PARTS
    part_of = {ds.sample_id(i): layout.names[b] for i, b in enumerate(layout.of_sample)}
    assert len(_runs([part_of[s] for s in IDS])) == PARTS  # as written: 9 ids per part
    sampler = Sampler(ds, num_replicas=1, rank=0, window_blocks=1)
    assert sampler.mode() == "blocks"
    for epoch in range(3):
        sampler.set_epoch(epoch)
        parts = [part_of[ds.sample_id(i)] for i in sampler]
        runs = _runs(parts)
        assert sorted(runs) == sorted(layout.names)  # each part read in one stretch
        assert all(parts.count(p) == PER_PART for p in runs)
        if epoch == 0:
            first = runs
    assert runs != first  # the parts come in another order each epoch


def test_a_window_of_parts_is_shuffled_together(sharded: str) -> None:
    ds = CachedDataset(sharded, FP)
    layout = ds.blocks()
    assert layout is not None
    part_of = {ds.sample_id(i): layout.names[b] for i, b in enumerate(layout.of_sample)}
    parts = [part_of[ds.sample_id(i)] for i in Sampler(ds, num_replicas=1, rank=0)]
    # window_blocks=4 (the default) of 7 parts: 4 parts mixed, then the other 3
    assert len(set(parts[: 4 * PER_PART])) == 4 and len(set(parts[4 * PER_PART :])) == 3
    assert len(_runs(parts[: 4 * PER_PART])) > 4  # mixed, not one part after another


def test_resume_over_a_sharded_snapshot_with_other_ranks(sharded: str) -> None:
    loaders = [
        DataLoader(
            CachedDataset(sharded, FP),
            batch_size=4,
            sampler=Sampler(CachedDataset(sharded, FP), num_replicas=2, rank=r),
            collate_fn=collate_spc,
        )
        for r in range(2)
    ]
    iterators = [iter(loader) for loader in loaders]
    first = [sid for _ in range(4) for it in iterators for sid in next(it)["sample_ids"]]
    state = loaders[0].state_dict()
    assert state["mode"] == "blocks" and state["consumed"] == 32
    rest = []
    for rank in range(3):
        ds = CachedDataset(sharded, FP)
        resumed = DataLoader(
            ds, batch_size=5, sampler=Sampler(ds, num_replicas=3, rank=rank), collate_fn=collate_spc
        )
        resumed.load_state_dict(state)
        rest += [sid for batch in resumed for sid in batch["sample_ids"]]
    whole = CachedDataset(sharded, FP)
    order = [whole.sample_id(i) for i in Sampler(whole, num_replicas=1, rank=0)]
    padding = (-(len(IDS) - 32)) % 3
    assert_exactly_once(first + rest, IDS, order[len(IDS) - padding :] if padding else ())


def test_a_state_over_parts_does_not_resume_over_a_cache_directory(
    sharded: str, tmp_path: Path
) -> None:
    ds = CachedDataset(sharded, FP)
    loader = DataLoader(ds, batch_size=4, shuffle=True, collate_fn=collate_spc)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    local = write_cache(tmp_path / "cache", IDS)  # the same ids, read from LMDB
    elsewhere = DataLoader(CachedDataset(local, FP), batch_size=4, shuffle=True)
    with pytest.raises(ParameterError, match="ordered 'blocks'.*ordered 'global'"):
        elsewhere.load_state_dict(state)


def test_a_zarr_snapshot_is_read_by_chunk_ranges(tmp_path: Path) -> None:
    cache = write_cache(tmp_path / "cache", IDS)
    dest = tmp_path / "snap.zarr"
    done = run_spcache(
        "export", FP, "--cache", cache, "--to", dest, "--chunk-kib", "1", "--no-progress"
    )
    assert done.returncode == 0, done.stderr
    ds = CachedDataset(dest, FP)
    layout = ds.blocks()
    assert layout is not None and len(layout.names) > 3
    sizes = np.bincount(layout.of_sample)
    assert sizes.sum() == len(IDS) and (sizes > 0).all()
    sampler = Sampler(ds, num_replicas=1, rank=0, window_blocks=1)
    blocks = [layout.names[layout.of_sample[i]] for i in sampler]
    assert sorted(_runs(blocks)) == sorted(layout.names)  # each range read in one stretch
    assert CachedDataset(cache, FP).blocks() is None  # LMDB: any record, any time
