from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache_store.errors import InvalidSampleId, ParameterError
from cache_store.keys import (
    MAX_SAMPLE_ID_BYTES,
    compute_fingerprint,
    record_key,
    split_key,
    validate_fingerprint,
    validate_sample_id,
)
from cache_store.recipes.registry import get_recipe_spec


def _fp(**params: object) -> str:
    spec = get_recipe_spec("spc_query")
    return compute_fingerprint("spc_query", spec.version, spec.resolve(params))


def test_fingerprint_is_stable_and_independent_of_parameter_order() -> None:
    a = compute_fingerprint("spc", 1, {"level": 8, "surface_samples": 100})
    b = compute_fingerprint("spc", 1, {"surface_samples": 100, "level": 8})
    assert a == b
    assert validate_fingerprint(a) == a


def test_every_input_changes_the_fingerprint() -> None:
    base = compute_fingerprint("spc", 1, {"level": 8})
    assert compute_fingerprint("spc", 2, {"level": 8}) != base
    assert compute_fingerprint("spc_query", 1, {"level": 8}) != base
    assert compute_fingerprint("spc", 1, {"level": 9}) != base
    assert compute_fingerprint("spc", 1, {"level": 8, "x": 0}) != base


def test_defaults_are_part_of_the_fingerprint() -> None:
    assert _fp() == _fp(level=8)  # 8 is the default level
    assert _fp() != _fp(level=7)
    assert _fp(surface_sigma=0.01) == _fp(surface_sigma=0.010)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), object(), b"bytes"])
def test_unrepresentable_parameters_are_refused(bad: object) -> None:
    with pytest.raises(ParameterError):
        compute_fingerprint("spc", 1, {"level": bad})


@pytest.mark.parametrize("bad", ["", "ABCDEF" * 6, "0" * 31, "g" * 32, None, "0" * 33])
def test_validate_fingerprint_refuses(bad: object) -> None:
    with pytest.raises(ParameterError):
        validate_fingerprint(bad)


@pytest.mark.parametrize("good", ["a1", "chairs/a1", "chairs/a 1", "über/ß", "x.y", "..a", "a.."])
def test_valid_sample_ids(good: str) -> None:
    assert validate_sample_id(good) == good


HOSTILE = [
    "",
    "../x",
    "a/../../x",
    "/etc/passwd",
    "..\\x",
    "a\\b",
    "a\x00b",
    "a\nb",
    "a\x1bb",
    "a\x7fb",
    "a\u202eb",
    "a\u200bb",
    ".",
    "..",
    "a/./b",
    "a/",
    "a//b",
    "x" * (MAX_SAMPLE_ID_BYTES + 1),
    "x" * 513,
    "a" * 256,
    "/".join(["a" * 200] * 3),
    "é" * (MAX_SAMPLE_ID_BYTES // 2 + 1),
    "\u2024",
    "\u2025",
    "a/\u2025/b",
    "\uff0e\uff0e/x",
    "a\uff0fb",
    "a\uff3cb",
    " a",
    "a/b ",
    "...",
    17,
    None,
    b"a",
]


@pytest.mark.parametrize("bad", HOSTILE, ids=lambda v: repr(v)[:30])
def test_hostile_sample_ids_are_refused(bad: object) -> None:
    with pytest.raises(InvalidSampleId) as err:
        validate_sample_id(bad)
    assert "invalid sample id" in str(err.value)


def test_longest_ids_fit() -> None:
    longest = "/".join(["a" * 223, "b" * 224])
    assert len(longest.encode()) == MAX_SAMPLE_ID_BYTES
    assert validate_sample_id(longest) == longest
    assert len(record_key("0" * 32, longest).encode()) <= 511  # LMDB's key limit


def test_sample_ids_are_nfc_normalised() -> None:
    nfd = "cafe\u0301"
    assert validate_sample_id(nfd) == "caf\u00e9"
    assert record_key("0" * 32, nfd) == "0" * 32 + "/caf\u00e9"


def test_record_key_round_trip() -> None:
    fp = _fp()
    key = record_key(fp, "chairs/a1")
    assert key == f"{fp}/chairs/a1"
    assert split_key(key) == (fp, "chairs/a1")
    with pytest.raises(InvalidSampleId):
        record_key(fp, "../a")
    with pytest.raises(ParameterError):
        split_key("nokey")


@given(st.text(max_size=40))
def test_accepted_ids_never_escape(sample_id: str) -> None:
    try:
        sid = validate_sample_id(sample_id)
    except InvalidSampleId:
        return
    import posixpath
    import unicodedata

    folded = unicodedata.normalize("NFKC", sid)
    assert not folded.startswith("/")
    assert ".." not in posixpath.normpath(folded).split("/")
    assert "\\" not in folded and "\x00" not in sid


def _rules_for_plain(sample_id: str) -> bool:
    """The rules of ``validate_sample_id`` for ids of ASCII letters, digits, ``_-./#``:
    what it must answer whichever way it checks them."""
    import re

    segments = sample_id.split("/")
    return (
        0 < len(sample_id) <= MAX_SAMPLE_ID_BYTES
        and all(0 < len(s) <= 255 and set(s) != {"."} for s in segments)
        and re.search(r"#v[1-9][0-9]{0,3}$", sample_id) is None
    )


@given(
    st.lists(
        st.one_of(
            st.text("ab.-_#v1", min_size=0, max_size=6),
            st.sampled_from([".", "..", "...", "a" * 250, "b" * 256]),
        ),
        min_size=1,
        max_size=5,
    ).map("/".join)
)
def test_plain_ids_are_judged_by_every_rule(sample_id: str) -> None:
    """Ids of plain ASCII take a short path (no per-character Unicode checks, the cost of
    a million ids in a re-run): it accepts exactly what the rules accept, dot segments,
    empty segments, long segments and the variant suffix refused as before."""
    try:
        accepted = validate_sample_id(sample_id) == sample_id
    except InvalidSampleId:
        accepted = False
    assert accepted == _rules_for_plain(sample_id), sample_id
