"""The record format: named CPU tensors plus string metadata, as one safetensors value.

Layout (the safetensors format, so any safetensors reader opens a record)::

    u64 little-endian N | N bytes of JSON header (space-padded to 8-byte alignment) | data

The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the data section) and holds ``"__metadata__"``, a str -> str map.
Tensors are laid out by decreasing item size, so every buffer is aligned for its dtype.

spcache's metadata adds, besides what the writer describes (recipe, fingerprint, sample
id, source hash, ...):

``format_version``
    ``"1"``. A reader meeting another version raises :class:`UnsupportedFormat`.
``field_checksums``
    JSON ``{name: xxh3_64 hex}`` of each tensor's bytes, so decoding a subset of fields
    hashes only the bytes it returns.
``checksum``
    xxh3_128 hex of the header text exactly as stored, with this entry's own 32 digits
    replaced by zeros. The header pins every field's name, dtype, shape, offsets and hash
    (``field_checksums``) and every metadata value, so the checksum changes whenever any
    byte of the record would. The service uses it as a strong ETag.

Decoding parses the header with strict validation; any malformed value raises
:class:`CorruptRecord` naming the key, never another exception type.

(Past the ~600-line mark on purpose: this is the one definition of the record's bytes,
encoder, strict decoder and the small helpers every store and the service share about
those bytes (header length, checksum peek, key check, packed ids). Splitting encoder
from decoder would put the checksum rules in two places. The batch decoder
``decode_records`` stays too: it and ``decode_record`` (which takes the batch path inside
a DataLoader worker) share one copy-and-verify pass over the parsed header, the dtype
tables and the error rules, so a separate module would import half of this one back and
be imported by it. Where a batch's memory comes from, which knows nothing of the format,
is :mod:`cache_store.format.buffers`.)
"""

from __future__ import annotations

import datetime as _dt
import json
import struct
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import xxhash

from cache_store.format.buffers import allocate, in_dataloader_worker
from cache_store.errors import CorruptRecord, ParameterError, UnknownName, UnsupportedFormat

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMAT_VERSION",
    "REQUIRED_METADATA",
    "DTYPES",
    "Record",
    "RecordHeader",
    "TensorInfo",
    "encode_record",
    "encode_tensors",
    "decode_record",
    "decode_records",
    "decode_filled",
    "parse_stored_header",
    "decode_arrays",
    "check_record",
    "torch_dtype",
    "read_header",
    "read_metadata",
    "record_checksum",
    "select_fields",
    "HEADER_LENGTH",
    "peek_checksum",
    "metadata_key",
    "check_names_key",
    "pack_ids",
    "unpack_ids",
]

FORMAT_VERSION = "1"
#: Metadata a record must describe itself with (``created`` and ``spcache_version`` are
#: filled in by :func:`encode_record` when absent).
REQUIRED_METADATA = ("recipe", "recipe_version", "fingerprint", "sample_id", "source_hash",
                     "backend", "device", "created", "spcache_version")
_MANAGED = ("format_version", "checksum", "field_checksums")
#: Largest header accepted (the safetensors reference reader uses the same bound).
MAX_HEADER_BYTES = 100 * 1024 * 1024

#: safetensors dtype name -> torch dtype name (every dtype the recipes use, and the rest
#: that both sides know). torch is imported only to build tensors, so reading headers,
#: checksums and re-encoding subsets (what the service does) needs no torch.
DTYPES: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64",
}
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8,
             "U64": 8, "F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_FROM_TORCH = {f"torch.{v}": k for k, v in DTYPES.items()}
