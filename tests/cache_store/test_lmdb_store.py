from __future__ import annotations

from pathlib import Path

import pytest

from cache_store.errors import CacheNotFound, UnknownName
from cache_store.lmdb_store import LMDBStore
from cache_store.store import Store, backend_for, open_store
from tests.cache_store.store_contract import FP_A, WritableStoreContract
from tests.cache_store.synthetic import make_record


class TestLMDBStoreContract(WritableStoreContract):
    @pytest.fixture
    def make_empty_store(self, tmp_path: Path):
        stores = []

        def make() -> Store:
            store = LMDBStore(tmp_path / f"cache{len(stores)}", readonly=False, map_size=1 << 20)
            stores.append(store)
            return store
        yield make
        for store in stores:
            store.close()

    def reopen(self, store: Store, readonly: bool) -> Store:
        return LMDBStore(store.location, readonly=readonly)


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
        store.put_many(items[start:start + 8])
    assert store.stats()["lmdb"]["map_size"] > 64 * 1024
    assert all(store.get(k) == v for k, v in items)
    store.close()


def test_open_store_picks_backends(tmp_path: Path) -> None:
    assert backend_for(tmp_path) == "lmdb"
    assert backend_for("http://host:8000") == "http"
    assert backend_for("HTTPS://host") == "http"
    assert backend_for("s3://bucket/cache.zarr/") == "zarr"
    assert backend_for(str(tmp_path / "snap.zarr")) == "zarr"
    with pytest.raises(UnknownName, match="ftp"):
        backend_for("ftp://host/x")
    store = open_store(tmp_path, readonly=False)
    assert isinstance(store, LMDBStore) and not store.readonly
    assert open_store(store) is store
    assert isinstance(open_store(f"file://{tmp_path}"), LMDBStore)
