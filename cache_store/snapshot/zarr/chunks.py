"""A local snapshot's chunk files read and written directly, without zarr's codec pipeline.

Only for the exact layout :mod:`cache_store.snapshot.zarr.export` writes (regular chunks along axis 0,
default "/" chunk keys, little-endian bytes -> blosc -> crc32c); anything else is read
and written through zarr, which also writes every array's metadata. ``bench/zarr_snapshot.py``
compares the two ways of reading (docs/BENCHMARKS.md); the writer exists because zarr's
per-call overhead made an export 2-3x slower than the LMDB ingest of the same records.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import math
import os
import threading
from typing import Any

import numpy as np

__all__ = [
    "ChunkWriterPool",
    "LocalChunkReader",
    "LocalChunkWriter",
    "RawChunkAppender",
    "check_chunk_crc",
    "chunk_key",
]


def supports_direct(array: Any) -> bool:
    """Whether ``array`` has exactly the layout this module reads and writes."""
    meta = array.metadata
    try:
        codecs = [c.to_dict() for c in meta.codecs]
        separator = meta.chunk_key_encoding.separator
        name = meta.chunk_key_encoding.name
    except AttributeError:
        return False
    little = ({"name": "bytes"}, {"name": "bytes", "configuration": {"endian": "little"}})
    blosc = len(codecs) == 3 and codecs[1].get("name") == "blosc"
    return (
        len(codecs) in (2, 3)
        and codecs[0] in little
        and (blosc or len(codecs) == 2)
        and codecs[-1] == {"name": "crc32c"}
        and name == "default"
        and separator == "/"
        and all(c >= s for c, s in zip(array.chunks[1:], array.shape[1:], strict=True))
        and not isinstance(getattr(array, "shards", None), tuple)
    )


def check_chunk_crc(raw: bytes, key: str) -> bytes:
    """The body of chunk file ``raw`` (named ``key``), after checking the CRC-32C the
    exporter's last codec appended; ``ValueError`` when it does not match."""
    import google_crc32c

    body = raw[:-4]
    if len(raw) < 4 or np.uint32(google_crc32c.value(body)).tobytes() != raw[-4:]:
        raise ValueError(f"chunk {key}: stored and computed CRC-32C do not match")
    return body


def chunk_key(index: int, ndim: int) -> str:
    """Chunk ``index`` (axis 0) of an ``ndim``-d array: its file under the array's
    directory, with zarr's default "/" chunk keys."""
    return "/".join(["c", str(index)] + ["0"] * (ndim - 1))


