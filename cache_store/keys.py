"""Fingerprints, sample ids and record keys.

A *fingerprint* names one exact way of computing features: the hash of the canonical
JSON of (recipe name, recipe version, every parameter with its default filled in). Any
change to any of them is a different fingerprint, so a changed recipe is a cache miss,
never a stale hit.

A *sample id* names one source inside a dataset. Ids are relative paths without an
extension (``chairs/a1``), so they may contain ``/``; everything that could escape a
directory, confuse a terminal or differ only invisibly is refused.

A *record key* is ``"<fingerprint>/<sample id>"`` for a sample's record (its variant 0),
and ``"<fingerprint>/<sample id>#v<k>"`` for its variant ``k >= 1`` (another seeded
version of the sample, see :func:`record_key`). The part after the fingerprint is the
*record id*; a sample id never ends like a variant's suffix, so the two cannot collide.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import unicodedata
from collections.abc import Iterable, Mapping
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
    "record_id",
    "key_of_record_id",
    "split_key",
    "split_record_id",
    "MAX_VARIANTS",
    "validate_variant",
    "validate_variant_count",
    "validate_record_id",
    "variant_counts",
]

#: Length of a fingerprint: 128 bits of BLAKE2b as lowercase hex.
FINGERPRINT_HEX_CHARS = 32
#: Longest sample id accepted, counted in UTF-8 bytes: a key (32-char fingerprint, '/',
#: id) must fit LMDB's 511-byte key limit.
MAX_SAMPLE_ID_BYTES = 448
#: Longest path segment of a sample id (a file name on common filesystems).
MAX_SEGMENT_BYTES = 255
#: Most variants a sample may have (variant indices run ``0 .. MAX_VARIANTS - 1``).
MAX_VARIANTS = 1024

# A variant's suffix of a record id: ``#v1`` .. ``#v1023`` (no leading zero: one spelling).
_VARIANT_SUFFIX = re.compile(r"#v([1-9][0-9]{0,3})$")

#: A fingerprint's syntax as a regular expression (for routes and URL matching).
FINGERPRINT_PATTERN = rf"[0-9a-f]{{{FINGERPRINT_HEX_CHARS}}}"
_FINGERPRINT_RE = re.compile(FINGERPRINT_PATTERN)
# Unicode categories refused anywhere in an id: control (C0, C1, DEL), format (bidi
# overrides, zero-width joiners: invisible differences), surrogates, private use, and the
# line/paragraph separators.
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Zl", "Zp"})
#: An id of ASCII letters, digits, ``_``, ``-`` and ``.`` in ``/``-separated segments of
#: 1 to MAX_SEGMENT_BYTES characters, none of them dots only: it keeps every rule of
#: :func:`validate_sample_id` (no Unicode form changes it, none of its characters is
#: refused or folds into a dot or slash, it has no ``#``) once its length is within
#: MAX_SAMPLE_ID_BYTES, so it is accepted as it is without the per-character checks (a
#: re-run over a million files validates a million ids).
_PLAIN_SEGMENT = rf"(?!\.+(?:/|\Z))[A-Za-z0-9_.\-]{{1,{MAX_SEGMENT_BYTES}}}(?=/|\Z)"
_PLAIN_ID = re.compile(rf"{_PLAIN_SEGMENT}(?:/{_PLAIN_SEGMENT})*")


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
    if len(sample_id) <= MAX_SAMPLE_ID_BYTES and _PLAIN_ID.fullmatch(sample_id):
        return sample_id  # every rule below holds for it (see _PLAIN_ID)
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
    if _VARIANT_SUFFIX.search(normalised):
        raise InvalidSampleId(
            sample_id,
            "ends like '#v<number>', the suffix spcache gives the record of a sample's "
            "variant (rename the file, or choose another --id-template)",
        )
    return normalised


def validate_variant(variant: object) -> int:
    """Return ``variant`` if it is an int in ``[0, MAX_VARIANTS)``, else raise
    ``ParameterError``."""
    if isinstance(variant, bool) or not isinstance(variant, int) or not 0 <= variant < MAX_VARIANTS:
        raise ParameterError(
            [f"variant: expected an integer from 0 to {MAX_VARIANTS - 1}, got {variant!r}"]
        )
    return variant


def validate_variant_count(variants: object) -> int:
    """Return ``variants`` (records asked for per sample) if it is an int from 1 to
    ``MAX_VARIANTS``, else raise ``ParameterError``: the one check of every ``variants``
    (a run, a job, a warm-up, a reader)."""
    if (
        isinstance(variants, bool)
        or not isinstance(variants, int)
        or not 1 <= variants <= MAX_VARIANTS
    ):
        raise ParameterError(
            [f"variants: expected an integer from 1 to {MAX_VARIANTS}, got {variants!r}"]
        )
    return variants


def record_id(sample_id: str, variant: int = 0) -> str:
    """The part of a record key after the fingerprint: the sample id for variant 0 (so a
    cache made before variants existed holds variant 0 of each sample), else the sample
    id followed by ``#v<variant>``. Neither part is validated here."""
    return sample_id if variant == 0 else f"{sample_id}#v{variant}"


