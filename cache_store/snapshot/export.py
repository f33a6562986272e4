"""Export one fingerprint of a cache into a Zarr v3 snapshot (CPU only).

:func:`export_snapshot` reads every record of a fingerprint's index from a source store
(normally the LMDB cache), checks it (header checksum, per-field xxh3, metadata naming
its key) and writes the layout described in :mod:`cache_store.snapshot.format`.

Two passes over the source: the first reads and checks every record and keeps its
header, so each array can be created at its final shape with chunks sized for it; the
second streams the tensors into chunk-aligned writes (no chunk is written twice) and
makes sure no record changed in between. A local export compresses and writes its data
chunks on a pool of threads (:class:`~cache_store.snapshot.chunks.LocalChunkWriter`, the bytes
zarr would write); an object store is written through zarr.

Publishing is atomic for readers:

* a local destination (a path or ``file://`` URL) is written as a whole group in a hidden
  sibling directory, fsynced, and renamed into ``DEST/<fingerprint>``; a killed export
  leaves only the hidden directory, which the next export sweeps away (with any
  ``*.partial`` files zarr's own atomic writes left inside ``DEST``). One export at a time
  per destination: a lock (``flock`` on the ``DEST`` directory) refuses a second writer.
* an object-store URL (no rename there) is written in place under a group whose
  ``complete`` attribute is false, set true as the very last write. Readers ignore
  incomplete groups; ``verify`` reports them. Object stores offer no lock: run one
  export per destination; a writer token in the attributes detects a concurrent writer
  before completion.

Chunking: along the first axis. When every record has the same rows for a field, a
chunk holds whole records (a sample is never split); otherwise at least the mean
record's rows (a sample touches one or two chunks). Either way about ``chunk_bytes``
(the rows split evenly between chunks, so the last is not mostly padding), so small
fields are not split into tiny objects. Chunks are blosc compressed (zstd, lz4hc or lz4;
byte shuffle for multi-byte dtypes) or, with the ``none`` codec, the rows as they are;
either way they end in a CRC-32C. The default codec is ``none`` for a local destination
and ``zstd`` for a URL (:func:`default_codec`).

Why one module: the two passes of an export (survey, then chunk-aligned writes) share
their plan; the layout rule is in format.py and the chunk files in chunks.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import datetime as _dt
import fcntl
import logging
import math
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from cache_store.errors import (
    CorruptRecord,
    ParameterError,
    RecordNotFound,
    SpcacheError,
    UnknownName,
)
from cache_store.keys import validate_fingerprint
from cache_store.format.decode import check_record
from cache_store.format.descriptor import Descriptor, descriptor_name
from cache_store.format.header import DTYPES, FORMAT_VERSION, RecordHeader
from cache_store.format.ids import pack_ids
from cache_store.recipes.specs import RECIPE_SPECS
from cache_store.format.index import DatasetIndex
from cache_store.stores.base import Store, open_store
from cache_store.snapshot.chunks import ChunkWriterPool, LocalChunkWriter, RawChunkAppender
from cache_store.location import local_path, parse_location
from cache_store.snapshot.format import (
    ATTRS_KEY,
    SNAPSHOT_FORMAT_VERSION,
    SNAPSHOT_KIND,
    SNAPSHOT_ROOT_KIND,
    array_digest,
    records_digest,
    validate_field_name,
)

__all__ = [
    "ExportSummary",
    "export_snapshot",
    "sweep_leftovers",
    "CODECS",
    "DEFAULT_LOCAL_CODEC",
    "DEFAULT_REMOTE_CODEC",
    "default_codec",
    "DEFAULT_CHUNK_BYTES",
    "RAW_CHUNK_BYTES",
    "DEFAULT_CLEVEL",
    "FieldWriter",
    "compressors_for",
    "export_lock",
]

log = logging.getLogger(__name__)

#: Smallest uncompressed chunk of a data array, in bytes, for a compressing codec: a
#: read decompresses whole chunks, so they stay small.
DEFAULT_CHUNK_BYTES = 256 * 1024
#: The same for ``codec="none"``: a local read takes only a record's own rows from a
#: chunk file, whatever its size, so chunks are large (fewer files to open, keep open
#: and fsync).
RAW_CHUNK_BYTES = 16 * 1024 * 1024
#: Blosc's ``clevel`` (1-9, one scale for every blosc codec; blosc maps it onto the
#: codec's own levels, so it is not a zstd level). docs/BENCHMARKS.md compares levels.
DEFAULT_CLEVEL = 3
#: Elements per chunk of the index arrays (ids, offsets, headers are read whole).
_INDEX_CHUNK = 1 << 20
_HEADER_CHUNK_BYTES = 256 * 1024
#: fsyncs in flight at the end of a local export.
_FSYNC_THREADS = 16


@dataclass
class ExportSummary:
    """What an export wrote: samples, what it left out and why, sizes and time."""

    fingerprint: str
    destination: str
    samples: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    record_bytes: int = 0
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "destination": self.destination,
            "samples": self.samples,
            "skipped": dict(self.skipped),
            "record_bytes": self.record_bytes,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class _FieldLayout:
    dtype: str  # safetensors name (F32 ...)
    trailing: tuple[int, ...]  # shape after the first axis
    scalar: bool  # 0-d tensors: one row per record
    rows: list[int] = field(default_factory=list)

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype("uint16" if self.dtype == "BF16" else DTYPES[self.dtype])

    def rows_of(self, shape: tuple[int, ...]) -> int:
        return 1 if self.scalar else shape[0]

    def describe(self, meaning: str) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "zarr_dtype": str(self.numpy_dtype),
            "shape": [] if self.scalar else [None, *self.trailing],
            "meaning": meaning,
        }


@dataclass
class _Survey:
    """Pass one: the records to export, their headers and the field layouts."""

    sample_ids: list[str] = field(default_factory=list)
    headers: list[bytes] = field(default_factory=list)
    checksums: list[str] = field(default_factory=list)
    fields: dict[str, _FieldLayout] = field(default_factory=dict)
    bad: dict[str, str] = field(default_factory=dict)
    record_bytes: int = 0
    descriptors: dict[str, Descriptor] = field(default_factory=dict)  # by digest


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="rec", disable=not enabled, leave=False)


def _layout_problem(layouts: Mapping[str, _FieldLayout], header: RecordHeader) -> str | None:
    if set(header.tensors) != set(layouts):
        return f"fields {sorted(header.tensors)} differ from the first record's {sorted(layouts)}"
    for name, info in header.tensors.items():
        lay = layouts[name]
        if (
            info.dtype != lay.dtype
            or (len(info.shape) == 0) != lay.scalar
            or (not lay.scalar and tuple(info.shape[1:]) != lay.trailing)
        ):
            return (
                f"field {name!r} is {info.dtype} {list(info.shape)}, unlike the first "
                f"record's {lay.dtype} {'[]' if lay.scalar else ['*', *lay.trailing]}"
            )
    return None


def _survey(store: Store, index: DatasetIndex, progress: bool) -> _Survey:
    survey = _Survey()
    with _progress(len(index), "checking", progress) as bar:
        for sample_id in index.sample_ids.tolist():
            key = f"{index.fingerprint}/{sample_id}"
            bar.update(1)
            try:
                with store.read_view(key) as value:  # checked in place, not copied
                    header = check_record(value, key=key, lookup=store.descriptor)
                    header_bytes = bytes(memoryview(value)[8 : header.data_start])
                    size = len(value)
            except (RecordNotFound, CorruptRecord) as exc:
                survey.bad[key] = exc.reason if isinstance(exc, CorruptRecord) else "no record"
                continue
            if not survey.fields:
                survey.fields = {
                    validate_field_name(name): _FieldLayout(
                        info.dtype, tuple(info.shape[1:]), len(info.shape) == 0
                    )
                    for name, info in sorted(header.tensors.items())
                }
            problem = _layout_problem(survey.fields, header)
            if problem:
                survey.bad[key] = problem
                continue
            for name, lay in survey.fields.items():
                lay.rows.append(lay.rows_of(header.tensors[name].shape))
            digest = header.metadata.get("descriptor")
            if digest is not None and digest not in survey.descriptors:  # checked just now
                survey.descriptors[digest] = store.descriptor(index.fingerprint, digest)
            survey.sample_ids.append(sample_id)
            survey.headers.append(header_bytes)
            survey.checksums.append(header.checksum)
            survey.record_bytes += size
    return survey


#: Chunk codecs offered: blosc with zstd compresses best; lz4hc reads 1.2-1.9x faster at
#: 11-15% more size and exports slowest; lz4 exports fastest of the three; ``none``
#: stores the rows as they are (with their CRC-32C), and a local reader then reads only
#: a record's own bytes, as from the LMDB cache. docs/BENCHMARKS.md compares them.
CODECS = ("zstd", "lz4hc", "lz4", "none")
#: Chosen by measurement (docs/BENCHMARKS.md): a local snapshot is for reading
#: (training), and only ``none`` lets a read take just the record's bytes (0.6-0.95x the
#: LMDB cache's rate, vs 0.15-0.45x for lz4 and 0.08-0.4x for zstd, which decompress
#: whole chunks), at the cache's own size; an object-store snapshot is for moving and
#: sharing, read through zarr one whole chunk at a time, so there the smallest: zstd
#: (~2.8x smaller than the records on spc_query data).
DEFAULT_LOCAL_CODEC = "none"
DEFAULT_REMOTE_CODEC = "zstd"


def default_codec(dest: str | os.PathLike[str]) -> str:
    """The codec an export to ``dest`` uses when none is named."""
    return DEFAULT_LOCAL_CODEC if parse_location(dest).is_local else DEFAULT_REMOTE_CODEC


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
    :class:`~cache_store.snapshot.chunks.LocalChunkWriter`."""

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


