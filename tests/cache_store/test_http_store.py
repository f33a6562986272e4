"""HTTPStore: reading a cache through a live service."""

from __future__ import annotations

import multiprocessing as mp
import threading
from pathlib import Path

import pytest

from cache_store.errors import CorruptRecord, ReadOnlyStoreError, RecordNotFound, SpcacheError
from cache_store.keys import record_key
from cache_store.stores.http import HTTPStore
from cache_store.format.wire import decode_batch, encode_batch
from cache_store.format.decode import decode_record
from cache_store.stores.opener import open_store
from service.settings import Settings
from cache_store.stores.lmdb import LMDBStore
from cache_store.testing import SWAPPED_FOR, SWAPPED_KEY, StoreContract
from tests.helpers.faults import plant_lmdb_value
from tests.helpers.service import Cache, InProcessServer, build_cache


@pytest.fixture
def served(tmp_path: Path):
    cache = build_cache(tmp_path)
    settings = Settings(cache=cache.root, source_roots=[cache.sources], worker=False)
    with InProcessServer(settings) as server:
        yield cache, server


class TestHTTPStoreContract(StoreContract):
    """The shared read contract, through a real service over an LMDB cache."""

    @pytest.fixture(autouse=True)
    def _servers(self, tmp_path: Path):
        self.root = tmp_path
        self.servers: list[InProcessServer] = []
        yield
        for server in self.servers:
            server.__exit__()

    def _serve(self, records, indexes, plant: tuple[str, bytes] | None = None) -> HTTPStore:
        root = self.root / f"cache{len(self.servers)}"
        writer = LMDBStore(root, readonly=False)
        writer.put_many(records.items())
        for index in indexes:
            writer.put_index(index)
        writer.close()
        if plant is not None:
            plant_lmdb_value(root, *plant)
        server = InProcessServer(Settings(cache=root, source_roots=[self.root], worker=False))
        self.servers.append(server.__enter__())
        return HTTPStore(server.url)

    def make_store(self, records, indexes) -> HTTPStore:
        return self._serve(records, indexes)

    def make_swapped_store(self, records, indexes) -> HTTPStore:
        return self._serve(records, indexes, plant=(SWAPPED_KEY, records[SWAPPED_FOR]))


def test_open_store_picks_http_and_reads_records(served: tuple[Cache, InProcessServer]) -> None:
    cache, server = served
    store = open_store(server.url)
    assert isinstance(store, HTTPStore)
    key = record_key(cache.fingerprint, cache.ids[0])
    assert store.get(key) == cache.values[cache.ids[0]]
    assert store.has(key) and not store.has(record_key(cache.fingerprint, "nope"))
    with pytest.raises(RecordNotFound):
        store.get(record_key(cache.fingerprint, "nope"))
    record = store.get_record(key, fields=["octree"])
    assert set(record.tensors) == {"octree"}
    store.close()


def test_index_keys_and_batch(served: tuple[Cache, InProcessServer]) -> None:
    cache, server = served
    store = HTTPStore(server.url, batch_size=2)
    assert store.fingerprints() == [cache.fingerprint]
    index = store.get_index(cache.fingerprint)
    assert index.sample_ids.tolist() == cache.ids and index.params == cache.params
    assert list(store.keys()) == [
        record_key(cache.fingerprint, s) for s in sorted(cache.ids, key=str.encode)
    ]
    wanted = [record_key(cache.fingerprint, s) for s in cache.ids] + [
        record_key(cache.fingerprint, "gone")
    ]
    got, missing = store.get_many(wanted)
    assert list(got) == wanted[:-1] and "RecordNotFound" in missing[wanted[-1]]
    assert all(bytes(got[k]) == cache.values[k.split("/", 1)[1]] for k in got)
    records = store.get_records(wanted[:3], fields=["scale", "octree"])
    assert [r.metadata["sample_id"] for r in records] == cache.ids[:3]
    assert all(set(r.tensors) == {"scale", "octree"} for r in records)
    with pytest.raises(RecordNotFound, match="gone"):
        store.get_records(wanted)
    assert store.verify().ok
    store.close()


def test_read_only(served: tuple[Cache, InProcessServer]) -> None:
    _, server = served
    with HTTPStore(server.url) as store, pytest.raises(ReadOnlyStoreError):
        store.put_many([])
    with pytest.raises(ReadOnlyStoreError):
        HTTPStore(server.url, readonly=False)


def test_connection_errors_are_retried_then_reported(tmp_path: Path) -> None:
    from tests.helpers.procs import refused_port

    with refused_port() as port:
        store = HTTPStore(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01)
        with store, pytest.raises(SpcacheError, match="after 3 attempts"):
            store.get(record_key("0" * 32, "a"))


