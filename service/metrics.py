"""Prometheus metrics through ``prometheus_client``, counted by one pure-ASGI middleware.

Counters live in-process (one service process) in the app's own registry (several apps
in one process, as in the tests, never share counters); gauges about the cache and the
queue are read when ``/metrics`` is scraped (``routes_health``). Counting a request costs
~0.5 us over the hand-rolled counters it replaced (labelled children are cached), under
1 % of the record fast path (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["Metrics", "MetricsMiddleware", "MEDIA_TYPE"]

#: What ``prometheus_client.generate_latest`` writes.
MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """Request, byte and record counters, safe to bump from the event loop and threads."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "spcache_http_requests",
            "HTTP requests by method, route and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self._bytes = Counter(
            "spcache_http_response_bytes",
            "response body bytes sent, by route",
            ["route"],
            registry=self.registry,
        )
        self._records = Counter(
            "spcache_records_served",
            "records sent (single and batch reads)",
            registry=self.registry,
        )
        self._hashed = Counter(
            "spcache_source_bytes_hashed",
            "source bytes hashed to compare records with their sources (sample listings)",
            registry=self.registry,
        )
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def observe(self, method: str, route: str, status: int, nbytes: int) -> None:
        key = (method, route, status)
        children = self._children.get(key)
        if children is None:  # label lookups cost ~2 us: once per (method, route, status)
            with self._lock:
                children = self._children.setdefault(
                    key,
                    (self._requests.labels(method, route, str(status)), self._bytes.labels(route)),
                )
        children[0].inc()
        children[1].inc(nbytes)

    def add_records(self, n: int) -> None:
        self._records.inc(n)

    def add_listing_hashed(self, n: int) -> None:
        self._hashed.inc(n)

    def snapshot(self) -> tuple[dict[tuple[str, str, str], int], dict[str, int], int]:
        """``(requests by (method, route, status), bytes by route, records served)``."""
        requests: dict[tuple[str, str, str], int] = {}
        nbytes: dict[str, int] = {}
        records = 0
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name == "spcache_http_requests_total":
                    labels = sample.labels
                    requests[(labels["method"], labels["route"], labels["status"])] = int(
                        sample.value
                    )
                elif sample.name == "spcache_http_response_bytes_total":
                    nbytes[sample.labels["route"]] = int(sample.value)
                elif sample.name == "spcache_records_served_total":
                    records = int(sample.value)
        return requests, nbytes, records


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
            route = (
                scope.get("spcache.route")
                or getattr(scope.get("route"), "path", None)
                or "unmatched"
            )
            self.metrics.observe(scope["method"], route, status, nbytes)
