"""spcache.Sampler and spcache.DataLoader in one process: the global order dealt out to any
number of ranks (given as num_replicas/rank), the state counting what was yielded, and
resumes across world sizes, worker counts, collates and skipped samples. Real forked
DataLoader workers where workers are asked for; real ranks and a real kill are in
test_resume_ddp.py."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler

from spcache import CachedDataset, DataLoader, ParameterError, Sampler, collate_spc
from tests.helpers.resume import FP, assert_exactly_once, sample_ids, write_cache

N = 62  # not a multiple of 2, 3, 4 or any batch size used: uneven tails everywhere
IDS = sample_ids(N)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_cache(tmp_path_factory.mktemp("resume") / "cache", IDS)


def _ds(cache: Path, **kw: Any) -> CachedDataset:
    return CachedDataset(cache, FP, **kw)


def _steps(cache: Path, world: int, batch: int, epoch: int = 0, **kw: Any) -> list[list[str]]:
    """Per step, the ids of every rank's batch together (ranks in rank order)."""
    ranks = []
    for rank in range(world):
        ds = _ds(cache)
        sampler = Sampler(ds, num_replicas=world, rank=rank, **kw)
        sampler.set_epoch(epoch)
        ranks.append([[ds.sample_id(i) for i in b] for b in BatchSampler(sampler, batch, False)])
    assert len({len(r) for r in ranks}) == 1, "ranks took different numbers of steps"
    return [[sid for r in ranks for sid in r[k]] for k in range(len(ranks[0]))]


def _order(cache: Path, epoch: int = 0) -> list[str]:
    ds = _ds(cache)
    sampler = Sampler(ds, num_replicas=1, rank=0)
    sampler.set_epoch(epoch)
    return [ds.sample_id(i) for i in sampler]