def test_retry_reaches_a_server_that_comes_up_late(tmp_path: Path) -> None:
    cache = build_cache(tmp_path)
    settings = Settings(cache=cache.root, source_roots=[cache.sources], worker=False)
    server = InProcessServer(settings)
    store = HTTPStore(server.url, retries=8, backoff_s=0.05)
    timer = threading.Timer(0.2, server.__enter__)
    timer.start()
    try:
        assert store.get(record_key(cache.fingerprint, cache.ids[0])) == cache.values[cache.ids[0]]
    finally:
        store.close()
        timer.join()
        server.__exit__()


def _read_in_child(store: HTTPStore, key: str, out: mp.Queue[tuple[int, int]]) -> None:
    inherited = store._client._value  # the parent's pool, as the fork copied it
    value = store.get(key)
    out.put((len(value), int(store._client.peek() not in (None, inherited))))


def test_a_forked_reader_opens_its_own_pool(served: tuple[Cache, InProcessServer]) -> None:
    cache, server = served
    store = HTTPStore(server.url)
    key = record_key(cache.fingerprint, cache.ids[0])
    store.get(key)
    parent_client = store._client.peek()
    assert parent_client is not None
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(store, key, out))
    child.start()
    assert out.get(timeout=30) == (len(cache.values[cache.ids[0]]), 1)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert store._client.peek() is parent_client and store.get(key) == cache.values[cache.ids[0]]
    store.close()


def test_batch_frame_round_trip_and_corruption() -> None:
    frame = encode_batch([("a", b"xyz"), ("b/c", b"")], [("d", "RecordNotFound", "gone")])
    found, missing = decode_batch(frame)
    assert {k: bytes(v) for k, v in found.items()} == {"a": b"xyz", "b/c": b""}
    assert missing == {"d": "RecordNotFound: gone"}
    for bad in (
        frame[:5],
        frame[:-1],
        b"\xff" * 8 + frame[8:],
        frame.replace(b'"version":1', b'"version":9'),
    ):
        with pytest.raises(CorruptRecord):
            decode_batch(bad)


def test_constructor_opens_no_pool() -> None:
    store = HTTPStore("http://127.0.0.1:1")
    assert store._client.peek() is None


def test_cached_dataset_reads_over_http_in_forked_loader_workers(
    served: tuple[Cache, InProcessServer],
) -> None:
    import torch
    from torch.utils.data import DataLoader

    from cache_store.readers.dataset import CachedDataset

    cache, server = served
    dataset = CachedDataset(server.url, cache.fingerprint, fields=["octree", "scale"])
    assert len(dataset) == len(cache.ids)
    loader = DataLoader(
        dataset, batch_size=2, num_workers=2, collate_fn=list, multiprocessing_context="fork"
    )
    seen = [sample for batch in loader for sample in batch]
    assert len(seen) == len(cache.ids)
    for sample, sid in zip(seen, cache.ids, strict=True):
        expected = decode_record(cache.values[sid]).tensors["octree"]
        octree = sample["octree"] if isinstance(sample, dict) else sample.tensors["octree"]
        assert torch.equal(octree, expected)
    dataset.close()


def test_503_is_retried_honouring_retry_after() -> None:
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    calls = []
    from tests.helpers.service import make_record

    value = make_record("a" * 32, "x/y", "xxh3_128:0")  # get() checks it names its key

    async def busy_then_ok(request):  # the service's answer when LMDB's reader table is full
        calls.append(request.url.path)
        if len(calls) < 3:
            return Response(
                b'{"error": "SpcacheError", "detail": "busy"}',
                status_code=503,
                headers={"Retry-After": "0.05"},
                media_type="application/json",
            )
        return Response(value, media_type="application/octet-stream")

    async def descriptor(request):  # what the record names, as the service serves it
        return Response(value.descriptor.text, media_type="application/json")

    app = Starlette(
        routes=[
            Route("/v1/caches/{fp}/records/{sid:path}", busy_then_ok),
            Route("/v1/caches/{fp}/descriptors/{digest}", descriptor),
        ]
    )
    with InProcessServer(None, app=app) as server, HTTPStore(server.url, retries=3) as store:
        assert store.get(record_key("a" * 32, "x/y")) == value
    assert calls == ["/v1/caches/" + "a" * 32 + "/records/x/y"] * 3
    with InProcessServer(None, app=app) as server, HTTPStore(server.url, retries=0) as store:
        calls.clear()
        with pytest.raises(SpcacheError, match="503"):
            store.get(record_key("a" * 32, "x/y"))
