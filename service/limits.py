"""Limits on requests: body size and time (uvicorn has neither of its own), and how
many requests may wait for records at once."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cache_store.errors import WaitingFull

__all__ = ["BodySizeLimit", "WaitSlots"]


class _TooLarge(HTTPException):
    """Raised from ``receive``: FastAPI re-raises HTTPExceptions met while reading a body,
    so the app's own handler answers 413 (anything else it would turn into a 400)."""


class _TooSlow(HTTPException):
    """Raised from ``receive`` when the body has not arrived in time (answered 408)."""


class BodySizeLimit:
    """Answer 413 for bodies over ``max_bytes``, declared (Content-Length) or streamed,
    and 408 for a body still incomplete ``body_timeout_s`` after the request began (a
    client trickling bytes would otherwise hold its request open for ever)."""

    def __init__(self, app: ASGIApp, max_bytes: int, body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in {"GET", "HEAD", "OPTIONS"}:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                await self._reject(send, 400, "BadRequest", "Content-Length is not a number")
                return
            if too_big:
                await self._reject_size(send)
                return
        seen = 0
        started = False
        deadline = time.monotonic() + self.body_timeout_s

        async def limited_receive() -> Message:
            nonlocal seen
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                raise _TooSlow(
                    408, f"request body not received within {self.body_timeout_s:g} s"
                ) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(413, f"request body larger than {self.max_bytes} bytes")
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._reject_size(send)
        except _TooSlow as exc:
            if not started:
                await self._reject(send, 408, "RequestTimeout", str(exc.detail))

    async def _reject_size(self, send: Send) -> None:
        await self._reject(
            send, 413, "RequestTooLarge", f"request body larger than {self.max_bytes} bytes"
        )

    @staticmethod
    async def _reject(send: Send, status: int, error: str, detail: str) -> None:
        body = json.dumps({"error": error, "detail": detail}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class WaitSlots:
    """At most ``limit`` requests waiting for records at once (read-through ``?wait=``,
    :mod:`service.read_through`); one more is :class:`WaitingFull` (503)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0
        self._lock = threading.Lock()

    @contextmanager
    def slot(self) -> Iterator[None]:
        with self._lock:
            if self.taken >= self.limit:
                raise WaitingFull(
                    f"{self.taken} requests are already waiting for records "
                    f"(max_waiting_requests={self.limit}); retry shortly"
                )
            self.taken += 1
        try:
            yield
        finally:
            with self._lock:
                self.taken -= 1