_NUMPY_DTYPES = {k: np.dtype(v) for k, v in DTYPES.items() if k != "BF16"}
_FROM_NUMPY = {v: k for k, v in _NUMPY_DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (``"F32"`` -> ``torch.float32``)."""
    import torch

    return getattr(torch, DTYPES[name])


class _TorchDtypes(dict):  # type: ignore[type-arg]
    """safetensors name -> torch dtype, filled on first use (torch stays unimported until
    a tensor is built)."""

    def __missing__(self, name: str) -> Any:
        self[name] = dtype = torch_dtype(name)
        return dtype


_TORCH_DTYPES = _TorchDtypes()


#: The u64 little-endian length that opens a record (and an HTTP batch, see
#: :mod:`cache_store.format.wire`): the one definition of that framing.
HEADER_LENGTH = struct.Struct("<Q")
_LEN = HEADER_LENGTH

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    raise ImportError("cache_store.format.record reads little-endian buffers in place; "
                      "this host is big-endian")


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


@dataclass
class Record:
    """A decoded record: CPU tensors by name, and the record's metadata."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def checksum(self) -> str:
        """The record checksum (also its strong ETag)."""
        return self.metadata.get("checksum", "")

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


# --------------------------------------------------------------------------- encoding


def _bad(name: str, problem: str) -> ParameterError:
    return ParameterError([f"{name}: {problem}"], what="record tensors")


def _numpy_bytes_view(name: str, array: np.ndarray) -> tuple[str, tuple[int, ...], memoryview]:
    dtype = _FROM_NUMPY.get(array.dtype.newbyteorder("="))
    if dtype is None:
        raise _bad(name, f"numpy dtype {array.dtype} has no safetensors name here")
    array = np.ascontiguousarray(array, dtype=_NUMPY_DTYPES[dtype])  # native order
    return dtype, tuple(array.shape), memoryview(array.reshape(-1).view(np.uint8))


def _as_bytes_view(name: str, tensor: Any) -> tuple[str, tuple[int, ...], memoryview]:
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
        raise _bad(name, f"dtype {tensor.dtype} has no safetensors name here "
                         f"(known: {', '.join(DTYPES.values())})")
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if dtype == "BF16":  # no NumPy dtype: bytes through torch
        return dtype, tuple(tensor.shape), memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    array = tensor.numpy()
    return dtype, array.shape, memoryview(array.reshape(-1).view(np.uint8))


_CHECKSUM_TAG = b'"checksum":"'
_CHECKSUM_HEX = 32
_BLANK_CHECKSUM = "0" * _CHECKSUM_HEX


def _checksum_slot(text: bytes) -> int:
    """Offset of the checksum's 32 hex digits in a header text; ValueError if not exactly one.

    In JSON text an unescaped ``"checksum":"`` can only be the metadata key itself (a
    quote inside a string is always escaped, and a tensor entry is an object).
    """
    first = text.find(_CHECKSUM_TAG)
    if first < 0 or text.find(_CHECKSUM_TAG, first + 1) >= 0:
        raise ValueError("header must hold exactly one checksum entry")
    at = first + len(_CHECKSUM_TAG)
    if text[at + _CHECKSUM_HEX:at + _CHECKSUM_HEX + 1] != b'"':
        raise ValueError("checksum entry is not 32 characters")
    return at


def _header_digest(text: bytes, at: int) -> str:
    blank = b"".join([text[:at], _BLANK_CHECKSUM.encode(), text[at + _CHECKSUM_HEX:]])
    return xxhash.xxh3_128_hexdigest(blank)


def _sign(text: bytes) -> bytes:
    """Fill in the record checksum: xxh3_128 of the header text with its slot zeroed."""
    at = _checksum_slot(text)
    return b"".join([text[:at], _header_digest(text, at).encode(), text[at + _CHECKSUM_HEX:]])


def _assemble(layout: list[tuple[str, str, tuple[int, ...], Any]],
              field_checksums: Mapping[str, str], metadata: Mapping[str, str]) -> bytes:
    """``layout``: (name, dtype, shape, bytes-like) in the order to write them."""
    meta = dict(metadata)
    meta["format_version"] = FORMAT_VERSION
    meta["field_checksums"] = json.dumps({n: field_checksums[n] for n, *_ in layout},
                                         sort_keys=True, separators=(",", ":"))
    meta["checksum"] = _BLANK_CHECKSUM
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, dtype, shape, buf in layout:
        size = len(buf)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + _LEN.size) % 8)
    text = _sign(text)
    return b"".join([_LEN.pack(len(text)), text, *(buf for *_, buf in layout)])


