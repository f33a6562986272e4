from __future__ import annotations

from pathlib import Path

import pytest

from cache_store.errors import CacheNotFound, StoreFull, UnknownName
from cache_store.stores.lmdb import LMDBStore
from cache_store.location import parse_location
from cache_store.stores.base import Store
from cache_store.stores.opener import open_store
from cache_store.testing import FP_A, WritableStoreContract
from tests.helpers.faults import plant_lmdb_value
from tests.helpers.synthetic import make_record


class TestLMDBStoreContract(WritableStoreContract):
    """The shared contract, reads and writes, on LMDB caches in a temporary directory."""

    @pytest.fixture(autouse=True)
    def _where(self, tmp_path: Path) -> None:
        self.root = tmp_path

    def make_empty_store(self) -> Store:
        path = self.root / f"cache{len(self.made)}"
        return self.keep(LMDBStore(path, readonly=False, map_size=1 << 20))

    def reopen(self, store: Store, readonly: bool) -> Store:
        return LMDBStore(store.location, readonly=readonly)

    def plant(self, store: Store, key: str, value: bytes) -> Store:
        store.close()  # the lmdb module opens the path itself
        plant_lmdb_value(store.location, key, value)
        return self.reopen(store, readonly=True)


def test_readonly_on_a_directory_without_cache_names_the_path(tmp_path: Path) -> None:
    store = LMDBStore(tmp_path / "nowhere")  # constructing opens nothing
    with pytest.raises(CacheNotFound) as err:
        store.get("k")
    assert str(tmp_path / "nowhere") in str(err.value)
    assert isinstance(err.value, FileNotFoundError)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CacheNotFound, match="not a directory"):
        LMDBStore(tmp_path / "file").fingerprints()
    assert not (tmp_path / "nowhere").exists()


def test_map_grows_past_its_initial_size(tmp_path: Path) -> None:
    store = LMDBStore(tmp_path, readonly=False, map_size=64 * 1024)
    items = [(f"{FP_A}/s{i}", make_record(FP_A, f"s{i}", i, num_points=3000)) for i in range(40)]
    payload = sum(len(v) for _, v in items)
    assert payload > 4 * 64 * 1024
    for start in range(0, 40, 8):
        store.put_many(items[start : start + 8])
    assert store.stats()["lmdb"]["map_size"] > 64 * 1024
    assert all(store.get(k) == v for k, v in items)
    store.close()


def test_a_map_at_its_bound_is_store_full_and_keeps_what_was_committed(tmp_path: Path) -> None:
    store = LMDBStore(tmp_path, readonly=False, map_size=256 * 1024, max_map_size=512 * 1024)
    items = [(f"{FP_A}/s{i}", make_record(FP_A, f"s{i}", i, num_points=3000)) for i in range(40)]
    committed = []
    with pytest.raises(StoreFull, match="no space left on .*max_map_size 524288") as err:
        for start in range(0, 40, 4):
            store.put_many(items[start : start + 4])
            committed.extend(items[start : start + 4])
    assert isinstance(err.value, OSError) and str(tmp_path) in str(err.value)
    assert 0 < len(committed) < 40  # some batches landed before the bound
    assert store.stats()["records"] == len(committed)
    assert all(store.get(k) == v for k, v in committed)
    report = store.verify()  # records kept whole; no index was written for them
    assert not report.corrupt and not report.missing and report.damaged is None
    assert report.unindexed == {FP_A: len(committed)} and report.checked == len(committed)
    store.close()


def test_open_store_picks_backends(tmp_path: Path) -> None:
    assert parse_location(tmp_path).kind == "lmdb"
    assert parse_location("http://host:8000").kind == "http"
    assert parse_location("HTTPS://host").kind == "http"
    assert parse_location("s3://bucket/cache.zarr/").kind == "zarr"
    assert parse_location(str(tmp_path / "snap.zarr")).kind == "zarr"
    with pytest.raises(UnknownName, match="ftp"):
        parse_location("ftp://host/x")
    store = open_store(tmp_path, readonly=False)
    assert isinstance(store, LMDBStore) and not store.readonly
    assert open_store(store) is store
    assert isinstance(open_store(f"file://{tmp_path}"), LMDBStore)


def test_keys_lmdb_cannot_hold_are_just_absent(tmp_path: Path) -> None:
    from cache_store.errors import RecordNotFound

    store = LMDBStore(tmp_path, readonly=False)
    store.put_many([(f"{FP_A}/a", make_record(FP_A, "a", 1))])
    for key in ["", "x" * 600, "\udcff", f"{FP_A}/" + "y" * 500]:
        assert not store.has(key)
        with pytest.raises(RecordNotFound):
            store.get(key)
    store.close()


def test_keys_are_listed_across_transaction_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cache_store.stores.lmdb.store as lmdb_store

    monkeypatch.setattr(lmdb_store, "KEYS_PER_TXN", 3)
    store = LMDBStore(tmp_path, readonly=False)
    keys = [f"{FP_A}/k{i:02d}" for i in range(10)]
    store.put_many((k, make_record(FP_A, k.split("/", 1)[1], i)) for i, k in enumerate(keys))
    assert list(store.keys()) == keys
    assert list(store.keys(f"{FP_A}/k0")) == keys
    keys += [f"{FP_A}/k{i:02d}" for i in range(10, 13)]
    store.put_many((k, make_record(FP_A, k.split("/", 1)[1], 0)) for k in keys[10:])
    assert list(store.keys(f"{FP_A}/k1")) == keys[10:]
    assert len(list(store.keys())) == 13
    store.close()


def test_threads_share_one_store(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    writer = LMDBStore(tmp_path, readonly=False)
    items = {f"{FP_A}/t{i}": make_record(FP_A, f"t{i}", i) for i in range(16)}
    writer.put_many(items.items())
    reader = LMDBStore(tmp_path)  # same path, same process: shares the environment

    def read(key: str) -> bool:
        return (
            reader.get(key) == items[key]
            and reader.get_record(key).metadata["sample_id"] == key.split("/", 1)[1]
        )

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(read, list(items) * 8))
    assert list(reader.keys("\udcff")) == []
    reader.close()
    assert writer.has(f"{FP_A}/t0")  # the writer's handle outlives the reader's close
    writer.close()
