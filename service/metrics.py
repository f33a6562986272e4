"""Prometheus text exposition, without a client library.

Counters live in-process (one service process); gauges about the cache and the queue
are read when ``/metrics`` is scraped.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["Metrics", "MetricsMiddleware", "render"]


class Metrics:
    """Request and byte counters, safe to bump from the event loop and from threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, str], int] = defaultdict(int)
        self.bytes_served: dict[str, int] = defaultdict(int)
        self.records_served = 0

    def observe(self, method: str, route: str, status: int, nbytes: int) -> None:
        with self._lock:
            self.requests[(method, route, str(status))] += 1
            self.bytes_served[route] += nbytes

    def add_records(self, n: int) -> None:
        with self._lock:
            self.records_served += n

    def snapshot(self) -> tuple[dict[tuple[str, str, str], int], dict[str, int], int]:
        with self._lock:
            return dict(self.requests), dict(self.bytes_served), self.records_served


class MetricsMiddleware:
    """Pure ASGI (no per-request task): counts requests by route and status, and bytes sent."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        nbytes = 0

        async def counting_send(message: Message) -> None:
            nonlocal status, nbytes
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                nbytes += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            route = (scope.get("spcache.route") or getattr(scope.get("route"), "path", None)
                     or "unmatched")
            self.metrics.observe(scope["method"], route, status, nbytes)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: str) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def render(families: Iterable[tuple[str, str, str, list[tuple[dict[str, str], float]]]]) -> str:
    """Families of ``(name, type, help, [(labels, value), ...])`` as Prometheus text 0.0.4."""
    lines: list[str] = []
    for name, kind, help_text, samples in families:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            shown = repr(float(value)) if isinstance(value, float) else str(value)
            lines.append(f"{name}{_labels(**labels)} {shown}")
    return "\n".join(lines) + "\n"
