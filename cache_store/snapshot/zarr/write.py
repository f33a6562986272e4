"""Pass two of an export: the arrays and attributes of one fingerprint group.

:func:`write_group` writes the small index arrays (ids, offsets, headers) through zarr,
then streams each field's rows in chunk-aligned writes: through zarr (any store), a
local :class:`~cache_store.snapshot.zarr.chunks.LocalChunkWriter` (compressed on a pool
of threads) or, for the ``none`` codec, a
:class:`~cache_store.snapshot.zarr.chunks.RawChunkAppender`. Every record is checked
again as it is copied: it must be the record pass one surveyed. The group
stays incomplete here; publishing it is :mod:`cache_store.snapshot.zarr.publish`'s.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from cache_store.errors import SpcacheError
from cache_store.format.decode import check_record
from cache_store.format.header import FORMAT_VERSION
from cache_store.format.ids import pack_ids
from cache_store.format.index import DatasetIndex
from cache_store.recipes.registry import RECIPE_SPECS
from cache_store.snapshot.zarr.chunks import ChunkWriterPool, LocalChunkWriter, RawChunkAppender
from cache_store.snapshot.zarr.format import (
    ATTRS_KEY,
    SNAPSHOT_FORMAT_VERSION,
    SNAPSHOT_KIND,
    SNAPSHOT_ROOT_KIND,
    array_digest,
    records_digest,
)
from cache_store.snapshot.zarr.plan import Survey, chunk_rows, progress_bar
from cache_store.stores.base import Store

__all__ = [
    "FieldWriter",
    "compressors_for",
    "ensure_root",
    "snapshot_attrs",
    "write_group",
]

#: Elements per chunk of the index arrays (ids, offsets, headers are read whole).
_INDEX_CHUNK = 1 << 20
_HEADER_CHUNK_BYTES = 256 * 1024


def compressors_for(dtype: np.dtype, clevel: int, codec: str = "zstd") -> list[Any]:
    from zarr.codecs import BloscCodec, Crc32cCodec

    if codec == "none":
        return [Crc32cCodec()]
    shuffle: Literal["shuffle", "noshuffle"] = "shuffle" if dtype.itemsize > 1 else "noshuffle"
    return [BloscCodec(cname=cast(Any, codec), clevel=clevel, shuffle=shuffle), Crc32cCodec()]


def _offsets(lengths: list[int]) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
    return offsets


def _write_small(
    group: Any, name: str, data: np.ndarray, clevel: int, codec: str, chunk: int = _INDEX_CHUNK
) -> None:
    arr = group.create_array(
        name,
        shape=data.shape,
        dtype=data.dtype,
        chunks=(max(1, min(chunk, data.shape[0])),),
        compressors=compressors_for(data.dtype, clevel, codec),
        fill_value=0,
    )
    if data.size:
        arr[:] = data


class FieldWriter:
    """Streams one field's rows into its data array in whole chunks, through
    ``write(start_row, rows)``: zarr's own (any store) or a local snapshot's
    :class:`~cache_store.snapshot.zarr.chunks.LocalChunkWriter`."""

    def __init__(self, write: Any, chunk_rows: int) -> None:
        self.write, self.chunk_rows = write, chunk_rows
        self.pending: list[np.ndarray] = []
        self.pending_rows = 0
        self.written = 0

    def add(self, rows: np.ndarray) -> None:
        self.pending.append(rows)
        self.pending_rows += rows.shape[0]
        if self.pending_rows >= self.chunk_rows:
            self.flush(final=False)

    def flush(self, final: bool) -> None:
        if not self.pending_rows:
            return
        block = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        take = block.shape[0] if final else block.shape[0] // self.chunk_rows * self.chunk_rows
        self.write(self.written, block[:take])
        self.written += take
        rest = block[take:]
        self.pending = [rest] if rest.shape[0] else []
        self.pending_rows = rest.shape[0]


def _zarr_write(array: Any) -> Any:
    def write(start: int, rows: np.ndarray) -> None:
        array[start : start + rows.shape[0]] = rows

    return write


def write_group(
    group: Any,
    store: Store,
    index: DatasetIndex,
    survey: Survey,
    attrs: dict[str, Any],
    chunk_bytes: int,
    clevel: int,
    codec: str,
    progress: bool,
    local_dir: Path | None = None,
) -> None:
    """Write every array of a fingerprint group, then its attributes (still incomplete).

    ``local_dir``: the group's directory when it is local; its data chunks are then
    compressed in parallel by :class:`~cache_store.snapshot.zarr.chunks.LocalChunkWriter`, or
    (codec ``none``) streamed by :class:`~cache_store.snapshot.zarr.chunks.RawChunkAppender`
    (zarr still writes every array's metadata and the small arrays)."""
    n = len(survey.sample_ids)
    id_bytes, id_offsets = pack_ids(survey.sample_ids)
    small = {
        "sample_ids": id_bytes,
        "sample_id_offsets": id_offsets,
        "header_offsets": _offsets([len(h) for h in survey.headers]),
    }
    small |= {f"offsets/{name}": _offsets(lay.rows) for name, lay in survey.fields.items()}
    for name, data in small.items():
        _write_small(group, name, data, clevel, codec)
    headers = np.frombuffer(b"".join(survey.headers), dtype=np.uint8)
    _write_small(
        group,
        "headers",
        headers,
        clevel,
        codec,
        chunk=max(_HEADER_CHUNK_BYTES, math.ceil(headers.size / max(n, 1))),
    )
    pool = ChunkWriterPool() if local_dir is not None and codec != "none" else None
    try:
        _write_fields(
            group, store, index, survey, chunk_bytes, clevel, codec, progress, local_dir, pool
        )
    finally:
        if pool is not None:
            pool.close()
    attrs["digests"] = {name: array_digest(data) for name, data in small.items()}
    group.update_attributes({ATTRS_KEY: attrs})


def _write_fields(
    group: Any,
    store: Store,
    index: DatasetIndex,
    survey: Survey,
    chunk_bytes: int,
    clevel: int,
    codec: str,
    progress: bool,
    local_dir: Path | None,
    pool: ChunkWriterPool | None,
) -> None:
    n = len(survey.sample_ids)
    writers: dict[str, Any] = {}
    for name, lay in survey.fields.items():
        dtype, rows = lay.numpy_dtype, sum(lay.rows)
        chunk = chunk_rows(lay, n, chunk_bytes)
        arr = group.create_array(
            f"data/{name}",
            shape=(rows, *lay.trailing),
            dtype=dtype,
            chunks=(chunk, *(max(1, d) for d in lay.trailing)),
            compressors=compressors_for(dtype, clevel, codec),
            fill_value=0,
        )
        where = None if local_dir is None else str(local_dir / "data" / name)
        if where is not None and codec == "none" and all(d > 0 for d in lay.trailing):
            writers[name] = RawChunkAppender(where, arr)
            continue
        if where is not None and pool is not None:
            write = LocalChunkWriter(where, arr, pool).write
        else:  # remote, or rows of zero width (chunks are at least 1 wide)
            write = _zarr_write(arr)
        writers[name] = FieldWriter(write, chunk)
    # Appenders write each record's rows at once, so they can take them from the
    # source's own memory; a FieldWriter keeps rows until a chunk is full: a copy.
    in_place = all(isinstance(w, RawChunkAppender) for w in writers.values())
    try:
        with progress_bar(n, "writing", progress) as bar:
            for i, sample_id in enumerate(survey.sample_ids):
                key = f"{index.fingerprint}/{sample_id}"
                if in_place:
                    with store.read_view(key) as value:
                        _send(writers, survey, key, value, survey.headers[i])
                else:
                    _send(writers, survey, key, store.get(key), survey.headers[i])
                bar.update(1)
        for writer in writers.values():
            writer.flush(final=True)
        if pool is not None:
            pool.finish()
    finally:
        for writer in writers.values():
            if isinstance(writer, RawChunkAppender):
                writer.close()


def _send(
    writers: Mapping[str, Any], survey: Survey, key: str, value: Any, checked_header: bytes
) -> None:
    """One record's rows to every field's writer, after checking it is the record the
    first pass checked (its header the same bytes: the same descriptor too)."""
    header = check_record(value, key=key, lookup=survey.descriptor)
    view = memoryview(value)
    if bytes(view[8 : header.data_start]) != checked_header:
        raise SpcacheError(
            f"{key}: record changed during the export (is a worker "
            f"still writing this fingerprint?); export again"
        )
    for name, lay in survey.fields.items():
        info = header.tensors[name]
        rows = np.frombuffer(view[info.begin : info.end], dtype=lay.numpy_dtype)
        writers[name].add(rows.reshape(lay.rows_of(info.shape), *lay.trailing))


def snapshot_attrs(index: DatasetIndex, survey: Survey, source: str, token: str) -> dict[str, Any]:
    spec = RECIPE_SPECS.get(index.recipe)
    meanings = {name: f.meaning for name, f in spec.fields.items()} if spec else {}
    from cache_store.version import __version__

    return {
        "kind": SNAPSHOT_KIND,
        "format_version": SNAPSHOT_FORMAT_VERSION,
        "complete": False,
        "writer": token,
        "fingerprint": index.fingerprint,
        "recipe": index.recipe,
        "recipe_version": index.recipe_version,
        "params": dict(index.params),
        "index_created": index.created,
        "exported": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "spcache_version": __version__,
        "source": source,
        "samples": len(survey.sample_ids),
        "record_format_version": FORMAT_VERSION,
        "record_bytes": survey.record_bytes,
        "fields": {
            name: lay.describe(meanings.get(name, "")) for name, lay in survey.fields.items()
        },
        "records_digest": records_digest(survey.checksums),
        "skipped": len(survey.bad),
        "descriptors": {d: survey.descriptors[d].text for d in sorted(survey.descriptors)},
        "layout": "sample_ids (UTF-8) + sample_id_offsets; headers (each record's "
        "safetensors header: metadata, per-field xxh3 checksums, record checksum, the "
        "digest of its descriptor in 'descriptors') "
        "+ header_offsets; data/<field> concatenated along axis 0 + "
        "offsets/<field> (rows of record i: offsets[i]:offsets[i+1])",
    }


def _root_attrs() -> dict[str, Any]:
    return {ATTRS_KEY: {"kind": SNAPSHOT_ROOT_KIND, "format_version": SNAPSHOT_FORMAT_VERSION}}


def ensure_root(zstore: Any, where: str) -> Any:
    import zarr

    try:
        root = zarr.open_group(zstore, mode="r+")
    except (FileNotFoundError, KeyError):
        return zarr.create_group(zstore, attributes=_root_attrs())
    attrs = root.attrs.get(ATTRS_KEY)
    if not isinstance(attrs, dict) or attrs.get("kind") != SNAPSHOT_ROOT_KIND:
        raise SpcacheError(
            f"{where}: a Zarr group that is not an spcache snapshot; refusing to write into it"
        )
    return root
