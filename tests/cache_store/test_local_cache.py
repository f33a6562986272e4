"""``local_cache``: a remote snapshot read through a bounded directory on this machine.

Against moto's real S3 HTTP API on 127.0.0.1, with forked DataLoader workers and several
processes sharing one directory: records read through it equal records read directly;
the directory never holds more than ``cache_limit`` at any fetch or eviction, in any
process, while an epoch reads more than the limit; a part in use is never evicted;
processes fetching one part at once end with one good copy, fetched once; a copy damaged
on disk is fetched again, never served; a part damaged in the snapshot is not kept and
its bad record fails alone; a limit that cannot hold one part is refused before any read.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from cache_store.errors import CorruptRecord, LimitTooSmall, ParameterError, StoreFull, UsageError
from cache_store.local_cache import LocalCache, LocalDisk, directory_bytes
from cache_store.readers.dataset import CachedDataset
from cache_store.snapshot.sharded import ShardedSnapshot
from cache_store.stores.opener import open_store
from tests.helpers.local_cache import (
    FP,
    BytesUnit,
    SizeWatch,
    as_list,
    limit_for,
    peak_bytes,
    same,
    write_sharded,
)
from tests.helpers.s3 import S3Server, moto_s3

FORK = multiprocessing.get_context("fork")


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with moto_s3() as server:
        yield server


@pytest.fixture(scope="module")
def snapshot(s3: S3Server) -> tuple[str, list[str]]:
    """8 parts of 6 records (about 40 KB each part), indexed."""
    location = f"s3://{s3.new_bucket()}/train/snap.zarr"
    return location, write_sharded(location, parts=8, per_part=6)


def part_sizes(location: str) -> dict[str, int]:
    """Each committed part's bytes, as the bucket lists them."""
    with ShardedSnapshot(location) as store:
        listed = store.fs.ls(store.path(FP, "parts"), detail=True, refresh=True)
    return {str(i["name"]).rsplit("/", 1)[-1][: -len(".bin")]: int(i["size"]) for i in listed}


def test_records_through_local_cache_equal_direct_reads(snapshot, tmp_path: Path) -> None:
    location, ids = snapshot
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
    assert len(os.listdir(tmp_path / "lc" / "data")) == 8  # every part, once
    assert os.listdir(tmp_path / "lc" / "tmp") == []


def test_the_bound_holds_while_an_epoch_reads_more_than_the_limit(snapshot, tmp_path: Path) -> None:
    location, ids = snapshot
    largest = max(part_sizes(location).values())
    directory = tmp_path / "lc"
    limit = limit_for(directory, 3, largest)  # 3 of the 8 parts
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
        sizes = watch.sizes()
        pids = {line.split()[0] for line in watch.events("fetched")}
    assert len(watch.events("fetched")) > 8  # more than the limit was read: parts came back
    assert watch.events("evicted")
    assert len(pids) >= 2  # the events of the loader processes, not only this one's
    assert max(sizes) <= limit, (max(sizes), limit)
    assert peak[0] <= limit, (peak[0], limit)
    assert directory_bytes(str(directory)) <= limit
    assert LocalDisk(LocalCache(str(directory), limit)).usage() <= limit


def _pin_and_wait(directory: str, limit: int, unit: BytesUnit, ready: Path, release: Path) -> None:
    disk = LocalDisk(LocalCache(directory, limit))
    with disk.pinned(unit) as fd:
        assert os.pread(fd, unit.size(), 0) == unit.data
        ready.write_text("pinned")
        deadline = time.monotonic() + 120
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.01)


def _wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert time.monotonic() < deadline, f"{what} did not happen within 120 s"
        time.sleep(0.01)


def test_eviction_never_removes_a_unit_another_process_reads(tmp_path: Path) -> None:
    directory = tmp_path / "lc"
    fetches = tmp_path / "fetches.txt"
    units = [BytesUnit(f"u{n}", bytes([n]) * 60_000, fetches) for n in range(5)]
    limit = limit_for(directory, 2, 60_000)
    disk = LocalDisk(LocalCache(str(directory), limit))
    held = disk.digest("u0")
    ready, release = tmp_path / "ready", tmp_path / "release"
    child = FORK.Process(
        target=_pin_and_wait, args=(str(directory), limit, units[0], ready, release)
    )
    child.start()
    try:
        _wait_for(ready, "the child's pin")
        for unit in units[1:]:  # each needs the room of an older one
            with disk.pinned(unit) as fd:
                assert os.pread(fd, unit.size(), 0) == unit.data
            assert (directory / "data" / held).exists()
            assert directory_bytes(str(directory)) <= limit
        assert units[0].fetch_count() == 1
        assert [u.fetch_count() for u in units[1:]] == [1, 1, 1, 1]
        assert not (directory / "data" / disk.digest("u1")).exists()  # evicted instead
    finally:
        release.write_text("go")
        child.join(60)
    assert child.exitcode == 0


