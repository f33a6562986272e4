"""``local_cache``: what a warm epoch asks of the bucket, counted by the S3 server.

moto's server on 127.0.0.1 counts every request it answers (``S3Server.requests``), from
any process. A warm epoch (every part already in the local directory) through forked
DataLoader workers and the sampler's read-ahead makes none: the workers start from the
listing their parent made, and the parts' manifests are read once. What is promised
fresh stays fresh: a new dataset lists the commits again and sees a part committed
since, and a key missing from an inherited listing is listed for again in the process
that misses it.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

from cache_store.format.index import DatasetIndex
from cache_store.local_cache import LocalCache
from cache_store.recipes.registry import get_recipe_spec
from cache_store.readers.dataset import CachedDataset
from cache_store.snapshot.sharded import ShardedSnapshot
from cache_store.snapshot.sharded.store import MISS_RELIST_S
from cache_store.stores.opener import open_store
from spcache import Sampler
from tests.helpers.local_cache import FP, write_sharded
from tests.helpers.s3 import S3Server, moto_s3
from tests.helpers.synthetic import make_record

FORK = multiprocessing.get_context("fork")


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with moto_s3() as server:
        yield server


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def epoch_ids(loader: DataLoader[Any]) -> list[str]:
    return [sample.sample_id for batch in loader for sample in batch]


def loader_of(ds: CachedDataset, sampler: Sampler) -> DataLoader[Any]:
    return DataLoader(
        ds,
        batch_size=6,
        sampler=sampler,
        num_workers=2,
        multiprocessing_context="fork",
        collate_fn=as_list,
    )


def test_a_warm_epoch_through_forked_workers_makes_no_request(s3: S3Server, tmp_path: Path) -> None:
    location = f"s3://{s3.new_bucket()}/snap.zarr"
    ids = write_sharded(location, parts=6, per_part=6)
    ds = CachedDataset(location, FP, local_cache=tmp_path / "lc", cache_limit="50M")
    sampler = Sampler(ds, seed=2, num_replicas=1, rank=0, read_ahead=12)
    loader = loader_of(ds, sampler)

    mark = s3.requests.mark()
    assert sorted(epoch_ids(loader)) == sorted(ids)
    first = s3.requests.since(mark)
    assert sum("/parts/" in r for r in first) >= 6  # every part fetched, over S3

    for epoch in (1, 2):  # fresh workers each epoch, forked from this process
        sampler.set_epoch(epoch)
        mark = s3.requests.mark()
        assert sorted(epoch_ids(loader)) == sorted(ids)
        assert s3.requests.since(mark) == []


def _read_new(location: str, directory: str, key: str, out: Path) -> None:
    store = open_store(location, readonly=True, local_cache=LocalCache(directory, 50 << 20))
    out.write_text(store.get_record(key).metadata["sample_id"])


def test_a_part_committed_after_the_listing_is_still_seen(s3: S3Server, tmp_path: Path) -> None:
    location = f"s3://{s3.new_bucket()}/snap.zarr"
    ids = write_sharded(location, parts=3, per_part=4)
    directory = tmp_path / "lc"
    ds = CachedDataset(location, FP, local_cache=directory, cache_limit="50M")
    sampler = Sampler(ds, seed=0, num_replicas=1, rank=0, read_ahead=8)
    assert sorted(epoch_ids(loader_of(ds, sampler))) == sorted(ids)  # listed, parts here

    new = [f"n{i:03d}" for i in range(4)]
    writer = ShardedSnapshot(location, readonly=False)
    writer.put_many(
        [(f"{FP}/{sid}", make_record(FP, sid, seed=90 + n)) for n, sid in enumerate(new)]
    )
    spec = get_recipe_spec("spc")
    writer.put_index(DatasetIndex(FP, "spc", spec.version, spec.resolve({}), np.array(ids + new)))
    writer.close()
    time.sleep(MISS_RELIST_S + 0.1)  # past the rate limit on listing for a missed key

    # a process forked now inherits the old listing: the missed key is listed for again
    out = tmp_path / "child.txt"
    child = FORK.Process(target=_read_new, args=(location, str(directory), f"{FP}/{new[2]}", out))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    assert out.read_text() == new[2]

    # a new dataset lists the commits again, and its forked workers read the new part
    mark = s3.requests.mark()
    again = CachedDataset(location, FP, local_cache=directory, cache_limit="50M")
    assert len(again) == len(ids) + len(new)
    assert any("list-type=2" in r or "prefix=" in r for r in s3.requests.since(mark))
    later = Sampler(again, seed=0, num_replicas=1, rank=0, read_ahead=8)
    assert sorted(epoch_ids(loader_of(again, later))) == sorted(ids + new)
