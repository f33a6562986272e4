"""The HTTP batch wire format, shared by the service (writes it) and ``HTTPStore`` (reads it).

``application/x-spcache-batch``, no pickle::

    u64 little-endian N | N bytes of JSON header | data

The header is ``{"format": "spcache-batch", "version": 1, "records": [{"id", "offset",
"length"[, "tag"]}, ...], "missing": [{"id", "error", "detail"}, ...]}``; each record's bytes are
``data[offset:offset + length]`` (a complete safetensors record), in request order. The
length prefix is the same u64 framing as a record's (:data:`cache_store.format.header.HEADER_LENGTH`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from cache_store.errors import CorruptRecord, UnsupportedFormat
from cache_store.format.header import HEADER_LENGTH

__all__ = ["BATCH_FORMAT", "BATCH_MEDIA_TYPE", "BATCH_VERSION", "decode_batch", "encode_batch"]

BATCH_MEDIA_TYPE = "application/x-spcache-batch"
BATCH_FORMAT = "spcache-batch"
BATCH_VERSION = 1


def encode_batch(
    records: Sequence[tuple[str, bytes]],
    missing: Sequence[tuple[str, str, str]] = (),
    tags: Sequence[str] | None = None,
) -> bytes:
    """Frame ``(id, record bytes)`` pairs and ``(id, error class, detail)`` misses;
    ``tags`` (one per record, :mod:`cache_store.format.tag`) go in the entries."""
    entries = []
    offset = 0
    for i, (sample_id, value) in enumerate(records):
        entry: dict[str, object] = {"id": sample_id, "offset": offset, "length": len(value)}
        if tags is not None:
            entry["tag"] = tags[i]
        entries.append(entry)
        offset += len(value)
    header = json.dumps(
        {
            "format": BATCH_FORMAT,
            "version": BATCH_VERSION,
            "records": entries,
            "missing": [{"id": i, "error": e, "detail": d} for i, e, d in missing],
        },
        separators=(",", ":"),
    ).encode("utf-8")
    return b"".join([HEADER_LENGTH.pack(len(header)), header, *(value for _, value in records)])


def decode_batch(
    body: bytes,
    *,
    where: str = "batch",
    tags: dict[str, str] | None = None,
) -> tuple[dict[str, memoryview], dict[str, str]]:
    """Inverse of :func:`encode_batch`: ``({id: record bytes}, {id: "Error: detail"})``;
    record tags, where the entries carry them, are added to ``tags`` when given.

    Record values are zero-copy views into ``body``. Raises :class:`CorruptRecord`
    (naming ``where``) on a malformed frame, :class:`UnsupportedFormat` on another version.
    """
    view = memoryview(body)
    if view.nbytes < HEADER_LENGTH.size:
        raise CorruptRecord(where, "batch response shorter than its header length")
    (n,) = HEADER_LENGTH.unpack_from(view, 0)
    if n > view.nbytes - HEADER_LENGTH.size:
        raise CorruptRecord(where, f"batch header length {n} exceeds the response")
    try:
        header = json.loads(bytes(view[HEADER_LENGTH.size : HEADER_LENGTH.size + n]))
    except ValueError as exc:
        raise CorruptRecord(where, f"batch header is not JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != BATCH_FORMAT:
        raise CorruptRecord(where, "not an spcache batch response")
    if header.get("version") != BATCH_VERSION:
        raise UnsupportedFormat(
            where,
            f"batch version {header.get('version')!r} is not "
            f"supported (this reader knows {BATCH_VERSION})",
        )
    data = view[HEADER_LENGTH.size + n :]
    found: dict[str, memoryview] = {}
    try:
        for entry in header["records"]:
            begin, length = int(entry["offset"]), int(entry["length"])
            if begin < 0 or length < 0 or begin + length > data.nbytes:
                raise CorruptRecord(where, f"record {entry['id']!r} lies outside the response")
            found[str(entry["id"])] = data[begin : begin + length]
            if tags is not None and isinstance(entry.get("tag"), str):
                tags[str(entry["id"])] = entry["tag"]
        missing = {str(m["id"]): f"{m['error']}: {m['detail']}" for m in header["missing"]}
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptRecord(where, f"malformed batch header: {exc!r}") from None
    return found, missing
