"""One fingerprint group of an exported snapshot, opened in this process, and the reads
of its records' rows.

:func:`open_root` opens a snapshot's root group (checked to be an spcache snapshot of a
known format version); :func:`load_group` opens one complete fingerprint group: its
small arrays (ids, offsets, header offsets) are read whole and checked against their
digests, every offsets array must tile its data, the rest stays as handles. A record is
then read from its rows: :func:`read_values` rebuilds record values byte for byte (a
header and each field's rows), :func:`decode_local` decodes a local snapshot's records
straight from its chunk files into their tensors' storage. Reads are issued together on
zarr's IO loop (:func:`run`) or, locally, read from the chunk files directly
(:class:`~cache_store.snapshot.zarr.chunks.LocalChunkReader`).

:class:`~cache_store.snapshot.zarr.store.ZarrStore` builds the Store contract on these.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cache_store.errors import CacheNotFound, CorruptRecord, SpcacheError, UnsupportedFormat
from cache_store.format.decode import Record
from cache_store.format.header import HEADER_LENGTH, parse_stored_header
from cache_store.format.ids import unpack_ids
from cache_store.location import local_path, parse_location
from cache_store.snapshot.zarr.chunks import LocalChunkReader
from cache_store.snapshot.zarr.format import (
    ATTRS_KEY,
    SNAPSHOT_FORMAT_VERSION,
    SNAPSHOT_KIND,
    SNAPSHOT_ROOT_KIND,
    array_digest,
    validate_field_name,
)
from cache_store.stores.base import RecordDecoder

__all__ = [
    "READ_ERRORS",
    "ChunkReaders",
    "Located",
    "OpenedGroup",
    "OpenedRoot",
    "decode_local",
    "gather",
    "load_group",
    "open_root",
    "read_values",
    "run",
    "values_of",
]

#: What a codec raises for bad stored bytes (CRC mismatch, bad blosc frame).
READ_ERRORS = (ValueError, RuntimeError)


def run(coro: Any) -> Any:
    """Run a coroutine on zarr's IO loop (this process's) and return its result."""
    from zarr.core.sync import sync

    return sync(coro)


async def gather(calls: Sequence[Any]) -> list[Any]:
    return await asyncio.gather(*calls, return_exceptions=True)


@dataclass
class OpenedGroup:
    """One fingerprint group, opened in this process: small index arrays in memory,
    handles (async arrays) for the rest."""

    fingerprint: str
    attrs: dict[str, Any]
    sample_ids: np.ndarray  # <U, index order
    sorted_ids: np.ndarray  # <U, code point (= UTF-8 byte) order
    order: np.ndarray  # int64: sorted position -> row
    header_offsets: np.ndarray  # int64 [n + 1]
    headers: Any  # AsyncArray uint8
    field_offsets: dict[str, np.ndarray]
    data: dict[str, Any]  # field -> AsyncArray
    row_bytes: dict[str, int]  # field -> bytes of one row of its data array
    local: dict[str, LocalChunkReader] | None = None  # "headers" and fields, when local

    def row(self, sample_id: str) -> int | None:
        pos = int(np.searchsorted(self.sorted_ids, sample_id))
        if pos < len(self.sorted_ids) and self.sorted_ids[pos] == sample_id:
            return int(self.order[pos])
        return None

    @property
    def fields(self) -> list[str]:
        return list(self.data)

    def data_len(self, row: int) -> int:
        """Bytes of record ``row``'s fields: the data section its header must tile."""
        return sum(
            (int(o[row + 1]) - int(o[row])) * self.row_bytes[name]
            for name, o in self.field_offsets.items()
        )


#: Builds the direct reader of one array's chunk files: (its path in the group, the array).
ChunkReaders = Callable[[str, Any], LocalChunkReader]

#: A record found: (key, its group, its row).
Located = tuple[str, "OpenedGroup", int]


@dataclass
class OpenedRoot:
    """What one process has opened: the root group and the fingerprint groups read."""

    root: Any
    snapshots: dict[str, OpenedGroup] = field(default_factory=dict)


def _zarr_store(location: str, storage_options: Mapping[str, Any]) -> Any:
    from zarr.storage import FsspecStore, LocalStore

    if parse_location(location).is_local:
        path = local_path(location)
        if not os.path.isdir(path):
            raise CacheNotFound(path, "no Zarr snapshot here (not a directory)")
        return LocalStore(path, read_only=True)
    return FsspecStore.from_url(
        location, read_only=True, storage_options=dict(storage_options) or None
    )


