"""Reading a local snapshot's chunk files directly, without zarr's codec pipeline.

Only for the exact layout :mod:`cache_store.export` writes (regular chunks along axis 0,
default "/" chunk keys, little-endian bytes -> blosc -> crc32c); anything else is read
through zarr. ``bench/zarr_snapshot.py`` compares the two (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import numpy as np

__all__ = ["LocalChunkReader"]


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
    """

    def __init__(self, directory: str, array: Any, cache_bytes: int = 16 << 20,
                 min_chunks: int = 2) -> None:
        self.directory = directory
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype)
        self.chunk_shape = tuple(array.chunks)
        chunk_bytes = max(math.prod(self.chunk_shape) * self.dtype.itemsize, 1)
        self.cache_chunks = max(min_chunks, cache_bytes // chunk_bytes)
        self._cache: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()  # the service reads from several threads

    @classmethod
    def supports(cls, array: Any) -> bool:
        meta = array.metadata
        try:
            codecs = [c.to_dict() for c in meta.codecs]
            separator = meta.chunk_key_encoding.separator
            name = meta.chunk_key_encoding.name
        except AttributeError:
            return False
        little = ({"name": "bytes"}, {"name": "bytes", "configuration": {"endian": "little"}})
        return (len(codecs) == 3 and codecs[0] in little and codecs[1].get("name") == "blosc" and codecs[2] == {"name": "crc32c"}
                and name == "default" and separator == "/"
                and all(c >= s for c, s in zip(array.chunks[1:], array.shape[1:], strict=True))
                and not isinstance(getattr(array, "shards", None), tuple))

    def _chunk(self, index: int) -> np.ndarray:
        with self._lock:
            cached = self._cache.pop(index, None)
            if cached is not None:
                self._cache[index] = cached  # most recently used last
        if cached is not None:
            return cached
        import google_crc32c
        import numcodecs

        parts = ["c", str(index)] + ["0"] * (len(self.chunk_shape) - 1)
        path = os.path.join(self.directory, *parts)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:  # never written: all fill value (0)
            chunk = np.zeros(self.chunk_shape, dtype=self.dtype)
        else:
            body = raw[:-4]
            if len(raw) < 4 or np.uint32(google_crc32c.value(body)).tobytes() != raw[-4:]:
                raise ValueError(f"chunk {'/'.join(parts)}: stored and computed CRC-32C "
                                 f"do not match")
            try:
                decoded = numcodecs.Blosc().decode(body)
            except (RuntimeError, ValueError, TypeError) as exc:
                raise ValueError(f"chunk {'/'.join(parts)}: {exc}") from None
            chunk = np.frombuffer(decoded, dtype=self.dtype)
            if chunk.size != math.prod(self.chunk_shape):
                raise ValueError(f"chunk {'/'.join(parts)}: decodes to {chunk.size} items, "
                                 f"expected {math.prod(self.chunk_shape)}")
            chunk = chunk.reshape(self.chunk_shape)
        with self._lock:
            while len(self._cache) >= self.cache_chunks:
                self._cache.pop(next(iter(self._cache)))
            self._cache[index] = chunk
        return chunk

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` (axis 0), all of the other axes."""
        trailing = tuple(self.shape[1:])
        step = self.chunk_shape[0]
        pieces = []
        for index in range(start // step, (stop - 1) // step + 1 if stop > start else 0):
            chunk = self._chunk(index)
            lo, hi = max(start, index * step) - index * step, min(stop, (index + 1) * step) - index * step
            pieces.append(chunk[(slice(lo, hi), *(slice(0, d) for d in trailing))])
        if not pieces:
            return np.empty((0, *trailing), dtype=self.dtype)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