# -- the order, dealt out ---------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4, 12, 48])
def test_each_step_is_the_next_global_batch_whatever_the_world_size(
    cache: Path, world: int
) -> None:
    order = _order(cache, epoch=5)
    batch = max(1, 12 // world)
    steps = _steps(cache, world, batch, epoch=5)
    size = batch * world
    for k, step in enumerate(steps):
        segment = order[k * size : (k + 1) * size]
        if len(segment) == size:  # a full global batch: exactly that stretch of the order
            assert sorted(step) == sorted(segment), k
    flat = [sid for step in steps for sid in step]
    padding = (-N) % world
    assert_exactly_once(flat, IDS, order[N - padding :] if padding else ())


def test_the_first_global_batches_hold_the_same_samples_for_any_world_size(
    cache: Path,
) -> None:
    # global batch 12 as 1 x 12, 2 x 6, 3 x 4, 4 x 3, 12 x 1
    runs = [_steps(cache, world, 12 // world, epoch=1) for world in (1, 2, 3, 4, 12)]
    for k in range(N // 12):
        assert len({tuple(sorted(run[k])) for run in runs}) == 1, k


def test_drop_last_leaves_the_uneven_tail_out(cache: Path) -> None:
    order = _order(cache)
    flat = [sid for step in _steps(cache, 4, 5, drop_last=True) for sid in step]
    assert sorted(flat) == sorted(order[: N - N % 4])


def test_no_shuffle_deals_the_index_order(cache: Path) -> None:
    steps = _steps(cache, 2, 3, shuffle=False)
    assert steps[0] == [IDS[0], IDS[2], IDS[4], IDS[1], IDS[3], IDS[5]]


def test_set_epoch_reshuffles_and_reaches_the_dataset(cache: Path) -> None:
    ds = _ds(cache)
    sampler = Sampler(ds, num_replicas=1, rank=0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert ds.epoch == 1  # the hook per-epoch variants plug into
    assert list(sampler) != first


def test_a_launched_rank_without_a_process_group_is_warned(
    cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    sampler = Sampler(_ds(cache))
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    assert "torch.distributed is not initialised" in caplog.text
    caplog.clear()
    Sampler(_ds(cache), num_replicas=2, rank=1)  # told: nothing to warn about
    assert caplog.text == ""


def test_bad_arguments_are_refused_by_name(cache: Path) -> None:
    ds = _ds(cache)
    with pytest.raises(ParameterError, match="rank: expected < num_replicas"):
        Sampler(ds, num_replicas=2, rank=2)
    with pytest.raises(ParameterError, match="seed: expected an int"):
        Sampler(ds, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(ParameterError, match="packed_ids"):
        Sampler(list(range(4)))
    with pytest.raises(ParameterError, match="in_order=False"):
        DataLoader(ds, batch_size=2, in_order=False)


# -- state and resume ---------------------------------------------------------------------


def _loader(cache: Path, world: int, rank: int, batch: int, workers: int, **kw: Any) -> DataLoader:
    ds = kw.pop("dataset", None) or _ds(cache)
    sampler = Sampler(ds, num_replicas=world, rank=rank, seed=kw.pop("seed", 0))
    extra = {"multiprocessing_context": "fork"} if workers else {}
    return DataLoader(
        ds,
        batch_size=batch,
        sampler=sampler,
        num_workers=workers,
        collate_fn=kw.pop("collate_fn", collate_spc),
        **extra,
        **kw,
    )


def _ranks(
    cache: Path, world: int, batch: int, workers: int, state: dict | None, steps: int | None
) -> tuple[list[str], dict]:
    """Run ``world`` ranks in step for ``steps`` steps (None: to the end) from ``state``;
    the ids yielded and rank 0's state afterwards (through JSON, as a checkpoint is)."""
    loaders = [_loader(cache, world, r, batch, workers) for r in range(world)]
    iterators = []
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))
        loader.set_epoch(state["epoch"] if state else 3)
        iterators.append(iter(loader))
    yielded = []
    k = 0
    while steps is None or k < steps:
        batches = [next(it, None) for it in iterators]
        if all(b is None for b in batches):
            break
        assert all(b is not None for b in batches), "ranks ran out at different steps"
        yielded += [sid for b in batches for sid in b["sample_ids"]]
        k += 1
    return yielded, loaders[0].state_dict()


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 4 on 2 cores
@pytest.mark.parametrize(
    ("before", "after"),
    [
        ((2, 4, 4), (3, 5, 0)),  # 2 ranks x 4 workers -> 3 ranks, no workers
        ((3, 3, 0), (2, 3, 2)),
        ((1, 7, 2), (4, 2, 0)),
        ((2, 5, 2), (2, 5, 2)),  # the same job again
    ],
)
def test_resume_with_another_world_size_and_workers_yields_each_sample_once(
    cache: Path, before: tuple[int, int, int], after: tuple[int, int, int]
) -> None:
    first, state = _ranks(cache, *before, state=None, steps=3)
    world, batch, _ = before
    assert state["epoch"] == 3 and state["consumed"] == 3 * batch * world  # yielded, not fetched
    rest, end = _ranks(cache, *after, state=state, steps=None)
    assert end["consumed"] == N  # the epoch is complete
    remaining = N - state["consumed"]
    padding = (-remaining) % after[0]
    order = _order(cache, epoch=3)
    assert_exactly_once(first + rest, IDS, order[N - padding :] if padding else ())


def test_a_resume_of_the_same_job_gives_the_same_batches(cache: Path) -> None:
    whole = [_loader(cache, 2, r, 4, 2) for r in range(2)]
    for loader in whole:
        loader.set_epoch(7)
    uninterrupted = [[b["sample_ids"] for b in loader] for loader in whole]
    stopped = _loader(cache, 2, 0, 4, 2)
    stopped.set_epoch(7)
    it = iter(stopped)
    for _ in range(5):
        next(it)
    state = stopped.state_dict()
    for rank in range(2):
        resumed = _loader(cache, 2, rank, 4, 0)
        resumed.load_state_dict(state)
        resumed.set_epoch(7)  # the state's epoch: keeps the position
        assert [b["sample_ids"] for b in resumed] == uninterrupted[rank][5:]


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 on 2 cores
def test_the_state_counts_batches_yielded_not_prefetched(cache: Path) -> None:
    loader = _loader(cache, 1, 0, 4, 3, prefetch_factor=4)
    it = iter(loader)
    next(it)
    next(it)
    assert loader.sampler.position.consumed > 8  # the workers' prefetch drew far ahead
    state = loader.state_dict()
    assert state["consumed"] == 8
    del it


def test_resume_with_a_custom_collate(cache: Path) -> None:
    def ids_and_octrees(samples: list[Any]) -> tuple[list[str], torch.Tensor]:
        return [s.sample_id for s in samples], torch.cat([s["octree"] for s in samples])

    loader = _loader(cache, 1, 0, 6, 2, collate_fn=ids_and_octrees)
    it = iter(loader)
    first = [sid for _ in range(4) for sid in next(it)[0]]
    state = loader.state_dict()
    again = _loader(cache, 1, 0, 4, 0, collate_fn=ids_and_octrees)
    again.load_state_dict(state)
    rest = [sid for ids, _ in again for sid in ids]
    assert_exactly_once(first + rest, IDS)


def test_state_between_epochs_and_after_one(cache: Path) -> None:
    loader = _loader(cache, 1, 0, 8, 0)
    loader.set_epoch(2)
    assert loader.state_dict()["consumed"] == 0
    for _ in loader:
        pass
    done = loader.state_dict()
    assert (done["epoch"], done["consumed"]) == (2, N)
    again = _loader(cache, 1, 0, 8, 0)
    again.load_state_dict(done)
    again.set_epoch(2)
    assert list(again) == []  # nothing left of epoch 2
    again.set_epoch(3)
    assert sum(len(b["sample_ids"]) for b in again) == N


def test_a_state_over_other_samples_is_refused_mid_epoch(tmp_path: Path, cache: Path) -> None:
    loader = _loader(cache, 1, 0, 4, 0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    grown = write_cache(tmp_path / "grown", [*IDS, "shapes/new"])
    other = _loader(grown, 1, 0, 4, 0)
    with pytest.raises(ParameterError, match="the samples or the store's block layout changed"):
        other.load_state_dict(state)
    for _ in it:
        pass
    other.load_state_dict(loader.state_dict())  # a complete epoch resumes over any samples
    with pytest.raises(ParameterError, match="format"):
        other.load_state_dict({"consumed": 3})


def test_the_state_is_small_and_says_what_rebuilds_the_order(cache: Path) -> None:
    loader = _loader(cache, 2, 1, 4, 0, seed=11)
    loader.set_epoch(4)
    next(iter(loader))
    state = loader.state_dict()
    assert state == {
        "format": "spcache.sampler/1",
        "order_version": 1,
        "epoch": 4,
        "consumed": 8,
        "samples": N,
        "seed": 11,
        "shuffle": True,
        "mode": "global",
        "window_blocks": 4,
        "digest": state["digest"],
    }
    assert len(json.dumps(state)) < 300
    seeded = _loader(cache, 3, 0, 4, 0)  # built with seed 0: the state's seed wins
    seeded.load_state_dict(state)
    assert seeded.sampler.seed == 11


# -- on_error="skip" ----------------------------------------------------------------------


def test_skipped_samples_count_as_consumed_and_stay_failed(tmp_path: Path) -> None:
    order = _order(write_cache(tmp_path / "plain", IDS), epoch=0)
    missing = [order[2], order[9], order[30], order[50]]  # two before the stop, two after
    cache = write_cache(tmp_path / "cache", IDS, missing=missing)
    loader = _loader(cache, 1, 0, 5, 2, dataset=_ds(cache, on_error="skip"))
    it = iter(loader)
    first = [sid for _ in range(3) for sid in next(it)["sample_ids"]]
    state = loader.state_dict()
    assert state["consumed"] == 15  # 3 batches of 5: the skipped ones count
    assert len(first) == 13
    stopped = {entry[1] for entry in state["failed"]}
    assert {order[2], order[9]} <= stopped  # (workers may have met later ones already)
    del it
    resumed_ds = _ds(cache, on_error="skip")
    resumed = _loader(cache, 1, 0, 4, 0, dataset=resumed_ds)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert stopped <= set(resumed_ds.failed)  # restored before the first read
    rest = [sid for b in resumed for sid in b.get("sample_ids", [])]
    assert set(resumed_ds.failed) == set(missing)
    assert resumed_ds.failed[order[2]].reason.startswith("RecordNotFound")
    assert_exactly_once(first + rest, [sid for sid in IDS if sid not in missing])


def test_skips_across_ranks_resumed_with_another_world_size(tmp_path: Path) -> None:
    order = _order(write_cache(tmp_path / "plain", IDS), epoch=3)
    missing = [order[1], order[25], order[26], order[N - 1]]
    cache = write_cache(tmp_path / "cache", IDS, missing=missing)
    datasets = [_ds(cache, on_error="skip") for _ in range(2)]
    loaders = [_loader(cache, 2, r, 4, 2, dataset=datasets[r]) for r in range(2)]
    for loader in loaders:
        loader.set_epoch(3)
    iterators = [iter(loader) for loader in loaders]
    first = [sid for _ in range(3) for it in iterators for sid in next(it).get("sample_ids", [])]
    state = loaders[0].state_dict()
    del iterators
    assert state["consumed"] == 24
    again = [_ds(cache, on_error="skip") for _ in range(3)]
    rest = []
    for rank in range(3):
        resumed = _loader(cache, 3, rank, 3, 0, dataset=again[rank])
        resumed.load_state_dict(state)
        rest += [sid for b in resumed for sid in b.get("sample_ids", [])]
    padding = (-(N - 24)) % 3
    kept = [sid for sid in IDS if sid not in missing]
    padded = [sid for sid in order[N - padding :] if sid not in missing]
    assert_exactly_once(first + rest, kept, padded)
    # the state carries what the saving rank skipped, and every resumed rank lists it;
    # each rank lists its own skips, so the job's are the union over its ranks
    saved = {entry[1] for entry in state["failed"]}
    assert order[1] not in saved and saved <= set(datasets[0].failed)
    assert all(saved <= set(ds.failed) for ds in again)
    listed = set().union(*(ds.failed for ds in datasets + again))
    assert listed == set(missing)


# -- torchdata's StatefulDataLoader ------------------------------------------------------


# torchdata 0.11 (the last release) calls torch.set_vital, which torch 2.13 deprecates
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("workers", [0, 2])
def test_torchdata_stateful_dataloader_resumes_through_the_sampler(
    cache: Path, workers: int
) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader() -> StatefulDataLoader:
        ds = _ds(cache)
        extra = {"multiprocessing_context": "fork"} if workers else {}
        return StatefulDataLoader(
            ds,
            batch_size=4,
            sampler=Sampler(ds, num_replicas=1, rank=0),
            num_workers=workers,
            collate_fn=collate_spc,
            **extra,
        )

    stopped = loader()
    stopped.sampler.set_epoch(2)
    it = iter(stopped)
    first = [sid for _ in range(5) for sid in next(it)["sample_ids"]]
    state = stopped.state_dict()  # torchdata snapshots the sampler per batch yielded
    del it
    resumed = loader()
    resumed.load_state_dict(state)  # applied when the next iteration starts
    rest = [sid for b in resumed for sid in b["sample_ids"]]
    assert resumed.sampler.epoch == 2
    assert len(first) == 20
    assert_exactly_once(first + rest, IDS)


# -- the arithmetic, for any sizes ---------------------------------------------------------


class _Ids:
    """What a Sampler asks of a dataset, without a store: ids, blocks, the epoch hook."""

    def __init__(self, n: int, block: int | None = None) -> None:
        from cache_store.format.ids import pack_ids

        self.ids = [f"s{i}" for i in range(n)]
        self.packed = pack_ids(self.ids)
        self.block = block

    def __len__(self) -> int:
        return len(self.ids)

    def packed_ids(self) -> Any:
        return self.packed

    def blocks(self) -> Any:
        if self.block is None:
            return None
        import numpy as np

        from cache_store.stores.base import BlockLayout

        of = np.arange(len(self.ids)) // self.block
        return BlockLayout(tuple(f"b{b}" for b in range(int(of.max()) + 1)), of)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 120),
    before=st.tuples(st.integers(1, 7), st.integers(1, 9)),
    after=st.tuples(st.integers(1, 7), st.integers(1, 9)),
    steps=st.integers(0, 20),
    block=st.one_of(st.none(), st.integers(1, 30)),
    drop_last=st.booleans(),
)
def test_any_stop_and_any_new_world_size_covers_the_epoch_once(
    n: int,
    before: tuple[int, int],
    after: tuple[int, int],
    steps: int,
    block: int | None,
    drop_last: bool,
) -> None:
    data = _Ids(n, block)
    world, batch = before
    samplers = [
        Sampler(data, num_replicas=world, rank=r, drop_last=drop_last) for r in range(world)
    ]
    taken: list[int] = []
    per_rank = [list(BatchSampler(s, batch, False)) for s in samplers]
    done = min(steps, len(per_rank[0]))
    for k in range(done):
        taken += [i for rank in per_rank for i in rank[k]]
    local = min(done * batch, samplers[0].local_count(0))
    state = samplers[0].state_dict(samplers[0].position_after(0, 0, local))
    world2, batch2 = after
    rest: list[int] = []
    for r in range(world2):
        again = Sampler(data, num_replicas=world2, rank=r, drop_last=drop_last)
        again.load_state_dict(state)
        rest += [i for b in BatchSampler(again, batch2, False) for i in b]
    order = Sampler(data, num_replicas=1, rank=0).order(0).tolist()
    counts = Counter(taken + rest)
    # the tail belongs to the job whose pass reached the end of the epoch
    complete = local >= samplers[0].local_count(0)
    remaining, ranks = (n, world) if complete else (n - state["consumed"], world2)
    assert state["consumed"] == (n if complete else local * world)
    if complete:
        assert rest == []
    uneven = remaining % ranks
    if drop_last:  # the last `uneven` of the order left out, nothing repeated
        dropped = set(order[n - uneven :]) if uneven else set()
        assert set(counts) == set(range(n)) - dropped
        assert all(c == 1 for c in counts.values())
    else:  # each sample once, and (-remaining) % ranks repeats from the order's end
        assert set(counts) == set(range(n))
        padding = (-remaining) % ranks
        repeated = {i: c - 1 for i, c in counts.items() if c > 1}
        assert sum(repeated.values()) == padding
        assert set(repeated) <= set(order[n - min(padding, n) :])
