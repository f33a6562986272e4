"""The store contract as tests, for every backend, a plugin's included (as zarr ships its
store tests in ``zarr.testing.store``).

Subclass :class:`StoreContract` (reads: any backend) or :class:`WritableStoreContract`
(reads and writes) in a test module, under a name pytest collects (``Test...``), and
provide the hooks; pytest runs the ``test_*`` methods. Every backend in spcache runs
through them: LMDB, memory, the Zarr and the sharded snapshot (a directory and S3), a
remote sharded snapshot read through ``local_cache``, HTTP.
Importing this module needs neither pytest nor torch (building a record imports torch).

Hooks of :class:`StoreContract`:

* ``make_store(records, indexes) -> Store``: a store holding exactly those records
  (``key -> record bytes``) and dataset indexes, built however the backend is filled;
* ``make_swapped_store(records, indexes) -> Store``: the same, except that
  :data:`SWAPPED_KEY` holds the record of :data:`SWAPPED_FOR`, planted past the writer's
  checks (as a bug or an attacker could): every decoded read must refuse it;
* ``content() -> (records, indexes)``: what the tests store; :func:`sample_content` by
  default (a backend that builds its store once overrides it to return what it built).

:class:`WritableStoreContract` builds both stores through the backend's own writes and
asks instead for ``make_empty_store() -> Store`` (writable), ``reopen(store, readonly)
-> Store`` (another handle on the same location) and ``plant(store, key, value) ->
Store`` (a reader of ``store`` that finds ``value`` under ``key``, written past every
check). Two rules differ between backends and a subclass states which it keeps:
``put_index_keeps_given_ids`` (True: an index is stored as given; False: a sharded
snapshot's index lists every committed record, the given ids first, and leaves out ids
without one).

Every store a test makes is closed after it (``teardown_method``).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from cache_store.errors import (
    CorruptRecord,
    FingerprintLookupError,
    ReadOnlyStoreError,
    RecordNotFound,
    SpcacheError,
)
from cache_store.format.decode import decode_record
from cache_store.format.header import read_header
from cache_store.format.index import DatasetIndex
from cache_store.stores.base import Store
from cache_store.testing.format1 import metadata_read_back
from cache_store.testing.records import (
    FP_A,
    FP_B,
    FP_C,
    IDS_A,
    IDS_B,
    SWAPPED_FOR,
    SWAPPED_KEY,
    V1_KEYS,
    Content,
    contract_record,
    index_of,
    sample_content,
)

__all__ = ["StoreContract", "WritableStoreContract", "raises"]


class _Raised:
    value: BaseException | None = None


@contextlib.contextmanager
def raises(kind: type[BaseException], match: str | None = None) -> Iterator[_Raised]:
    """``pytest.raises`` without pytest: the block must raise ``kind`` (its message
    matching the regular expression ``match``); the error is ``.value`` afterwards."""
    caught = _Raised()
    try:
        yield caught
    except kind as exc:
        if match is not None and not re.search(match, str(exc)):
            raise AssertionError(
                f"{type(exc).__name__}({str(exc)!r}) does not match {match!r}"
            ) from exc
        caught.value = exc
        return
    raise AssertionError(f"did not raise {kind.__name__}")


def _equal_tensors(a: Any, b: Any) -> bool:
    return bool(a.dtype == b.dtype and np.array_equal(a.numpy(), b.numpy()))


class StoreContract:
    """Reads: what every backend keeps. Subclasses provide the hooks (see the module doc)."""

    # -- hooks --------------------------------------------------------------------------
    def make_store(self, records: dict[str, bytes], indexes: list[DatasetIndex]) -> Store:
        raise NotImplementedError("subclasses provide make_store")

    def make_swapped_store(self, records: dict[str, bytes], indexes: list[DatasetIndex]) -> Store:
        raise NotImplementedError("subclasses provide make_swapped_store")

    def content(self) -> Content:
        return sample_content()

    # -- the stores a test made, closed after it ---------------------------------------
    def setup_method(self, method: object = None) -> None:
        self.made: list[Store] = []

    def teardown_method(self, method: object = None) -> None:
        for store in reversed(getattr(self, "made", [])):
            store.close()

    def keep(self, store: Store) -> Store:
        """``store``, closed when the test ends."""
        self.made.append(store)
        return store

    def opened(self) -> tuple[Store, dict[str, bytes], list[DatasetIndex]]:
        """A store holding :meth:`content`, and that content."""
        records, indexes = self.content()
        return self.keep(self.make_store(records, indexes)), records, indexes

    # -- reads ---------------------------------------------------------------------------
    def test_get_returns_the_stored_bytes(self) -> None:
        store, records, _ = self.opened()
        for key, value in records.items():
            assert store.get(key) == value

    def test_missing_record_names_key_and_location(self) -> None:
        store, _, _ = self.opened()
        key = f"{FP_A}/nope"
        with raises(RecordNotFound) as err:
            store.get(key)
        assert isinstance(err.value, KeyError)
        assert key in str(err.value) and store.location in str(err.value)
        with raises(RecordNotFound):
            store.get_record(key)

    def test_has(self) -> None:
        store, records, _ = self.opened()
        assert all(store.has(key) for key in records)
        assert not store.has(f"{FP_A}/nope")
        assert not store.has(f"{FP_A}/chairs")  # a prefix of ids is not an id

    def test_keys_sorted_and_filtered_by_prefix(self) -> None:
        store, records, _ = self.opened()
        assert list(store.keys()) == sorted(records, key=lambda k: k.encode())
        assert list(store.keys(f"{FP_A}/chairs/")) == [f"{FP_A}/chairs/a1", f"{FP_A}/chairs/a2"]
        assert list(store.keys(f"{FP_B}/")) == [f"{FP_B}/{s}" for s in IDS_B]
        assert list(store.keys(f"{FP_A}/zz")) == []

    def test_get_record_decodes_and_subsets(self) -> None:
        store, records, _ = self.opened()
        key = f"{FP_B}/lamps/l1"
        full = decode_record(records[key])
        rec = store.get_record(key)
        assert set(rec.tensors) == set(full.tensors)
        for name, tensor in full.tensors.items():
            assert _equal_tensors(rec.tensors[name], tensor), name
        sub = store.get_record(key, fields=["octree", "query_pidx"])
        assert set(sub.tensors) == {"octree", "query_pidx"}
        assert sub.metadata["sample_id"] == "lamps/l1"
        many = store.get_records([key, f"{FP_A}/zeta"], fields=["octree"])
        assert [r.metadata["sample_id"] for r in many] == ["lamps/l1", "zeta"]

    def test_records_of_both_formats_read_alike(self) -> None:
        """Format-1 records (their whole metadata in each) and format-2 ones (what the
        fingerprint's records share in its descriptor) read with the same metadata."""
        store, records, _ = self.opened()
        keys = list(records)
        together = store.get_records(keys)
        for key, batched in zip(keys, together, strict=True):
            value = records[key]
            expected = metadata_read_back(value)
            assert expected["format_version"] == ("1" if key in V1_KEYS else "2"), key
            assert expected["fingerprint"] == key[:32] and expected["recipe"]
            want = decode_record(value).tensors
            for got in (store.get_record(key), batched):
                assert got.metadata == expected, key
                assert set(got.tensors) == set(want)
                assert all(_equal_tensors(got.tensors[n], t) for n, t in want.items()), key

    def test_indexes(self) -> None:
        store, _, indexes = self.opened()
        assert store.fingerprints() == sorted(i.fingerprint for i in indexes)
        for expected in indexes:
            got = store.get_index(expected.fingerprint)
            assert got.recipe == expected.recipe and got.recipe_version == expected.recipe_version
            assert got.params == expected.params
            assert isinstance(got.sample_ids, np.ndarray)
            assert got.sample_ids.tolist() == expected.sample_ids.tolist()
        with raises(FingerprintLookupError) as err:
            store.get_index("f" * 32)
        assert FP_A in str(err.value)

    def test_block_layout_is_none_or_one_named_block_per_sample(self) -> None:
        store, _, indexes = self.opened()
        for index in indexes:
            ids = index.sample_ids.tolist()
            layout = store.block_layout(index.fingerprint, ids)
            if layout is None:  # any record is read as cheaply as any other
                continue
            assert len(layout.of_sample) == len(ids)
            assert all(0 <= b < len(layout.names) for b in layout.of_sample.tolist())
            assert all(isinstance(name, str) and name for name in layout.names)  # all stored
            block_of = dict(zip(ids, (layout.names[b] for b in layout.of_sample), strict=True))
            asked = ids[::-1]  # the names depend on the samples, not on how they are asked
            again = store.block_layout(index.fingerprint, asked)
            assert again is not None
            assert [again.names[b] for b in again.of_sample] == [block_of[s] for s in asked]

    def test_find_fingerprints(self) -> None:
        store, _, _ = self.opened()
        assert [i.fingerprint for i in store.find_fingerprints("spc")] == sorted([FP_A, FP_C])
        assert [i.fingerprint for i in store.find_fingerprints("spc", level=5)] == [FP_C]
        assert [i.fingerprint for i in store.find_fingerprints("spc", level=np.int64(5))] == [FP_C]
        assert [i.fingerprint for i in store.find_fingerprints("spc_query", level=4)] == [FP_B]
        assert store.find_fingerprints("spc", level=6) == []
        # values are compared as given: checking a user's values by the recipe's schema
        # (and refusing unknown names) is the dataset's job (resolve_index)
        assert store.find_fingerprints("spc", levle=4) == []

    def test_stats(self) -> None:
        store, records, _ = self.opened()
        stats = store.stats()
        assert stats["records"] == len(records)
        assert stats["bytes"] == sum(len(v) for v in records.values())
        assert stats["fingerprints"][FP_A]["records"] == len(IDS_A)
        assert stats["fingerprints"][FP_A]["recipe"] == "spc"
        assert stats["fingerprints"][FP_B]["bytes"] == sum(
            len(v) for k, v in records.items() if k.startswith(FP_B)
        )

    def test_verify_clean_store(self) -> None:
        store, records, _ = self.opened()
        report = store.verify()
        assert report.ok and report.checked == len(records)
        assert store.verify(FP_B).checked == len(IDS_B)

    def test_capabilities_are_declared_and_kept(self) -> None:
        store, records, indexes = self.opened()
        assert isinstance(store.supports_writes, bool) and isinstance(store.supports_listing, bool)
        if not store.supports_writes:  # no method fakes the missing half
            key = next(iter(records))
            with raises(ReadOnlyStoreError):
                store.put_many([(key, records[key])])
            with raises(ReadOnlyStoreError):
                store.put_index(indexes[0])
            assert store.get(key) == records[key]  # nothing changed

    def test_read_view_lends_the_stored_bytes(self) -> None:
        store, records, _ = self.opened()
        for key, value in records.items():
            with store.read_view(key) as view:
                assert bytes(view) == value
        with raises(RecordNotFound):
            with store.read_view(f"{FP_A}/nope"):
                pass

    def test_value_size(self) -> None:
        store, records, _ = self.opened()
        for key, value in records.items():
            assert store.value_size(key) == len(value)
        with raises(RecordNotFound) as err:
            store.value_size(f"{FP_A}/nope")
        assert f"{FP_A}/nope" in str(err.value)

    def test_generation_stays_while_nothing_is_written(self) -> None:
        store, records, _ = self.opened()
        first = store.generation()
        assert first is None or (isinstance(first, int) and not isinstance(first, bool))
        store.get_records(list(records))
        store.verify()
        assert store.generation() == first

    def test_a_record_under_another_key_is_refused(self) -> None:
        records, indexes = self.content()
        store = self.keep(self.make_swapped_store(records, indexes))
        named = SWAPPED_FOR.split("/", 1)[1]
        reads: dict[str, Callable[[], object]] = {
            "get_record": lambda: store.get_record(SWAPPED_KEY),
            "get_record(fields)": lambda: store.get_record(SWAPPED_KEY, fields=["octree"]),
            "get_records": lambda: store.get_records([f"{FP_A}/zeta", SWAPPED_KEY]),
            "get_records(fields)": lambda: store.get_records([SWAPPED_KEY], ["octree"]),
        }
        for what, read in reads.items():
            with raises(CorruptRecord) as err:
                read()
            assert isinstance(err.value, CorruptRecord)
            assert err.value.key == SWAPPED_KEY, what
            assert named in str(err.value), what
        report = store.verify(FP_A)
        assert SWAPPED_KEY in report.corrupt and named in report.corrupt[SWAPPED_KEY]
        assert f"{FP_A}/zeta" not in report.corrupt
        assert store.get_record(f"{FP_A}/zeta").metadata["sample_id"] == "zeta"

    def test_close_then_use_again(self) -> None:
        store, records, _ = self.opened()
        key = next(iter(records))
        store.close()
        assert store.get(key) == records[key]
        store.close()
        store.close()


class WritableStoreContract(StoreContract):
    """Reads and writes. Subclasses provide ``make_empty_store``, ``reopen`` and
    ``plant`` (see the module doc)."""

    #: False where an index lists every committed record, the given ids first (sharded).
    put_index_keeps_given_ids = True

    # -- hooks --------------------------------------------------------------------------
    def make_empty_store(self) -> Store:
        raise NotImplementedError("subclasses provide make_empty_store")

    def reopen(self, store: Store, readonly: bool) -> Store:
        raise NotImplementedError("subclasses provide reopen")

    def plant(self, store: Store, key: str, value: bytes) -> Store:
        raise NotImplementedError("subclasses provide plant")

    def make_store(self, records: dict[str, bytes], indexes: list[DatasetIndex]) -> Store:
        store = self.make_empty_store()
        store.put_many(records.items())
        for index in indexes:
            store.put_index(index)
        return store

    def make_swapped_store(self, records: dict[str, bytes], indexes: list[DatasetIndex]) -> Store:
        store = self.keep(self.make_store(records, indexes))
        return self.plant(store, SWAPPED_KEY, records[SWAPPED_FOR])

    def reader_of(self, store: Store) -> Store:
        """A read-only handle on ``store``'s location, closed after the test."""
        return self.keep(self.reopen(store, readonly=True))

    # -- writes --------------------------------------------------------------------------
    def test_a_recomputed_record_replaces_the_stored_one(self) -> None:
        store, _, _ = self.opened()
        key = f"{FP_A}/zeta"
        new = contract_record(FP_A, "zeta", 1234, source_hash="1" * 16)  # its source changed
        fresh = (f"{FP_A}/fresh", contract_record(FP_A, "fresh", 5))
        assert store.put_many([(key, new), fresh]) == 2
        assert store.get(key) == new and store.has(fresh[0])

    def test_put_many_is_all_or_nothing(self) -> None:
        store, _, _ = self.opened()
        good = (f"{FP_A}/new1", contract_record(FP_A, "new1", 1))
        for bad in [
            (f"{FP_A}/../x", good[1]),
            (f"{FP_A}/new2", b"garbage"),
            (f"{FP_A}/new3", contract_record(FP_A, "other", 1)),  # metadata names another id
            (f"{FP_B}/new4", contract_record(FP_A, "new4", 1)),  # ... another fingerprint
        ]:
            with raises(SpcacheError):
                store.put_many([good, bad])
            assert not store.has(good[0])

    def test_generation_changes_with_every_write(self) -> None:
        store, _, _ = self.opened()
        before = store.generation()
        reader = self.reader_of(store)
        store.put_many([(f"{FP_A}/gen1", contract_record(FP_A, "gen1", 1))])
        after_put = store.generation()
        store.put_index(index_of("spc", ["gen1"], level=4))
        if before is None:  # the backend cannot tell: it says so, every time
            assert after_put is None and store.generation() is None
            assert reader.generation() is None
            return
        assert after_put != before
        assert store.generation() not in (before, after_put)
        # another handle on the same store sees the same counter, and its changes
        assert reader.generation() == store.generation()
        store.put_many([(f"{FP_A}/gen2", contract_record(FP_A, "gen2", 2))])
        assert reader.generation() == store.generation()

    def test_put_index_replaces(self) -> None:
        store, _, _ = self.opened()
        store.put_index(index_of("spc", ["zeta", "chairs/a1"], level=4))
        ids = store.get_index(FP_A).sample_ids.tolist()
        if self.put_index_keeps_given_ids:
            assert ids == ["zeta", "chairs/a1"]
        else:  # the given ids first, then every other committed one
            assert ids[:2] == ["zeta", "chairs/a1"] and sorted(ids) == sorted(IDS_A)

    def test_verify_reports_corrupt_and_missing(self) -> None:
        store, records, _ = self.opened()
        key = f"{FP_A}/chairs/a3"
        value = bytearray(contract_record(FP_A, "chairs/a3", 7))
        value[read_header(bytes(value)).tensors["octree"].begin] ^= 0x10
        store.put_many([(key, bytes(value))])  # the header is intact, so the write passes
        with raises(CorruptRecord, match="octree"):
            store.get_record(key)
        store.put_index(index_of("spc", ["only", "ghost"], level=5))
        report = store.verify()
        assert not report.ok
        assert list(report.corrupt) == [key] and "octree" in report.corrupt[key]
        assert report.checked == len(records) + 1
        if self.put_index_keeps_given_ids:
            assert report.missing == [f"{FP_C}/ghost"]
        else:  # an id without a record never enters the index
            assert report.missing == [] and store.get_index(FP_C).sample_ids.tolist() == ["only"]

    def test_readonly_store_refuses_writes(self) -> None:
        store, _, _ = self.opened()
        reader = self.reader_of(store)
        with raises(ReadOnlyStoreError):
            reader.put_many([(f"{FP_A}/x", contract_record(FP_A, "x", 1))])
        with raises(ReadOnlyStoreError):
            reader.put_index(store.get_index(FP_A))
        assert reader.get(f"{FP_A}/zeta") == store.get(f"{FP_A}/zeta")
        assert not reader.has(f"{FP_A}/x")

    def test_reader_sees_later_writes(self) -> None:
        store, _, _ = self.opened()
        reader = self.reader_of(store)
        assert not reader.has(f"{FP_A}/later")
        store.put_many([(f"{FP_A}/later", contract_record(FP_A, "later", 3))])
        # at once on most backends; a sharded reader lists commits again at most once a
        # second, so it is given a generous bound, never a fixed sleep
        deadline = time.monotonic() + 60.0
        while not reader.has(f"{FP_A}/later"):
            assert time.monotonic() < deadline, "the reader never saw the later write"
            time.sleep(0.05)
        assert reader.get(f"{FP_A}/later") == store.get(f"{FP_A}/later")
