"""The contract every store backend keeps, as test classes to subclass.

``StoreContract`` needs only reads, so read-only backends (a Zarr snapshot, HTTP) can run
it: the subclass provides a ``make_store`` fixture returning a callable
``make(records: dict[str, bytes], indexes: list[DatasetIndex]) -> Store`` that yields a
store holding exactly those records and indexes (built however the backend is filled).

``WritableStoreContract`` adds the write side; its subclass provides ``make_empty_store``
(a fixture returning ``() -> Store`` opened writable, plus ``reopen(store, readonly)``
when the backend can open the same location twice). Its ``make_store`` fills an empty
store through ``put_many``/``put_index``.

The shared content mixes the record formats: :data:`V1_KEYS` hold records of format 1
(each carrying its whole metadata), the others format 2 (naming the descriptor their
fingerprint's records share, which the store keeps and reads add back); a fingerprint
holds both, another format 1 only. Every backend reads them alike.

The key check (a record whose metadata names another key is refused by every decoded
read and reported by ``verify``) needs a store that holds such a record, which no
writer lets in: each subclass provides ``swapped_store``, a store holding the sample
content except that :data:`SWAPPED_KEY` holds the record of :data:`SWAPPED_FOR` (planted
past the writer's checks, as a bug or an attacker could).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lmdb

import numpy as np
import pytest
import torch

from cache_store.errors import (
    CorruptRecord,
    FingerprintLookupError,
    ParameterError,
    ReadOnlyStoreError,
    RecordNotFound,
    SpcacheError,
)
from cache_store.format.decode import decode_record
from cache_store.format.header import MANAGED_METADATA, read_header
from cache_store.format.index import DatasetIndex
from cache_store.stores.base import Store
from tests.helpers.synthetic import fingerprint_of, make_record
from tests.helpers.v1_records import encode_record_v1

MakeStore = Callable[[dict[str, bytes], list[DatasetIndex]], Store]

FP_A = fingerprint_of("spc", level=4)
FP_B = fingerprint_of("spc_query", level=4)
FP_C = fingerprint_of("spc", level=5)
IDS_A = ["chairs/a1", "chairs/a2", "tables/t1", "unicode/é-ü", "zeta"]
IDS_B = ["chairs/a1", "lamps/l1"]
#: In ``swapped_store``, this key holds the record of SWAPPED_FOR (same length, so a
#: snapshot's ids can be swapped in place).
SWAPPED_KEY = f"{FP_A}/chairs/a1"
SWAPPED_FOR = f"{FP_A}/chairs/a2"
#: Keys whose record is of format 1 in the shared content (the rest: format 2).
V1_KEYS = frozenset({f"{FP_A}/tables/t1", f"{FP_A}/unicode/é-ü", f"{FP_C}/only"})


def as_format_1(value: bytes) -> bytes:
    """The record ``encode_record`` returned (``value``), as the format-1 writer wrote
    it: the same tensors, its descriptor's metadata in its own header."""
    record = decode_record(value)
    own = {k: v for k, v in record.metadata.items() if k not in MANAGED_METADATA}
    return encode_record_v1(record.tensors, {**value.descriptor.metadata, **own})


def metadata_read_back(value: bytes) -> dict[str, str]:
    """What a read returns as the metadata of stored ``value``: a format-1 record's own,
    a format-2 record's with its descriptor's (which ``encode_record`` gave it)."""
    own = read_header(value).metadata
    descriptor = getattr(value, "descriptor", None)
    return own if descriptor is None else {**descriptor.metadata, **own}


def plant_lmdb_value(cache_dir: str | Path, key: str, value: bytes) -> None:
    """Write ``value`` under ``key`` in the LMDB cache at ``cache_dir`` with the lmdb
    module itself, past every check of ``LMDBStore.put_many`` (no store of this process
    may have the cache open)."""
    env = lmdb.open(str(Path(cache_dir) / "records"), max_dbs=4, subdir=True)
    try:
        with env.begin(write=True) as txn:
            txn.put(key.encode(), value, db=env.open_db(b"records", txn=txn))
    finally:
        env.close()


def sample_content() -> tuple[dict[str, bytes], list[DatasetIndex]]:
    records = {f"{FP_A}/{sid}": make_record(FP_A, sid, seed=i) for i, sid in enumerate(IDS_A)}
    records |= {
        f"{FP_B}/{sid}": make_record(FP_B, sid, seed=10 + i, recipe="spc_query")
        for i, sid in enumerate(IDS_B)
    }
    records[f"{FP_C}/only"] = make_record(FP_C, "only", seed=99, level=5)
    records = {k: as_format_1(v) if k in V1_KEYS else v for k, v in records.items()}
    indexes = [
        DatasetIndex(FP_A, "spc", 1, {"level": 4, "surface_samples": 100_000}, np.array(IDS_A)),
        DatasetIndex(
            FP_B,
            "spc_query",
            1,
            {
                "level": 4,
                "surface_samples": 100_000,
                "uniform_queries": 16_384,
                "surface_queries": 16_384,
                "surface_sigma": 0.01,
            },
            IDS_B,
        ),
        DatasetIndex(FP_C, "spc", 1, {"level": 5, "surface_samples": 100_000}, ["only"]),
    ]
    return records, indexes