def split_record_id(text: str) -> tuple[str, int]:
    """Inverse of :func:`record_id`: ``(sample id, variant)``; nothing validated."""
    found = _VARIANT_SUFFIX.search(text)
    if found is None:
        return text, 0
    return text[: found.start()], int(found.group(1))


def record_key(fingerprint: str, sample_id: str, variant: int = 0) -> str:
    """Return the record key of variant ``variant`` of a sample, after validating every
    part: ``"<fingerprint>/<sample id>"`` for variant 0, ``"<fingerprint>/<sample
    id>#v<variant>"`` for the others (:func:`record_id`)."""
    return (
        f"{validate_fingerprint(fingerprint)}/"
        f"{record_id(validate_sample_id(sample_id), validate_variant(variant))}"
    )


def validate_record_id(text: object) -> str:
    """Return the record id ``text`` (``a1``, or ``a1#v3`` for variant 3) with its sample
    id normalised, after validating both parts (raises ``SpcacheError``)."""
    if not isinstance(text, str):
        raise InvalidSampleId(text, f"expected a string, got {type(text).__name__}")
    sample_id, variant = split_record_id(text)
    return record_id(validate_sample_id(sample_id), validate_variant(variant))


def variant_counts(record_ids: Iterable[str]) -> dict[str, int]:
    """Sample id -> how many variants of it ``record_ids`` hold, counting from 0 while
    each is there (``a``, ``a#v1``, ``a#v3``: 2), for every sample whose variant 0 is
    there; in the order the variants 0 first appear. Nothing validated."""
    present: dict[str, set[int]] = {}
    firsts: list[str] = []
    for text in record_ids:
        sample_id, variant = split_record_id(text)
        present.setdefault(sample_id, set()).add(variant)
        if variant == 0:
            firsts.append(sample_id)
    counts = {}
    for sample_id in firsts:
        n, have = 0, present[sample_id]
        while n in have:
            n += 1
        counts[sample_id] = n
    return counts


def key_of_record_id(fingerprint: str, text: str) -> str:
    """The record key of a record id as a URL or a request names it (``chairs/a1``, or
    ``chairs/a1#v3`` for variant 3), after validating every part."""
    if not isinstance(text, str):
        raise InvalidSampleId(text, f"expected a string, got {type(text).__name__}")
    sample_id, variant = split_record_id(text)
    return record_key(fingerprint, sample_id, variant)


def split_key(key: str) -> tuple[str, str]:
    """``(fingerprint, record id)`` of a record key (inverse of :func:`record_key`; the
    record id is the sample id itself for variant 0, see :func:`split_record_id`);
    validates every part (raises ``SpcacheError``)."""
    if not isinstance(key, str) or "/" not in key:
        raise ParameterError([f"key: expected '<fingerprint>/<sample id>', got {key!r}"])
    fingerprint, tail = key.split("/", 1)
    validate_fingerprint(fingerprint)
    sample_id, _ = split_record_id(tail)
    if validate_sample_id(sample_id) != sample_id:
        raise InvalidSampleId(sample_id, "not in Unicode NFC form (keys hold normalised ids)")
    return fingerprint, tail
