"""Reading records: the whole-record check, tensors (one record, batches, records
filled in parts) and NumPy arrays, each verifying exactly the bytes it returns.

The header is parsed by :mod:`cache_store.format.header`; where a batch's memory comes
from is :mod:`cache_store.format.buffers`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from cache_store.errors import CorruptRecord, ParameterError, UnknownName
from cache_store.format.buffers import allocate, in_dataloader_worker
from cache_store.format.descriptor import DescriptorLookup, bind_metadata
from cache_store.format.header import (
    ITEMSIZE,
    numpy_dtypes,
    TORCH_DTYPES,
    RecordHeader,
    TensorInfo,
    byte_view,
    parse_view,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "Record",
    "Fill",
    "check_record",
    "decode_record",
    "decode_records",
    "decode_filled",
    "decode_arrays",
    "selected_fields",
    "verified_field",
]


@dataclass
class Record:
    """A decoded record: CPU tensors by name, and the record's metadata."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)
    #: for views (:mod:`cache_store.views`): where the record's bytes lie (file device
    #: and inode, offset, length); None for a copy
    place: tuple[int, int, int, int] | None = None

    @property
    def checksum(self) -> str:
        """The record checksum (also its strong ETag)."""
        return self.metadata.get("checksum", "")

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def selected_fields(header: RecordHeader, fields: Iterable[str] | None, key: str) -> list[str]:
    if fields is None:
        return list(header.tensors)
    if isinstance(fields, str):
        fields = [fields]
    names = list(dict.fromkeys(fields))
    missing = [n for n in names if n not in header.tensors]
    if missing:
        raise UnknownName(
            f"field of record {key!r}" if key else "field", missing[0], header.tensors
        )
    return names


def verified_field(view: memoryview, header: RecordHeader, name: str, key: str) -> memoryview:
    """Field ``name``'s bytes in ``view``, checked as a decode checks its copy."""
    info = header.tensors[name]
    part = view[info.begin : info.end]
    if xxhash.xxh3_64_hexdigest(part) != header.field_checksums[name]:
        raise CorruptRecord(key, f"checksum mismatch in tensor {name!r}")
    if info.dtype == "BOOL":
        _check_bools(part, name, key)
    return part


def _check_bools(data: Any, name: str, key: str) -> None:
    """The one rule for a BOOL field's bytes, for every reader: each is 0 or 1."""
    import numpy as np

    if np.frombuffer(data, dtype=np.uint8).max(initial=0) > 1:
        raise CorruptRecord(key, f"tensor {name!r}: BOOL bytes other than 0 and 1")


def check_record(value: Any, *, key: str, lookup: DescriptorLookup) -> RecordHeader:
    """The whole-record check: every rule a stored record must keep, in one place, for
    every store's ``verify``, the snapshot export and a Zarr ``get``.

    Header (strict parse, header checksum, layout), each field's checksum, BOOL bytes
    (0 or 1), and that the record is bound to ``key`` (:func:`bind_metadata`: its
    metadata names that key; a format-2 record's descriptor, found through ``lookup``
    under the key's fingerprint, is there and sound). Builds nothing and needs no torch.
    Returns the header (the record's own metadata); raises ``CorruptRecord`` (or
    ``UnsupportedFormat``) naming ``key``. A decode makes the same checks on the fields
    it returns (:func:`verified_field` and its copy loops), and the store base class
    binds every record it decodes.
    """
    view = byte_view(value, key)
    header = parse_view(view, key)
    for name in header.tensors:
        verified_field(view, header, name, key)
    bind_metadata(header.metadata, key, lookup)
    return header


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
        out[:] = self.views[j][info.begin : info.end]  # the one copy out of LMDB's map / the bytes

    def span(self, j: int, begin: int, end: int, out: memoryview) -> None:
        out[:] = self.views[j][begin:end]


