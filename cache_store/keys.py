"""Fingerprints, sample ids and record keys.

A *fingerprint* names one exact way of computing features: the hash of the canonical
JSON of (recipe name, recipe version, every parameter with its default filled in). Any
change to any of them is a different fingerprint, so a changed recipe is a cache miss,
never a stale hit.

A *sample id* names one source inside a dataset. Ids are relative paths without an
extension (``chairs/a1``), so they may contain ``/``; everything that could escape a
directory, confuse a terminal or differ only invisibly is refused.

A *record key* is ``"<fingerprint>/<sample id>"``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import unicodedata
from collections.abc import Mapping
from typing import Any, TypeGuard

from cache_store.errors import InvalidSampleId, ParameterError

__all__ = [
    "FINGERPRINT_HEX_CHARS",
    "FINGERPRINT_PATTERN",
    "is_fingerprint",
    "MAX_SAMPLE_ID_BYTES",
    "MAX_SEGMENT_BYTES",
    "canonical_json",
    "compute_fingerprint",
    "validate_fingerprint",
    "validate_sample_id",
    "record_key",
    "split_key",
]

#: Length of a fingerprint: 128 bits of BLAKE2b as lowercase hex.
FINGERPRINT_HEX_CHARS = 32
#: Longest sample id accepted, counted in UTF-8 bytes: a key (32-char fingerprint, '/',
#: id) must fit LMDB's 511-byte key limit.
MAX_SAMPLE_ID_BYTES = 448
#: Longest path segment of a sample id (a file name on common filesystems).
MAX_SEGMENT_BYTES = 255

#: A fingerprint's syntax as a regular expression (for routes and URL matching).
FINGERPRINT_PATTERN = rf"[0-9a-f]{{{FINGERPRINT_HEX_CHARS}}}"
_FINGERPRINT_RE = re.compile(FINGERPRINT_PATTERN)
# Unicode categories refused anywhere in an id: control (C0, C1, DEL), format (bidi
# overrides, zero-width joiners: invisible differences), surrogates, private use, and the
# line/paragraph separators.
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Zl", "Zp"})


def _check_param_value(path: str, value: Any) -> None:
    if value is None or isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ParameterError([f"{path}: not a finite number ({value!r})"])
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ParameterError([f"{path}: keys must be strings, got {k!r}"])
            _check_param_value(f"{path}.{k}", v)
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_param_value(f"{path}[{i}]", v)
        return
    raise ParameterError([f"{path}: {type(value).__name__} cannot be part of a fingerprint"])


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys, no spaces and no NaN: equal values give equal text."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def compute_fingerprint(
    recipe: str, recipe_version: int, resolved_params: Mapping[str, Any]
) -> str:
    """Return the fingerprint (32 lowercase hex chars) of a recipe run.

    ``resolved_params`` must hold *every* parameter, defaults filled in (see
    :meth:`cache_store.recipes.specs.RecipeSpec.resolve`); values are JSON scalars, lists or
    string-keyed mappings. ``1`` and ``1.0`` fingerprint differently, which is why
    parameters are coerced to their declared type before they get here.
    """
    if not isinstance(recipe, str) or not recipe:
        raise ParameterError([f"recipe: expected a non-empty name, got {recipe!r}"])
    if isinstance(recipe_version, bool) or not isinstance(recipe_version, int):
        raise ParameterError([f"recipe_version: expected an integer, got {recipe_version!r}"])
    _check_param_value("params", dict(resolved_params))
    text = canonical_json(
        {"recipe": recipe, "recipe_version": recipe_version, "params": dict(resolved_params)}
    )
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=FINGERPRINT_HEX_CHARS // 2)
    return digest.hexdigest()


def is_fingerprint(text: object) -> TypeGuard[str]:
    """True when ``text`` has a fingerprint's syntax (32 lowercase hex chars)."""
    return isinstance(text, str) and _FINGERPRINT_RE.fullmatch(text) is not None


def validate_fingerprint(fingerprint: object) -> str:
    """Return ``fingerprint`` if it is 32 lowercase hex chars, else raise ``ParameterError``."""
    if not is_fingerprint(fingerprint):
        raise ParameterError(
            [
                (
                    f"fingerprint: expected {FINGERPRINT_HEX_CHARS} lowercase hex "
                    f"characters, got {fingerprint!r}"
                )
            ]
        )
    return fingerprint


