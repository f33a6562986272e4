"""Request-body size limit (uvicorn has none of its own)."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodySizeLimit"]


class _TooLarge(HTTPException):
    """Raised from ``receive``: FastAPI re-raises HTTPExceptions met while reading a body,
    so the app's own handler answers 413 (anything else it would turn into a 400)."""


class BodySizeLimit:
    """Answer 413 for bodies over ``max_bytes``, declared (Content-Length) or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

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

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
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

    async def _reject_size(self, send: Send) -> None:
        await self._reject(send, 413, "RequestTooLarge",
                           f"request body larger than {self.max_bytes} bytes")

    @staticmethod
    async def _reject(send: Send, status: int, error: str, detail: str) -> None:
        body = json.dumps({"error": error, "detail": detail}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
