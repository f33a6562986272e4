"""Content hashes of source files, shared by the service and the workers.

A record stores the hash of the source it was computed from (``source_hash``); the
service compares it with the file's current hash to tell "already ready" from "stale",
so both sides must hash the same way. Format: ``"xxh3_128:<32 hex digits>"`` over the
file's bytes (the same value ``workers.sources.hash_bytes`` gives them).
"""

from __future__ import annotations

import os

import xxhash

from cache_store.errors import SourceError

__all__ = ["HASH_PREFIX", "hash_bytes", "hash_file"]

HASH_PREFIX = "xxh3_128:"
_BLOCK = 1 << 20


def hash_bytes(data: bytes | memoryview) -> str:
    """Content hash of ``data``: ``"xxh3_128:<32 hex digits>"``."""
    return HASH_PREFIX + xxhash.xxh3_128_hexdigest(data)


def hash_file(path: str | os.PathLike[str]) -> str:
    """Content hash of the file at ``path`` (streamed); raises :class:`SourceError`."""
    digest = xxhash.xxh3_128()
    try:
        with open(path, "rb") as fh:
            while block := fh.read(_BLOCK):
                digest.update(block)
    except OSError as exc:
        raise SourceError(path, f"cannot read file: {exc.strerror or exc}") from exc
    return HASH_PREFIX + digest.hexdigest()
