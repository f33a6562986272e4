"""``local_cache`` over the service's URL: a record's version (key, ETag) is the unit.

Against a real ``spcache serve`` (uvicorn) over a real LMDB cache, with forked DataLoader
workers, counting at the service (its ``/metrics``): records read through the local
directory equal records read directly; a second epoch sends one conditional request a
record, answered 304, and no record bytes; a record recomputed on the service under the
same key is read as its new version at the next read; the directory never holds more
than ``cache_limit`` while an epoch reads more than the limit; a limit that cannot hold
a record is refused naming both; with ``record_key`` a copy a 304 confirms is checked as
a fetched record is (its tag).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch.utils.data import DataLoader

from cache_store.errors import CorruptRecord, LimitTooSmall
from cache_store.keys import record_key
from cache_store.local_cache import LocalCache, LocalDisk, directory_bytes
from cache_store.local_cache.service_records import CachedHTTPStore
from cache_store.readers.dataset import CachedDataset
from cache_store.sources.files import hash_source_file
from cache_store.stores.lmdb import LMDBStore
from cache_store.stores.opener import open_store
from tests.helpers.local_cache import SizeWatch, as_list, limit_for, peak_bytes, same
from tests.helpers.procs import Server
from tests.helpers.service import Cache, build_cache, make_record, start_server, stop_server

ROUTE = "/v1/caches/{fingerprint}/records/{sample_id:path}"


@dataclass
class Served:
    cache: Cache
    server: Server

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    cache = build_cache(tmp_path / "svc", n=12)
    server = start_server(cache.root, cache.sources)
    try:
        yield Served(cache, server)
    finally:
        stop_server(server)


@pytest.fixture
def open_ds() -> Iterator[Callable[..., CachedDataset]]:
    """``CachedDataset(...)``, closed (its connections in this process) after the test."""
    made: list[CachedDataset] = []

    def make(*args: Any, **kwargs: Any) -> CachedDataset:
        made.append(CachedDataset(*args, **kwargs))
        return made[-1]

    yield make
    for ds in made:
        ds.close()


def counts(url: str) -> dict[str, int]:
    """What the service counted: record route requests by status, its response bytes,
    records served (200s)."""
    text = httpx.get(url + "/metrics", timeout=60).text
    found = {"200": 0, "304": 0, "bytes": 0, "records": 0}
    route = re.escape(ROUTE)
    for line in text.splitlines():
        m = re.match(r"spcache_http_requests_total\{(.*)\} (\S+)", line)
        if m and re.search(f'route="{route}"', m.group(1)):
            status = re.search(r'status="(\d+)"', m.group(1))
            assert status is not None
            found[status.group(1)] = found.get(status.group(1), 0) + int(float(m.group(2)))
        m = re.match(r'spcache_http_response_bytes_total\{route="(.*)"\} (\S+)', line)
        if m and m.group(1) == ROUTE:
            found["bytes"] += int(float(m.group(2)))
        m = re.match(r"spcache_records_served_total (\S+)", line)
        if m:
            found["records"] = int(float(m.group(1)))
    return found


def epoch(ds: CachedDataset, order: list[int]) -> list[dict[str, torch.Tensor]]:
    loader = DataLoader(
        ds,
        batch_size=3,
        sampler=order,
        num_workers=2,
        multiprocessing_context="fork",
        collate_fn=as_list,
    )
    return [sample for batch in loader for sample in batch]


def test_the_service_url_opens_through_local_cache(tmp_path: Path) -> None:
    store = open_store("http://127.0.0.1:9", local_cache=LocalCache(str(tmp_path / "lc"), 1 << 20))
    assert isinstance(store, CachedHTTPStore)
    store.close()


def test_a_second_epoch_gets_304s_and_no_record_bytes(
    served: Served, tmp_path: Path, open_ds: Callable[..., CachedDataset]
) -> None:
    fp, n = served.cache.fingerprint, len(served.cache.ids)
    direct = open_ds(served.url, fp)
    want = [direct[i] for i in range(n)]
    cached = open_ds(served.url, fp, local_cache=tmp_path / "lc", cache_limit="64M")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()
    before = counts(served.url)
    first = epoch(cached, order)
    after_first = counts(served.url)
    second = epoch(cached, order[::-1])
    after_second = counts(served.url)
    for i, sample in zip(order, first, strict=True):
        assert same(sample, want[i])
    for i, sample in zip(order[::-1], second, strict=True):
        assert same(sample, want[i])
    assert after_first["records"] - before["records"] == n  # each record sent once
    assert after_first["200"] - before["200"] == n
    assert after_first["304"] == before["304"]
    # the second epoch, in new forked workers: one conditional request a record, no body
    assert after_second["304"] - after_first["304"] == n
    assert after_second["200"] == after_first["200"]
    assert after_second["records"] == after_first["records"]
    assert after_second["bytes"] == after_first["bytes"]
    copies = sorted(p.stat().st_size for p in (tmp_path / "lc" / "data").iterdir())
    assert copies == sorted(len(v) for v in served.cache.values.values())  # each once


def test_a_record_recomputed_on_the_service_is_read_as_its_new_version(
    served: Served, tmp_path: Path, open_ds: Callable[..., CachedDataset]
) -> None:
    cache, fp = served.cache, served.cache.fingerprint
    cached = open_ds(served.url, fp, local_cache=tmp_path / "lc", cache_limit="64M")
    direct = open_ds(served.url, fp)
    old = direct[2]
    assert same(cached[2], old)
    assert same(cached[2], old)  # from the copy (a 304)
    sid = cache.ids[2]
    new_value = make_record(
        fp, sid, hash_source_file(cache.sources / f"{sid}.obj"), nbytes=6000, seed=99
    )
    store = LMDBStore(cache.root, readonly=False)
    store.put_many([(record_key(fp, sid), new_value)])
    store.close()
    new = direct[2]
    assert not same(new, old)
    before = counts(served.url)
    got = epoch(cached, [2, 0, 2])  # forked workers: the note of the old version is shared
    assert same(got[0], new) and same(got[2], new)
    assert same(cached[2], new)  # this process too
    assert counts(served.url)["records"] - before["records"] >= 1
    sizes = sorted(p.stat().st_size for p in (tmp_path / "lc" / "data").iterdir())
    assert len(new_value) in sizes and len(cache.values[sid]) in sizes  # the old one waits


def test_the_bound_holds_while_an_epoch_reads_more_than_the_limit(
    served: Served, tmp_path: Path, open_ds: Callable[..., CachedDataset]
) -> None:
    fp, n = served.cache.fingerprint, len(served.cache.ids)
    directory = tmp_path / "lc"
    largest = max(len(v) for v in served.cache.values.values())
    limit = limit_for(directory, 3, largest)  # 3 records of 12
    direct = open_ds(served.url, fp)
    want = [direct[i] for i in range(n)]
    with SizeWatch.installed(str(directory), tmp_path / "events.txt") as watch:
        ds = open_ds(served.url, fp, local_cache=directory, cache_limit=limit)
        with peak_bytes(directory) as peak:
            for seed in range(2):
                order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
                for i, sample in zip(order, epoch(ds, order), strict=True):
                    assert same(sample, want[i])
        sizes_seen = watch.sizes()
    assert len(watch.events("fetched")) > n  # more than the limit: records came back
    assert watch.events("evicted")
    assert max(sizes_seen) <= limit, (max(sizes_seen), limit)
    assert peak[0] <= limit, (peak[0], limit)
    assert directory_bytes(str(directory)) <= limit
    assert LocalDisk(LocalCache(str(directory), limit)).usage() <= limit


def test_a_limit_below_one_record_is_refused(
    served: Served, tmp_path: Path, open_ds: Callable[..., CachedDataset]
) -> None:
    fp = served.cache.fingerprint
    directory = tmp_path / "lc"
    smallest = min(len(v) for v in served.cache.values.values())
    limit = limit_for(directory, 1, smallest // 4)
    ds = open_ds(served.url, fp, local_cache=directory, cache_limit=limit)
    with pytest.raises(LimitTooSmall, match=f"cache_limit .*{limit} bytes.*cannot hold"):
        ds[0]
    assert os.listdir(directory / "data") == []


def test_with_a_record_key_a_copy_confirmed_by_304_is_checked_as_a_fetched_one(
    tmp_path: Path, open_ds: Callable[..., CachedDataset]
) -> None:
    secret = "k" * 32
    cache = build_cache(tmp_path / "svc", n=4)
    server = start_server(cache.root, cache.sources, env={"SPCACHE_RECORD_KEY": secret})
    try:
        options = {"record_key": secret}
        direct = open_ds(server.url, cache.fingerprint, store_options=options)
        cached = open_ds(
            server.url,
            cache.fingerprint,
            store_options=options,
            local_cache=tmp_path / "lc",
            cache_limit="64M",
        )
        for _ in range(2):  # fetched, then confirmed: tag and current checksum both times
            for i in range(4):
                assert same(cached[i], direct[i])
        assert counts(server.url)["304"] == 4
        wrong = open_ds(
            server.url,
            cache.fingerprint,
            store_options={"record_key": "x" * 32},
            local_cache=tmp_path / "lc",
            cache_limit="64M",
        )
        with pytest.raises(CorruptRecord, match="record tag does not match"):
            wrong[0]  # the copy is here, but the 304's tag is not this key's
    finally:
        stop_server(server)
