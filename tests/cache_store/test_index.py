from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_store.errors import CorruptRecord, ParameterError, SpcacheError
from cache_store.format.index import (
    DatasetIndex,
    IndexPage,
    decode_index,
    encode_index,
    index_page,
)
from tests.helpers.synthetic import fingerprint_of

FP = fingerprint_of("spc", level=4)
PARAMS = {"level": 4, "surface_samples": 100_000}


def test_round_trip_keeps_order_unicode_and_empty() -> None:
    ids = ["z/last", "a/first", "ünï/cödé", "x" * 200]
    index = DatasetIndex(FP, "spc", 1, PARAMS, ids)
    back = decode_index(encode_index(index), key="i")
    assert back.sample_ids.tolist() == ids and back.params == PARAMS
    assert back.created == index.created
    empty = decode_index(encode_index(DatasetIndex(FP, "spc", 1, PARAMS, np.array([], dtype=str))))
    assert len(empty) == 0


def test_sample_ids_are_normalised_and_not_coerced() -> None:
    index = DatasetIndex(FP, "spc", 1, PARAMS, ["cafe\u0301"])
    assert index.sample_ids.tolist() == ["caf\u00e9"]


def test_an_index_is_checked_when_made() -> None:
    """Its parameters must give its fingerprint; its ids are valid and distinct."""
    other = fingerprint_of("spc", level=5)
    with pytest.raises(ParameterError, match="fingerprint"):
        DatasetIndex(other, "spc", 1, PARAMS, ["a"])
    with pytest.raises(ParameterError, match="more than once"):
        DatasetIndex(FP, "spc", 1, PARAMS, ["a", "b", "a"])
    with pytest.raises(SpcacheError):
        DatasetIndex(FP, "spc", 1, PARAMS, ["a", "../b"])
    with pytest.raises(SpcacheError):
        DatasetIndex(FP, "spc", 1, PARAMS, ["a", 1])


def test_a_record_is_not_an_index() -> None:
    from tests.helpers.synthetic import make_record

    with pytest.raises(CorruptRecord, match="not a dataset index"):
        decode_index(make_record(FP, "a", 1), key="idx")


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_damaged_indexes_raise_corrupt_record(data: st.DataObject) -> None:
    value = bytearray(encode_index(DatasetIndex(FP, "spc", 1, PARAMS, ["a", "b/c", "d"])))
    pos = data.draw(st.integers(0, len(value) - 1))
    value[pos] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(CorruptRecord):
        decode_index(bytes(value), key="idx")


IDS = ["z/last", "a/first", "ünï/cödé", "x" * 200, "b", "c/d/e"]


def test_a_page_of_a_stored_index_is_the_slice_of_the_decoded_one() -> None:
    index = DatasetIndex(FP, "spc", 1, PARAMS, IDS)
    value = encode_index(index)
    for offset in range(len(IDS) + 2):
        for limit in (0, 1, 2, 5, 100):
            page = index_page(value, offset, limit, key="i")
            assert page.sample_ids == IDS[offset : offset + limit]
            assert page == IndexPage.of(index, offset, limit)  # the default's answer
    page = index_page(value, 2, 1)
    assert (page.total, page.recipe, page.recipe_version, page.params) == (6, "spc", 1, PARAMS)
    assert (page.fingerprint, page.created) == (FP, index.created)
    empty = encode_index(DatasetIndex(FP, "spc", 1, PARAMS, np.array([], dtype=str)))
    assert index_page(empty, 0, 10).sample_ids == [] and index_page(empty, 0, 10).total == 0
    with pytest.raises(CorruptRecord, match="not a dataset index"):
        from tests.helpers.synthetic import make_record

        index_page(make_record(FP, "a", 1), 0, 1, key="idx")


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_page_of_a_damaged_index_raises_corrupt_record(data: st.DataObject) -> None:
    """Every field is checked whole, not only the page's bytes: one flipped bit anywhere
    is damage, whichever page is asked for."""
    value = bytearray(encode_index(DatasetIndex(FP, "spc", 1, PARAMS, IDS)))
    pos = data.draw(st.integers(0, len(value) - 1))
    value[pos] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(CorruptRecord):
        index_page(bytes(value), data.draw(st.integers(0, 6)), 1, key="idx")


def test_the_lmdb_store_pages_an_index_without_decoding_all_of_it(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LMDBStore.get_index_page`` (the service's cache view) answers from the stored
    value, and sees each write: never the whole index decoded per request."""
    from cache_store.errors import FingerprintLookupError
    from cache_store.stores.lmdb import LMDBStore
    from cache_store.stores.lmdb import store as lmdb_store

    with LMDBStore(tmp_path / "cache", readonly=False) as store:
        store.put_index(DatasetIndex(FP, "spc", 1, PARAMS, IDS[:3]))
        with monkeypatch.context() as patched:
            patched.setattr(lmdb_store, "decode_index", _whole_decode)
            assert store.get_index_page(FP, 1, 5).sample_ids == IDS[1:3]
            store.put_index(DatasetIndex(FP, "spc", 1, PARAMS, IDS))  # a run added three
            page = store.get_index_page(FP, 2, 3)
            assert (page.sample_ids, page.total) == (IDS[2:5], 6)
            with pytest.raises(FingerprintLookupError):
                store.get_index_page(fingerprint_of("spc", level=5), 0, 1)
        assert store.get_index(FP).sample_ids.tolist() == IDS


def _whole_decode(*args: object, **kwargs: object) -> None:
    raise AssertionError("the whole index was decoded for a page of it")
