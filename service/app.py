"""``create_app(settings)``: the FastAPI application, assembled and nothing more.

No work at import time and none in the factory beyond wiring: the store and the job
queue open on first use, per process.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from cache_store.version import __version__
from cache_store.recipes.registry import installed_recipes
from service.context import ServiceContext
from service.errors import ERROR_RESPONSES, install_error_handlers
from service.fastpath import RecordFastPath
from service.hosts import HostGuard
from service.limits import BodySizeLimit
from service.metrics import MetricsMiddleware
from service.routes_caches import router as caches_router
from service.routes_health import router as health_router
from service.routes_jobs import router as jobs_router
from service.routes_page import install_page
from service.settings import Settings

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> FastAPI:
    """The spcache service for ``settings.cache``."""
    installed_recipes()  # a recipe that cannot be used is named now, one ERROR line each
    ctx = ServiceContext(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        log.info(
            "serving cache %s (source roots: %s; token %s)",
            settings.cache,
            ", ".join(str(r) for r in settings.source_roots),
            "required for mutations" if settings.token else "not set (loopback only)",
        )
        try:
            yield
        finally:
            ctx.close()

    app = FastAPI(
        title="spcache",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,  # offline versions: service.routes_page
        description="Precomputed SPC octrees and octree queries, served as safetensors records.",
    )
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(health_router, responses=ERROR_RESPONSES)
    app.include_router(jobs_router, responses=ERROR_RESPONSES)
    app.include_router(caches_router, responses=ERROR_RESPONSES)
    install_page(app)
    # Added last = outermost: metrics see every answer, the 413s included.
    app.add_middleware(RecordFastPath, ctx=ctx)
    app.add_middleware(
        BodySizeLimit, max_bytes=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s
    )
    # Host check before anything reads the body; redaction of local details outside
    # every route (see service.hosts).
    app.add_middleware(HostGuard, settings=settings)
    app.add_middleware(MetricsMiddleware, metrics=ctx.metrics)
    return app
