from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cache_store import CachedDataset, collate_spc
from cache_store.errors import (
    CacheNotFound,
    CorruptRecord,
    FingerprintLookupError,
    ParameterError,
    RecordNotFound,
    UnknownName,
)
from cache_store.keys import compute_fingerprint
from cache_store.stores.lmdb import LMDBStore, shared_envs
from cache_store.format.decode import decode_record
from cache_store.format.header import read_header
from cache_store.format.index import DatasetIndex
from tests.helpers.synthetic import fingerprint_of, make_record

QUERY_PARAMS = {
    "level": 4,
    "surface_samples": 100_000,
    "uniform_queries": 16_384,
    "surface_queries": 16_384,
    "surface_sigma": 0.01,
}
FP_Q4 = fingerprint_of("spc_query", level=4)
FP_Q5 = fingerprint_of("spc_query", level=5)
FP_S4 = fingerprint_of("spc", level=4)
N = 24


def _ids(n: int) -> list[str]:
    return [f"{['chairs', 'tables', 'lamps'][i % 3]}/s{i:03d}" for i in range(n)][::-1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cache")
    store = LMDBStore(path, readonly=False)
    for fp, level, recipe, n in (
        (FP_Q4, 4, "spc_query", N),
        (FP_Q5, 5, "spc_query", 3),
        (FP_S4, 4, "spc", 2),
    ):
        ids = _ids(n)
        store.put_many(
            (
                f"{fp}/{sid}",
                make_record(fp, sid, seed=i, recipe=recipe, level=level, num_points=20 + 5 * i),
            )
            for i, sid in enumerate(ids)
        )
        params = (
            dict(QUERY_PARAMS, level=level)
            if recipe == "spc_query"
            else {"level": level, "surface_samples": 100_000}
        )
        store.put_index(DatasetIndex(fp, recipe, 1, params, np.array(ids)))
    # an older version of spc at level 4: never selected by name
    old = compute_fingerprint("spc", 0, {"level": 4, "surface_samples": 100_000})
    store.put_index(DatasetIndex(old, "spc", 0, {"level": 4, "surface_samples": 100_000}, []))
    store.close()
    return path


def _expected(cache: Path, fp: str) -> list[dict[str, torch.Tensor]]:
    store = LMDBStore(cache)
    ids = store.get_index(fp).sample_ids.tolist()
    out = [decode_record(store.get(f"{fp}/{sid}")).tensors for sid in ids]
    store.close()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_reads_every_record_in_index_order(cache: Path) -> None:
    ds = CachedDataset(cache, FP_Q4)
    expected = _expected(cache, FP_Q4)
    assert len(ds) == N
    assert ds.sample_id(0) == _ids(N)[0] and ds.sample_id(-1) == _ids(N)[-1]
    assert all(_same(ds[i], expected[i]) for i in range(N))
    assert _same(ds[-1], expected[-1])
    with pytest.raises(IndexError):
        ds[N]
    assert ds.recipe == ("spc_query", 1, QUERY_PARAMS)


def test_fields_and_transform(cache: Path) -> None:
    ds = CachedDataset(
        cache,
        FP_Q4,
        fields=["octree", "pyramid"],
        transform=lambda s: {**s, "n": s["octree"].numel()},
    )
    sample = ds[3]
    assert set(sample) == {"octree", "pyramid", "n"}
    assert sample["n"] == sample["octree"].numel()


def test_constructor_opens_nothing_and_index_leaves_nothing_open(
    cache: Path, tmp_path: Path
) -> None:
    missing = CachedDataset(tmp_path / "none", FP_Q4)  # no error yet: nothing is opened
    with pytest.raises(CacheNotFound, match=str(tmp_path / "none")):
        len(missing)
    ds = CachedDataset(cache, FP_Q4)
    env_key = os.path.realpath(cache / "records")
    assert len(ds) == N
    shared = shared_envs.get(env_key)
    assert shared is None or shared.env is None  # the index came without leaving it open
    assert ds._id_bytes.dtype == np.uint8 and ds._id_offsets.dtype == np.int64


def test_select_by_recipe_and_parameters(cache: Path) -> None:
    assert CachedDataset(cache, "spc_query", level=4).fingerprint == FP_Q4
    assert CachedDataset(cache, "spc_query", level=np.int64(5)).fingerprint == FP_Q5
    with pytest.raises(ParameterError, match=r"level: expected an integer, got 5\.0"):
        CachedDataset(cache, "spc_query", level=5.0).fingerprint  # noqa: B018
    assert CachedDataset(cache, "spc").fingerprint == FP_S4  # the v0 index is not current
    with pytest.raises(FingerprintLookupError) as err:
        len(CachedDataset(cache, "spc_query"))
    assert set(err.value.candidates) == {FP_Q4, FP_Q5}
    assert FP_Q4 in str(err.value) and FP_Q5 in str(err.value)
    # the error teaches the rule: what was left out matched any stored value, no default
    assert "matches 2 datasets" in str(err.value)
    assert "(a parameter left out matches any stored value)" in str(err.value)
    assert '"level":4' in str(err.value) and '"level":5' in str(err.value)
    with pytest.raises(FingerprintLookupError) as err:
        len(CachedDataset(cache, "spc_query", level=6))
    assert set(err.value.candidates) == {FP_Q4, FP_Q5}
    with pytest.raises(UnknownName, match="spc_query"):
        len(CachedDataset(cache, "nope", level=4))
    with pytest.raises(ParameterError, match="levle"):
        len(CachedDataset(cache, "spc_query", levle=4))
    with pytest.raises(ParameterError):
        len(CachedDataset(cache, FP_Q4, level=4))
    with pytest.raises(FingerprintLookupError):
        len(CachedDataset(cache, "f" * 32))


def test_missing_and_corrupt_records(tmp_path: Path) -> None:
    fp = FP_S4
    store = LMDBStore(tmp_path, readonly=False)
    good = make_record(fp, "good", 1)
    bad = bytearray(make_record(fp, "bad", 2))
    bad[read_header(bytes(bad)).tensors["exsum"].begin] ^= 1
    store.put_many([(f"{fp}/good", good), (f"{fp}/bad", bytes(bad))])
    store.put_index(
        DatasetIndex(
            fp, "spc", 1, {"level": 4, "surface_samples": 100_000}, ["good", "bad", "gone"]
        )
    )
    store.close()
    ds = CachedDataset(tmp_path, fp)
    assert ds[0]["octree"].dtype == torch.uint8
    with pytest.raises(CorruptRecord, match=f"{fp}/bad"):
        ds[1]
    with pytest.raises(RecordNotFound) as err:
        ds[2]
    assert f"{fp}/gone" in str(err.value) and str(tmp_path) in str(err.value)


# -------------------------------------------------------------- DataLoader workers


def forbid_cuda(worker_id: int) -> None:
    """worker_init_fn: any CUDA initialisation in this worker raises."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"CUDA initialised in DataLoader worker {worker_id}")

    torch.cuda._lazy_init = refuse
    torch.cuda.init = refuse


def probe(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transform: records which process read the sample and whether CUDA is initialised."""
    sample["pid"] = torch.tensor(os.getpid())
    sample["cuda_initialized"] = torch.tensor(torch.cuda.is_initialized())
    return sample


def touch_cuda(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    torch.cuda.current_device()
    return sample


def _load_all(
    cache: Path, context: str, workers: int, **kw: object
) -> list[dict[str, torch.Tensor]]:
    ds = CachedDataset(cache, FP_Q4, transform=probe)
    loader = DataLoader(
        ds,
        batch_size=None,
        num_workers=workers,
        multiprocessing_context=context,
        worker_init_fn=forbid_cuda,
        **kw,
    )
    return list(loader)


def _check_against_single_process(
    cache: Path, got: list[dict[str, torch.Tensor]], workers: int
) -> None:
    expected = _expected(cache, FP_Q4)
    assert len(got) == len(expected)
    for sample, want in zip(got, expected, strict=True):
        assert not sample.pop("cuda_initialized").item()
        sample.pop("pid")
        assert _same(sample, want)


# this machine may have fewer cores than workers; the test is about correctness
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_four_forked_workers_read_exactly_what_one_process_reads(cache: Path) -> None:
    got = _load_all(cache, "fork", 4)
    pids = {int(s["pid"]) for s in got}
    assert len(pids) == 4 and os.getpid() not in pids
    _check_against_single_process(cache, got, 4)
    assert not torch.cuda.is_initialized()


def test_parent_that_read_before_forking(cache: Path) -> None:
    ds = CachedDataset(cache, FP_Q4, transform=probe)
    ds[0]  # the parent's store is open now; forking must still work
    loader = DataLoader(
        ds,
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=forbid_cuda,
    )
    _check_against_single_process(cache, list(loader), 2)
    assert not ds[1]["cuda_initialized"].item()


def test_a_worker_that_touches_cuda_fails(cache: Path) -> None:
    ds = CachedDataset(cache, FP_Q4, transform=touch_cuda)
    loader = DataLoader(
        ds,
        batch_size=None,
        num_workers=1,
        multiprocessing_context="fork",
        worker_init_fn=forbid_cuda,
    )
    batches = iter(loader)
    with pytest.raises(RuntimeError, match="CUDA initialised in DataLoader worker"):
        next(batches)
    batches._shutdown_workers()  # the failed iterator would otherwise linger until collected


def test_persistent_workers_over_two_epochs_with_collate(cache: Path) -> None:
    ds = CachedDataset(cache, FP_Q4)
    loader = DataLoader(
        ds,
        batch_size=5,
        num_workers=2,
        multiprocessing_context="fork",
        persistent_workers=True,
        collate_fn=collate_spc,
        worker_init_fn=forbid_cuda,
    )
    expected = _expected(cache, FP_Q4)
    for _ in range(2):
        batches = list(loader)
        assert sum(len(b["lengths"]) for b in batches) == N
        octrees = torch.cat([b["octree"] for b in batches])
        assert torch.equal(octrees, torch.cat([e["octree"] for e in expected]))
        assert batches[0]["pyramid"].shape == (5, 2, 6)
    del loader  # shut the persistent workers down now, not at garbage collection


def keep_list(batch: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    return batch


@pytest.mark.parametrize("collate", [keep_list, collate_spc], ids=["list", "collate_spc"])
@pytest.mark.parametrize(
    "fields", [None, ("point_hierarchy", "octree", "query_points")], ids=["all", "subset"]
)
def test_worker_batches_arrive_as_one_shared_storage(cache: Path, collate, fields) -> None:
    ds = CachedDataset(cache, FP_Q4, fields=fields)
    loader = DataLoader(
        ds,
        batch_size=4,
        num_workers=1,
        multiprocessing_context="fork",
        collate_fn=collate,
        worker_init_fn=forbid_cuda,
    )
    expected = _expected(cache, FP_Q4)
    names = fields or tuple(expected[0])
    got = []
    for batch in loader:
        samples = batch if collate is keep_list else [batch]
        tensors = [t for s in samples for n, t in s.items() if n in names]
        # the batch crossed as ONE storage (one shared-memory file), not one per tensor
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
        assert all(t.is_shared() for t in tensors)
        got.extend(batch if collate is keep_list else [batch])
    if collate is keep_list:
        assert len(got) == N
        for sample, want in zip(got, expected, strict=True):
            assert _same(sample, {n: want[n] for n in names})
    else:
        octrees = torch.cat([b["octree"] for b in got])
        assert torch.equal(octrees, torch.cat([e["octree"] for e in expected]))
    assert not torch.cuda.is_initialized()


def test_a_worker_sample_arrives_as_one_shared_storage(cache: Path) -> None:
    ds = CachedDataset(cache, FP_Q4)
    loader = DataLoader(
        ds,
        batch_size=None,
        num_workers=1,
        multiprocessing_context="fork",
        worker_init_fn=forbid_cuda,
    )
    got = list(loader)
    for sample, want in zip(got, _expected(cache, FP_Q4), strict=True):
        assert len({t.untyped_storage().data_ptr() for t in sample.values()}) == 1
        assert all(t.is_shared() for t in sample.values())
        assert _same(sample, want)


@pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")
def test_pin_memory_keeps_working(cache: Path) -> None:
    # Without an accelerator pinning is a no-op that warns; with CUDA it copies into
    # pinned memory. Either way the batch must come through intact.
    ds = CachedDataset(cache, FP_Q4)
    loader = DataLoader(
        ds,
        batch_size=6,
        num_workers=1,
        multiprocessing_context="fork",
        collate_fn=collate_spc,
        pin_memory=True,
        worker_init_fn=forbid_cuda,
    )
    batches = list(loader)
    expected = _expected(cache, FP_Q4)
    assert torch.equal(
        torch.cat([b["point_hierarchy"] for b in batches]),
        torch.cat([e["point_hierarchy"] for e in expected]),
    )
    if torch.cuda.is_available():
        assert all(b["octree"].is_pinned() for b in batches)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize(("context", "workers"), [("spawn", 4), ("forkserver", 1)])
def test_spawn_and_forkserver_workers(cache: Path, context: str, workers: int) -> None:
    # each worker imports torch afresh (seconds on a small machine): forkserver gets one
    got = _load_all(cache, context, workers)
    assert len({int(s["pid"]) for s in got}) == workers
    _check_against_single_process(cache, got, workers)


def test_each_sample_says_which_it_is_and_a_batch_lists_them(cache: Path) -> None:
    ds = CachedDataset(cache, FP_Q4)
    assert ds[3].sample_id == _ids(N)[3] and "sample_id" not in ds[3]  # not a field
    loader = DataLoader(
        ds, batch_size=5, num_workers=2, collate_fn=collate_spc, multiprocessing_context="fork"
    )
    listed = [sid for batch in loader for sid in batch["sample_ids"]]
    assert listed == _ids(N)  # through worker processes, in batch order

    def plain(sample: dict) -> dict:  # a transform returning a plain dict keeps the id
        return {"octree": sample["octree"]}

    mapped = CachedDataset(cache, FP_Q4, transform=plain)
    assert collate_spc(mapped.__getitems__([0, 2]))["sample_ids"] == [_ids(N)[0], _ids(N)[2]]
