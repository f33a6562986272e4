"""Writing records: tensors (torch or NumPy) and metadata to the bytes of
:mod:`cache_store.format.header` (format 2: what the fingerprint's records share goes to
their descriptor, :mod:`cache_store.format.descriptor`), re-encoding a subset of a stored
record's fields, and rewriting a format-1 record as format 2."""

from __future__ import annotations

import datetime as _dt
import functools
import json
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import xxhash

from cache_store.errors import CorruptRecord, ParameterError
from cache_store.format.decode import selected_fields, verified_field
from cache_store.format.descriptor import Descriptor, make_descriptor, split_metadata
from cache_store.version import __version__
from cache_store.format.header import (
    BLANK_CHECKSUM,
    DTYPES,
    FORMAT_VERSION,
    HEADER_LENGTH,
    ITEMSIZE,
    MANAGED_METADATA,
    numpy_dtypes,
    REQUIRED_METADATA,
    byte_view,
    check_names_key,
    field_checksums_text,
    read_header,
    sign_header,
)

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "EncodedRecord",
    "encode_record",
    "encode_tensors",
    "select_fields",
    "assemble_record",
    "upgrade_record",
]


class EncodedRecord(bytes):
    """A record's bytes as :func:`encode_record` returns them, carrying the descriptor
    the record names (``descriptor``): a store given the record (``put_many``) writes
    that descriptor in the same commit when it does not hold it yet. Compares, hashes
    and slices as the plain bytes it is; ``bytes(record)`` drops the descriptor."""

    descriptor: Descriptor

    def __new__(cls, value: bytes, descriptor: Descriptor) -> EncodedRecord:
        record = super().__new__(cls, value)
        record.descriptor = descriptor
        return record


_FROM_TORCH = {f"torch.{v}": k for k, v in DTYPES.items()}


@functools.cache
def _from_numpy() -> dict[Any, str]:
    """NumPy dtype -> safetensors dtype name."""
    return {v: k for k, v in numpy_dtypes().items()}


def _bad(name: str, problem: str) -> ParameterError:
    return ParameterError([f"{name}: {problem}"], what="record tensors")


def _numpy_bytes_view(name: str, array: np.ndarray) -> tuple[str, tuple[int, ...], memoryview]:
    import numpy as np

    dtype = _from_numpy().get(array.dtype.newbyteorder("="))
    if dtype is None:
        raise _bad(name, f"numpy dtype {array.dtype} has no safetensors name here")
    array = np.ascontiguousarray(array, dtype=numpy_dtypes()[dtype])  # native order
    return dtype, tuple(array.shape), array.reshape(-1).view(np.uint8).data


def _as_bytes_view(name: str, tensor: Any) -> tuple[str, tuple[int, ...], memoryview]:
    import numpy as np

    if isinstance(tensor, np.ndarray):
        return _numpy_bytes_view(name, tensor)
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(tensor, torch.Tensor):
        raise _bad(name, f"expected a torch.Tensor or numpy array, got {type(tensor).__name__}")
    # Every record's every tensor passes here: few torch calls (each costs ~1 us).
    if not tensor.is_cpu:
        raise _bad(name, f"tensor is on {tensor.device}; move it to the CPU before encoding")
    if tensor.layout is not torch.strided:
        raise _bad(name, "only dense real tensors can be stored")
    dtype = _FROM_TORCH.get(str(tensor.dtype))  # complex and quantized have no name here
    if dtype is None:
        if tensor.is_complex() or tensor.is_quantized:
            raise _bad(name, "only dense real tensors can be stored")
        raise _bad(
            name,
            f"dtype {tensor.dtype} has no safetensors name here "
            f"(known: {', '.join(DTYPES.values())})",
        )
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if dtype == "BF16":  # no NumPy dtype: bytes through torch
        return dtype, tuple(tensor.shape), memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    array = tensor.numpy()
    return dtype, array.shape, memoryview(array.reshape(-1).view(np.uint8))


def assemble_record(
    layout: list[tuple[str, str, tuple[int, ...], Any]],
    field_checksums: Mapping[str, str],
    metadata: Mapping[str, str],
    descriptor: str | None = None,
) -> bytes:
    """``layout``: (name, dtype, shape, bytes-like) in the order to write them;
    ``descriptor``: the digest of the descriptor the record names, if it names one."""
    meta = dict(metadata)
    if descriptor is not None:
        meta["descriptor"] = descriptor
    meta["format_version"] = FORMAT_VERSION
    meta["field_checksums"] = field_checksums_text([field_checksums[n] for n, *_ in layout])
    meta["checksum"] = BLANK_CHECKSUM
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, dtype, shape, buf in layout:
        size = len(buf)
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + HEADER_LENGTH.size) % 8)
    text = sign_header(text)
    return b"".join([HEADER_LENGTH.pack(len(text)), text, *(buf for *_, buf in layout)])


