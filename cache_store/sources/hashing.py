"""Content hashes of source files, shared by the service and the workers.

A record stores the hash of the source it was computed from (``source_hash``); the
service compares it with the file's current hash to tell "already ready" from "stale",
so both sides must hash the same way. Format: ``"xxh3_128:<32 hex digits>"`` over the
file's bytes (the same value ``workers.source_load.hash_bytes`` gives them). Files are hashed
only through the source gate, :func:`cache_store.sources.files.hash_source_file`.
"""

from __future__ import annotations

import xxhash

__all__ = ["HASH_PREFIX", "hash_bytes"]

HASH_PREFIX = "xxh3_128:"


def hash_bytes(data: bytes | memoryview) -> str:
    """Content hash of ``data``: ``"xxh3_128:<32 hex digits>"``."""
    return HASH_PREFIX + xxhash.xxh3_128_hexdigest(data)
