"""The record GET, answered before FastAPI's routing and parameter machinery.

Reading one record is the service's hot path: one LMDB read and a header peek for the
ETag. Going through FastAPI's router, dependency solving and parameter validation costs
several times that per request, so this pure-ASGI layer answers the *successful* GETs
and HEADs of ``/v1/caches/{fingerprint}/records/{sample_id}`` itself. Anything else, and
any request that would end in an error, is passed on unchanged to the FastAPI route,
which stays the one definition of the route's behaviour and its errors (and its entry
in the OpenAPI schema). Both call the same functions, so they cannot drift apart.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

from cache_store.errors import SpcacheError
from cache_store.keys import FINGERPRINT_PATTERN, key_of_record_id
from service.context import ServiceContext
from service.records import (
    RECORD_MEDIA_TYPE,
    RecordStream,
    etag_matches,
    read_record,
    record_tag_header,
)

__all__ = ["RecordFastPath", "RECORD_ROUTE"]

log = logging.getLogger(__name__)

RECORD_ROUTE = "/v1/caches/{fingerprint}/records/{sample_id:path}"
_PATH = re.compile(rf"^/v1/caches/({FINGERPRINT_PATTERN})/records/(.+)$")
_MEDIA = RECORD_MEDIA_TYPE.encode()


class RecordFastPath:
    def __init__(self, app: ASGIApp, ctx: ServiceContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        match = _PATH.match(scope["path"])
        if match is None:
            await self.app(scope, receive, send)
            return
        answer = self._answer(match.group(1), match.group(2), scope)
        if answer is None:
            await self.app(scope, receive, send)  # the FastAPI route says what went wrong
            return
        status, headers, body, release = answer
        scope["spcache.route"] = RECORD_ROUTE
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            if isinstance(body, RecordStream) and scope["method"] == "GET":
                # the reservation and the map's lease are held until the last chunk left
                await body.send(send, f"record {match.group(2)!r}")
            else:
                await send(
                    {
                        "type": "http.response.body",
                        "body": body
                        if scope["method"] == "GET" and not isinstance(body, RecordStream)
                        else b"",
                    }
                )
        finally:
            release()

    def _answer(
        self,
        fingerprint: str,
        raw_id: str,
        scope: Scope,
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes | RecordStream, Callable[[], None]] | None:
        fields = None
        if scope.get("query_string"):
            query = parse_qs(scope["query_string"].decode("latin-1"), keep_blank_values=True)
            # ?wait= only matters on a miss, which the FastAPI route answers
            if set(query) - {"fields", "wait"} or len(query.get("fields", ())) > 1:
                return None
            fields = query["fields"][0] if "fields" in query else None
        try:
            # scope["path"] is percent-decoded already: do not decode it again.
            value, etag, release = read_record(self.ctx, fingerprint, raw_id, fields)
        except SpcacheError:
            return None
        headers = [(b"etag", etag.encode()), (b"cache-control", b"no-cache")]
        if self.ctx.settings.record_key is not None:
            headers += [
                (name.lower().encode(), tag.encode())
                for name, tag in record_tag_header(
                    self.ctx, key_of_record_id(fingerprint, raw_id), etag
                ).items()
            ]
        if_none_match = None
        for name, val in scope["headers"]:
            if name == b"if-none-match":
                if_none_match = val.decode("latin-1")
        if etag_matches(if_none_match, etag):
            release()
            return 304, headers, b"", _nothing
        self.ctx.metrics.add_records(1)
        headers += [(b"content-type", _MEDIA), (b"content-length", str(len(value)).encode())]
        return 200, headers, value, release


def _nothing() -> None:
    return None
