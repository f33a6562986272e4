"""The record format's bytes and its one strict header parser.

Why one module: the framing, the dtype tables and the parser are one rule, read on every
record read (every check in one loop, no call per field); apart they would be one
rule in two places.

A record is named CPU tensors plus string metadata, as one safetensors value::

    u64 little-endian N | N bytes of JSON header (space-padded to 8-byte alignment) | data

The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the data section) and holds ``"__metadata__"``, a str -> str map.
Tensors are laid out by decreasing item size, so every buffer is aligned for its dtype.

spcache's metadata adds, besides what the writer describes (sample id, source hash, ...):

``format_version``
    ``"2"`` (records written since the descriptors came; ``"1"`` before, still read). A
    reader meeting another version raises :class:`UnsupportedFormat`.
``field_checksums``
    Each tensor's xxh3_64 (16 hex digits), so decoding a subset of fields hashes only the
    bytes it returns. Format 2: the digests concatenated in the order of the tensors'
    data offsets (no second JSON text to parse); format 1: JSON ``{name: hex}``.
``checksum``
    xxh3_128 hex of the header text exactly as stored, with this entry's own 32 digits
    replaced by zeros. The header pins every field's name, dtype, shape, offsets and hash
    (``field_checksums``) and every metadata value, so the checksum changes whenever any
    byte of the record would. The service uses it as a strong ETag.
``descriptor``
    Format 2 records written by :func:`~cache_store.format.encode.encode_record`: the
    digest of the descriptor holding what the fingerprint's records share (recipe,
    parameters, schema, code digest...; :mod:`cache_store.format.descriptor`), which a
    format 1 record carried in its own header. A record without one names its
    ``fingerprint`` itself.

This module holds the dtype tables, the framing, the header checksum rule and the only
header parser (:func:`parse_view`, reached through :func:`read_header`,
:func:`parse_stored_header`, :func:`read_metadata`, :func:`record_checksum`): any
malformed value raises :class:`CorruptRecord` naming the key, never another exception
type. Writing records is :mod:`cache_store.format.encode`; reading their tensors and the
whole-record check are :mod:`cache_store.format.decode`.

Why one module: the parser, the checksum rule and the key a header names are read
together on every record read; split, each read would cross modules for one header.
"""

from __future__ import annotations

import functools
import json
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import xxhash

from cache_store.errors import CorruptRecord, UnsupportedFormat

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "FIELD_CHECKSUM_HEX",
    "REQUIRED_METADATA",
    "MANAGED_METADATA",
    "MAX_HEADER_BYTES",
    "DTYPES",
    "ITEMSIZE",
    "numpy_dtypes",
    "TORCH_DTYPES",
    "HEADER_LENGTH",
    "BLANK_CHECKSUM",
    "STRICT_DECODER",
    "field_checksums_text",
    "TensorInfo",
    "RecordHeader",
    "torch_dtype",
    "sign_header",
    "byte_view",
    "parse_view",
    "parse_stored_header",
    "read_header",
    "read_own_metadata",
    "read_metadata",
    "record_checksum",
    "record_etag",
    "metadata_key",
    "metadata_record_id",
    "check_names_key",
]

FORMAT_VERSION = "2"
#: Every record format version this reader reads (writers write :data:`FORMAT_VERSION`).
READABLE_VERSIONS = ("1", "2")
#: Metadata a record must describe itself with (``created`` and ``spcache_version`` are
#: filled in by :func:`~cache_store.format.encode.encode_record` when absent).
REQUIRED_METADATA = (
    "recipe",
    "recipe_version",
    "fingerprint",
    "sample_id",
    "source_hash",
    "backend",
    "device",
    "created",
    "spcache_version",
)
#: Metadata the format itself writes (callers may not set it).
MANAGED_METADATA = ("format_version", "checksum", "field_checksums", "descriptor")
#: Hex digits of one field's checksum (xxh3_64).
FIELD_CHECKSUM_HEX = 16
#: Largest header accepted (the safetensors reference reader uses the same bound).
MAX_HEADER_BYTES = 100 * 1024 * 1024

#: safetensors dtype name -> torch dtype name (every dtype the recipes use, and the rest
#: that both sides know). torch is imported only to build tensors, so reading headers,
#: checksums and re-encoding subsets (what the service does) needs no torch.
DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
}
#: safetensors dtype name -> bytes per item.
ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "U16": 2,
    "I32": 4,
    "U32": 4,
    "I64": 8,
    "U64": 8,
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "F64": 8,
}