def open_root(location: str, storage_options: Mapping[str, Any]) -> OpenedRoot:
    """Open a snapshot's root group in this process (checked to be an spcache snapshot)."""
    import zarr

    store = _zarr_store(location, storage_options)
    try:
        root = zarr.open_group(store, mode="r")
    except (FileNotFoundError, KeyError, ValueError) as exc:
        raise CacheNotFound(location, f"no Zarr group here ({exc})") from None
    attrs = root.attrs.get(ATTRS_KEY)
    if not isinstance(attrs, dict) or attrs.get("kind") != SNAPSHOT_ROOT_KIND:
        raise CacheNotFound(
            location,
            f"a Zarr group, but not an spcache snapshot (no {ATTRS_KEY!r} root attributes)",
        )
    if attrs.get("format_version") != SNAPSHOT_FORMAT_VERSION:
        raise UnsupportedFormat(
            f"snapshot:{location}",
            f"format_version {attrs.get('format_version')!r} is not "
            f"supported (this reader knows {SNAPSHOT_FORMAT_VERSION})",
        )
    return OpenedRoot(root)


def load_group(
    fingerprint: str, group: Any, attrs: dict[str, Any], readers: ChunkReaders | None
) -> OpenedGroup:
    """Open one complete fingerprint group: its small arrays read and checked against
    their digests, offsets checked to tile their arrays. ``readers``: builds the reader
    of an array's chunk files from its path in the group (``"headers"``,
    ``"data/<field>"``) and the array, to read them directly (None: through zarr only)."""
    where = f"snapshot:{fingerprint}"
    if attrs.get("kind") != SNAPSHOT_KIND or attrs.get("fingerprint") != fingerprint:
        raise CorruptRecord(where, "group attributes do not describe this fingerprint")
    if attrs.get("format_version") != SNAPSHOT_FORMAT_VERSION:
        raise UnsupportedFormat(
            where,
            f"format_version {attrs.get('format_version')!r} "
            f"is not supported (this reader knows "
            f"{SNAPSHOT_FORMAT_VERSION})",
        )
    try:
        fields = [validate_field_name(f) for f in attrs["fields"]]
        n = int(attrs["samples"])
        digests = dict(attrs["digests"])
        small = {
            "sample_ids": group["sample_ids"],
            "sample_id_offsets": group["sample_id_offsets"],
            "header_offsets": group["header_offsets"],
        }
        small |= {f"offsets/{f}": group[f"offsets/{f}"] for f in fields}
        data = {f: group[f"data/{f}"] for f in fields}
        headers = group["headers"]
    except (KeyError, TypeError, ValueError, SpcacheError) as exc:
        raise CorruptRecord(where, f"snapshot layout incomplete: {exc}") from None
    names = list(small)
    results = run(gather([small[name].async_array.getitem(slice(None)) for name in names]))
    arrays: dict[str, np.ndarray] = {}
    for name, result in zip(names, results, strict=True):
        if isinstance(result, BaseException):
            if isinstance(result, READ_ERRORS):
                raise CorruptRecord(where, f"array {name!r} unreadable: {result}")
            raise result
        arrays[name] = np.asarray(result)
        if digests.get(name) != array_digest(arrays[name]):
            raise CorruptRecord(where, f"array {name!r} does not match its digest")
    _check_offsets(where, "header_offsets", arrays["header_offsets"], n, headers.shape[0])
    _check_offsets(
        where,
        "sample_id_offsets",
        arrays["sample_id_offsets"],
        n,
        arrays["sample_ids"].shape[0],
    )
    for f in fields:
        _check_offsets(
            where,
            f"offsets/{f}",
            arrays[f"offsets/{f}"],
            n,
            data[f].shape[0] if data[f].ndim else 0,
        )
    ids = unpack_ids(arrays["sample_ids"], arrays["sample_id_offsets"])
    order = np.argsort(ids, kind="stable")
    return OpenedGroup(
        fingerprint,
        attrs,
        ids,
        ids[order],
        order.astype(np.int64),
        arrays["header_offsets"],
        headers.async_array,
        {f: arrays[f"offsets/{f}"] for f in fields},
        {f: data[f].async_array for f in fields},
        {f: math.prod(data[f].shape[1:]) * np.dtype(data[f].dtype).itemsize for f in fields},
        _local_readers(readers, headers, data),
    )


def _local_readers(
    readers: ChunkReaders | None, headers: Any, data: dict[str, Any]
) -> dict[str, LocalChunkReader] | None:
    if readers is None:
        return None
    arrays = {"headers": (headers, "headers")}
    arrays |= {f: (a, f"data/{f}") for f, a in data.items()}
    if not all(LocalChunkReader.supports(a) for a, _ in arrays.values()):
        return None
    return {name: readers(path, array) for name, (array, path) in arrays.items()}


def _check_offsets(where: str, name: str, offsets: np.ndarray, n: int, total: int) -> None:
    if (
        offsets.dtype != np.int64
        or offsets.shape != (n + 1,)
        or offsets[0] != 0
        or offsets[-1] != total
        or np.any(np.diff(offsets) < 0)
    ):
        raise CorruptRecord(where, f"array {name!r} does not index {n} records over {total} rows")