def _check_metadata(metadata: Mapping[str, str], required: Iterable[str]) -> dict[str, str]:
    problems = [
        f"metadata {k!r}: keys and values must be str, got {type(v).__name__}"
        for k, v in metadata.items()
        if not isinstance(k, str) or not isinstance(v, str)
    ]
    problems += [
        f"metadata {k!r}: set by the record format, not by callers"
        for k in metadata
        if k in MANAGED_METADATA
    ]
    problems += [f"metadata {k!r}: required" for k in required if k not in metadata]
    if problems:
        raise ParameterError(problems, what="record metadata")
    return dict(metadata)


def encode_tensors(
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
    *,
    descriptor: str | None = None,
) -> bytes:
    """Encode tensors with free-form str -> str metadata (no required keys).

    The building block of :func:`encode_record`, also used for dataset indexes.
    """
    meta = _check_metadata(metadata or {}, ())
    prepared = []
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ParameterError(
                [(f"tensor name {name!r}: must be a non-empty str other than '__metadata__'")],
                what="record tensors",
            )
        prepared.append((name, *_as_bytes_view(name, tensor)))
    # Largest item size first, then by name: every buffer starts aligned for its dtype.
    prepared.sort(key=lambda item: (-ITEMSIZE[item[1]], item[0]))
    checksums = {name: xxhash.xxh3_64_hexdigest(buf) for name, _, _, buf in prepared}
    return assemble_record(prepared, checksums, meta, descriptor)


def encode_record(tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> EncodedRecord:
    """Encode one record (format 2).

    Args:
        tensors: name -> CPU ``torch.Tensor`` (or numpy array) of any dtype in
            :data:`DTYPES` and any shape, 0-d and empty included.
        metadata: str -> str; must hold :data:`REQUIRED_METADATA` except ``created``
            (default: now, UTC, ISO 8601) and ``spcache_version`` (default: this
            package's). ``format_version``, ``checksum``, ``field_checksums`` and
            ``descriptor`` are added here and may not be given.

    Returns:
        EncodedRecord: the safetensors-format value, holding the metadata that is the
        record's own (:data:`~cache_store.format.descriptor.DESCRIPTOR_METADATA` aside)
        and the digest of the descriptor holding the rest, which it carries
        (``.descriptor``) for the store that will keep both.

    Raises:
        ParameterError: on a non-CPU tensor, unknown dtype, bad name or bad metadata.
    """
    meta = dict(metadata)
    if "created" not in meta:
        meta["created"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")
    if "spcache_version" not in meta:
        meta["spcache_version"] = __version__
    _check_metadata(meta, REQUIRED_METADATA)
    shared, own = split_metadata(meta)
    try:
        descriptor = make_descriptor(shared)
    except ValueError as exc:
        raise ParameterError([f"metadata 'fingerprint': {exc}"], what="record metadata") from None
    return EncodedRecord(encode_tensors(tensors, own, descriptor=descriptor.digest), descriptor)


def select_fields(value: Any, fields: Iterable[str], *, key: str = "") -> bytes:
    """Re-encode a record keeping only ``fields`` (raw bytes copied, no tensors built).

    The kept fields' bytes are verified against their checksums; the metadata is carried
    over (the descriptor digest too), with ``field_checksums`` and ``checksum``
    recomputed for the subset (so the subset has its own strong ETag). A subset is
    written in the current format. Raises as :func:`decode_record`.
    """
    header = read_header(value, key=key)
    view = byte_view(value, key)
    names = selected_fields(header, fields, key)
    layout = []
    for name in names:
        info = header.tensors[name]
        layout.append((name, info.dtype, info.shape, verified_field(view, header, name, key)))
    layout.sort(key=lambda item: (-ITEMSIZE[item[1]], item[0]))
    meta = {k: v for k, v in header.metadata.items() if k not in MANAGED_METADATA}
    return assemble_record(layout, header.field_checksums, meta, header.metadata.get("descriptor"))


def upgrade_record(value: Any, *, key: str) -> EncodedRecord | None:
    """A format-1 record rewritten as format 2 (None: ``value`` is format 2 already).

    The fields' bytes are copied as they are (each verified against its checksum first)
    and keep their order; the metadata is split as :func:`encode_record` splits it, so
    the record read back with its descriptor has the same tensors and the same metadata
    (the format's own entries aside). Raises ``CorruptRecord`` naming ``key`` for a
    record that does not check out or names another key.
    """
    header = read_header(value, key=key)
    if header.metadata.get("format_version") != "1":
        return None
    check_names_key(header.metadata, key)
    view = byte_view(value, key)
    layout = []
    for name, info in sorted(header.tensors.items(), key=lambda item: item[1][2:]):
        layout.append((name, info.dtype, info.shape, verified_field(view, header, name, key)))
    meta = {k: v for k, v in header.metadata.items() if k not in MANAGED_METADATA}
    shared, own = split_metadata(meta)
    try:
        descriptor = make_descriptor(shared)
    except ValueError as exc:
        raise CorruptRecord(key, f"cannot be rewritten: {exc}") from None
    return EncodedRecord(
        assemble_record(layout, header.field_checksums, own, descriptor.digest), descriptor
    )
