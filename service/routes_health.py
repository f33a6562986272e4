"""``/healthz`` (process alive), ``/readyz`` (queue and store reachable), ``/metrics``."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from cache_store.errors import SpcacheError
from service.context import Context, ServiceContext
from service.metrics import render

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(ctx: Context) -> JSONResponse:
    """200 when the job queue answers and the store (if created yet) opens; else 503."""
    problems = []
    try:
        queue = ctx.queue.counts()
    except Exception as exc:  # noqa: BLE001 - any failure here means "not ready", and says why
        problems.append(f"job queue: {type(exc).__name__}: {exc}")
        queue = {}
    try:
        store_state = "open" if ctx.store() is not None else "not created yet"
    except Exception as exc:  # noqa: BLE001 - as above
        problems.append(f"store: {type(exc).__name__}: {exc}")
        store_state = "error"
    body: dict[str, Any] = {"status": "not ready" if problems else "ready", "queue": queue,
                            "store": store_state, "worker_heartbeat_age_s": _heartbeat_age(ctx)}
    if problems:
        body["problems"] = problems
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
    return JSONResponse(body)


def _heartbeat_age(ctx: ServiceContext) -> float | None:
    try:
        beats = ctx.queue.heartbeats()
    except SpcacheError:
        return None
    return round(time.time() - beats[0]["seen"], 3) if beats else None


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(ctx: Context) -> PlainTextResponse:
    """Prometheus text: requests, bytes served, queue depth, worker heartbeat, cache sizes."""
    requests, nbytes, records = ctx.metrics.snapshot()
    families: list[tuple[str, str, str, list[tuple[dict[str, str], float]]]] = [
        ("spcache_http_requests_total", "counter", "HTTP requests by method, route and status",
         [({"method": m, "route": r, "status": s}, n)
          for (m, r, s), n in sorted(requests.items())]),
        ("spcache_http_response_bytes_total", "counter", "response body bytes sent, by route",
         [({"route": r}, n) for r, n in sorted(nbytes.items())]),
        ("spcache_records_served_total", "counter", "records sent (single and batch reads)",
         [({}, records)]),
        ("spcache_queue_items", "gauge", "job queue items by status",
         [({"status": s}, n) for s, n in ctx.queue.counts().items()]),
        ("spcache_uptime_seconds", "gauge", "seconds since the service started",
         [({}, round(time.time() - ctx.started, 3))]),
    ]
    beats = ctx.queue.heartbeats()
    if beats:
        families.append(("spcache_worker_heartbeat_age_seconds", "gauge",
                         "seconds since each worker last reported",
                         [({"worker": b["worker_id"]}, round(time.time() - b["seen"], 3))
                          for b in beats]))
    store = ctx.store()
    if store is not None:
        per_fp = [(fp, ctx.cache_stats(fp)) for fp in store.fingerprints()]
        families.append(("spcache_cache_records", "gauge", "records stored per fingerprint",
                         [({"fingerprint": fp}, st.records) for fp, st in per_fp]))
        families.append(("spcache_cache_bytes", "gauge", "record bytes stored per fingerprint",
                         [({"fingerprint": fp}, st.bytes) for fp, st in per_fp]))
    return PlainTextResponse(render(families), media_type="text/plain; version=0.0.4")
