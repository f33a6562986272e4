"""A dataset index: the ordered sample ids of one fingerprint and the recipe that
computed them, and its stored form (a checksummed value of the record format, ids packed
as UTF-8 + offsets).

Where samples have variants (a run asked for ``variants=K``), the index also holds how
many each has stored, all of variants ``0 .. n-1`` (``variant_counts``, uint16 per
sample); an index without it (every index written before variants existed, and every
one whose samples have one record each) means one per sample, so it is stored exactly
as before.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any


from cache_store.errors import CorruptRecord, ParameterError, SpcacheError
from cache_store.format.decode import decode_arrays, verified_field
from cache_store.format.encode import encode_tensors
from cache_store.format.header import byte_view, parse_view
from cache_store.format.ids import pack_ids, unpack_ids
from cache_store.keys import (
    canonical_json,
    MAX_VARIANTS,
    compute_fingerprint,
    validate_fingerprint,
    validate_sample_id,
)
import itertools

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "INDEX_KIND",
    "DatasetIndex",
    "IndexPage",
    "append_ids",
    "encode_index",
    "decode_index",
    "index_page",
]

#: The ``kind`` metadata of a stored dataset index.
INDEX_KIND = "spcache.dataset_index"


@dataclass(frozen=True, eq=False)
class DatasetIndex:
    """The ordered sample ids of one fingerprint, with the recipe that computed them.

    ``sample_ids`` is a NumPy unicode array (no per-sample Python objects). The
    constructor validates every id (normalising to NFC), refuses duplicates, and checks
    that ``fingerprint`` is the fingerprint of ``(recipe, recipe_version, params)``.
    ``variants``: how many variants each sample has stored (uint16 ``[n]``, each >= 1),
    or None: one each.
    """

    fingerprint: str
    recipe: str
    recipe_version: int
    params: Mapping[str, Any]
    sample_ids: np.ndarray
    created: str = ""
    variants: np.ndarray | None = None

    def __post_init__(self) -> None:
        import numpy as np

        validate_fingerprint(self.fingerprint)
        expected = compute_fingerprint(self.recipe, self.recipe_version, self.params)
        if expected != self.fingerprint:
            raise ParameterError(
                [
                    (
                        f"fingerprint {self.fingerprint} is not that of recipe "
                        f"{self.recipe!r} v{self.recipe_version} with params "
                        f"{canonical_json(dict(self.params))} ({expected})"
                    )
                ],
                what="dataset index",
            )
        given = self.sample_ids
        raw = given.ravel().tolist() if isinstance(given, np.ndarray) else list(given)
        ids = [validate_sample_id(s) for s in raw]  # refuses non-str ids (no str() coercion)
        seen: set[str] = set()
        for sample_id in ids:
            if sample_id in seen:
                raise ParameterError(
                    [f"sample id {sample_id!r} appears more than once"], what="dataset index"
                )
            seen.add(sample_id)
        object.__setattr__(self, "params", dict(self.params))
        object.__setattr__(
            self, "sample_ids", np.array(ids, dtype=str) if ids else np.array([], dtype="<U1")
        )
        object.__setattr__(self, "variants", _variant_counts(self.variants, len(ids)))
        if not self.created:
            object.__setattr__(
                self, "created", _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
            )

    @classmethod
    def from_trusted(
        cls,
        fingerprint: str,
        recipe: str,
        recipe_version: int,
        params: dict[str, Any],
        sample_ids: np.ndarray,
        created: str,
        variants: np.ndarray | None = None,
    ) -> DatasetIndex:
        """Build without re-validating: for indexes read back from checksummed storage,
        which were validated when written."""
        obj = object.__new__(cls)
        for name, value in (
            ("fingerprint", fingerprint),
            ("recipe", recipe),
            ("recipe_version", recipe_version),
            ("params", params),
            ("sample_ids", sample_ids),
            ("created", created),
            ("variants", _variant_counts(variants, len(sample_ids))),
        ):
            object.__setattr__(obj, name, value)
        validate_fingerprint(fingerprint)
        if compute_fingerprint(recipe, recipe_version, params) != fingerprint:
            raise ValueError("fingerprint does not match recipe and params")
        return obj

    def __len__(self) -> int:
        return len(self.sample_ids)

    def variant_counts(self) -> np.ndarray:
        """How many variants each sample has stored: uint16 ``[n]`` (ones without any)."""
        import numpy as np

        if self.variants is None:
            return np.ones(len(self), dtype=np.uint16)
        return self.variants

    def packed_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """``(blob uint8 [total_bytes], offsets int64 [n + 1])``: the ids in UTF-8, packed."""
        return pack_ids(self.sample_ids.tolist())

    def describe(self) -> dict[str, Any]:
        """JSON-able summary (no ids). ``variants``: how many every sample has at least
        (1 without variants); ``variants_max`` where some have more."""
        out: dict[str, Any] = {
            "fingerprint": self.fingerprint,
            "recipe": self.recipe,
            "recipe_version": self.recipe_version,
            "params": dict(self.params),
            "samples": len(self),
            "created": self.created,
            "variants": 1,
        }
        if self.variants is not None and len(self):
            out["variants"] = int(self.variants.min())
            if int(self.variants.max()) > out["variants"]:
                out["variants_max"] = int(self.variants.max())
        return out


def append_ids(held: Sequence[str], more: Iterable[str]) -> list[str]:
    """The ids of a dataset that gains ``more``: ``held`` in its order, then the ids of
    ``more`` not in it yet, in theirs (ids already indexed never move or vanish). The
    one rule for adding to an index: a run's ledger and an import both call it."""
    known = set(held)
    added = [sid for sid in dict.fromkeys(more) if sid not in known]
    return [*held, *added]