def test_a_fetch_with_every_unit_pinned_waits_then_names_the_sizes(tmp_path: Path) -> None:
    directory = tmp_path / "lc"
    fetches = tmp_path / "fetches.txt"
    first, second = (BytesUnit(f"u{n}", bytes([n]) * 60_000, fetches) for n in range(2))
    limit = limit_for(directory, 1, 60_000)
    ready, release = tmp_path / "ready", tmp_path / "release"
    child = FORK.Process(target=_pin_and_wait, args=(str(directory), limit, first, ready, release))
    child.start()
    try:
        _wait_for(ready, "the child's pin")
        impatient = LocalDisk(LocalCache(str(directory), limit), wait_s=0.5)
        with pytest.raises(StoreFull) as caught, impatient.pinned(second):
            pass
        message = str(caught.value)
        assert "u1 needs 60.0 KiB" in message and "held by readers" in message
        assert (directory / "data" / impatient.digest("u0")).exists()
    finally:
        release.write_text("go")
        child.join(60)
    with LocalDisk(LocalCache(str(directory), limit)).pinned(second) as fd:  # now it fits
        assert os.pread(fd, 60_000, 0) == second.data


def _read_one(directory: str, limit: int, unit: BytesUnit, out: Path) -> None:
    with LocalDisk(LocalCache(directory, limit)).pinned(unit) as fd:
        out.write_bytes(os.pread(fd, unit.size() + 1, 0))