def _record_tensors(
    fill: Fill, header: RecordHeader, names: list[str], key: str
) -> dict[str, torch.Tensor]:
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
    import numpy as np
    import torch

    infos, checksums = header.tensors, header.field_checksums
    span = getattr(fill, "span", None)
    slots = []  # (name, info, offset in the buffer)
    runs: list[
        tuple[int, int, int]
    ] = []  # (begin, end, offset): source ranges copied whole (``span``)
    size = 0
    run_end = -1
    for name in names:
        info = infos[name]
        begin, end = info.begin, info.end
        if span is not None and begin == run_end and size % ITEMSIZE[info.dtype] == 0:
            runs[-1] = (runs[-1][0], end, runs[-1][2])  # extends the current run
        else:
            size = (size + 7) & ~7
            if span is not None:
                runs.append((begin, end, size))
        slots.append((name, info, size))
        size += end - begin
        run_end = end
    buf = np.empty(size, dtype=np.uint8)  # uninitialised: every byte is written below
    out = buf.data
    for begin, end, offset in runs:
        span(0, begin, end, out[offset : offset + end - begin])  # type: ignore[misc]
    tensors = {}
    from_numpy, hexdigest = torch.from_numpy, xxhash.xxh3_64_hexdigest
    np_dtypes = numpy_dtypes()
    for name, info, offset in slots:
        dtype, shape, begin, end = info
        nbytes = end - begin
        copy = out[offset : offset + nbytes]
        if span is None:
            fill(0, name, info, copy)
        if hexdigest(copy) != checksums[name]:
            raise CorruptRecord(key, f"checksum mismatch in tensor {name!r}")
        np_dtype = np_dtypes.get(dtype)
        if dtype == "BOOL":
            _check_bools(copy, name, key)
        if not nbytes:
            tensors[name] = torch.empty(shape, dtype=TORCH_DTYPES[dtype])
        elif np_dtype is not None:  # a NumPy view costs a fraction of torch.frombuffer
            tensors[name] = from_numpy(np.ndarray(shape, np_dtype, buf, offset))
        else:  # bfloat16: no NumPy dtype
            tensors[name] = torch.frombuffer(
                buf, dtype=TORCH_DTYPES[dtype], count=nbytes // ITEMSIZE[dtype], offset=offset
            ).view(shape)
    return tensors