def _check_metadata(metadata: Mapping[str, str], required: Iterable[str]) -> dict[str, str]:
    problems = [f"metadata {k!r}: keys and values must be str, got {type(v).__name__}"
                for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
    problems += [f"metadata {k!r}: set by the record format, not by callers"
                 for k in metadata if k in _MANAGED]
    problems += [f"metadata {k!r}: required" for k in required if k not in metadata]
    if problems:
        raise ParameterError(problems, what="record metadata")
    return dict(metadata)


def encode_tensors(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> bytes:
    """Encode tensors with free-form str -> str metadata (no required keys).

    The building block of :func:`encode_record`, also used for dataset indexes.
    """
    meta = _check_metadata(metadata or {}, ())
    prepared = []
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ParameterError([f"tensor name {name!r}: must be a non-empty str other than "
                                  f"'__metadata__'"], what="record tensors")
        prepared.append((name, *_as_bytes_view(name, tensor)))
    # Largest item size first, then by name: every buffer starts aligned for its dtype.
    prepared.sort(key=lambda item: (-_ITEMSIZE[item[1]], item[0]))
    checksums = {name: xxhash.xxh3_64_hexdigest(buf) for name, _, _, buf in prepared}
    return _assemble(prepared, checksums, meta)


def encode_record(tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> bytes:
    """Encode one record.

    Args:
        tensors: name -> CPU ``torch.Tensor`` (or numpy array) of any dtype in
            :data:`DTYPES` and any shape, 0-d and empty included.
        metadata: str -> str; must hold :data:`REQUIRED_METADATA` except ``created``
            (default: now, UTC, ISO 8601) and ``spcache_version`` (default: this
            package's). ``format_version``, ``checksum`` and ``field_checksums`` are
            added here and may not be given.

    Returns:
        bytes: the safetensors-format value.

    Raises:
        ParameterError: on a non-CPU tensor, unknown dtype, bad name or bad metadata.
    """
    meta = dict(metadata)
    if "created" not in meta:
        meta["created"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")
    if "spcache_version" not in meta:
        from cache_store import __version__  # late: cache_store/__init__ imports this module

        meta["spcache_version"] = __version__
    _check_metadata(meta, REQUIRED_METADATA)
    return encode_tensors(tensors, meta)


# --------------------------------------------------------------------------- decoding


def _fail(key: str, reason: str) -> CorruptRecord:
    return CorruptRecord(key, reason)


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
_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_reject_constant)

try:  # a C parser ~4x faster than json with the hook above (an optional speed-up)
    import orjson as _orjson
except ImportError:  # pragma: no cover - a listed dependency; the strict parser serves
    _orjson = None


def _loads(text: bytes) -> Any:
    """A header (or its ``field_checksums``) parsed exactly as :data:`_DECODER` parses it.

    Fast path: orjson parses, and the result is accepted only if serialising it again
    gives back the very text (trailing padding aside). Every record this package writes
    is in that canonical form (compact ``json.dumps``; ASCII). Any other text (spaces,
    escapes, non-ASCII, a constant, an int past 64 bits, a duplicate key, which the
    parsed dict would have lost) takes the strict parser, which gives the answer and the
    error. The fast path therefore accepts nothing the strict one refuses.
    """
    if _orjson is not None:
        try:
            parsed = _orjson.loads(text)
        except _orjson.JSONDecodeError:
            pass
        else:
            if _orjson.dumps(parsed) == text.rstrip(b" "):
                return parsed
    return _DECODER.decode(text.decode("utf-8"))


def _parse_tensor_info(key: str, name: str, entry: object, data_len: int,
                       data_start: int) -> TensorInfo:
    # ``type(x) is int`` on purpose: JSON gives int, and it refuses bool. Written as
    # plain loops: this runs for every field of every record read.
    if type(entry) is not dict or len(entry) != 3:
        raise _fail(key, f"tensor {name!r}: header entry must have exactly dtype, shape, "
                         f"data_offsets")
    try:
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    except KeyError:
        raise _fail(key, f"tensor {name!r}: header entry must have exactly dtype, shape, "
                         f"data_offsets") from None
    itemsize = _ITEMSIZE.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        raise _fail(key, f"tensor {name!r}: unknown dtype {dtype!r}")
    if type(shape) is not list:
        raise _fail(key, f"tensor {name!r}: shape must be a list of non-negative ints")
    numel = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise _fail(key, f"tensor {name!r}: shape must be a list of non-negative ints")
        numel *= d
    if type(offsets) is not list or len(offsets) != 2:
        raise _fail(key, f"tensor {name!r}: data_offsets must be two ints")
    begin, end = offsets
    if type(begin) is not int or type(end) is not int:
        raise _fail(key, f"tensor {name!r}: data_offsets must be two ints")
    if not 0 <= begin <= end <= data_len:
        raise _fail(key, f"tensor {name!r}: data_offsets {offsets} outside the "
                         f"{data_len}-byte data section")
    if numel * itemsize != end - begin:
        raise _fail(key, f"tensor {name!r}: {dtype} x {shape} needs {numel * itemsize} "
                         f"bytes, offsets give {end - begin}")
    return TensorInfo(dtype, tuple(shape), data_start + begin, data_start + end)


def _byte_view(value: Any, key: str) -> memoryview:
    try:
        view = memoryview(value)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except TypeError:
        raise _fail(key, f"expected a contiguous bytes-like value, got "
                         f"{type(value).__name__}") from None


def _parse_header(value: Any, key: str) -> RecordHeader:
    return _parse_view(_byte_view(value, key), key)


def _parse_view(view: memoryview, key: str) -> RecordHeader:
    total = view.nbytes
    if total < _LEN.size:
        raise _fail(key, f"{total} bytes: too short for a header length")
    (n,) = _LEN.unpack_from(view, 0)
    if n < 2 or n > MAX_HEADER_BYTES or n > total - _LEN.size:
        raise _fail(key, f"header length {n} does not fit a {total}-byte value")
    return _parse_text(bytes(view[_LEN.size:_LEN.size + n]), total, key)


def parse_stored_header(text: bytes, data_len: int, *, key: str = "") -> RecordHeader:
    """The header of a record stored in parts (a snapshot keeps each record's header
    text apart from its fields): ``text`` is the header as it follows the length prefix,
    ``data_len`` the bytes of its fields where they are stored. Checked as
    :func:`read_header` checks a whole value (JSON, metadata, checksum, and that the
    fields tile exactly ``data_len`` bytes)."""
    if len(text) < 2 or len(text) > MAX_HEADER_BYTES:
        raise _fail(key, f"header length {len(text)} out of range")
    return _parse_text(bytes(text), _LEN.size + len(text) + int(data_len), key)


def _parse_text(raw: bytes, total: int, key: str) -> RecordHeader:
    n = len(raw)
    if raw[:1] != b"{":
        raise _fail(key, "header does not start with '{'")
    try:
        header = _loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _fail(key, f"header is not valid JSON: {exc}") from None
    if type(header) is not dict:
        raise _fail(key, "header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if type(meta) is not dict or not set(map(type, meta.values())) <= _STR_ONLY:
        raise _fail(key, "header has no '__metadata__' map of str -> str")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise UnsupportedFormat(key, f"format_version {version!r} is not supported "
                                     f"(this reader knows {FORMAT_VERSION!r})")
    try:
        at = _checksum_slot(raw)
    except ValueError as exc:
        raise _fail(key, str(exc)) from None
    stored = raw[at:at + _CHECKSUM_HEX].decode("ascii", "replace")
    if meta.get("checksum") != stored or _header_digest(raw, at) != stored:
        raise _fail(key, "header checksum mismatch (metadata or layout altered)")
    data_start = _LEN.size + n
    tensors = _tensor_infos(key, header, total - data_start, data_start)
    checksums = _parse_field_checksums(key, meta, tensors)
    return RecordHeader(meta, tensors, checksums, data_start)


def _tensor_infos(key: str, header: Mapping[str, Any], data_len: int,
                  data_start: int) -> dict[str, TensorInfo]:
    """Every tensor entry of a parsed header, checked as :func:`_parse_tensor_info` and
    :func:`_check_layout` check them, in one loop with no call per field: this runs for
    every record read. An entry that fails any check goes to ``_parse_tensor_info``,
    which raises naming what is wrong; fields that are not in data order (a writer other
    than this package's) go to ``_check_layout``."""
    tensors = {}
    itemsizes = _ITEMSIZE
    position = 0      # where the next field must begin for the fields to be in order
    in_order = True
    for name, entry in header.items():
        if type(entry) is dict and len(entry) == 3:
            dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
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
                            tensors[name] = TensorInfo(dtype, tuple(shape), data_start + begin,
                                                       data_start + end)
                            in_order = in_order and begin == position
                            position = end
                            continue
        _parse_tensor_info(key, name, entry, data_len, data_start)  # raises: says what is wrong
        raise _fail(key, f"tensor {name!r}: malformed header entry")  # (the checks agree)
    if not (in_order and position == data_len):
        _check_layout(key, tensors, data_start, data_start + data_len)
    return tensors


def _begin_of(item: tuple[str, TensorInfo]) -> tuple[int, int]:
    return item[1][2], item[1][3]


def _check_layout(key: str, tensors: Mapping[str, TensorInfo], data_start: int,
                  total: int) -> None:
    position = data_start
    for name, (_, _, begin, end) in sorted(tensors.items(), key=_begin_of):
        if begin != position:
            what = "overlaps the previous one" if begin < position else "leaves a gap"
            raise _fail(key, f"tensor {name!r} {what} (data must be contiguous)")
        position = end
    if position != total:
        raise _fail(key, f"data section is {total - data_start} bytes, tensors cover "
                         f"{position - data_start}")


def _parse_field_checksums(key: str, meta: Mapping[str, str],
                           tensors: Mapping[str, TensorInfo]) -> dict[str, str]:
    try:
        checksums = _loads(meta.get("field_checksums", "").encode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise _fail(key, f"metadata 'field_checksums' is not valid JSON: {exc}") from None
    if (type(checksums) is not dict or checksums.keys() != tensors.keys()
            or not set(map(type, checksums.values())) <= _STR_ONLY):
        raise _fail(key, "metadata 'field_checksums' does not list exactly the record's tensors")
    return checksums


def read_header(value: Any, *, key: str = "") -> RecordHeader:
    """Parse and validate a record's header without touching its data section.

    Raises:
        CorruptRecord: on any malformed header, layout or checksum of the header.
        UnsupportedFormat: on a ``format_version`` other than :data:`FORMAT_VERSION`.
    """
    return _parse_header(value, key)


def read_metadata(value: Any, *, key: str = "") -> dict[str, str]:
    """The metadata of a record (validated header, data not read)."""
    return dict(_parse_header(value, key).metadata)


def record_checksum(value: Any, *, key: str = "") -> str:
    """The record checksum (xxh3_128 hex), usable as a strong ETag; header-only read."""
    return _parse_header(value, key).checksum


def _selected(header: RecordHeader, fields: Iterable[str] | None, key: str) -> list[str]:
    if fields is None:
        return list(header.tensors)
    if isinstance(fields, str):
        fields = [fields]
    names = list(dict.fromkeys(fields))
    missing = [n for n in names if n not in header.tensors]
    if missing:
        raise UnknownName(f"field of record {key!r}" if key else "field", missing[0],
                          header.tensors)
    return names


def _verified_slice(view: memoryview, header: RecordHeader, name: str, key: str) -> memoryview:
    """Field ``name``'s bytes in ``view``, checked as a decode checks its copy."""
    info = header.tensors[name]
    part = view[info.begin:info.end]
    if xxhash.xxh3_64_hexdigest(part) != header.field_checksums[name]:
        raise _fail(key, f"checksum mismatch in tensor {name!r}")
    if info.dtype == "BOOL":
        _check_bools(part, name, key)
    return part


def _check_bools(data: Any, name: str, key: str) -> None:
    """The one rule for a BOOL field's bytes, for every reader: each is 0 or 1."""
    if np.frombuffer(data, dtype=np.uint8).max(initial=0) > 1:
        raise _fail(key, f"tensor {name!r}: BOOL bytes other than 0 and 1")


def check_record(value: Any, *, key: str = "") -> dict[str, str]:
    """Every check :func:`decode_record` makes on a whole record (header, layout, each
    field's checksum, BOOL bytes), building nothing and without torch: what ``verify``
    walks need. Returns the metadata; raises as :func:`decode_record`."""
    view = _byte_view(value, key)
    header = _parse_view(view, key)
    for name in header.tensors:
        _verified_slice(view, header, name, key)
    return dict(header.metadata)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    rank = len(shape)
    if rank == 1:
        return (1,)
    if rank == 2:
        return (max(shape[1], 1), 1)
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


#: ``fill(j, name, info, out)``: write record ``j``'s field ``name`` (``info`` its
#: place in the record) into ``out`` (a writable memoryview of exactly its bytes).
Fill = Callable[[int, str, TensorInfo, memoryview], None]


class _ViewFill:
    """A :data:`Fill` over whole record values (bytes-like, e.g. LMDB map buffers).

    Its ``span`` copies any byte range of record ``j``: fields that lie end to end in the
    record are copied in one go (a snapshot's fill has no ``span``: its fields are apart).
    """

    __slots__ = ("views",)

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.views = views

    def __call__(self, j: int, name: str, info: TensorInfo, out: memoryview) -> None:
        out[:] = self.views[j][info.begin:info.end]  # the one copy out of LMDB's map / the bytes

    def span(self, j: int, begin: int, end: int, out: memoryview) -> None:
        out[:] = self.views[j][begin:end]


def _record_tensors(fill: Fill, header: RecordHeader, names: list[str],
                    key: str) -> dict[str, torch.Tensor]:
    """One record read in this (non-worker) process: its fields copied into one fresh
    buffer, each verified against its checksum and viewed as a tensor on its own storage.
    Nothing will share or collate this record's storage, and a NumPy view +
    ``torch.from_numpy`` per field is ~2x cheaper to build and free than a torch view of
    one storage. Same checks as :func:`_batch_tensors`.

    Fields that follow each other in the record (all of them, when all are read: the
    encoder writes them end to end, by decreasing item size) keep their relative places
    in the buffer and are copied by one ``fill.span``; a field out of order, or whose
    place would not be aligned for its dtype, starts a new 8-byte aligned run. Each field
    is then hashed from the copy, so what is verified is what is returned.
    """
    import torch

    infos, checksums = header.tensors, header.field_checksums
    span = getattr(fill, "span", None)
    slots = []  # (name, info, offset in the buffer)
    runs = []   # (begin, end, offset): source ranges copied whole (``span``)
    size = 0
    run_end = -1
    for name in names:
        info = infos[name]
        begin, end = info.begin, info.end
        if span is not None and begin == run_end and size % _ITEMSIZE[info.dtype] == 0:
            runs[-1] = (runs[-1][0], end, runs[-1][2])  # extends the current run
        else:
            size = (size + 7) & ~7
            if span is not None:
                runs.append((begin, end, size))
        slots.append((name, info, size))
        size += end - begin
        run_end = end
    buf = np.empty(size, dtype=np.uint8)  # uninitialised: every byte is written below
    out = memoryview(buf)
    for begin, end, offset in runs:
        span(0, begin, end, out[offset:offset + end - begin])  # type: ignore[misc]
    tensors = {}
    from_numpy, hexdigest = torch.from_numpy, xxhash.xxh3_64_hexdigest
    for name, info, offset in slots:
        dtype, shape, begin, end = info
        nbytes = end - begin
        copy = out[offset:offset + nbytes]
        if span is None:
            fill(0, name, info, copy)
        if hexdigest(copy) != checksums[name]:
            raise _fail(key, f"checksum mismatch in tensor {name!r}")
        np_dtype = _NUMPY_DTYPES.get(dtype)
        if dtype == "BOOL":
            _check_bools(copy, name, key)
        if not nbytes:
            tensors[name] = torch.empty(shape, dtype=_TORCH_DTYPES[dtype])
        elif np_dtype is not None:  # a NumPy view costs a fraction of torch.frombuffer
            tensors[name] = from_numpy(np.ndarray(shape, np_dtype, buf, offset))
        else:  # bfloat16: no NumPy dtype
            tensors[name] = torch.frombuffer(buf, dtype=_TORCH_DTYPES[dtype],
                                             count=nbytes // _ITEMSIZE[dtype],
                                             offset=offset).view(shape)
    return tensors


def _batch_tensors(fill: Fill, headers: Sequence[RecordHeader],
                   names: Sequence[list[str]], keys: Sequence[str]) -> list[dict[str, torch.Tensor]]:
    """Copy the named fields of every record into ONE fresh buffer, verify each copy
    against its checksum, and view each as a tensor of that ONE storage (batches, and
    any read inside a DataLoader worker; one record in the trainer's process goes
    through :func:`_record_tensors`).

    Field-major: all records' ``octree`` end to end, then all ``exsum``, ... (each field's
    group starts 8-byte aligned; within a group every slot is aligned for its dtype), so
    :func:`~cache_store.readers.collate.collate_spc` concatenates or stacks a batch by taking a
    view, and the DataLoader hands a batch between processes as one storage, not one per
    tensor (a fixed cost each).

    One pass over each source: a field is copied first and the copy hashed while it is
    still in the CPU cache, so what is verified is exactly what is returned, and the
    source (an LMDB map page, often not cached) is read once.
    """
    import torch

    order: dict[str, None] = {}
    for selected in names:
        order.update(dict.fromkeys(selected))
    slots: list[tuple[int, str, TensorInfo, int]] = []
    size = 0
    for name in order:
        size = (size + 7) & ~7
        for j, selected in enumerate(names):
            if name in selected:
                info = headers[j].tensors[name]
                size = -(-size // _ITEMSIZE[info.dtype]) * _ITEMSIZE[info.dtype]
                slots.append((j, name, info, size))
                size += info.end - info.begin
    size = (size + 7) & ~7  # so the storage views as any dtype
    base, buf = allocate(size, in_dataloader_worker())
    flat: dict[str, torch.Tensor] = {}  # dtype name -> the whole storage as that dtype
    out = memoryview(buf)
    tensors: list[dict[str, torch.Tensor]] = [{} for _ in names]
    for j, name, info, offset in slots:
        dtype, shape, begin, end = info
        nbytes = end - begin
        copy = out[offset:offset + nbytes]
        fill(j, name, info, copy)
        if xxhash.xxh3_64_hexdigest(copy) != headers[j].field_checksums[name]:
            raise _fail(keys[j], f"checksum mismatch in tensor {name!r}")
        if dtype == "BOOL":
            _check_bools(copy, name, keys[j])
        whole = flat.get(dtype)
        if whole is None:
            whole = flat[dtype] = base.view(_TORCH_DTYPES[dtype])
        tensors[j][name] = whole.as_strided(shape, _strides(shape), offset // _ITEMSIZE[dtype])
    # a record's own field order, as a dict of its header gives it
    return [{name: found[name] for name in selected} for found, selected in zip(tensors, names)]


def decode_record(value: Any, *, key: str = "", fields: Iterable[str] | None = None) -> Record:
    """Decode a record into CPU tensors, verifying checksums of what it returns.

    Args:
        value: bytes-like (bytes, bytearray, memoryview; e.g. an LMDB buffer, valid only
            inside its transaction: the tensors returned never alias it).
        key: the record's key, named in errors.
        fields: names of the tensors to return (default: all). Only their bytes are read
            and hashed.

    Returns:
        Record: ``tensors`` (name -> CPU tensor, dtype and shape as stored, writable;
        parts of one fresh buffer, never the input's memory; in a DataLoader worker
        views of ONE storage in shared memory, so the record crosses to the trainer as
        one shared-memory file) and ``metadata`` (str -> str).

    Raises:
        CorruptRecord: malformed value or checksum mismatch (names ``key``).
        UnsupportedFormat: unknown ``format_version``.
        UnknownName: a requested field the record does not hold.
    """
    view = _byte_view(value, key)
    header = _parse_view(view, key)
    names = _selected(header, fields, key)
    if in_dataloader_worker():
        return Record(_batch_tensors(_ViewFill([view]), [header], [names], [key])[0],
                      header.metadata)
    return Record(_record_tensors(_ViewFill([view]), header, names, key), header.metadata)


def decode_records(items: Iterable[tuple[str, Any]], *,
                   fields: Iterable[str] | None = None) -> list[Record]:
    """Decode several records (``(key, value)`` pairs) at once, as :func:`decode_record`
    does each, into ONE fresh storage laid out field by field (see ``collate_spc``, which
    then batches them without copying). Every header and checksum is verified as by
    :func:`decode_record`; the first bad record raises naming its key.
    """
    if fields is not None:
        fields = [fields] if isinstance(fields, str) else list(fields)
    keys, views, headers, names = [], [], [], []
    for key, value in items:
        view = _byte_view(value, key)
        header = _parse_view(view, key)
        keys.append(key)
        views.append(view)
        headers.append(header)
        names.append(_selected(header, fields, key))
    tensors = _batch_tensors(_ViewFill(views), headers, names, keys)
    return [Record(t, h.metadata) for t, h in zip(tensors, headers)]


def decode_filled(headers: Sequence[RecordHeader], keys: Sequence[str], fill: Fill, *,
                  fields: Iterable[str] | None = None) -> list[Record]:
    """Decode records whose bytes are not one value: a snapshot's record is its header
    (:func:`parse_stored_header`) and its fields' rows in separate arrays. ``fill``
    writes each selected field's bytes straight into the returned tensors' storage
    (e.g. ``pread`` from a chunk file), which are then verified against the header's
    field checksums exactly as :func:`decode_records` verifies its copies; one record in
    the trainer's process, batches, and reads in a DataLoader worker are laid out as
    there."""
    if fields is not None:
        fields = [fields] if isinstance(fields, str) else list(fields)
    names = [_selected(h, fields, k) for h, k in zip(headers, keys)]
    if len(headers) == 1 and not in_dataloader_worker():
        return [Record(_record_tensors(fill, headers[0], names[0], keys[0]),
                       headers[0].metadata)]
    tensors = _batch_tensors(fill, headers, names, keys)
    return [Record(t, h.metadata) for t, h in zip(tensors, headers)]


def decode_arrays(value: Any, *, key: str = "",
                  fields: Iterable[str] | None = None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Like :func:`decode_record` but to NumPy arrays, without torch.

    Returns ``(arrays, metadata)``; each array owns its memory. ``BF16`` fields (NumPy
    has no bfloat16) raise ``ParameterError``.
    """
    view = _byte_view(value, key)
    header = _parse_view(view, key)
    arrays = {}
    for name in _selected(header, fields, key):
        info = header.tensors[name]
        if info.dtype == "BF16":
            raise ParameterError([f"{name}: bfloat16 has no NumPy dtype; use decode_record"])
        flat = np.frombuffer(view[info.begin:info.end], dtype=np.uint8).copy()
        if xxhash.xxh3_64_hexdigest(flat) != header.field_checksums[name]:  # the copy, cached
            raise _fail(key, f"checksum mismatch in tensor {name!r}")
        array = flat.view(_NUMPY_DTYPES[info.dtype]).reshape(info.shape)
        if info.dtype == "BOOL":
            _check_bools(flat, name, key)
        arrays[name] = array
    return arrays, dict(header.metadata)


def select_fields(value: Any, fields: Iterable[str], *, key: str = "") -> bytes:
    """Re-encode a record keeping only ``fields`` (raw bytes copied, no tensors built).

    The kept fields' bytes are verified against their checksums; the metadata is carried
    over, with ``field_checksums`` and ``checksum`` recomputed for the subset (so the
    subset has its own strong ETag). Raises as :func:`decode_record`.
    """
    header = _parse_header(value, key)
    view = _byte_view(value, key)
    names = _selected(header, fields, key)
    layout = []
    for name in names:
        info = header.tensors[name]
        layout.append((name, info.dtype, info.shape, _verified_slice(view, header, name, key)))
    layout.sort(key=lambda item: (-_ITEMSIZE[item[1]], item[0]))
    meta = {k: v for k, v in header.metadata.items() if k not in _MANAGED}
    return _assemble(layout, header.field_checksums, meta)


def peek_checksum(value: Any) -> str | None:
    """The checksum a record's header claims, read without validating anything; None when
    the value does not even look like a record (callers then use :func:`record_checksum`,
    which validates and raises ``CorruptRecord``). For serving ETags on the hot path."""
    try:
        (n,) = HEADER_LENGTH.unpack_from(value, 0)
        if n <= len(value) - HEADER_LENGTH.size:
            checksum = json.loads(value[HEADER_LENGTH.size:HEADER_LENGTH.size + n])[
                "__metadata__"]["checksum"]
            if isinstance(checksum, str) and checksum.isalnum():
                return checksum
    except (ValueError, KeyError, TypeError, RecursionError, struct.error):
        return None
    return None


def metadata_key(metadata: Mapping[str, str]) -> str:
    """The key a record's metadata names: ``"<fingerprint>/<sample id>"``."""
    return f"{metadata.get('fingerprint')}/{metadata.get('sample_id')}"


def check_names_key(metadata: Mapping[str, str], key: str) -> None:
    """Raise ``CorruptRecord`` naming ``key`` unless the metadata names that key."""
    named = metadata_key(metadata)
    if named != key:
        raise CorruptRecord(key, f"record metadata names {named}")


def pack_ids(sample_ids: Iterable[str]) -> tuple[np.ndarray, np.ndarray]:
    """Sample ids packed as UTF-8: ``(blob uint8 [total_bytes], offsets int64 [n + 1])``,
    id i being ``blob[offsets[i]:offsets[i + 1]]`` (dataset indexes, snapshots)."""
    encoded = [s.encode("utf-8") for s in sample_ids]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    blob = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
    return blob, offsets


def unpack_ids(blob: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_ids`: the ids as a NumPy str array [n] (``<U1`` when empty)."""
    raw = blob.tobytes()
    ids = [raw[offsets[i]:offsets[i + 1]].decode("utf-8") for i in range(len(offsets) - 1)]
    return np.array(ids, dtype=str) if ids else np.array([], dtype="<U1")