def encode_index(index: DatasetIndex) -> bytes:
    """A dataset index as a checksummed safetensors value (ids packed as UTF-8 + offsets)."""
    blob, offsets = index.packed_ids()
    meta = {
        "kind": INDEX_KIND,
        "fingerprint": index.fingerprint,
        "recipe": index.recipe,
        "recipe_version": str(index.recipe_version),
        "params": canonical_json(dict(index.params)),
        "created": index.created,
    }
    arrays = {"sample_ids_utf8": blob, "sample_id_offsets": offsets}
    if index.variants is not None:
        arrays["variant_counts"] = index.variants
    return encode_tensors(arrays, meta)


def decode_index(value: Any, *, key: str = "") -> DatasetIndex:
    """Inverse of :func:`encode_index`; raises ``CorruptRecord`` naming ``key``."""
    import numpy as np

    arrays, meta = decode_arrays(value, key=key)
    try:
        if meta.get("kind") != INDEX_KIND:
            raise ValueError(f"kind {meta.get('kind')!r} is not a dataset index")
        blob, offsets = arrays["sample_ids_utf8"], arrays["sample_id_offsets"]
        if blob.dtype != np.uint8 or offsets.dtype != np.int64 or offsets.size == 0:
            raise ValueError("unexpected dtypes for sample ids")
        if (
            offsets.ndim != 1
            or offsets[0] != 0
            or offsets[-1] != blob.size
            or np.any(np.diff(offsets) < 0)
        ):
            raise ValueError("sample id offsets do not cover the id bytes")
        params = json.loads(meta["params"])
        if not isinstance(params, dict):
            raise ValueError("params is not a JSON object")
        counts = arrays.get("variant_counts")
        if counts is not None and (
            counts.dtype != np.uint16 or counts.shape != (offsets.size - 1,)
        ):
            raise ValueError("variant counts are not uint16, one per sample")
        return DatasetIndex.from_trusted(
            meta["fingerprint"],
            meta["recipe"],
            int(meta["recipe_version"]),
            params,
            unpack_ids(blob, offsets),
            meta.get("created", ""),
            counts,
        )
    except (KeyError, ValueError, TypeError, SpcacheError) as exc:
        if isinstance(exc, CorruptRecord):
            raise
        raise CorruptRecord(key, f"bad dataset index: {exc}") from None


