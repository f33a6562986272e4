"""Reading a stored record for an answer: size checks, read budget, ``?fields=``, ETag.

Shared by the record route (:mod:`service.routes_caches`), its fast path
(:mod:`service.fastpath`) and the previews (:mod:`service.routes_page`), so the three
answer the same bytes with the same validators; routes never import one another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Annotated, Any

from fastapi import Path
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from cache_store import usage
from cache_store.errors import (
    CacheDamaged,
    FingerprintRemoved,
    ParameterError,
    RecordNotFound,
    SpcacheError,
)
from cache_store.format.encode import select_fields
from cache_store.format.header import record_etag
from cache_store.format.tag import TAG_HEADER, tag_for_checksum
from cache_store.keys import FINGERPRINT_PATTERN, key_of_record_id
from cache_store.errors import ResponseTooLarge
from service.budget import record_length
from service.context import ServiceContext

__all__ = [
    "RecordStream",
    "RecordStreamResponse",
    "STREAM_GRACE_S",
    "STREAM_CHUNK",
    "Fingerprint",
    "RECORD_MEDIA_TYPE",
    "read_record",
    "read_stored",
    "record_etag",
    "etag_matches",
    "record_tag_header",
    "parse_fields",
    "note_read_hourly",
]

log = logging.getLogger(__name__)

RECORD_MEDIA_TYPE = "application/octet-stream"
#: "last read" of a fingerprint (spcache ls, prune): recorded at most once an hour each
note_read_hourly = usage.Throttle(usage.note_read, 3600.0)

#: Route path parameter: a cache's fingerprint.
Fingerprint = Annotated[
    str, Path(pattern=f"^{FINGERPRINT_PATTERN}$", description="32 lowercase hex characters")
]


def etag_matches(header: str | None, etag: str) -> bool:
    """Whether an ``If-None-Match`` header names ``etag`` (or is ``*``)."""
    if not header:
        return False
    if header.strip() == "*":
        return True
    return any(tag.strip() == etag for tag in header.split(","))


def read_stored(ctx: ServiceContext, key: str) -> bytes:
    """The stored bytes of ``key``; :class:`RecordNotFound` while there is no store yet."""
    store = ctx.store()
    if store is None:
        raise RecordNotFound(key, str(ctx.cache))
    return store.get(key)


def parse_fields(fields: str | None) -> list[str] | None:
    """The field names of a ``?fields=a,b`` query (None: every field)."""
    if fields is None:
        return None
    names = [f.strip() for f in fields.split(",") if f.strip()]
    if not names:
        raise ParameterError(["fields: empty list; leave it out to get every field"], what="query")
    return names


#: Whole records larger than this are streamed from the store in chunks of this size.
STREAM_CHUNK = 1 << 20


#: A large record's answer may take this long plus its size at the minimum rate.
STREAM_GRACE_S = 10.0


class RecordStream:
    """A whole record sent from the store's own memory (the LMDB map) in chunks of
    :data:`STREAM_CHUNK`: one chunk is copied at a time, and the lease that keeps the
    map's pages valid is held until :meth:`close` (after the last chunk). The answer
    must be sent within ``time_limit_s``; :meth:`send` cuts a slower client off."""

    def __init__(self, view: Any, stack: contextlib.ExitStack, time_limit_s: float) -> None:
        self.view = memoryview(view).cast("B")
        self._stack = stack
        self.time_limit_s = time_limit_s

    def __len__(self) -> int:
        return self.view.nbytes

    def chunks(self) -> Iterator[bytes]:
        for start in range(0, self.view.nbytes, STREAM_CHUNK):
            yield bytes(self.view[start : start + STREAM_CHUNK])

    async def send(self, send: Send, what: str) -> bool:
        """Send the chunks as the ASGI response body, each send waiting while the
        connection's buffer is full. A client still reading at the time limit is cut
        off: logged, the body left unfinished (the server closes the connection), False.
        The one rule for every route that streams a record."""
        started = time.monotonic()
        sent = 0
        for chunk in self.chunks():
            left = started + self.time_limit_s - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                await asyncio.wait_for(
                    send({"type": "http.response.body", "body": chunk, "more_body": True}), left
                )
            except TimeoutError:
                log.warning(
                    "%s: the client took too long (%d of %d bytes sent in %.0f s, the limit "
                    "for this size: SPCACHE_MIN_STREAM_BYTES_PER_S); connection closed",
                    what,
                    sent,
                    len(self),
                    time.monotonic() - started,
                )
                return False
            sent += len(chunk)
        await send({"type": "http.response.body", "body": b""})
        return True

    def close(self) -> None:
        view, self.view = self.view, memoryview(b"")
        view.release()
        self._stack.close()


class RecordStreamResponse(Response):
    """A :class:`RecordStream` as a Starlette response (the FastAPI route's), sent by
    :meth:`RecordStream.send` as the fast path sends it; ``release`` runs at the end."""

    def __init__(
        self,
        stream: RecordStream,
        headers: dict[str, str],
        release: Callable[[], None],
        what: str,
    ) -> None:
        super().__init__(
            media_type=RECORD_MEDIA_TYPE, headers={**headers, "Content-Length": str(len(stream))}
        )
        self.stream, self.release, self.what = stream, release, what

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await self.stream.send(send, self.what)
        finally:
            self.release()


def read_record(
    ctx: ServiceContext, fingerprint: str, sample_id: str, fields: str | None
) -> tuple[bytes | RecordStream, str, Callable[[], None]]:
    """The body to send for a record (all fields, or the comma-separated ``fields``),
    its strong ETag, and the release of the bytes reserved for it in the process's read
    budget (call it once the last byte is sent: it also ends the stream's read view).

    The record's size is checked before it is read: over ``max_response_bytes`` is
    :class:`ResponseTooLarge` (413), past the read budget :class:`ReadBudgetBusy` (503).
    A whole record over :data:`STREAM_CHUNK` is a :class:`RecordStream` over the
    store's memory (nothing copied up front); a smaller one, or a ``fields`` subset, is
    bytes (one copy, done inline: cheaper than a hop to the thread pool).
    """
    key = key_of_record_id(fingerprint, sample_id)  # a variant's record id too (a#v3)
    store = ctx.store()
    if store is None:
        raise RecordNotFound(key, str(ctx.cache))
    note_read_hourly(ctx.cache, fingerprint)
    try:
        size = record_length(store, key)
    except FingerprintRemoved:
        raise
    except RecordNotFound as exc:
        damaged = _damage_behind(store, fingerprint, sample_id, ctx.cache)
        if damaged is None:
            raise
        raise damaged from exc
    limit = ctx.settings.max_response_bytes
    if size > limit:
        raise ResponseTooLarge(
            f"record {sample_id!r} is {size} bytes, over the "
            f"{limit}-byte response limit (SPCACHE_MAX_RESPONSE_BYTES); read it "
            "from the cache directly"
        )
    reserved = ctx.read_budget.reserve(size, f"record {sample_id!r}")
    names = parse_fields(fields)
    stack = contextlib.ExitStack()
    try:
        if names is None and size > STREAM_CHUNK:
            stream = RecordStream(
                stack.enter_context(store.read_view(key)),
                stack,
                STREAM_GRACE_S + size / ctx.settings.min_stream_bytes_per_s,
            )

            def release() -> None:
                stream.close()
                reserved()

            return stream, record_etag(stream.view, key=key), release
        value = store.get(key)
        if names is not None:
            value = select_fields(value, names, key=key)
        return value, record_etag(value, key=key), reserved
    except BaseException:
        stack.close()
        reserved()
        raise


def _damage_behind(
    store: Any, fingerprint: str, sample_id: str, cache: object
) -> CacheDamaged | None:
    """A record its dataset index lists but the store cannot find: records commit before
    their index and a removal drops the index first, so only damage to the storage (a
    flipped byte in an LMDB branch page) hides one. Then the answer is "cache damaged"
    (503), never a plain "not found". Looked into only on a miss."""
    try:
        listed = bool((store.get_index(fingerprint).sample_ids == sample_id).any())
    except SpcacheError:
        return None
    if not listed:
        return None
    return CacheDamaged(
        cache,
        f"{fingerprint}/{sample_id} is in its dataset index but cannot "
        f"be found (a damaged page?); run spcache verify --cache {cache}",
    )


def record_tag_header(ctx: ServiceContext, key: str, etag: str) -> dict[str, str]:
    """``{X-Spcache-Record-Tag: tag}`` when the service has a record key, else ``{}``."""
    secret = ctx.settings.record_key
    if secret is None:
        return {}
    return {
        TAG_HEADER: tag_for_checksum(
            secret.get_secret_value().encode("utf-8"), key, etag.strip('"')
        )
    }
