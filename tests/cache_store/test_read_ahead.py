"""Read-ahead: a Sampler over a read-through dataset queues its upcoming samples for the
worker, in the sampler's order, a window ahead of the loaders; a real worker fills an
empty cache in that order during the first epoch of spcache.DataLoader. Over a remote
sharded snapshot read through ``local_cache`` (moto's S3 server), the sampler has the
parts of its window fetched in its order, and forked loaders read them from there; over
an exported Zarr snapshot, the chunk files of its window, sample by sample."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from cache_store.jobs.queue import JobQueue
from spcache import CachedDataset, DataLoader, NoWorkerAlive, Sampler, collate_spc
from tests.helpers.read_through import PARAMS, start_worker, stop_worker


def _queued(cache: Path) -> list[str]:
    """Sample ids of every queue item, in the order they were queued."""
    queue = JobQueue(cache)
    try:
        items = [item for job in queue.jobs(limit=10_000) for item in queue.items(job.id)]
    finally:
        queue.close()
    return [item["sample_id"] for item in sorted(items, key=lambda item: item["id"])]


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    folder = tmp_path / "meshes"
    folder.mkdir()
    for i in range(40):  # queued, never read: their contents do not matter here
        (folder / f"m{i:02d}.xyz").write_text("0 0 0\n1 1 1\n")
    return folder


def test_the_sampler_queues_its_upcoming_samples_in_its_order(
    tmp_path: Path, sources: Path
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    JobQueue(cache).heartbeat("w1", {"heartbeat_s": 1.0})  # a worker counts as alive
    ds = CachedDataset(cache, "spc", sources=sources, level=4)
    sampler = Sampler(ds, num_replicas=2, rank=1, read_ahead=8)
    assert ds.warm_ahead == 0  # the sampler queues ahead, not the dataset's index order
    sampler.set_epoch(2)
    plain = CachedDataset(cache, "spc", sources=sources, level=4, on_miss="error")
    same = Sampler(plain, num_replicas=2, rank=1)  # the same order, reading nothing ahead
    same.set_epoch(2)
    share = [plain.sample_id(i) for i in same]  # this rank's order
    assert len(share) == 20 and _queued(cache) == []
    it = iter(sampler)
    for taken in range(1, 12):
        next(it)
        queued = _queued(cache)
        assert queued == share[: len(queued)]  # in the sampler's order, each once
        assert taken + 4 <= len(queued) <= taken + 8  # the window: half to whole
    assert sorted(share) != share  # and that order is not the index order


def test_without_read_through_nothing_is_queued(tmp_path: Path, sources: Path) -> None:
    ds = CachedDataset(tmp_path / "cache", "spc", sources=sources, level=4, on_miss="error")
    sampler = Sampler(ds, num_replicas=1, rank=0, read_ahead=8)
    assert sampler.read_ahead == 0 and ds.warm_ahead == 16
    assert len(list(sampler)) == 40
    assert not (tmp_path / "cache" / "jobs.sqlite").exists()


def test_no_worker_fails_at_the_first_read_ahead(tmp_path: Path, sources: Path) -> None:
    ds = CachedDataset(tmp_path / "cache", "spc", sources=sources, level=4)
    loader = DataLoader(ds, batch_size=4, shuffle=True, collate_fn=collate_spc)
    with pytest.raises(NoWorkerAlive, match="spcache worker"):
        next(iter(loader))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_a_first_epoch_over_an_empty_cache_is_computed_in_the_samplers_order(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    cache = tmp_path / "cache"
    proc = start_worker(cache)
    try:
        ds = CachedDataset(cache, "spc_query", sources=corpus_meshes, **PARAMS)
        sampler = Sampler(ds, seed=5, read_ahead=4)
        loader = DataLoader(
            ds,
            batch_size=2,
            sampler=sampler,
            num_workers=2,
            collate_fn=collate_spc,
            multiprocessing_context="fork",
        )
        yielded = [sid for batch in loader for sid in batch["sample_ids"]]
    finally:
        stop_worker(proc)
    order = [ds.sample_id(i) for i in Sampler(ds, seed=5, num_replicas=1, rank=0)]
    assert yielded == order
    assert _queued(cache) == order  # every sample queued once, ahead, in that order


def test_over_the_service_the_read_ahead_is_one_warm_up_per_window(
    tmp_path: Path, sources: Path
) -> None:
    from tests.helpers.service import TOKEN, start_server, stop_server

    cache = tmp_path / "cache"
    cache.mkdir()
    server = start_server(cache, sources, "--no-worker")
    try:
        JobQueue(cache).heartbeat("w1", {"heartbeat_s": 1.0})  # a worker counts as alive
        ds = CachedDataset(
            server.url, "spc", sources=sources, level=4, store_options={"token": TOKEN}
        )
        sampler = Sampler(ds, num_replicas=1, rank=0, read_ahead=10)
        it = iter(sampler)
        taken = [ds.sample_id(next(it)) for _ in range(7)]
        queued = _queued(cache)
        assert queued[:7] == taken and 7 + 5 <= len(queued) <= 7 + 10
        ds.close()
    finally:
        stop_server(server)
    order = [ds.sample_id(i) for i in Sampler(ds, num_replicas=1, rank=0, read_ahead=0)]
    assert queued == order[: len(queued)]


def test_over_a_local_cache_the_sampler_fetches_its_parts_in_its_order(tmp_path: Path) -> None:
    import os

    from cache_store.snapshot.sharded import ShardedSnapshot
    from tests.helpers.local_cache import FP, SizeWatch, write_sharded
    from tests.helpers.s3 import moto_s3

    def parts_fetched(watch: SizeWatch) -> list[tuple[str, str]]:
        """(pid, part) of each fetch into the local directory, in order."""
        return [
            (line.split()[0], line.split(": fetched ")[1].split()[0].rsplit("/", 1)[1])
            for line in watch.events("fetched")
        ]

    with moto_s3() as s3:
        location = f"s3://{s3.new_bucket()}/train/snap.zarr"
        write_sharded(location, parts=6, per_part=5)
        with ShardedSnapshot(location) as store:
            part_of = {key: store.entry_of(key).part for key in store.keys(FP + "/")}  # type: ignore[union-attr]
        directory = tmp_path / "lc"
        with SizeWatch.installed(str(directory), tmp_path / "events.txt") as watch:
            ds = CachedDataset(location, FP, local_cache=directory, cache_limit="50M")
            plain = Sampler(ds, seed=3, num_replicas=1, rank=0, window_blocks=2, read_ahead=0)
            plain.set_epoch(1)
            first_seen = list(dict.fromkeys(part_of[ds.key(i)] + ".bin" for i in plain))
            assert len(first_seen) == 6 and first_seen != sorted(first_seen)
            assert parts_fetched(watch) == []  # read_ahead=0: nothing fetched

            sampler = Sampler(ds, seed=3, num_replicas=1, rank=0, window_blocks=2, read_ahead=30)
            sampler.set_epoch(1)
            next(iter(sampler))  # one index handed out, no sample read
            deadline = time.monotonic() + 120
            while len(parts_fetched(watch)) < 6:
                assert time.monotonic() < deadline, f"{parts_fetched(watch)} after 120 s"
                time.sleep(0.05)
            assert parts_fetched(watch) == [(str(os.getpid()), p) for p in first_seen]

            sampler.set_epoch(1)  # an epoch through forked loaders: read from the copies
            loader = DataLoader(
                ds,
                batch_size=4,
                sampler=sampler,
                num_workers=2,
                multiprocessing_context="fork",
                collate_fn=collate_spc,
            )
            yielded = [sid for batch in loader for sid in batch["sample_ids"]]
            assert yielded == [ds.sample_id(i) for i in plain]
            assert len(parts_fetched(watch)) == 6  # no part fetched again


def _chunk_files(location: str, storage_options: dict[str, str]) -> dict[str, list[str]]:
    """Each sample's chunk files in an exported Zarr snapshot (its header's, then each
    field's data), as zarr itself describes the group; files never written left out."""
    import zarr
    from zarr.storage import FsspecStore

    from cache_store.snapshot.sharded.storage import open_fs
    from tests.helpers.local_cache import FP

    fs, root = open_fs(location, {})
    head = f"{root}/{FP}/"
    written = {name[len(head) :] for name in fs.find(head)}
    store = FsspecStore.from_url(location, read_only=True, storage_options=storage_options)
    group = zarr.open_group(store, mode="r")[FP]
    raw, at = group["sample_ids"][:].tobytes(), group["sample_id_offsets"][:]
    ids = [raw[at[n] : at[n + 1]].decode() for n in range(len(at) - 1)]
    arrays = {"headers": (group["headers"], group["header_offsets"][:])}
    for name in group["data"].array_keys():
        arrays[f"data/{name}"] = (group[f"data/{name}"], group[f"offsets/{name}"][:])
    files: dict[str, list[str]] = {}
    for row, sid in enumerate(ids):
        for path, (array, offsets) in arrays.items():
            step, tail = array.chunks[0], "/0" * (array.ndim - 1)
            first, last = int(offsets[row]), int(offsets[row + 1])
            for k in range(first // step, (last - 1) // step + 1 if last > first else 0):
                if f"{path}/c/{k}{tail}" in written:
                    files.setdefault(sid, []).append(f"{path}/c/{k}{tail}")
    return files


def test_over_a_local_cache_the_sampler_fetches_a_zarr_snapshots_chunks_in_its_order(
    tmp_path: Path,
) -> None:
    import os

    from tests.helpers.local_cache import FP, SizeWatch, write_exported
    from tests.helpers.s3 import moto_s3

    def chunks_fetched(watch: SizeWatch) -> list[tuple[str, str]]:
        """(pid, chunk file in the group) of each fetch into the local directory (the
        unit's name ends ``<fingerprint>/<writer token>/<file>``)."""
        return [
            (line.split()[0], line.split(": fetched ")[1].split()[0].split(f"/{FP}/")[1])
            for line in watch.events("fetched")
        ]

    def in_group(fetched: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [(pid, name.split("/", 1)[1]) for pid, name in fetched]

    with moto_s3() as s3:
        location = f"s3://{s3.new_bucket()}/train/exported.zarr"
        # zarr opens a remote group through fsspec's file systems, one per set of options
        # and process, made with the environment's endpoint then (another test's server,
        # stopped since): this server's is named, so the file systems are this test's
        options = {"endpoint_url": s3.endpoint}
        write_exported(location, tmp_path / "lmdb", 36, 12_000, storage_options=options)
        files = _chunk_files(location, options)
        directory = tmp_path / "lc"
        with SizeWatch.installed(str(directory), tmp_path / "events.txt") as watch:
            ds = CachedDataset(
                location,
                FP,
                local_cache=directory,
                cache_limit="50M",
                store_options={"storage_options": options},
            )
            plain = Sampler(ds, seed=3, num_replicas=1, rank=0, window_blocks=2, read_ahead=0)
            plain.set_epoch(1)
            order = [ds.sample_id(i) for i in plain]
            first_seen = list(dict.fromkeys(path for sid in order for path in files[sid]))
            # the files each sample is the first to need, sample by sample in the order
            news, seen = [], set()
            for sid in order:
                if new := set(files[sid]) - seen:
                    news.append(new)
                    seen |= new
            data = [p for p in first_seen if p.startswith("data/point_hierarchy/")]
            assert len(data) >= 4 and data != sorted(data)  # not the files' own order
            assert chunks_fetched(watch) == []  # read_ahead=0: nothing fetched

            sampler = Sampler(ds, seed=3, num_replicas=1, rank=0, window_blocks=2, read_ahead=30)
            sampler.set_epoch(1)
            next(iter(sampler))  # one index handed out, no sample read
            deadline = time.monotonic() + 120
            while len(chunks_fetched(watch)) < len(first_seen):
                assert time.monotonic() < deadline, f"{chunks_fetched(watch)} after 120 s"
                time.sleep(0.05)
            fetched = in_group(chunks_fetched(watch))
            assert {pid for pid, _ in fetched} == {str(os.getpid())}  # the sampler's thread
            got = iter(name for _, name in fetched)
            assert [{next(got) for _ in new} for new in news] == news  # in the sampler's order

            sampler.set_epoch(1)  # an epoch through forked loaders: read from the copies
            loader = DataLoader(
                ds,
                batch_size=4,
                sampler=sampler,
                num_workers=2,
                multiprocessing_context="fork",
                collate_fn=collate_spc,
            )
            yielded = [sid for batch in loader for sid in batch["sample_ids"]]
            assert yielded == order
            assert len(chunks_fetched(watch)) == len(first_seen)  # none fetched again


def _slow_collate(batch: list[Any]) -> Any:
    """``collate_spc`` after 0.2 s: loaders slower than the fetches, so a read-ahead that
    took the whole window would run through the directory before they read it."""
    time.sleep(0.2)
    return collate_spc(batch)


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_a_read_ahead_window_larger_than_the_limit_takes_half_of_it(tmp_path: Path) -> None:
    """``cache_limit`` below the read-ahead window (the whole epoch here): the read-ahead
    fetches at most half the limit of each window, so it never evicts what the loaders
    read next: each part is fetched once and the bound holds. Parts are fetched again
    only when the limit cannot hold the blocks read together (``window_blocks``), with
    read-ahead or without; the bound holds then too."""
    from cache_store.local_cache import LocalCache, LocalDisk
    from cache_store.snapshot.sharded import ShardedSnapshot
    from tests.helpers.local_cache import FP, SizeWatch, limit_for, peak_bytes, write_sharded
    from tests.helpers.s3 import moto_s3

    def epoch(location: str, directory: Path, parts: int, window_blocks: int) -> SizeWatch:
        """One epoch through 2 forked loaders, reading ahead the whole epoch, through a
        directory that holds ``parts`` of the largest part; its fetches and evictions."""
        limit = limit_for(directory, parts, largest)
        with SizeWatch.installed(str(directory), tmp_path / f"{directory.name}.txt") as watch:
            ds = CachedDataset(location, FP, local_cache=directory, cache_limit=limit)
            sampler = Sampler(
                ds, seed=3, num_replicas=1, rank=0, window_blocks=window_blocks, read_ahead=48
            )
            assert len(sampler) == 48 and sampler.read_ahead == 48  # all 8 parts
            with peak_bytes(directory) as peak:
                loader = DataLoader(
                    ds,
                    batch_size=4,
                    sampler=sampler,
                    num_workers=2,
                    multiprocessing_context="fork",
                    collate_fn=_slow_collate,
                )
                assert sum(len(b["sample_ids"]) for b in loader) == 48
        assert max(watch.sizes()) <= limit and peak[0] <= limit, (watch.sizes(), peak, limit)
        assert LocalDisk(LocalCache(str(directory), limit)).usage() <= limit
        return watch

    with moto_s3() as s3:
        location = f"s3://{s3.new_bucket()}/train/snap.zarr"
        write_sharded(location, parts=8, per_part=6)
        with ShardedSnapshot(location) as store:
            listed = store.fs.ls(store.path(FP, "parts"), detail=True, refresh=True)
        largest = max(int(info["size"]) for info in listed)

        # 5 of the 8 parts; one block read at a time: the read-ahead takes 2.5 parts
        watch = epoch(location, tmp_path / "five", parts=5, window_blocks=1)
        assert len(watch.events("fetched")) == 8  # each part once
        assert watch.events("evicted")  # more than the limit was read

        # 3 parts, 4 blocks read together: parts come back, the bound holds
        watch = epoch(location, tmp_path / "three", parts=3, window_blocks=4)
        assert len(watch.events("fetched")) > 8