@functools.cache
def numpy_dtypes() -> dict[str, np.dtype[Any]]:
    """Safetensors dtype name -> NumPy dtype (``BF16`` has none). A function, not a
    constant, so that NumPy loads where a record's tensors are touched, not where a
    header is read (``spcache ls``/``stats`` never load it)."""
    import numpy as np

    return {k: np.dtype(v) for k, v in DTYPES.items() if k != "BF16"}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (``"F32"`` -> ``torch.float32``)."""
    import torch

    return getattr(torch, DTYPES[name])


class _TorchDtypes(dict[str, Any]):
    """safetensors name -> torch dtype, filled on first use (torch stays unimported until
    a tensor is built)."""

    def __missing__(self, name: str) -> Any:
        self[name] = dtype = torch_dtype(name)
        return dtype


TORCH_DTYPES = _TorchDtypes()


#: The u64 little-endian length that opens a record (and an HTTP batch, see
#: :mod:`cache_store.format.wire`): the one definition of that framing.
HEADER_LENGTH = struct.Struct("<Q")

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    raise ImportError(
        "cache_store.format.header reads little-endian buffers in place; this host is big-endian"
    )


class TensorInfo(NamedTuple):
    """Where one tensor lies in a record: dtype name, shape, absolute byte range.

    Immutable (a named tuple: built for every field of every read, so it must be cheap).
    """

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class RecordHeader:
    """A validated header: metadata, tensor layout, and where the data section starts."""

    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    field_checksums: dict[str, str]
    data_start: int

    @property
    def checksum(self) -> str:
        return self.metadata["checksum"]


_CHECKSUM_TAG = b'"checksum":"'
_CHECKSUM_HEX = 32
BLANK_CHECKSUM = "0" * _CHECKSUM_HEX


def _checksum_slot(text: bytes) -> int:
    """Offset of the checksum's 32 hex digits in a header text; ValueError if not exactly one.

    In JSON text an unescaped ``"checksum":"`` can only be the metadata key itself (a
    quote inside a string is always escaped, and a tensor entry is an object).
    """
    first = text.find(_CHECKSUM_TAG)
    if first < 0 or text.find(_CHECKSUM_TAG, first + 1) >= 0:
        raise ValueError("header must hold exactly one checksum entry")
    at = first + len(_CHECKSUM_TAG)
    if text[at + _CHECKSUM_HEX : at + _CHECKSUM_HEX + 1] != b'"':
        raise ValueError("checksum entry is not 32 characters")
    return at


def _header_digest(text: bytes, at: int) -> str:
    blank = b"".join([text[:at], BLANK_CHECKSUM.encode(), text[at + _CHECKSUM_HEX :]])
    return xxhash.xxh3_128_hexdigest(blank)


def sign_header(text: bytes) -> bytes:
    """Fill in the record checksum: xxh3_128 of the header text with its slot zeroed."""
    at = _checksum_slot(text)
    return b"".join([text[:at], _header_digest(text, at).encode(), text[at + _CHECKSUM_HEX :]])


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # dict() and len() run in C: far cheaper per object than a Python loop over pairs
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate JSON key {k!r}")
            seen.add(k)
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


# One decoder for every read (``json.loads`` with hooks builds a new decoder and scanner
# per call). Stateless between calls, so safe to share across threads.
_STR_ONLY = {str}  # ``set(map(type, values)) <= _STR_ONLY``: all str, checked in C
STRICT_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_reject_constant)

try:  # a C parser ~4x faster than json with the hook above (an optional speed-up)
    import orjson as FAST_JSON
except ImportError:  # pragma: no cover - a listed dependency; the strict parser serves
    FAST_JSON = None  # type: ignore[assignment]  # None stands for "not installed"


def _loads(text: bytes) -> Any:
    """A header (or its ``field_checksums``) parsed exactly as :data:`STRICT_DECODER` parses it.

    Fast path: orjson parses, and the result is accepted only if serialising it again
    gives back the very text (trailing padding aside). Every record this package writes
    is in that canonical form (compact ``json.dumps``; ASCII). Any other text (spaces,
    escapes, non-ASCII, a constant, an int past 64 bits, a duplicate key, which the
    parsed dict would have lost) takes the strict parser, which gives the answer and the
    error. The fast path therefore accepts nothing the strict one refuses.
    """
    if FAST_JSON is not None:
        try:
            parsed = FAST_JSON.loads(text)
        except FAST_JSON.JSONDecodeError:
            pass
        else:
            if FAST_JSON.dumps(parsed) == text.rstrip(b" "):
                return parsed
    return STRICT_DECODER.decode(text.decode("utf-8"))


def _parse_tensor_info(
    key: str, name: str, entry: object, data_len: int, data_start: int
) -> TensorInfo:
    # ``type(x) is int`` on purpose: JSON gives int, and it refuses bool. Written as
    # plain loops: this runs for every field of every record read.
    if type(entry) is not dict or len(entry) != 3:
        raise CorruptRecord(
            key, f"tensor {name!r}: header entry must have exactly dtype, shape, data_offsets"
        )
    try:
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    except KeyError:
        raise CorruptRecord(
            key, f"tensor {name!r}: header entry must have exactly dtype, shape, data_offsets"
        ) from None
    itemsize = ITEMSIZE.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        raise CorruptRecord(key, f"tensor {name!r}: unknown dtype {dtype!r}")
    if type(shape) is not list:
        raise CorruptRecord(key, f"tensor {name!r}: shape must be a list of non-negative ints")
    numel = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise CorruptRecord(key, f"tensor {name!r}: shape must be a list of non-negative ints")
        numel *= d
    if type(offsets) is not list or len(offsets) != 2:
        raise CorruptRecord(key, f"tensor {name!r}: data_offsets must be two ints")
    begin, end = offsets
    if type(begin) is not int or type(end) is not int:
        raise CorruptRecord(key, f"tensor {name!r}: data_offsets must be two ints")
    if not 0 <= begin <= end <= data_len:
        raise CorruptRecord(
            key, f"tensor {name!r}: data_offsets {offsets} outside the {data_len}-byte data section"
        )
    if numel * itemsize != end - begin:
        raise CorruptRecord(
            key,
            f"tensor {name!r}: {dtype} x {shape} needs {numel * itemsize} "
            f"bytes, offsets give {end - begin}",
        )
    return TensorInfo(dtype, tuple(shape), data_start + begin, data_start + end)


def byte_view(value: Any, key: str) -> memoryview:
    """``value`` as a flat byte memoryview; ``CorruptRecord`` when it is not bytes-like."""
    try:
        view = memoryview(value)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except TypeError:
        raise CorruptRecord(
            key, f"expected a contiguous bytes-like value, got {type(value).__name__}"
        ) from None


def parse_view(view: memoryview, key: str) -> RecordHeader:
    """The checked header of a whole record value (a :func:`byte_view`)."""
    total = view.nbytes
    if total < HEADER_LENGTH.size:
        raise CorruptRecord(key, f"{total} bytes: too short for a header length")
    (n,) = HEADER_LENGTH.unpack_from(view, 0)
    if n < 2 or n > MAX_HEADER_BYTES or n > total - HEADER_LENGTH.size:
        raise CorruptRecord(key, f"header length {n} does not fit a {total}-byte value")
    return parse_text(bytes(view[HEADER_LENGTH.size : HEADER_LENGTH.size + n]), total, key)


def parse_stored_header(text: bytes, data_len: int, *, key: str = "") -> RecordHeader:
    """The header of a record stored in parts (a snapshot keeps each record's header
    text apart from its fields): ``text`` is the header as it follows the length prefix,
    ``data_len`` the bytes of its fields where they are stored. Checked as
    :func:`read_header` checks a whole value (JSON, metadata, checksum, and that the
    fields tile exactly ``data_len`` bytes)."""
    if len(text) < 2 or len(text) > MAX_HEADER_BYTES:
        raise CorruptRecord(key, f"header length {len(text)} out of range")
    return parse_text(bytes(text), HEADER_LENGTH.size + len(text) + int(data_len), key)


def parse_text(raw: bytes, total: int, key: str) -> RecordHeader:
    n = len(raw)
    header, meta, version = _checked_json(raw, key)
    data_start = HEADER_LENGTH.size + n
    tensors, in_order = _tensor_infos(key, header, total - data_start, data_start)
    if version == "1":
        checksums = _parse_field_checksums_v1(key, meta, tensors)
    else:
        checksums = _parse_field_checksums(key, meta, tensors, in_order)
    return RecordHeader(meta, tensors, checksums, data_start)


def read_own_metadata(value: Any, *, key: str = "") -> dict[str, str]:
    """The metadata a record's header holds itself (a format-2 record's without its
    descriptor's), its header checked as :func:`read_header` checks it (framing, JSON,
    version, the header checksum over metadata and field table) but its field table not
    taken apart: what deciding whether a stored record is current needs, at a third of
    a whole header's parse. Raises as :func:`read_header`."""
    view = byte_view(value, key)
    total = view.nbytes
    if total < HEADER_LENGTH.size:
        raise CorruptRecord(key, f"{total} bytes: too short for a header length")
    (n,) = HEADER_LENGTH.unpack_from(view, 0)
    if n < 2 or n > MAX_HEADER_BYTES or n > total - HEADER_LENGTH.size:
        raise CorruptRecord(key, f"header length {n} does not fit a {total}-byte value")
    raw = bytes(view[HEADER_LENGTH.size : HEADER_LENGTH.size + n])
    return _checked_json(raw, key)[1]


