"""The layout of a Zarr v3 snapshot: shared by the exporter (writes it) and the reader.

A snapshot is a Zarr v3 hierarchy (a local ``*.zarr`` directory or any fsspec URL)::

    DEST.zarr/                     root group; attrs["spcache"]: kind, format_version
      <fingerprint>/               one group per exported fingerprint; attrs["spcache"]:
                                   recipe, params, field schema, digests, ``complete``
        sample_ids                 uint8   [id bytes]      ids in index order, UTF-8
        sample_id_offsets          int64   [n + 1]
        headers                    uint8   [header bytes]  each record's safetensors
        header_offsets             int64   [n + 1]         header (metadata, field checksums)
        data/<field>               <dtype> [rows, *trailing]  the records' tensors,
                                   concatenated along the first axis (0-d: one row each)
        offsets/<field>            int64   [n + 1]         rows of record i: [o[i], o[i+1])

Every chunk is blosc-zstd compressed and ends in a CRC-32C (flipped bytes raise on
read). Sample ids and field names are *data*, never store keys; only fingerprints (32
hex chars) and validated field names name nodes.

Neither :mod:`cache_store.snapshot.zarr.export` nor :mod:`cache_store.snapshot.zarr.store` defines any of these
names; both import them from here. No zarr import: this module is constants and checks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np
import xxhash

from cache_store.errors import ParameterError

__all__ = [
    "ATTRS_KEY",
    "FIELD_NAME_PATTERN",
    "SNAPSHOT_FORMAT_VERSION",
    "SNAPSHOT_KIND",
    "SNAPSHOT_ROOT_KIND",
    "array_digest",
    "records_digest",
    "validate_field_name",
]

#: The attribute (of the root and of each fingerprint group) holding spcache's metadata.
ATTRS_KEY = "spcache"
SNAPSHOT_ROOT_KIND = "spcache.snapshot_root"
SNAPSHOT_KIND = "spcache.snapshot"
#: Layout version of a fingerprint group; a reader meeting another raises UnsupportedFormat.
SNAPSHOT_FORMAT_VERSION = 1
#: Field (tensor) names that may name a Zarr node: no slashes, dots or leading "__".
FIELD_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,127}")


def validate_field_name(name: str) -> str:
    """``name`` if it may become a Zarr node name, else ``ParameterError``."""
    if not isinstance(name, str) or not FIELD_NAME_PATTERN.fullmatch(name):
        raise ParameterError(
            [(f"field {name!r}: snapshot field names must match {FIELD_NAME_PATTERN.pattern}")],
            what="snapshot fields",
        )
    return name


def array_digest(array: np.ndarray) -> str:
    """xxh3_64 hex of an array's bytes (C order), as kept in a snapshot's attributes."""
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data)


def records_digest(checksums: Iterable[str]) -> str:
    """xxh3_128 hex over the records' checksums in index order (one per line)."""
    return xxhash.xxh3_128_hexdigest("\n".join(checksums).encode("ascii"))