class StoreContract:
    """Reads. Subclasses provide the ``make_store`` fixture (see the module doc)."""

    @pytest.fixture
    def make_store(self) -> MakeStore:  # pragma: no cover - overridden
        raise NotImplementedError("subclasses provide make_store")

    @pytest.fixture
    def content(self) -> tuple[dict[str, bytes], list[DatasetIndex]]:
        return sample_content()

    @pytest.fixture
    def store(self, make_store: MakeStore, content) -> Store:
        store = make_store(*content)
        yield store
        store.close()

    def test_get_returns_the_stored_bytes(self, store: Store, content) -> None:
        records, _ = content
        for key, value in records.items():
            assert store.get(key) == value

    def test_missing_record_names_key_and_location(self, store: Store) -> None:
        key = f"{FP_A}/nope"
        with pytest.raises(RecordNotFound) as err:
            store.get(key)
        assert isinstance(err.value, KeyError)
        assert key in str(err.value) and store.location in str(err.value)
        with pytest.raises(RecordNotFound):
            store.get_record(key)

    def test_has(self, store: Store, content) -> None:
        records, _ = content
        assert all(store.has(key) for key in records)
        assert not store.has(f"{FP_A}/nope")
        assert not store.has(f"{FP_A}/chairs")  # a prefix of ids is not an id

    def test_keys_sorted_and_filtered_by_prefix(self, store: Store, content) -> None:
        records, _ = content
        assert list(store.keys()) == sorted(records, key=lambda k: k.encode())
        assert list(store.keys(f"{FP_A}/chairs/")) == [f"{FP_A}/chairs/a1", f"{FP_A}/chairs/a2"]
        assert list(store.keys(f"{FP_B}/")) == [f"{FP_B}/{s}" for s in IDS_B]
        assert list(store.keys(f"{FP_A}/zz")) == []

    def test_get_record_decodes_and_subsets(self, store: Store, content) -> None:
        records, _ = content
        key = f"{FP_B}/lamps/l1"
        full = decode_record(records[key])
        rec = store.get_record(key)
        assert set(rec.tensors) == set(full.tensors)
        for name, tensor in full.tensors.items():
            assert torch.equal(rec.tensors[name], tensor)
        sub = store.get_record(key, fields=["octree", "query_pidx"])
        assert set(sub.tensors) == {"octree", "query_pidx"}
        assert sub.metadata["sample_id"] == "lamps/l1"
        many = store.get_records([key, f"{FP_A}/zeta"], fields=["octree"])
        assert [r.metadata["sample_id"] for r in many] == ["lamps/l1", "zeta"]

    def test_records_of_both_formats_read_alike(self, store: Store, content) -> None:
        records, _ = content
        keys = list(records)
        together = store.get_records(keys)
        for key, batched in zip(keys, together, strict=True):
            value = records[key]
            expected = metadata_read_back(value)
            assert expected["format_version"] == ("1" if key in V1_KEYS else "2")
            assert expected["fingerprint"] == key[:32] and expected["recipe"]
            for got in (store.get_record(key), batched):
                assert got.metadata == expected, key
                want = decode_record(value).tensors
                assert set(got.tensors) == set(want)
                assert all(torch.equal(got.tensors[n], t) for n, t in want.items())

    def test_indexes(self, store: Store, content) -> None:
        _, indexes = content
        assert store.fingerprints() == sorted(i.fingerprint for i in indexes)
        for expected in indexes:
            got = store.get_index(expected.fingerprint)
            assert got.recipe == expected.recipe and got.recipe_version == expected.recipe_version
            assert got.params == expected.params
            assert isinstance(got.sample_ids, np.ndarray)
            assert got.sample_ids.tolist() == expected.sample_ids.tolist()
        with pytest.raises(FingerprintLookupError) as err:
            store.get_index("f" * 32)
        assert FP_A in str(err.value)

    def test_find_fingerprints(self, store: Store) -> None:
        assert [i.fingerprint for i in store.find_fingerprints("spc")] == sorted([FP_A, FP_C])
        assert [i.fingerprint for i in store.find_fingerprints("spc", level=5)] == [FP_C]
        assert [i.fingerprint for i in store.find_fingerprints("spc", level=np.int64(5))] == [FP_C]
        with pytest.raises(ParameterError, match=r"level: expected an integer, got 5\.0"):
            store.find_fingerprints("spc", level=5.0)
        assert [i.fingerprint for i in store.find_fingerprints("spc_query", level=4)] == [FP_B]
        assert store.find_fingerprints("spc", level=6) == []
        with pytest.raises(ParameterError):
            store.find_fingerprints("spc", levle=4)

    def test_stats(self, store: Store, content) -> None:
        records, _ = content
        stats = store.stats()
        assert stats["records"] == len(records)
        assert stats["bytes"] == sum(len(v) for v in records.values())
        assert stats["fingerprints"][FP_A]["records"] == len(IDS_A)
        assert stats["fingerprints"][FP_A]["recipe"] == "spc"
        assert stats["fingerprints"][FP_B]["bytes"] == sum(
            len(v) for k, v in records.items() if k.startswith(FP_B)
        )

    def test_verify_clean_store(self, store: Store, content) -> None:
        report = store.verify()
        assert report.ok and report.checked == len(content[0])
        assert store.verify(FP_B).checked == len(IDS_B)

    def test_capabilities_are_declared_and_kept(self, store: Store, content) -> None:
        records, indexes = content
        assert isinstance(store.supports_writes, bool) and isinstance(store.supports_listing, bool)
        if not store.supports_writes:  # no method fakes the missing half
            key = next(iter(records))
            with pytest.raises(ReadOnlyStoreError):
                store.put_many([(key, records[key])])
            with pytest.raises(ReadOnlyStoreError):
                store.put_index(indexes[0])
            assert store.get(key) == records[key]  # nothing changed

    def test_read_view_lends_the_stored_bytes(self, store: Store, content) -> None:
        records, _ = content
        for key, value in records.items():
            with store.read_view(key) as view:
                assert bytes(view) == value
        with pytest.raises(RecordNotFound):
            with store.read_view(f"{FP_A}/nope"):
                pass

    def test_value_size(self, store: Store, content) -> None:
        records, _ = content
        for key, value in records.items():
            assert store.value_size(key) == len(value)
        with pytest.raises(RecordNotFound) as err:
            store.value_size(f"{FP_A}/nope")
        assert f"{FP_A}/nope" in str(err.value)

    def test_generation_stays_while_nothing_is_written(self, store: Store, content) -> None:
        records, _ = content
        first = store.generation()
        assert first is None or (isinstance(first, int) and not isinstance(first, bool))
        store.get_records(list(records))
        store.verify()
        assert store.generation() == first

    @pytest.fixture
    def swapped_store(self) -> Store:  # pragma: no cover - overridden
        raise NotImplementedError("subclasses provide swapped_store")

    def test_a_record_under_another_key_is_refused(self, swapped_store: Store) -> None:
        store = swapped_store
        named = SWAPPED_FOR.split("/", 1)[1]
        reads = {
            "get_record": lambda: store.get_record(SWAPPED_KEY),
            "get_record(fields)": lambda: store.get_record(SWAPPED_KEY, fields=["octree"]),
            "get_records": lambda: store.get_records([f"{FP_A}/zeta", SWAPPED_KEY]),
            "get_records(fields)": lambda: store.get_records([SWAPPED_KEY], ["octree"]),
        }
        for what, read in reads.items():
            with pytest.raises(CorruptRecord) as err:
                read()
            assert err.value.key == SWAPPED_KEY, what
            assert named in str(err.value), what
        report = store.verify(FP_A)
        assert SWAPPED_KEY in report.corrupt and named in report.corrupt[SWAPPED_KEY]
        assert f"{FP_A}/zeta" not in report.corrupt
        assert store.get_record(f"{FP_A}/zeta").metadata["sample_id"] == "zeta"

    def test_close_then_use_again(self, store: Store, content) -> None:
        records, _ = content
        key = next(iter(records))
        store.close()
        assert store.get(key) == records[key]
        store.close()
        store.close()