@dataclass(frozen=True)
class IndexPage:
    """What describes a stored index, and the ids ``offset .. offset + len(sample_ids)``
    of it (``total``: how many it holds)."""

    fingerprint: str
    recipe: str
    recipe_version: int
    params: dict[str, Any]
    created: str
    total: int
    offset: int
    sample_ids: list[str]

    @classmethod
    def of(cls, index: DatasetIndex, offset: int, limit: int) -> IndexPage:
        """The page of an index already decoded."""
        return cls(
            index.fingerprint,
            index.recipe,
            index.recipe_version,
            dict(index.params),
            index.created,
            len(index),
            offset,
            [str(s) for s in index.sample_ids[offset : offset + limit]],
        )


def index_page(value: Any, offset: int, limit: int, *, key: str = "") -> IndexPage:
    """Ids ``offset .. offset + limit`` of a stored index (:func:`encode_index`) without
    building the others: what a view of one page of a million ids needs (the service's
    cache view). The checks are :func:`decode_index`'s: both fields' checksums over their
    stored bytes (no copy), the offsets' ends, and the page's offsets in order; raises
    ``CorruptRecord`` naming ``key``."""
    import numpy as np

    if offset < 0 or limit < 0:
        raise ValueError(f"offset {offset} and limit {limit} must be >= 0")
    view = byte_view(value, key)
    header = parse_view(view, key)
    meta = header.metadata
    try:
        if meta.get("kind") != INDEX_KIND:
            raise ValueError(f"kind {meta.get('kind')!r} is not a dataset index")
        kinds = {name: info.dtype for name, info in header.tensors.items()}
        if kinds.get("sample_ids_utf8") != "U8" or kinds.get("sample_id_offsets") != "I64":
            raise ValueError("unexpected dtypes for sample ids")
        blob = verified_field(view, header, "sample_ids_utf8", key)
        offsets = np.frombuffer(verified_field(view, header, "sample_id_offsets", key), "<i8")
        if offsets.size == 0 or offsets[0] != 0 or offsets[-1] != len(blob):
            raise ValueError("sample id offsets do not cover the id bytes")
        total = offsets.size - 1
        bounds = offsets[min(offset, total) : min(offset + limit, total) + 1].tolist()
        if any(b < a for a, b in itertools.pairwise(bounds)):
            raise ValueError("sample id offsets go backwards")
        ids = [bytes(blob[a:b]).decode("utf-8") for a, b in itertools.pairwise(bounds)]
        params = json.loads(meta["params"])
        if not isinstance(params, dict):
            raise ValueError("params is not a JSON object")
        fingerprint, recipe = meta["fingerprint"], meta["recipe"]
        version = int(meta["recipe_version"])
        validate_fingerprint(fingerprint)
        if compute_fingerprint(recipe, version, params) != fingerprint:
            raise ValueError("fingerprint does not match recipe and params")
    except (KeyError, ValueError, TypeError, UnicodeDecodeError, SpcacheError) as exc:
        if isinstance(exc, CorruptRecord):
            raise
        raise CorruptRecord(key, f"bad dataset index: {exc}") from None
    return IndexPage(
        fingerprint, recipe, version, params, meta.get("created", ""), total, offset, ids
    )


def _variant_counts(counts: Any, n: int) -> np.ndarray | None:
    """``counts`` as uint16 ``[n]``, each in ``1 .. MAX_VARIANTS``; None when absent or
    all ones (one record per sample: the index is stored as before variants)."""
    import numpy as np

    if counts is None:
        return None
    raw = np.asarray(counts)
    if raw.shape != (n,) or (n and (raw.min() < 1 or raw.max() > MAX_VARIANTS)):
        raise ParameterError(
            [f"variants: expected {n} counts from 1 to {MAX_VARIANTS}, got shape {raw.shape}"],
            what="dataset index",
        )
    if not n or int(raw.max()) == 1:
        return None
    return raw.astype(np.uint16)
