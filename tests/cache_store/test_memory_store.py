"""MemoryStore: the shared contract in memory, and what its shared data means."""

from __future__ import annotations

from cache_store.stores.base import Store
from cache_store.stores.memory import MemoryData, MemoryStore
from cache_store.testing import FP_A, WritableStoreContract, contract_record, raises
from cache_store.errors import ReadOnlyStoreError


class TestMemoryStoreContract(WritableStoreContract):
    """The shared contract, reads and writes, with nothing on disk."""

    def make_empty_store(self) -> Store:
        return MemoryStore(f"memory://contract-{len(self.made)}")

    def reopen(self, store: Store, readonly: bool) -> Store:
        assert isinstance(store, MemoryStore)
        return MemoryStore(store.location, readonly=readonly, data=store.data)

    def plant(self, store: Store, key: str, value: bytes) -> Store:
        assert isinstance(store, MemoryStore)
        store.data.records[key] = value  # past every check of put_many
        return self.reopen(store, readonly=True)


def test_stores_on_one_data_share_it_and_others_do_not() -> None:
    data = MemoryData()
    writer, reader = MemoryStore(data=data), MemoryStore(readonly=True, data=data)
    record = contract_record(FP_A, "a", 1)
    writer.put_many([(f"{FP_A}/a", record)])
    assert reader.get(f"{FP_A}/a") == record and reader.generation() == 1
    assert not MemoryStore().has(f"{FP_A}/a")
    with raises(ReadOnlyStoreError):
        reader.put_many([(f"{FP_A}/b", contract_record(FP_A, "b", 2))])
    writer.close()  # closing releases nothing: the contents stay
    assert writer.get(f"{FP_A}/a") == record