class WritableStoreContract(StoreContract):
    """Reads and writes. Subclasses provide ``make_empty_store`` (and ``reopen``)."""

    @pytest.fixture
    def make_empty_store(self) -> Callable[[], Store]:  # pragma: no cover - overridden
        raise NotImplementedError

    @pytest.fixture
    def make_store(self, make_empty_store) -> MakeStore:
        def make(records: dict[str, bytes], indexes: list[DatasetIndex]) -> Store:
            store = make_empty_store()
            store.put_many(records.items())
            for index in indexes:
                store.put_index(index)
            return store

        return make

    def reopen(self, store: Store, readonly: bool) -> Store:  # pragma: no cover - overridden
        raise NotImplementedError

    def test_put_many_counts_and_overwrites(self, store: Store) -> None:
        key = f"{FP_A}/zeta"
        new = make_record(FP_A, "zeta", seed=1234)
        assert store.put_many([(key, new), (f"{FP_A}/fresh", make_record(FP_A, "fresh", 5))]) == 2
        assert store.get(key) == new and store.has(f"{FP_A}/fresh")

    def test_put_many_is_all_or_nothing(self, store: Store) -> None:
        good = (f"{FP_A}/new1", make_record(FP_A, "new1", 1))
        for bad in [
            (f"{FP_A}/../x", good[1]),
            (f"{FP_A}/new2", b"garbage"),
            (f"{FP_A}/new3", make_record(FP_A, "other", 1)),  # metadata names another id
            (f"{FP_B}/new4", make_record(FP_A, "new4", 1)),
        ]:  # ... another fingerprint
            with pytest.raises(SpcacheError):
                store.put_many([good, bad])
            assert not store.has(good[0])

    @pytest.fixture
    def swapped_store(self, make_store, content) -> Store:
        records, indexes = content
        store = make_store(records, indexes)
        location = store.location
        store.close()
        plant_lmdb_value(location, SWAPPED_KEY, records[SWAPPED_FOR])
        reader = self.reopen(store, readonly=True)
        yield reader
        reader.close()

    def test_generation_changes_with_every_write(self, store: Store) -> None:
        before = store.generation()
        assert isinstance(before, int)
        store.put_many([(f"{FP_A}/gen1", make_record(FP_A, "gen1", 1))])
        after_put = store.generation()
        assert after_put != before
        store.put_index(
            DatasetIndex(FP_A, "spc", 1, {"level": 4, "surface_samples": 100_000}, ["gen1"])
        )
        assert store.generation() not in (before, after_put)
        reader = self.reopen(store, readonly=True)
        try:  # another handle on the same store sees the same counter, and its changes
            assert reader.generation() == store.generation()
            store.put_many([(f"{FP_A}/gen2", make_record(FP_A, "gen2", 2))])
            assert reader.generation() == store.generation()
        finally:
            reader.close()

    def test_put_index_replaces(self, store: Store) -> None:
        index = DatasetIndex(FP_A, "spc", 1, {"level": 4, "surface_samples": 100_000}, ["zeta"])
        store.put_index(index)
        assert store.get_index(FP_A).sample_ids.tolist() == ["zeta"]

    def test_index_validation(self) -> None:
        params = {"level": 4, "surface_samples": 100_000}
        with pytest.raises(ParameterError, match="fingerprint"):
            DatasetIndex(FP_C, "spc", 1, params, ["a"])
        with pytest.raises(ParameterError, match="more than once"):
            DatasetIndex(FP_A, "spc", 1, params, ["a", "b", "a"])
        with pytest.raises(SpcacheError):
            DatasetIndex(FP_A, "spc", 1, params, ["a", "../b"])
        with pytest.raises(SpcacheError):
            DatasetIndex(FP_A, "spc", 1, params, ["a", 1])

    def test_verify_reports_corrupt_and_missing(self, store: Store, content) -> None:
        records, _ = content
        key = f"{FP_A}/chairs/a2"
        value = bytearray(records[key])
        value[read_header(bytes(value)).tensors["octree"].begin] ^= 0x10
        store.put_many([(key, bytes(value))])  # the header is intact, so the write passes
        with pytest.raises(CorruptRecord, match="octree"):
            store.get_record(key)
        index = DatasetIndex(
            FP_C, "spc", 1, {"level": 5, "surface_samples": 100_000}, ["only", "ghost"]
        )
        store.put_index(index)
        report = store.verify()
        assert not report.ok
        assert list(report.corrupt) == [key] and "octree" in report.corrupt[key]
        assert report.missing == [f"{FP_C}/ghost"]
        assert report.checked == len(records)

    def test_readonly_store_refuses_writes(self, store: Store) -> None:
        reader = self.reopen(store, readonly=True)
        try:
            with pytest.raises(ReadOnlyStoreError):
                reader.put_many([(f"{FP_A}/x", make_record(FP_A, "x", 1))])
            with pytest.raises(ReadOnlyStoreError):
                reader.put_index(store.get_index(FP_A))
            assert reader.get(f"{FP_A}/zeta") == store.get(f"{FP_A}/zeta")
        finally:
            reader.close()

    def test_reader_sees_later_writes(self, store: Store) -> None:
        reader = self.reopen(store, readonly=True)
        try:
            assert not reader.has(f"{FP_A}/later")
            store.put_many([(f"{FP_A}/later", make_record(FP_A, "later", 3))])
            assert reader.has(f"{FP_A}/later")
        finally:
            reader.close()