def read_values(
    located: Sequence[Located], fields: Iterable[str] | None
) -> list[bytearray | CorruptRecord]:
    """Record values of ``(key, snapshot, row)``, rebuilt from the arrays (local
    snapshots: from the chunk files directly; others: one batch of concurrent reads
    on zarr's IO loop). Fields not in ``fields`` are left zero (not read); each entry
    is the value or the ``CorruptRecord`` that stopped it."""
    wanted = None if fields is None else set(fields)
    plan = [
        (key, snap, row, [f for f in snap.fields if wanted is None or f in wanted])
        for key, snap, row in located
    ]
    if all(snap.local is not None for _, snap, _, _ in plan):
        results = iter(_read_local(plan))
    else:
        results = iter(run(gather(_read_calls(plan))) if plan else [])
    return [
        _join_record(key, snap, row, names, [next(results) for _ in range(len(names) + 1)])
        for key, snap, row, names in plan
    ]


def _read_calls(plan: list[tuple[str, OpenedGroup, int, list[str]]]) -> list[Any]:
    calls = []
    for _, snap, row, names in plan:
        h = snap.header_offsets
        calls.append(snap.headers.getitem(slice(int(h[row]), int(h[row + 1]))))
        for f in names:
            o = snap.field_offsets[f]
            calls.append(snap.data[f].getitem(slice(int(o[row]), int(o[row + 1]))))
    return calls


def _read_local(plan: list[tuple[str, OpenedGroup, int, list[str]]]) -> list[Any]:
    out: list[Any] = []
    for _, snap, row, names in plan:
        local = snap.local
        assert local is not None
        for name in ["headers", *names]:
            o = snap.header_offsets if name == "headers" else snap.field_offsets[name]
            try:
                out.append(local[name].rows(int(o[row]), int(o[row + 1])))
            except ValueError as exc:
                out.append(exc)
    return out


def _join_record(
    key: str, snap: OpenedGroup, row: int, names: list[str], parts: list[Any]
) -> bytearray | CorruptRecord:
    for what, part in zip(["headers", *(f"data/{n}" for n in names)], parts, strict=True):
        if isinstance(part, BaseException):
            if isinstance(part, READ_ERRORS):
                return CorruptRecord(key, f"cannot read {snap.fingerprint}/{what}: {part}")
            raise part
    text = np.asarray(parts[0]).tobytes()
    try:
        header = parse_stored_header(text, snap.data_len(row), key=key)
    except CorruptRecord as exc:
        return exc
    value = bytearray(header.data_start + snap.data_len(row))  # unread fields stay zero
    value[: HEADER_LENGTH.size] = HEADER_LENGTH.pack(len(text))
    value[HEADER_LENGTH.size : header.data_start] = text
    target = np.frombuffer(value, dtype=np.uint8)  # writable view of value
    for name, part in zip(names, parts[1:], strict=True):
        raw = np.ascontiguousarray(part).view(np.uint8).reshape(-1)
        info = header.tensors.get(name)
        if info is None or info.end - info.begin != raw.size:
            return CorruptRecord(key, f"field {name!r} does not fit the stored header")
        target[info.begin : info.end] = raw
    return value


def values_of(located: Sequence[Located], fields: Iterable[str] | None) -> list[bytearray]:
    """As :func:`read_values`, raising the first ``CorruptRecord`` met."""
    out = []
    for value in read_values(located, fields):
        if isinstance(value, CorruptRecord):
            raise value
        out.append(value)
    return out


def decode_local(located: Sequence[Located], decoder: RecordDecoder) -> list[Record]:
    """Records of a local snapshot decoded straight from its chunk files: each field's
    rows are read into the tensors' own storage (no record value is assembled), then
    verified against the stored header's checksums like any read."""
    headers = []
    for key, snap, row in located:
        local = snap.local
        assert local is not None
        h = snap.header_offsets
        try:
            text = local["headers"].rows(int(h[row]), int(h[row + 1])).tobytes()
        except READ_ERRORS as exc:
            raise CorruptRecord(key, f"cannot read {snap.fingerprint}/headers: {exc}") from None
        headers.append(parse_stored_header(text, snap.data_len(row), key=key))

    def fill(j: int, name: str, info: Any, out: memoryview) -> None:
        key, snap, row = located[j]
        reader = snap.local.get(name) if snap.local is not None else None
        if reader is None:
            raise CorruptRecord(key, f"field {name!r} is not in snapshot {snap.fingerprint}")
        o = snap.field_offsets[name]
        try:
            reader.read_into(int(o[row]), int(o[row + 1]), out)
        except READ_ERRORS as exc:
            raise CorruptRecord(key, f"cannot read {snap.fingerprint}/data/{name}: {exc}") from None

    return decoder.filled(headers, fill)