def test_processes_fetching_one_unit_at_once_end_with_one_good_copy(tmp_path: Path) -> None:
    directory = tmp_path / "lc"
    unit = BytesUnit("shared", os.urandom(200_000), tmp_path / "fetches.txt", delay=0.5)
    limit = limit_for(directory, 2, 200_000)
    children = [
        FORK.Process(target=_read_one, args=(str(directory), limit, unit, tmp_path / f"got{n}"))
        for n in range(4)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
    assert [c.exitcode for c in children] == [0, 0, 0, 0]
    assert unit.fetch_count() == 1
    assert all((tmp_path / f"got{n}").read_bytes() == unit.data for n in range(4))
    assert os.listdir(directory / "data") == [LocalDisk.digest("shared")]
    assert os.listdir(directory / "tmp") == []


def _read_part(location: str, directory: str, indices: list[int], out: Path) -> None:
    ds = CachedDataset(location, FP, local_cache=directory, cache_limit="50M")
    samples = ds.__getitems__(indices)
    out.write_text(str(len(samples)))


def test_loader_processes_reading_one_part_fetch_it_once(snapshot, tmp_path: Path) -> None:
    location, _ = snapshot
    directory = tmp_path / "lc"
    with SizeWatch.installed(str(directory), tmp_path / "events.txt") as watch:
        children = [
            FORK.Process(
                target=_read_part,
                args=(location, str(directory), [0, 1, 2, 3, 4, 5], tmp_path / f"n{k}"),
            )
            for k in range(3)
        ]
        for child in children:
            child.start()
        for child in children:
            child.join(120)
        fetched = watch.events("fetched")
    assert [c.exitcode for c in children] == [0, 0, 0]
    assert all((tmp_path / f"n{k}").read_text() == "6" for k in range(3))
    assert len(fetched) == 1  # part 0, by one of the three
    assert len(os.listdir(directory / "data")) == 1
    assert os.listdir(directory / "tmp") == []


def test_a_copy_damaged_on_disk_is_fetched_again_not_served(
    snapshot, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    location, ids = snapshot
    direct = CachedDataset(location, FP)
    directory = tmp_path / "lc"
    ds = CachedDataset(location, FP, local_cache=directory, cache_limit="50M")
    ds[0]
    (copy,) = (directory / "data").iterdir()
    good = copy.read_bytes()
    damaged = bytearray(good)
    damaged[len(good) // 3] ^= 0xFF  # inside a record's field bytes
    copy.write_bytes(bytes(damaged))
    with caplog.at_level(logging.WARNING, logger="cache_store.local_cache.disk"):
        samples = ds.__getitems__(list(range(6)))  # the part's six records
    assert all(same(s, direct[i]) for i, s in enumerate(samples))
    assert "damaged" in caplog.text
    assert same(ds[2], direct[2])  # fetched again on the next read
    (again,) = (directory / "data").iterdir()
    assert again.read_bytes() == good
    again.write_bytes(good[: len(good) // 2])  # truncated on disk
    assert all(same(ds[i], direct[i]) for i in range(6))
    assert directory_bytes(str(directory)) <= 50 << 20


def test_a_part_damaged_in_the_snapshot_is_not_kept_and_its_bad_record_fails_alone(
    s3: S3Server, tmp_path: Path
) -> None:
    location = f"s3://{s3.new_bucket()}/bad/snap.zarr"
    write_sharded(location, parts=1, per_part=4)
    with ShardedSnapshot(location) as store:
        entry = store.entry_of(f"{FP}/s0002")
        assert entry is not None
        path = store.path(FP, "parts", f"{entry.part}.bin")
        data = bytearray(store.fs.cat_file(path))
        data[entry.offset + entry.length - 10] ^= 0xFF  # the last field of record s0002
        store.fs.pipe_file(path, bytes(data))
    directory = tmp_path / "lc"
    ds = CachedDataset(location, FP, local_cache=directory, cache_limit="50M")
    for i in (0, 1, 3):
        assert ds[i]["octree"].numel() > 0
    with pytest.raises(CorruptRecord) as caught:
        ds[2]
    assert caught.value.key == f"{FP}/s0002"
    assert os.listdir(directory / "data") == []  # never kept
    assert os.listdir(directory / "tmp") == []


def test_a_limit_below_one_part_is_refused_before_any_read(snapshot, tmp_path: Path) -> None:
    location, _ = snapshot
    sizes = part_sizes(location)
    largest = max(sizes, key=lambda p: sizes[p])
    ds = CachedDataset(location, FP, local_cache=tmp_path / "lc", cache_limit="20K")
    with pytest.raises(LimitTooSmall) as caught:
        len(ds)
    message = str(caught.value)
    assert "cache_limit 20.0 KiB (20480 bytes)" in message
    assert f"part {largest} of {FP}" in message and f"({sizes[largest]} bytes" in message
    assert os.listdir(tmp_path / "lc" / "data") == []


def test_prefetch_fetches_the_parts_of_the_given_samples_in_a_thread(
    snapshot, tmp_path: Path
) -> None:
    location, ids = snapshot
    directory = tmp_path / "lc"
    with SizeWatch.installed(str(directory), tmp_path / "events.txt") as watch:
        ds = CachedDataset(location, FP, local_cache=directory, cache_limit="50M")
        ds.prefetch([13, 14, 40, 0])  # parts 2, 6 and 0
        deadline = time.monotonic() + 120
        while len(os.listdir(directory / "data")) < 3:
            assert time.monotonic() < deadline, "prefetch did not fetch within 120 s"
            time.sleep(0.05)
        before = len(watch.events("fetched"))
        for i in (12, 17, 41, 2):
            ds[i]
        assert len(watch.events("fetched")) == before == 3  # read from what was prefetched
        ds.close()


def test_a_dead_fetchers_download_is_reclaimed(tmp_path: Path) -> None:
    directory = tmp_path / "lc"
    limit = limit_for(directory, 2, 60_000)
    disk = LocalDisk(LocalCache(str(directory), limit)).open()
    dead = directory / "tmp" / f"{disk.digest('gone')}.60000.deadbeef"
    dead.write_bytes(b"x" * 1000)  # its fetcher died: nobody holds its lock
    assert disk.usage() >= disk.cost(60_000)  # it counts what it reserved
    fetches = tmp_path / "fetches.txt"
    for n in range(2):
        with disk.pinned(BytesUnit(f"u{n}", b"y" * 60_000, fetches)):
            pass
    assert not dead.exists()
    assert directory_bytes(str(directory)) <= limit


def test_local_cache_arguments_are_checked(snapshot, tmp_path: Path) -> None:
    location, _ = snapshot
    with pytest.raises(ParameterError, match="cache_limit= needs local_cache="):
        CachedDataset(location, FP, cache_limit="1G")
    with pytest.raises(ParameterError, match="local_cache= needs cache_limit="):
        CachedDataset(location, FP, local_cache=tmp_path / "lc")
    with pytest.raises(ParameterError, match="cache_limit: size 'lots'"):
        CachedDataset(location, FP, local_cache=tmp_path / "lc", cache_limit="lots")
    with pytest.raises(ParameterError, match="is on this machine already"):
        CachedDataset(str(tmp_path / "cache"), FP, local_cache=tmp_path / "lc", cache_limit="1G")
    with pytest.raises(ParameterError, match="is the service; its records are not read"):
        CachedDataset("http://127.0.0.1:9", FP, local_cache=tmp_path / "lc", cache_limit="1G")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not empty and not a local cache"):
        len(CachedDataset(location, FP, local_cache=tmp_path / "home", cache_limit="1G"))
    assert (tmp_path / "home" / "notes.txt").read_text() == "mine"
    with pytest.raises(UsageError, match="local_cache is for reading"):
        open_store(location, readonly=False, local_cache=LocalCache(str(tmp_path / "lc"), 1 << 30))