def _new_chunk_path(directory: str, key: str) -> str:
    path = os.path.join(directory, *key.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


class _ChunkFile(io.FileIO):
    """A chunk file kept open by a reader: closed, without a ResourceWarning, when its
    last reference goes (the reader dropped it and no read holds it)."""

    def __del__(self) -> None:
        if not self.closed:
            self.close()


class LocalChunkReader:
    """Reads rows of one array of a *local* snapshot straight from its chunk files.

    Only for the exact layout the exporter writes (regular chunks along axis 0, default
    "/" chunk keys, little-endian bytes -> blosc -> crc32c); anything else is read through
    zarr. Skipping zarr's async pipeline matters for per-sample reads: a record is a
    dozen small reads, and each costs a few hops between threads there.

    Decoded chunks are kept, the most recent first, up to ``cache_bytes`` (at least
    ``min_chunks``). A small field (``center``, ``scale``, ``pyramid``) holds thousands of
    records per chunk: with only the last two chunks kept, every shuffled read
    decompressed a whole chunk per small field to take a few bytes of it; kept, its
    array is decoded once per process.


    Uncompressed chunks (the ``none`` codec: rows, then a CRC-32C) are not decoded
    whole: the rows asked for are read from the file with ``pread`` (open files kept, at
    most ``keep_files``), as LMDB reads a record from its map. The chunk's CRC covers the
    whole chunk and so is not checked on such a read; what is returned is checked
    anyway, by the per-field xxh3 of the record it belongs to (every read verifies it).
    """

    def __init__(
        self,
        directory: str,
        array: Any,
        cache_bytes: int = 16 << 20,
        min_chunks: int = 2,
        keep_files: int = 16,
    ) -> None:
        self.directory = directory
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype)
        self.chunk_shape = tuple(array.chunks)
        chunk_bytes = max(math.prod(self.chunk_shape) * self.dtype.itemsize, 1)
        self.cache_chunks = max(min_chunks, cache_bytes // chunk_bytes)
        self._cache: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()  # the service reads from several threads
        # rows read in place: no compressor, and a chunk's rows as wide as the array's
        self.raw = len(array.metadata.codecs) == 2 and tuple(self.chunk_shape[1:]) == tuple(
            self.shape[1:]
        )
        self.row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        self.chunk_file_bytes = chunk_bytes + 4
        self.keep_files = keep_files
        self.codec_names = [c.to_dict()["name"] for c in array.metadata.codecs]
        self._files: dict[int, _ChunkFile] = {}  # chunk index -> open file, oldest first

    @classmethod
    def supports(cls, array: Any) -> bool:
        return supports_direct(array)

    def _chunk(self, index: int) -> np.ndarray:
        with self._lock:
            cached = self._cache.pop(index, None)
            if cached is not None:
                self._cache[index] = cached  # most recently used last
        if cached is not None:
            return cached
        import numcodecs

        key = chunk_key(index, len(self.chunk_shape))
        raw = self.chunk_bytes(index)
        if raw is None:  # never written: all fill value (0)
            chunk = np.zeros(self.chunk_shape, dtype=self.dtype)
        else:
            body = check_chunk_crc(raw, key)
            if "blosc" in self.codec_names:
                try:
                    decoded = numcodecs.Blosc().decode(body)
                except (RuntimeError, ValueError, TypeError) as exc:
                    raise ValueError(f"chunk {key}: {exc}") from None
            else:
                decoded = body
            chunk = np.frombuffer(decoded, dtype=self.dtype)
            if chunk.size != math.prod(self.chunk_shape):
                raise ValueError(
                    f"chunk {key}: decodes to {chunk.size} items, "
                    f"expected {math.prod(self.chunk_shape)}"
                )
            chunk = chunk.reshape(self.chunk_shape)
        with self._lock:
            while len(self._cache) >= self.cache_chunks:
                self._cache.pop(next(iter(self._cache)))
            self._cache[index] = chunk
        return chunk

    def chunk_bytes(self, index: int) -> bytes | None:
        """Chunk ``index``'s file as stored (rows or blosc frame, then its CRC-32C); None
        when it was never written."""
        key = chunk_key(index, len(self.chunk_shape))
        try:
            with open(os.path.join(self.directory, *key.split("/")), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _file(self, index: int) -> _ChunkFile | None:
        """Chunk ``index``'s file, open (kept, at most ``keep_files``), after checking its
        size; None: no file. A file object, not a bare fd: one dropped from the kept set
        stays open while a thread still reads it, and closes with its last reference
        (a bare fd closed there could be reused by another open mid-read)."""
        f = self._files.get(index)
        if f is not None:
            return f
        key = chunk_key(index, len(self.chunk_shape))
        try:
            f = _ChunkFile(os.path.join(self.directory, *key.split("/")), "r")
        except FileNotFoundError:  # never written: all fill value (0)
            return None
        size = os.fstat(f.fileno()).st_size
        if size != self.chunk_file_bytes:
            f.close()
            raise ValueError(
                f"chunk {key}: {size} bytes, expected {self.chunk_file_bytes} (rows and a CRC-32C)"
            )
        with self._lock:
            self._files[index] = f
            while len(self._files) > self.keep_files:
                self._files.pop(next(iter(self._files)))
        return f

    def _read_rows(self, index: int, lo: int, hi: int) -> np.ndarray:
        want = (hi - lo) * self.row_bytes
        f = self._file(index)
        if f is None:
            return np.zeros((hi - lo, *self.shape[1:]), dtype=self.dtype)
        data = os.pread(f.fileno(), want, lo * self.row_bytes)
        if len(data) != want:
            raise ValueError(f"chunk c/{index}: {len(data)} of {want} bytes read")
        return np.frombuffer(data, dtype=self.dtype).reshape(hi - lo, *self.shape[1:])

    def read_into(self, start: int, stop: int, out: memoryview) -> None:
        """Write rows ``start:stop`` into ``out`` (exactly their bytes): an uncompressed
        chunk's rows straight from its file (``preadv``), others from the decoded chunk."""
        row_bytes = self.row_bytes
        if (stop - start) * row_bytes != out.nbytes:
            raise ValueError(
                f"rows {start}:{stop} are {(stop - start) * row_bytes} bytes, not {out.nbytes}"
            )
        if not self.raw:
            out[:] = np.ascontiguousarray(self.rows(start, stop)).view(np.uint8).reshape(-1).data
            return
        step = self.chunk_shape[0]
        at = 0
        for index in range(start // step, (stop - 1) // step + 1 if stop > start else 0):
            lo = max(start, index * step) - index * step
            hi = min(stop, (index + 1) * step) - index * step
            part = out[at : at + (hi - lo) * row_bytes]
            f = self._file(index)
            if f is None:
                part[:] = bytes(part.nbytes)
            elif os.preadv(f.fileno(), [part], lo * row_bytes) != part.nbytes:
                raise ValueError(f"chunk c/{index}: short read")
            at += part.nbytes

    def close(self) -> None:
        """Drop the chunk files kept open (each closes once no read holds it)."""
        with self._lock:
            self._files = {}

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` (axis 0), all of the other axes."""
        trailing = tuple(self.shape[1:])
        step = self.chunk_shape[0]
        pieces = []
        for index in range(start // step, (stop - 1) // step + 1 if stop > start else 0):
            lo, hi = (
                max(start, index * step) - index * step,
                min(stop, (index + 1) * step) - index * step,
            )
            if self.raw:
                pieces.append(self._read_rows(index, lo, hi))
                continue
            chunk = self._chunk(index)
            pieces.append(chunk[(slice(lo, hi), *(slice(0, d) for d in trailing))])
        if not pieces:
            return np.empty((0, *trailing), dtype=self.dtype)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


class ChunkWriterPool:
    """Threads that compress and write chunk files for :class:`LocalChunkWriter`.

    Blosc releases the GIL, so chunks of one export compress in parallel (one blosc
    thread each: numcodecs compresses single-threaded off the main thread). At most
    ``2 * threads`` chunks wait or run at once, so memory stays a few chunks, not the
    snapshot. The first failure is raised by :meth:`submit` or :meth:`finish`.
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or max(1, min(8, os.cpu_count() or 1))
        self._pool = cf.ThreadPoolExecutor(self.threads, thread_name_prefix="spcache-chunks")
        self._slots = threading.BoundedSemaphore(2 * self.threads)
        self._pending: set[cf.Future[None]] = set()

    def submit(self, job: Any, *args: Any) -> None:
        self._slots.acquire()
        try:
            future = self._pool.submit(job, *args)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        self._pending.add(future)
        done = {f for f in self._pending if f.done()}
        self._pending -= done
        for f in done:
            f.result()

    def finish(self) -> None:
        """Wait for every chunk; raise the first failure."""
        pending, self._pending = self._pending, set()
        for f in pending:
            f.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class LocalChunkWriter:
    """Writes whole chunks of one array of a *local* snapshot straight to their files.

    The array (its ``zarr.json``) is created by zarr; only its chunks are written here, in
    the very bytes zarr would write (little-endian rows, blosc with the array's cname,
    clevel, shuffle and typesize, then the CRC-32C of that, little-endian), so zarr and
    :class:`LocalChunkReader` read them alike (tests read exports both ways). A chunk
    past the end is padded with the fill value (0), as zarr stores a regular grid.
    """

    def __init__(self, directory: str, array: Any, pool: ChunkWriterPool) -> None:
        if not supports_direct(array):
            raise ValueError(f"{directory}: not a layout LocalChunkWriter writes")
        import numcodecs

        self.directory = directory
        self.dtype = np.dtype(array.dtype).newbyteorder("<")
        self.chunk_shape = tuple(array.chunks)
        self.pool = pool
        codecs = [c.to_dict() for c in array.metadata.codecs]
        if len(codecs) != 3:
            raise ValueError(f"{directory}: uncompressed chunks are written by RawChunkAppender")
        blosc = codecs[1]["configuration"]
        self.codec = numcodecs.Blosc(
            cname=blosc["cname"],
            clevel=int(blosc["clevel"]),
            shuffle={
                "noshuffle": numcodecs.Blosc.NOSHUFFLE,
                "shuffle": numcodecs.Blosc.SHUFFLE,
                "bitshuffle": numcodecs.Blosc.BITSHUFFLE,
            }[blosc["shuffle"]],
            blocksize=int(blosc.get("blocksize", 0)),
        )
        if int(blosc.get("typesize", self.dtype.itemsize)) != self.dtype.itemsize:
            raise ValueError(
                f"{directory}: blosc typesize {blosc['typesize']} is not the "
                f"dtype's itemsize {self.dtype.itemsize}"
            )

    def write(self, start: int, rows: np.ndarray) -> None:
        """Write ``rows`` from row ``start`` (a chunk boundary) on, one file per chunk;
        only the last chunk may be partial. ``rows`` may be reused once this returns."""
        step = self.chunk_shape[0]
        if start % step:
            raise ValueError(f"{self.directory}: write at row {start}, not a chunk boundary")
        for lo in range(0, rows.shape[0], step):
            part = rows[lo : lo + step]
            chunk = np.zeros(self.chunk_shape, dtype=self.dtype)
            chunk[(slice(0, part.shape[0]), *(slice(0, d) for d in part.shape[1:]))] = part
            self.pool.submit(self._write_chunk, (start + lo) // step, chunk)

    def _write_chunk(self, index: int, chunk: np.ndarray) -> None:
        import google_crc32c

        body = self.codec.encode(chunk)
        with open(
            _new_chunk_path(self.directory, chunk_key(index, len(self.chunk_shape))), "wb"
        ) as f:
            f.write(body)
            f.write(np.uint32(google_crc32c.value(body)).astype("<u4").tobytes())


class RawChunkAppender:
    """Streams rows into the chunk files of one *uncompressed* array (``none`` codec) of a
    local snapshot, as they come: each chunk file is the rows, then the CRC-32C of them
    (little-endian), exactly what zarr writes for ``bytes -> crc32c``; the last chunk is
    padded with the fill value (0). Nothing is buffered or encoded, so an uncompressed
    export costs one write and one CRC pass over the data.
    """

    def __init__(self, directory: str, array: Any) -> None:
        if not supports_direct(array) or len(array.metadata.codecs) != 2:
            raise ValueError(f"{directory}: not an uncompressed layout RawChunkAppender writes")
        self.directory = directory
        self.dtype = np.dtype(array.dtype).newbyteorder("<")
        self.chunk_shape = tuple(array.chunks)
        if tuple(self.chunk_shape[1:]) != tuple(array.shape[1:]):
            raise ValueError(f"{directory}: chunks narrower or wider than the rows")
        self.chunk_bytes = math.prod(self.chunk_shape) * self.dtype.itemsize
        self._index = 0
        self._file: Any = None
        self._crc = 0
        self._filled = 0

    def add(self, rows: np.ndarray) -> None:
        """Append ``rows`` (the array's dtype and trailing shape) after the last ones."""
        import google_crc32c

        # uint8 arrays, not memoryviews: google_crc32c takes arrays (and bytes) only
        data = np.ascontiguousarray(rows, dtype=self.dtype).reshape(-1).view(np.uint8)
        while data.nbytes:
            if self._file is None:
                key = chunk_key(self._index, len(self.chunk_shape))
                self._file = open(_new_chunk_path(self.directory, key), "wb")  # noqa: SIM115
                self._crc, self._filled = 0, 0
            part = data[: self.chunk_bytes - self._filled]
            self._file.write(part)
            self._crc = google_crc32c.extend(self._crc, part)
            self._filled += part.nbytes
            data = data[part.nbytes :]
            if self._filled == self.chunk_bytes:
                self._end_chunk()

    def flush(self, final: bool = True) -> None:
        """Pad and close the last chunk (``final``; rows are never held back)."""
        if final and self._file is not None:
            self.add(
                np.zeros(
                    (self.chunk_bytes - self._filled) // self.dtype.itemsize, dtype=self.dtype
                ).reshape(-1, *self.chunk_shape[1:])
            )

    def _end_chunk(self) -> None:
        self._file.write(np.uint32(self._crc).astype("<u4").tobytes())
        self._file.close()
        self._file = None
        self._index += 1

    def close(self) -> None:
        """Close a chunk left open by a failed export (its staging is removed anyway)."""
        if self._file is not None:
            self._file.close()
            self._file = None
