"""Host-header check (against DNS rebinding) and redaction of local details for strangers.

Two things a browser page on another site must not get from a service on loopback:

* **DNS rebinding**: a page on ``attacker.example`` whose name re-resolves to 127.0.0.1
  can send requests that look local. They carry ``Host: attacker.example``, so every
  request whose Host header (port removed) is not in the allowed list is answered 400
  before any route runs. The list defaults to the bound host, ``localhost``, ``127.0.0.1``
  and ``::1``; ``SPCACHE_ALLOWED_HOSTS`` replaces it, and ``*`` allows any (the default
  when bound to a wildcard address, where a token is mandatory anyway).
* **local details**: absolute cache and source-root paths and worker ``host:pid`` ids
  appear in error details, job errors and metrics labels. A caller is *trusted* when it
  sent the right bearer token, or when it connects from a loopback address (its Host
  having passed the check above). Other callers get JSON, text and HTML answers with those
  strings replaced by ``<cache>``, ``<source-root>`` and ``<worker>``. Record bytes
  (``application/octet-stream`` and the batch framing) are never rewritten.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import secrets
import socket
from collections.abc import Iterable
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.settings import Settings, is_loopback

__all__ = ["HostGuard", "allowed_hosts", "host_of"]

log = logging.getLogger(__name__)

_WILDCARD_BINDS = {"", "0.0.0.0", "::", "[::]"}
_REWRITTEN = (b"application/json", b"text/plain", b"text/html")


def allowed_hosts(settings: Settings) -> frozenset[str]:
    """The Host names (lower case, no port, IPv6 without brackets) the service answers."""
    if settings.allowed_hosts is not None:
        return frozenset(_norm(h) for h in settings.allowed_hosts)
    if settings.host in _WILDCARD_BINDS:
        return frozenset({"*"})
    return frozenset({_norm(settings.host), "localhost", "127.0.0.1", "::1"})


def _norm(host: str) -> str:
    return host.strip().lower().strip("[]")


def host_of(header: str) -> str:
    """``example:8000`` -> ``example``; ``[::1]:8000`` -> ``::1``; lower case."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    if header.count(":") == 1:
        return header.split(":", 1)[0]
    return header


_NOSNIFF = (b"x-content-type-options", b"nosniff")


def _nosniff(send: Send) -> Send:
    """``send`` adding ``X-Content-Type-Options: nosniff`` to every answer: a browser
    then never runs a record or a JSON body it was tricked into loading as a script or
    a style sheet."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), _NOSNIFF]}
        await send(message)

    return sending


class HostGuard:
    """Pure-ASGI middleware: 400 for a Host not allowed; redaction for untrusted callers;
    ``X-Content-Type-Options: nosniff`` on every answer."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _nosniff(send)
        host = b""
        token = b""
        for name, value in scope["headers"]:
            if name == b"host":
                host = value
            elif name == b"authorization":
                token = value
        if not _host_allowed(host, self._allowed()):
            text = host.decode("latin-1")
            await _reject(
                send,
                f"Host {text[:200]!r} is not served here (allowed: "
                f"{', '.join(sorted(self._allowed()))}; set "
                "SPCACHE_ALLOWED_HOSTS)",
            )
            return
        if self._trusted(scope, token):
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, _Redacting(send, self._secrets()).send)

    def _allowed(self) -> frozenset[str]:
        cached = getattr(self, "_allowed_cache", None)
        if cached is None:
            cached = self._allowed_cache = allowed_hosts(self.settings)
        return cached

    def _trusted(self, scope: Scope, authorization: bytes) -> bool:
        token = self.settings.token
        if token is not None and authorization:
            scheme, _, given = authorization.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and secrets.compare_digest(
                given.strip().encode("utf-8"), token.get_secret_value().encode("utf-8")
            ):
                return True
        client = scope.get("client")
        return client is not None and _loopback(str(client[0]))

    def _secrets(self) -> list[tuple[re.Pattern[bytes], bytes]]:
        cached = getattr(self, "_secrets_cache", None)
        if cached is None:
            cached = self._secrets_cache = _patterns(
                [(self.settings.cache, "<cache>")]
                + [(root, "<source-root>") for root in self.settings.source_roots]
            )
        return cached


@functools.lru_cache(maxsize=1024)
def _host_allowed(header: bytes, allowed: frozenset[str]) -> bool:
    """Cached: the record fast path passes here on every request."""
    return "*" in allowed or host_of(header.decode("latin-1")) in allowed


@functools.lru_cache(maxsize=1024)
def _loopback(address: str) -> bool:
    return is_loopback(address)  # cached: the record fast path passes here per request


def _patterns(paths: Iterable[tuple[Path, str]]) -> list[tuple[re.Pattern[bytes], bytes]]:
    subs: dict[str, str] = {}
    for path, label in paths:
        for form in {str(path), str(Path(path).expanduser().resolve())}:
            if len(form) > 1:  # never rewrite a bare "/"
                subs[form] = label
    out = [
        (re.compile(re.escape(text).encode()), label.encode())
        for text, label in sorted(subs.items(), key=lambda kv: -len(kv[0]))
    ]
    host = socket.gethostname()
    if host:
        out.append((re.compile(re.escape(host).encode() + rb":\d+"), b"<worker>"))
    return out


class _Redacting:
    """A ``send`` that buffers a JSON or text answer and rewrites local details in it."""

    def __init__(self, send: Send, patterns: list[tuple[re.Pattern[bytes], bytes]]) -> None:
        self._send = send
        self._patterns = patterns
        self._start: Message | None = None
        self._chunks: list[bytes] = []

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            ctype = dict(message.get("headers", [])).get(b"content-type", b"")
            if ctype.startswith(_REWRITTEN):
                self._start = message
                return
            await self._send(message)
            return
        if self._start is None or message["type"] != "http.response.body":
            await self._send(message)
            return
        self._chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(self._chunks)
        for pattern, label in self._patterns:
            body = pattern.sub(label, body)
        headers = [(k, v) for k, v in self._start.get("headers", []) if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self._send({**self._start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})


async def _reject(send: Send, detail: str) -> None:
    body = json.dumps({"error": "BadHost", "detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