def _batch_tensors(
    fill: Fill, headers: Sequence[RecordHeader], names: Sequence[list[str]], keys: Sequence[str]
) -> list[dict[str, torch.Tensor]]:
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
                size = -(-size // ITEMSIZE[info.dtype]) * ITEMSIZE[info.dtype]
                slots.append((j, name, info, size))
                size += info.end - info.begin
    size = (size + 7) & ~7  # so the storage views as any dtype
    base, buf = allocate(size, in_dataloader_worker())
    flat: dict[str, torch.Tensor] = {}  # dtype name -> the whole storage as that dtype
    out = buf.data
    tensors: list[dict[str, torch.Tensor]] = [{} for _ in names]
    for j, name, info, offset in slots:
        dtype, shape, begin, end = info
        nbytes = end - begin
        copy = out[offset : offset + nbytes]
        fill(j, name, info, copy)
        if xxhash.xxh3_64_hexdigest(copy) != headers[j].field_checksums[name]:
            raise CorruptRecord(keys[j], f"checksum mismatch in tensor {name!r}")
        if dtype == "BOOL":
            _check_bools(copy, name, keys[j])
        whole = flat.get(dtype)
        if whole is None:
            whole = flat[dtype] = base.view(TORCH_DTYPES[dtype])
        tensors[j][name] = whole.as_strided(shape, _strides(shape), offset // ITEMSIZE[dtype])
    # a record's own field order, as a dict of its header gives it
    return [
        {name: found[name] for name in selected}
        for found, selected in zip(tensors, names, strict=True)
    ]


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
        one shared-memory file) and ``metadata`` (str -> str): the record's own (a
        store's reads add its descriptor's, :func:`bind_metadata`).

    Raises:
        CorruptRecord: malformed value or checksum mismatch (names ``key``).
        UnsupportedFormat: unknown ``format_version``.
        UnknownName: a requested field the record does not hold.
    """
    view = byte_view(value, key)
    header = parse_view(view, key)
    names = selected_fields(header, fields, key)
    if in_dataloader_worker():
        return Record(
            _batch_tensors(_ViewFill([view]), [header], [names], [key])[0], header.metadata
        )
    return Record(_record_tensors(_ViewFill([view]), header, names, key), header.metadata)


def decode_records(
    items: Iterable[tuple[str, Any]], *, fields: Iterable[str] | None = None
) -> list[Record]:
    """Decode several records (``(key, value)`` pairs) at once, as :func:`decode_record`
    does each, into ONE fresh storage laid out field by field (see ``collate_spc``, which
    then batches them without copying). Every header and checksum is verified as by
    :func:`decode_record`; the first bad record raises naming its key.
    """
    if fields is not None:
        fields = [fields] if isinstance(fields, str) else list(fields)
    keys, views, headers, names = [], [], [], []
    for key, value in items:
        view = byte_view(value, key)
        header = parse_view(view, key)
        keys.append(key)
        views.append(view)
        headers.append(header)
        names.append(selected_fields(header, fields, key))
    tensors = _batch_tensors(_ViewFill(views), headers, names, keys)
    return [Record(t, h.metadata) for t, h in zip(tensors, headers, strict=True)]


def decode_filled(
    headers: Sequence[RecordHeader],
    keys: Sequence[str],
    fill: Fill,
    *,
    fields: Iterable[str] | None = None,
) -> list[Record]:
    """Decode records whose bytes are not one value: a snapshot's record is its header
    (:func:`parse_stored_header`) and its fields' rows in separate arrays. ``fill``
    writes each selected field's bytes straight into the returned tensors' storage
    (e.g. ``pread`` from a chunk file), which are then verified against the header's
    field checksums exactly as :func:`decode_records` verifies its copies; one record in
    the trainer's process, batches, and reads in a DataLoader worker are laid out as
    there."""
    if fields is not None:
        fields = [fields] if isinstance(fields, str) else list(fields)
    names = [selected_fields(h, fields, k) for h, k in zip(headers, keys, strict=True)]
    if len(headers) == 1 and not in_dataloader_worker():
        return [Record(_record_tensors(fill, headers[0], names[0], keys[0]), headers[0].metadata)]
    tensors = _batch_tensors(fill, headers, names, keys)
    return [Record(t, h.metadata) for t, h in zip(tensors, headers, strict=True)]


def decode_arrays(
    value: Any, *, key: str = "", fields: Iterable[str] | None = None
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Like :func:`decode_record` but to NumPy arrays, without torch.

    Returns ``(arrays, metadata)``; each array owns its memory. ``BF16`` fields (NumPy
    has no bfloat16) raise ``ParameterError``.
    """
    import numpy as np

    view = byte_view(value, key)
    header = parse_view(view, key)
    arrays = {}
    for name in selected_fields(header, fields, key):
        info = header.tensors[name]
        if info.dtype == "BF16":
            raise ParameterError([f"{name}: bfloat16 has no NumPy dtype; use decode_record"])
        flat = np.frombuffer(view[info.begin : info.end], dtype=np.uint8).copy()
        if xxhash.xxh3_64_hexdigest(flat.data) != header.field_checksums[name]:  # the copy, cached
            raise CorruptRecord(key, f"checksum mismatch in tensor {name!r}")
        array = flat.view(numpy_dtypes()[info.dtype]).reshape(info.shape)
        if info.dtype == "BOOL":
            _check_bools(flat, name, key)
        arrays[name] = array
    return arrays, dict(header.metadata)
