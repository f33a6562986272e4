"""Records of format 1, as spcache wrote them before the descriptors came (the writer of
that format, kept here to build old caches in tests; ``tests/data/records_v1/`` holds
records the real engine wrote in that format).

A format-1 record carries its whole metadata (recipe, parameters, schema, code digest...)
in its own header, and ``field_checksums`` as JSON text ``{name: xxh3_64 hex}``.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from cache_store.format.header import BLANK_CHECKSUM, HEADER_LENGTH, ITEMSIZE, sign_header

__all__ = ["encode_record_v1", "GOLDEN_V1", "golden_v1_records"]

#: Records the engine wrote in format 1 (spcache precompute --recipe spc --param level=3
#: over 64-point clouds, at commit e541b9c), with their sources.
GOLDEN_V1 = Path(__file__).resolve().parent.parent / "data" / "records_v1"

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
    """The format-1 record of ``tensors`` (torch or NumPy, no bfloat16) and ``metadata``
    (which keeps every key it is given), byte for byte as the format-1 writer made it."""
    meta = dict(metadata)
    meta.setdefault("created", _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds"))
    meta.setdefault("spcache_version", "0.1.0")
    layout = []
    for name, tensor in tensors.items():
        array = tensor.numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)
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


def golden_v1_records() -> dict[str, bytes]:
    """The golden format-1 records: key -> the bytes the engine wrote."""
    keys = json.loads((GOLDEN_V1 / "keys.json").read_text())["records"]
    return {key: (GOLDEN_V1 / f"{name}.safetensors").read_bytes() for name, key in keys.items()}
