"""Records of format 1, as spcache wrote them before record format 2, to build old caches
in tests (format 1's writer, kept here; the readers read both formats).

A format-1 record carries its whole metadata (recipe, parameters, schema, code digest...)
in its own header, and ``field_checksums`` as JSON text ``{name: xxh3_64 hex}``. What
format 2 changed is in :mod:`cache_store.format.descriptor` and ``docs/DESIGN.md``.
Importing this module needs neither pytest nor torch.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import xxhash

from cache_store.format.decode import decode_arrays
from cache_store.format.header import (
    BLANK_CHECKSUM,
    HEADER_LENGTH,
    ITEMSIZE,
    MANAGED_METADATA,
    read_header,
    sign_header,
)

__all__ = ["encode_record_v1", "as_format_1", "metadata_read_back"]

_NAMES = {
    np.dtype("bool"): "BOOL",
    np.dtype("uint8"): "U8",
    np.dtype("int8"): "I8",
    np.dtype("int16"): "I16",
    np.dtype("uint16"): "U16",
    np.dtype("int32"): "I32",
    np.dtype("uint32"): "U32",
    np.dtype("int64"): "I64",
    np.dtype("uint64"): "U64",
    np.dtype("float16"): "F16",
    np.dtype("float32"): "F32",
    np.dtype("float64"): "F64",
}


def encode_record_v1(tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> bytes:
    """The format-1 record of ``tensors`` (NumPy arrays or CPU torch tensors, no
    bfloat16) and ``metadata`` (which keeps every key it is given), byte for byte as the
    format-1 writer made it."""
    meta = dict(metadata)
    meta.setdefault("created", _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds"))
    meta.setdefault("spcache_version", "0.1.0")
    layout = []
    for name, tensor in tensors.items():
        array = tensor if isinstance(tensor, np.ndarray) else tensor.numpy()
        array = array.copy(order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        dtype = _NAMES[array.dtype.newbyteorder("=")]
        layout.append((name, dtype, array.shape, array.reshape(-1).view(np.uint8).tobytes()))
    layout.sort(key=lambda item: (-ITEMSIZE[item[1]], item[0]))
    checksums = {name: xxhash.xxh3_64_hexdigest(buf) for name, _, _, buf in layout}
    meta["format_version"] = "1"
    meta["field_checksums"] = json.dumps(checksums, sort_keys=True, separators=(",", ":"))
    meta["checksum"] = BLANK_CHECKSUM
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, dtype, shape, buf in layout:
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(buf)],
        }
        offset += len(buf)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + HEADER_LENGTH.size) % 8)
    text = sign_header(text)
    return b"".join([HEADER_LENGTH.pack(len(text)), text, *(buf for *_, buf in layout)])


def as_format_1(value: bytes) -> bytes:
    """The record ``encode_record`` returned (``value``, carrying its descriptor), as
    the format-1 writer wrote it: the same tensors, its descriptor's metadata in its own
    header."""
    arrays, own = decode_arrays(value)
    own = {k: v for k, v in own.items() if k not in MANAGED_METADATA}
    return encode_record_v1(arrays, {**value.descriptor.metadata, **own})  # type: ignore[attr-defined]


def metadata_read_back(value: bytes) -> dict[str, str]:
    """What a store's read returns as the metadata of stored ``value``: a format-1
    record's own, a format-2 record's with its descriptor's (which ``encode_record``
    gave it to carry)."""
    own = read_header(value).metadata
    descriptor = getattr(value, "descriptor", None)
    return own if descriptor is None else {**descriptor.metadata, **own}
