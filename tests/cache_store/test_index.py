from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_store.errors import CorruptRecord, ParameterError, SpcacheError
from cache_store.format.index import DatasetIndex, decode_index, encode_index
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