def _checked_json(raw: bytes, key: str) -> tuple[dict[str, Any], dict[str, str], str]:
    """``(header without __metadata__, metadata, format version)`` of a header's text,
    its JSON, metadata, version and header checksum checked."""
    if raw[:1] != b"{":
        raise CorruptRecord(key, "header does not start with '{'")
    try:
        header = _loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CorruptRecord(key, f"header is not valid JSON: {exc}") from None
    if type(header) is not dict:
        raise CorruptRecord(key, "header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if type(meta) is not dict or not set(map(type, meta.values())) <= _STR_ONLY:
        raise CorruptRecord(key, "header has no '__metadata__' map of str -> str")
    version = meta.get("format_version")
    if version not in READABLE_VERSIONS:
        raise UnsupportedFormat(
            key,
            f"format_version {version!r} is not supported (this reader knows "
            f"{', '.join(map(repr, READABLE_VERSIONS))})",
        )
    try:
        at = _checksum_slot(raw)
    except ValueError as exc:
        raise CorruptRecord(key, str(exc)) from None
    stored = raw[at : at + _CHECKSUM_HEX].decode("ascii", "replace")
    if meta.get("checksum") != stored or _header_digest(raw, at) != stored:
        raise CorruptRecord(key, "header checksum mismatch (metadata or layout altered)")
    return header, meta, version


def _tensor_infos(
    key: str, header: Mapping[str, Any], data_len: int, data_start: int
) -> tuple[dict[str, TensorInfo], bool]:
    """Every tensor entry of a parsed header, checked as :func:`_parse_tensor_info` and
    :func:`_check_layout` check them, in one loop with no call per field: this runs for
    every record read. An entry that fails any check goes to ``_parse_tensor_info``,
    which raises naming what is wrong; fields that are not in data order (a writer other
    than this package's) go to ``_check_layout``. Returns the entries and whether they
    were listed in data order."""
    tensors = {}
    itemsizes = ITEMSIZE
    position = 0  # where the next field must begin for the fields to be in order
    in_order = True
    for name, entry in header.items():
        if type(entry) is dict and len(entry) == 3:
            dtype, shape, offsets = (
                entry.get("dtype"),
                entry.get("shape"),
                entry.get("data_offsets"),
            )
            itemsize = itemsizes.get(dtype) if type(dtype) is str else None
            if itemsize and type(shape) is list and type(offsets) is list and len(offsets) == 2:
                begin, end = offsets
                if type(begin) is int and type(end) is int and 0 <= begin <= end <= data_len:
                    numel = 1
                    for d in shape:
                        if type(d) is not int or d < 0:
                            break
                        numel *= d
                    else:
                        if numel * itemsize == end - begin:
                            tensors[name] = TensorInfo(
                                cast(str, dtype), tuple(shape), data_start + begin, data_start + end
                            )
                            in_order = in_order and begin == position
                            position = end
                            continue
        _parse_tensor_info(key, name, entry, data_len, data_start)  # raises: says what is wrong
        raise CorruptRecord(key, f"tensor {name!r}: malformed header entry")  # (the checks agree)
    if not (in_order and position == data_len):
        _check_layout(key, tensors, data_start, data_start + data_len)
    return tensors, in_order


def _begin_of(item: tuple[str, TensorInfo]) -> tuple[int, int]:
    return item[1][2], item[1][3]


def _check_layout(key: str, tensors: Mapping[str, TensorInfo], data_start: int, total: int) -> None:
    position = data_start
    for name, (_, _, begin, end) in sorted(tensors.items(), key=_begin_of):
        if begin != position:
            what = "overlaps the previous one" if begin < position else "leaves a gap"
            raise CorruptRecord(key, f"tensor {name!r} {what} (data must be contiguous)")
        position = end
    if position != total:
        raise CorruptRecord(
            key,
            f"data section is {total - data_start} bytes, tensors cover {position - data_start}",
        )


def _parse_field_checksums(
    key: str, meta: Mapping[str, str], tensors: Mapping[str, TensorInfo], in_order: bool
) -> dict[str, str]:
    """Format 2: one 16-digit checksum per tensor, concatenated in data order (by data
    offsets; fields at one offset are empty, and empty fields' checksums are equal)."""
    text = meta.get("field_checksums")
    if type(text) is not str or len(text) != FIELD_CHECKSUM_HEX * len(tensors):
        raise CorruptRecord(key, "metadata 'field_checksums' does not hold one checksum per tensor")
    names = list(tensors) if in_order else [n for n, _ in sorted(tensors.items(), key=_begin_of)]
    step = FIELD_CHECKSUM_HEX
    return {name: text[i * step : i * step + step] for i, name in enumerate(names)}


def _parse_field_checksums_v1(
    key: str, meta: Mapping[str, str], tensors: Mapping[str, TensorInfo]
) -> dict[str, str]:
    try:
        checksums = _loads(meta.get("field_checksums", "").encode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CorruptRecord(key, f"metadata 'field_checksums' is not valid JSON: {exc}") from None
    if (
        type(checksums) is not dict
        or checksums.keys() != tensors.keys()
        or not set(map(type, checksums.values())) <= _STR_ONLY
    ):
        raise CorruptRecord(
            key, "metadata 'field_checksums' does not list exactly the record's tensors"
        )
    return checksums


def field_checksums_text(checksums_in_data_order: list[str]) -> str:
    """The format-2 ``field_checksums`` value of a record's tensors' checksums, given in
    the order of their data offsets."""
    return "".join(checksums_in_data_order)


def read_header(value: Any, *, key: str = "") -> RecordHeader:
    """Parse and validate a record's header without touching its data section.

    Raises:
        CorruptRecord: on any malformed header, layout or checksum of the header.
        UnsupportedFormat: on a ``format_version`` other than :data:`FORMAT_VERSION`.
    """
    return parse_view(byte_view(value, key), key)


def read_metadata(value: Any, *, key: str = "") -> dict[str, str]:
    """The metadata of a record (validated header, data not read)."""
    return dict(parse_view(byte_view(value, key), key).metadata)


def record_checksum(value: Any, *, key: str = "") -> str:
    """The record checksum (xxh3_128 hex), usable as a strong ETag; header-only read."""
    return parse_view(byte_view(value, key), key).checksum


def record_etag(value: Any, *, key: str = "") -> str:
    """The record's strong HTTP ETag: its checksum, quoted (the service answers it, a
    reader's local copy is named by it), from the strictly parsed header (a damaged one
    raises :class:`CorruptRecord`); the fields are not hashed here, readers check them."""
    return f'"{record_checksum(value, key=key)}"'


def metadata_key(metadata: Mapping[str, str]) -> str:
    """The key a record's metadata names: ``"<fingerprint>/<record id>"``."""
    return f"{metadata.get('fingerprint')}/{metadata_record_id(metadata)}"


def metadata_record_id(metadata: Mapping[str, str]) -> str:
    """The sample id, with ``#v<variant>`` for a variant's record (``keys.record_id``)."""
    variant, sample_id = metadata.get("variant"), metadata.get("sample_id")
    return f"{sample_id}" if variant is None else f"{sample_id}#v{variant}"


def check_names_key(metadata: Mapping[str, str], key: str) -> None:
    """Raise ``CorruptRecord`` naming ``key`` unless the metadata names that key."""
    named = metadata_key(metadata)
    if named != key:
        raise CorruptRecord(key, f"record metadata names {named}")
