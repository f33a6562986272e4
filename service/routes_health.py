"""``/healthz`` (process alive), ``/readyz`` (queue and store reachable), ``/metrics``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from starlette.concurrency import run_in_threadpool
from prometheus_client.core import GaugeMetricFamily

from cache_store.errors import SpcacheError
from cache_store.jobs.worker_state import describe_worker
from service.context import Context, ServiceContext
from service.metrics import MEDIA_TYPE

__all__ = ["router"]

router = APIRouter(tags=["health"])


def _noop() -> None:
    return None


@router.get("/healthz")
async def healthz(request: Request) -> JSONResponse:
    """200 when the process answers *and* its thread pool runs a trivial task within
    ``pool_check_s``; 503 when every pool thread is taken (the routes that run there
    would hang), so that a supervisor can tell a starved service from a live one."""
    # No ``Context`` dependency here: a sync dependency would itself wait for the pool.
    limit = request.app.state.ctx.settings.pool_check_s
    try:
        await asyncio.wait_for(run_in_threadpool(_noop), limit)
    except TimeoutError:
        return JSONResponse(
            {
                "status": "thread pool starved",
                "detail": f"a trivial task did not run within {limit:g} s",
            },
            status_code=503,
            headers={"Retry-After": "1"},
        )
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
def readyz(ctx: Context) -> JSONResponse:
    """200 when the job queue answers (its file is the one it opened, not replaced or
    truncated) and the store (if created yet) opens and walks without damage; else 503.

    ``token_required`` (either way) says whether the mutating routes want a bearer
    token: the status page asks for one only then. ``worker`` says what the newest live
    worker is doing (:func:`cache_store.jobs.worker_state.describe_worker`): ``stuck``
    names the sample it has been on for half its time limit or more, since when; the
    service still serves what is cached, so this alone does not make it not ready."""
    problems = []
    try:
        ctx.queue.check()
        queue = ctx.queue.counts()
    except Exception as exc:  # noqa: BLE001 - any failure here means "not ready", and says why
        problems.append(f"job queue: {type(exc).__name__}: {exc}")
        queue = {}
    try:
        store_state = "open" if ctx.store() is not None else "not created yet"
        if store_state == "open":
            ctx.cache_walk()  # in a child process; cached until the LMDB file changes
    except Exception as exc:  # noqa: BLE001 - as above
        problems.append(f"store: {type(exc).__name__}: {exc}")
        store_state = "error"
    body: dict[str, Any] = {
        "status": "not ready" if problems else "ready",
        "queue": queue,
        "store": store_state,
        "worker_heartbeat_age_s": _heartbeat_age(ctx),
        "worker": _worker(ctx),
        "token_required": ctx.settings.token is not None,
    }
    if problems:
        body["problems"] = problems
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
    return JSONResponse(body)


def _worker(ctx: ServiceContext) -> dict[str, Any]:
    try:
        return describe_worker(ctx.queue.live_workers())
    except SpcacheError as exc:
        return {"state": "unknown", "detail": str(exc)}


def _heartbeat_age(ctx: ServiceContext) -> float | None:
    try:
        beats = ctx.queue.heartbeats()
    except SpcacheError:
        return None
    return round(time.time() - beats[0]["seen"], 3) if beats else None


class _ScrapeGauges:
    """Gauges read when scraped: queue items, uptime, worker heartbeats, cache sizes."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def collect(self) -> Iterator[GaugeMetricFamily]:
        ctx = self.ctx
        queue = GaugeMetricFamily(
            "spcache_queue_items", "job queue items by status", labels=["status"]
        )
        for status, n in ctx.queue.counts().items():
            queue.add_metric([status], n)
        yield queue
        yield GaugeMetricFamily(
            "spcache_uptime_seconds",
            "seconds since the service started",
            value=round(time.time() - ctx.started, 3),
        )
        beats = ctx.queue.heartbeats()
        if beats:
            age = GaugeMetricFamily(
                "spcache_worker_heartbeat_age_seconds",
                "seconds since each worker last reported",
                labels=["worker"],
            )
            for b in beats:
                age.add_metric([b["worker_id"]], round(time.time() - b["seen"], 3))
            yield age
        try:
            walked = ctx.cache_walk()
        except SpcacheError:  # damaged: /readyz says so; no sizes to report
            walked = {}
        if walked:
            per_fp = [(fp, ctx.cache_stats(fp)) for fp, e in walked.items() if "recipe" in e]
            records = GaugeMetricFamily(
                "spcache_cache_records", "records stored per fingerprint", labels=["fingerprint"]
            )
            nbytes = GaugeMetricFamily(
                "spcache_cache_bytes", "record bytes stored per fingerprint", labels=["fingerprint"]
            )
            for fp, st in per_fp:
                records.add_metric([fp], st.records)
                nbytes.add_metric([fp], st.bytes)
            yield records
            yield nbytes


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(ctx: Context) -> Response:
    """Prometheus text: requests, bytes served, queue depth, worker heartbeat, cache sizes."""
    scrape = CollectorRegistry()
    scrape.register(_ScrapeGauges(ctx))
    body = generate_latest(ctx.metrics.registry) + generate_latest(scrape)
    return Response(body, media_type=MEDIA_TYPE)
