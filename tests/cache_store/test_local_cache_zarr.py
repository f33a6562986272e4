"""``local_cache`` over an exported Zarr snapshot: chunk files are the unit.

Against moto's real S3 HTTP API on 127.0.0.1, with forked DataLoader workers: records
read through the local directory equal records read directly (every chunk file fetched
once); the directory never holds more than ``cache_limit`` at any fetch or eviction, in
any process, while epochs read more than the limit; a copy damaged on disk is set aside
and fetched again, never served; a chunk damaged in the snapshot is not kept and fails
only its own records, as without ``local_cache``; a limit that cannot hold the largest
chunk file is refused before any read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from cache_store.errors import CorruptRecord, LimitTooSmall
from cache_store.local_cache import LocalCache, LocalDisk, directory_bytes
from cache_store.local_cache.zarr_snapshot import CachedZarrSnapshot
from cache_store.readers.dataset import CachedDataset
from cache_store.snapshot.sharded.storage import open_fs
from cache_store.stores.opener import open_store
from tests.helpers.local_cache import (
    FP,
    SizeWatch,
    as_list,
    limit_for,
    peak_bytes,
    same,
    write_exported,
)
from tests.helpers.s3 import S3Server, moto_s3


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with moto_s3() as server:
        yield server


@pytest.fixture(scope="module")
def snapshot(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    """24 records exported in small chunks (several records per data chunk)."""
    location = f"s3://{s3.new_bucket()}/train/exported.zarr"
    ids = write_exported(location, tmp_path_factory.mktemp("lmdb"), samples=24, chunk_bytes=48_000)
    return location, ids


def chunk_sizes(location: str) -> dict[str, int]:
    """Bytes of each chunk file the records are read from, as the bucket lists them."""
    fs, root = open_fs(location, {})
    head = f"{root}/{FP}/"
    listed = fs.find(head, detail=True)
    return {
        name[len(head) :]: int(info["size"])
        for name, info in listed.items()
        if name[len(head) :].startswith(("headers/c/", "data/")) and "/c/" in name[len(head) :]
    }


def test_an_exported_snapshot_opens_through_local_cache(snapshot, tmp_path: Path) -> None:
    location, _ = snapshot
    store = open_store(location, local_cache=LocalCache(str(tmp_path / "lc"), 50 << 20))
    assert isinstance(store, CachedZarrSnapshot)


def test_records_through_local_cache_equal_direct_reads(snapshot, tmp_path: Path) -> None:
    location, ids = snapshot
    sizes = chunk_sizes(location)
    assert sum(p.startswith("data/") for p in sizes) >= 8  # the test needs many units
    direct = CachedDataset(location, FP)
    cached = CachedDataset(location, FP, local_cache=tmp_path / "lc", cache_limit="50M")
    order = list(torch.randperm(len(ids), generator=torch.Generator().manual_seed(3)))
    loader = DataLoader(
        cached,
        batch_size=5,
        sampler=[int(i) for i in order],
        num_workers=2,
        multiprocessing_context="fork",
        collate_fn=as_list,
    )
    got = [sample for batch in loader for sample in batch]
    assert len(got) == len(ids)
    for i, sample in zip(order, got, strict=True):
        assert same(sample, direct[int(i)])
    assert same(cached[7], direct[7])  # this process, one sample
    copies = sorted(os.path.getsize(f) for f in (tmp_path / "lc" / "data").iterdir())
    assert copies == sorted(sizes.values())  # every chunk file, once
    assert os.listdir(tmp_path / "lc" / "tmp") == []


def test_the_bound_holds_while_an_epoch_reads_more_than_the_limit(snapshot, tmp_path: Path) -> None:
    location, ids = snapshot
    sizes = chunk_sizes(location)
    directory = tmp_path / "lc"
    limit = limit_for(directory, 3, max(sizes.values()))  # 3 chunk files of all of them
    watch_file = tmp_path / "events.txt"
    with SizeWatch.installed(str(directory), watch_file) as watch:
        ds = CachedDataset(location, FP, local_cache=directory, cache_limit=limit)
        with peak_bytes(directory) as peak:
            for epoch in range(2):
                order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(epoch))
                loader = DataLoader(
                    ds,
                    batch_size=4,
                    sampler=order.tolist(),
                    num_workers=2,
                    multiprocessing_context="fork",
                    collate_fn=as_list,
                )
                assert sum(len(b) for b in loader) == len(ids)
        sizes_seen = watch.sizes()
        pids = {line.split()[0] for line in watch.events("fetched")}
    assert len(watch.events("fetched")) > len(sizes)  # more than the limit: chunks came back
    assert watch.events("evicted")
    assert len(pids) >= 2  # the events of the loader processes, not only this one's
    assert max(sizes_seen) <= limit, (max(sizes_seen), limit)
    assert peak[0] <= limit, (peak[0], limit)
    assert directory_bytes(str(directory)) <= limit
    assert LocalDisk(LocalCache(str(directory), limit)).usage() <= limit


def test_a_copy_damaged_on_disk_is_fetched_again_not_served(
    snapshot, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    location, _ = snapshot
    direct = CachedDataset(location, FP)
    directory = tmp_path / "lc"
    first = CachedDataset(location, FP, local_cache=directory, cache_limit="50M")
    assert same(first[0], direct[0])
    good = {copy: copy.read_bytes() for copy in (directory / "data").iterdir()}
    assert len(good) >= 2  # the record's header chunk and its data chunks
    for copy, data in good.items():
        damaged = bytearray(data)
        damaged[len(data) // 2] ^= 0xFF
        copy.write_bytes(bytes(damaged))
    # a new reader (a loader worker, the next run): nothing decoded in its memory yet
    again = CachedDataset(location, FP, local_cache=directory, cache_limit="50M")
    with caplog.at_level(logging.WARNING, logger="cache_store.local_cache.disk"):
        assert same(again[0], direct[0])
        assert same(again[1], direct[1])
    assert "damaged" in caplog.text
    assert {copy: copy.read_bytes() for copy in (directory / "data").iterdir()} == good
    assert directory_bytes(str(directory)) <= 50 << 20


def test_a_limit_below_one_chunk_file_is_refused_before_any_read(snapshot, tmp_path: Path) -> None:
    location, _ = snapshot
    sizes = chunk_sizes(location)
    largest = max(sizes, key=lambda p: sizes[p])
    limit = sizes[largest]  # the file itself, not the directory's own files with it
    ds = CachedDataset(location, FP, local_cache=tmp_path / "lc", cache_limit=limit)
    with pytest.raises(LimitTooSmall) as caught:
        len(ds)
    message = str(caught.value)
    assert f"cache_limit {limit}" in message.replace(",", "") or f"({limit} bytes)" in message
    assert f"chunk {largest} of {FP}" in message and f"({sizes[largest]} bytes" in message
    assert os.listdir(tmp_path / "lc" / "data") == []


def test_a_chunk_damaged_in_the_snapshot_is_not_kept_and_fails_only_its_records(
    s3: S3Server, tmp_path: Path
) -> None:
    location = f"s3://{s3.new_bucket()}/bad/exported.zarr"
    ids = write_exported(location, tmp_path / "lmdb", samples=12, chunk_bytes=48_000)
    sizes = chunk_sizes(location)
    target = max((p for p in sizes if p.startswith("data/")), key=lambda p: sizes[p])
    fs, root = open_fs(location, {})
    path = f"{root}/{FP}/{target}"
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))

    def outcome(ds: CachedDataset) -> list[Any]:
        out: list[Any] = []
        for i in range(len(ids)):
            try:
                out.append(ds[i])
            except CorruptRecord as exc:
                out.append(exc.key)
        return out

    direct = outcome(CachedDataset(location, FP))
    directory = tmp_path / "lc"
    cached = outcome(CachedDataset(location, FP, local_cache=directory, cache_limit="50M"))
    bad = [i for i, got in enumerate(direct) if isinstance(got, str)]
    assert 0 < len(bad) < len(ids)  # the chunk's records fail, the others do not
    for i, (a, b) in enumerate(zip(direct, cached, strict=True)):
        assert a == b == f"{FP}/{ids[i]}" if i in bad else same(a, b)
    assert len(os.listdir(directory / "data")) == len(sizes) - 1  # all but the bad one
    assert os.listdir(directory / "tmp") == []