def _even(total: int, per_chunk: int) -> int:
    """``per_chunk`` lowered so that ``total`` splits into as many chunks, evenly: the
    last chunk (stored at full size, padded) is then not mostly padding."""
    return math.ceil(total / math.ceil(total / per_chunk)) if total > per_chunk else per_chunk


def _chunk_rows(lay: _FieldLayout, n: int, chunk_bytes: int) -> int:
    """Rows per chunk: records of one size get whole records per chunk (a sample is
    never split); otherwise at least the mean record. About ``chunk_bytes`` each, the
    rows split evenly between the chunks."""
    total = sum(lay.rows)
    row_bytes = lay.numpy_dtype.itemsize * math.prod(lay.trailing)
    if n and lay.rows[0] > 0 and all(r == lay.rows[0] for r in lay.rows):
        record_bytes = lay.rows[0] * row_bytes
        per_chunk = max(1, chunk_bytes // record_bytes) if record_bytes else n
        return lay.rows[0] * _even(n, min(n, per_chunk))
    mean_rows = math.ceil(total / n) if n else 1
    by_bytes = math.ceil(chunk_bytes / row_bytes) if row_bytes else total
    rows = max(1, min(max(total, 1), max(mean_rows, by_bytes)))
    return max(_even(total, rows), min(rows, mean_rows))


def _zarr_write(array: Any) -> Any:
    def write(start: int, rows: np.ndarray) -> None:
        array[start : start + rows.shape[0]] = rows

    return write


def _write_group(
    group: Any,
    store: Store,
    index: DatasetIndex,
    survey: _Survey,
    attrs: dict[str, Any],
    chunk_bytes: int,
    clevel: int,
    codec: str,
    progress: bool,
    local_dir: Path | None = None,
) -> None:
    """Write every array of a fingerprint group, then its attributes (still incomplete).

    ``local_dir``: the group's directory when it is local; its data chunks are then
    compressed in parallel by :class:`~cache_store.snapshot.chunks.LocalChunkWriter`, or
    (codec ``none``) streamed by :class:`~cache_store.snapshot.chunks.RawChunkAppender`
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
    survey: _Survey,
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
        chunk = _chunk_rows(lay, n, chunk_bytes)
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
        with _progress(n, "writing", progress) as bar:
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
    writers: Mapping[str, Any], survey: _Survey, key: str, value: Any, checked_header: bytes
) -> None:
    """One record's rows to every field's writer, after checking it is the record the
    first pass checked (its header the same bytes: the same descriptor too)."""
    header = check_record(value, key=key, lookup=lambda fp, digest: _surveyed(survey, fp, digest))
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


def _surveyed(survey: _Survey, fingerprint: str, digest: str) -> Descriptor:
    found = survey.descriptors.get(digest)
    if found is None or found.fingerprint != fingerprint:
        raise CorruptRecord(
            descriptor_name(fingerprint, digest), "not named by a record the export checked"
        )
    return found


def _snapshot_attrs(
    index: DatasetIndex, survey: _Survey, source: str, token: str
) -> dict[str, Any]:
    spec = RECIPE_SPECS.get(index.recipe)
    meanings = {name: f.meaning for name, f in spec.fields.items()} if spec else {}
    from cache_store import __version__

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


def _ensure_root(zstore: Any, where: str) -> Any:
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


# --------------------------------------------------------------------------- local


@contextlib.contextmanager
def export_lock(dest: Path) -> Iterator[None]:
    fd = os.open(dest, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SpcacheError(f"{dest}: another export is writing this snapshot") from None
        yield
    finally:
        os.close(fd)  # releases the lock


def sweep_leftovers(dest: str | os.PathLike[str]) -> int:
    """Remove what killed exports left at a local destination: hidden staging or
    replaced directories beside it and zarr's ``*.partial`` files inside it. Only safe
    while no export is writing (:func:`export_snapshot` holds the lock when it calls
    this). Returns the number of paths removed."""
    dest = Path(local_path(dest))
    removed = 0
    for pattern in (f".{dest.name}.*.staging", f".{dest.name}.*.old"):
        for path in dest.parent.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    if dest.is_dir():
        for path in dest.rglob("*.partial"):
            path.unlink(missing_ok=True)
            removed += 1
    if removed:
        log.warning("%s: removed %d leftover(s) of interrupted exports", dest, removed)
    return removed


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``, several at once: each fsync mostly
    waits on the disk, and a snapshot is thousands of chunk files (one at a time took
    0.7 s for 1,200 chunks, 16% of an export)."""
    files: list[str] = []
    dirs: list[Path] = []
    for dirpath, _, filenames in os.walk(root):
        files.extend(os.path.join(dirpath, name) for name in filenames)
        dirs.append(Path(dirpath))
    with cf.ThreadPoolExecutor(_FSYNC_THREADS, thread_name_prefix="spcache-fsync") as pool:
        list(pool.map(_fsync_file, files))
        list(pool.map(_fsync_dir, dirs))


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _existing_complete(path: Path) -> bool | None:
    """None: nothing there; else whether the group there is a complete snapshot."""
    meta = path / "zarr.json"
    if not path.exists():
        return None
    if not meta.is_file():
        return False
    import json

    try:
        attrs = json.loads(meta.read_text("utf-8")).get("attributes", {}).get(ATTRS_KEY, {})
    except (ValueError, AttributeError):
        return False
    return bool(isinstance(attrs, dict) and attrs.get("complete"))


def _export_local(
    dest: Path,
    store: Store,
    index: DatasetIndex,
    survey: _Survey,
    overwrite: bool,
    chunk_bytes: int,
    clevel: int,
    codec: str,
    progress: bool,
) -> None:
    import zarr
    from zarr.storage import LocalStore

    if dest.exists() and not dest.is_dir():
        raise SpcacheError(f"{dest}: exists and is not a directory")
    if dest.is_dir() and any(dest.iterdir()) and not (dest / "zarr.json").is_file():
        raise SpcacheError(f"{dest}: a non-empty directory that is not a Zarr snapshot")
    dest.mkdir(parents=True, exist_ok=True)
    with export_lock(dest):
        sweep_leftovers(dest)
        _ensure_root(LocalStore(dest), str(dest))
        target = dest / index.fingerprint
        if _existing_complete(target) and not overwrite:
            raise SpcacheError(
                f"{target}: fingerprint already exported; pass overwrite "
                f"(--overwrite) to replace it"
            )
        token = uuid.uuid4().hex
        staging = dest.parent / f".{dest.name}.{index.fingerprint}.{token}.staging"
        try:
            group = zarr.create_group(LocalStore(staging))
            attrs = _snapshot_attrs(index, survey, store.location, token)
            _write_group(
                group,
                store,
                index,
                survey,
                attrs,
                chunk_bytes,
                clevel,
                codec,
                progress,
                local_dir=staging,
            )
            attrs["complete"] = True
            group.update_attributes({ATTRS_KEY: attrs})
            _fsync_tree(staging)
            old = None
            if target.exists():
                old = dest.parent / f".{dest.name}.{index.fingerprint}.{token}.old"
                os.rename(target, old)
            os.rename(staging, target)
            _fsync_dir(dest)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


# --------------------------------------------------------------------------- remote


def _export_remote(
    url: str,
    store: Store,
    index: DatasetIndex,
    survey: _Survey,
    overwrite: bool,
    chunk_bytes: int,
    clevel: int,
    codec: str,
    progress: bool,
    storage_options: Mapping[str, Any] | None,
) -> None:
    import zarr
    from zarr.storage import FsspecStore

    zstore = FsspecStore.from_url(
        url, read_only=False, storage_options=dict(storage_options or {}) or None
    )
    root = _ensure_root(zstore, url)
    fp = index.fingerprint
    if fp in root:
        existing = root[fp].attrs.get(ATTRS_KEY, {})
        if isinstance(existing, dict) and existing.get("complete") and not overwrite:
            raise SpcacheError(
                f"{url}/{fp}: fingerprint already exported; pass overwrite "
                f"(--overwrite) to replace it"
            )
        del root[fp]
    token = uuid.uuid4().hex
    attrs = _snapshot_attrs(index, survey, store.location, token)
    group = root.create_group(fp, attributes={ATTRS_KEY: dict(attrs)})
    _write_group(group, store, index, survey, attrs, chunk_bytes, clevel, codec, progress)
    now = zarr.open_group(zstore, mode="r", path=fp).attrs.get(ATTRS_KEY, {})
    if not isinstance(now, dict) or now.get("writer") != token:
        raise SpcacheError(
            f"{url}/{fp}: another export wrote this fingerprint meanwhile; "
            f"run one export per destination and export again"
        )
    attrs["complete"] = True
    group.update_attributes({ATTRS_KEY: attrs})


# --------------------------------------------------------------------------- entry


def export_snapshot(
    source: Store | str | os.PathLike[str],
    fingerprint: str,
    dest: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    skip_bad: bool = False,
    chunk_bytes: int | None = None,
    clevel: int = DEFAULT_CLEVEL,
    codec: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> ExportSummary:
    """Export the records of ``fingerprint`` in ``source`` to the snapshot ``dest``.

    Args:
        source: a store, or a cache location for :func:`open_store` (read-only).
        fingerprint: the dataset to export (its index gives the records and their order).
        dest: ``*.zarr`` path, ``file://`` URL or fsspec URL; other fingerprints already
            there are kept.
        overwrite: replace an already exported fingerprint. Open readers re-open it when
            a read finds the replaced files; until then they may serve records of the
            old export from their chunk caches (whole, verified records).
        skip_bad: leave out records that are missing, corrupt or shaped unlike the
            first one (each is logged and listed in the summary) instead of failing.
        chunk_bytes: smallest uncompressed chunk of a data array (default
            :data:`DEFAULT_CHUNK_BYTES`, or :data:`RAW_CHUNK_BYTES` for ``codec="none"``).
        clevel: blosc's compression level, 1-9 for any codec (blosc maps it onto the
            codec's own scale: not a zstd level).
        codec: one of :data:`CODECS` (any reader decodes all); default
            :func:`default_codec`: ``none`` for a local destination, ``zstd`` for a URL.
        storage_options: fsspec options for a URL ``dest``.
        progress: show progress bars (stderr).

    Returns:
        ExportSummary.

    Raises:
        FingerprintLookupError: ``fingerprint`` has no index in ``source``.
        SpcacheError: bad records (without ``skip_bad``), an existing export (without
            ``overwrite``), a concurrent export, a destination that is not a snapshot.
    """
    validate_fingerprint(fingerprint)
    if not 1 <= int(clevel) <= 9:
        raise ParameterError([f"clevel: {clevel!r} is outside 1..9"])
    if codec is None:
        codec = default_codec(dest)
    if codec not in CODECS:
        raise UnknownName("snapshot codec", codec, CODECS)
    if chunk_bytes is None:
        chunk_bytes = RAW_CHUNK_BYTES if codec == "none" else DEFAULT_CHUNK_BYTES
    if int(chunk_bytes) < 1:
        raise ParameterError([f"chunk_bytes: {chunk_bytes!r} must be positive"])
    started = time.perf_counter()
    owned = not isinstance(source, Store)
    store = source if isinstance(source, Store) else open_store(source, readonly=True)
    try:
        index = store.get_index(fingerprint)
        survey = _survey(store, index, progress)
        if survey.bad:
            for key, reason in survey.bad.items():
                log.warning("export: %s: %s", key, reason)
            if not skip_bad:
                listed = "; ".join(f"{k}: {r}" for k, r in list(survey.bad.items())[:20])
                raise SpcacheError(
                    f"{len(survey.bad)} record(s) of {fingerprint} cannot be "
                    f"exported (skip_bad / --skip-bad leaves them out): {listed}"
                )
        if parse_location(dest).is_local:
            _export_local(
                Path(local_path(dest)).absolute(),
                store,
                index,
                survey,
                overwrite,
                int(chunk_bytes),
                int(clevel),
                codec,
                progress,
            )
        else:
            _export_remote(
                os.fspath(dest),
                store,
                index,
                survey,
                overwrite,
                int(chunk_bytes),
                int(clevel),
                codec,
                progress,
                storage_options,
            )
    finally:
        if owned:
            store.close()
    summary = ExportSummary(
        fingerprint,
        os.fspath(dest),
        len(survey.sample_ids),
        dict(survey.bad),
        survey.record_bytes,
        time.perf_counter() - started,
    )
    log.info(
        "exported %d records of %s to %s in %.1f s",
        summary.samples,
        fingerprint,
        summary.destination,
        summary.seconds,
    )
    return summary