def _check_segment(sample_id: str, segment: str) -> None:
    if not segment:
        raise InvalidSampleId(sample_id, "empty path segment (leading, trailing or double '/')")
    if len(segment.encode("utf-8")) > MAX_SEGMENT_BYTES:
        raise InvalidSampleId(sample_id, f"a segment is longer than {MAX_SEGMENT_BYTES} bytes")
    if segment != segment.strip():
        raise InvalidSampleId(sample_id, f"segment {segment!r} has leading or trailing whitespace")
    # Compatibility forms fold look-alikes (U+2024 ONE DOT LEADER, U+FF0E FULLWIDTH FULL
    # STOP, U+FF0F FULLWIDTH SOLIDUS ...) onto what some filesystem, URL normaliser or
    # downstream tool may turn them into; refuse the ones that would become traversal.
    folded = unicodedata.normalize("NFKC", segment)
    if folded in {".", ".."} or set(folded) <= {"."}:
        raise InvalidSampleId(sample_id, f"segment {segment!r} is (or looks like) '.' or '..'")
    if "/" in folded or "\\" in folded:
        raise InvalidSampleId(sample_id, f"segment {segment!r} contains a slash look-alike")


def validate_sample_id(sample_id: object) -> str:
    """Return ``sample_id`` in Unicode NFC form, or raise :class:`InvalidSampleId`.

    Accepted: a relative, ``/``-separated path of non-empty segments, at most
    :data:`MAX_SAMPLE_ID_BYTES` UTF-8 bytes in all and :data:`MAX_SEGMENT_BYTES` per
    segment. Refused: non-strings, empty ids, U+FFFD (the mark of undecodable bytes), a leading
    ``/``, backslashes, ``.``/``..`` segments (and segments that Unicode compatibility
    folding turns into dots or slashes), empty segments, segments with leading or trailing
    whitespace, and control, format, surrogate or private-use characters. The id is
    returned NFC-normalised so that the same name typed on different systems (macOS
    stores NFD file names) gives the same key; use the returned value.
    """
    if not isinstance(sample_id, str):
        raise InvalidSampleId(sample_id, f"expected a string, got {type(sample_id).__name__}")
    if not sample_id:
        raise InvalidSampleId(sample_id, "empty")
    for ch in sample_id:
        if unicodedata.category(ch) in _REFUSED_CATEGORIES:
            raise InvalidSampleId(
                sample_id, f"contains the control or invisible character U+{ord(ch):04X}"
            )
    if "\ufffd" in sample_id:  # what a lossy decoder makes of bytes that are not UTF-8
        raise InvalidSampleId(
            sample_id,
            "contains U+FFFD (the id was not valid UTF-8 "
            "somewhere; distinct bytes would share this id)",
        )
    normalised = unicodedata.normalize("NFC", sample_id)
    if len(normalised.encode("utf-8")) > MAX_SAMPLE_ID_BYTES:
        raise InvalidSampleId(sample_id, f"longer than {MAX_SAMPLE_ID_BYTES} bytes in UTF-8")
    if "\\" in normalised:
        raise InvalidSampleId(sample_id, "contains a backslash")
    if normalised.startswith("/"):
        raise InvalidSampleId(sample_id, "starts with '/' (ids are relative paths)")
    for segment in normalised.split("/"):
        _check_segment(sample_id, segment)
    return normalised


def record_key(fingerprint: str, sample_id: str) -> str:
    """Return the record key ``"<fingerprint>/<sample id>"`` after validating both parts."""
    return f"{validate_fingerprint(fingerprint)}/{validate_sample_id(sample_id)}"


def split_key(key: str) -> tuple[str, str]:
    """Inverse of :func:`record_key`; validates both parts (raises ``SpcacheError``)."""
    if not isinstance(key, str) or "/" not in key:
        raise ParameterError([f"key: expected '<fingerprint>/<sample id>', got {key!r}"])
    fingerprint, sample_id = key.split("/", 1)
    validate_fingerprint(fingerprint)
    if validate_sample_id(sample_id) != sample_id:
        raise InvalidSampleId(sample_id, "not in Unicode NFC form (keys hold normalised ids)")
    return fingerprint, sample_id
