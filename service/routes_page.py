"""The status page people look at: ``GET /``, record previews, sample search, a sample's
variants, offline docs.

``/`` is one static HTML page (plus a script and a style sheet under ``/ui``) that polls
the JSON routes; nothing is built and nothing comes from a CDN. ``/docs`` and ``/redoc``
use the Swagger UI and ReDoc bundles shipped by the pinned ``fastapi-offline`` package,
served from ``/docs-assets``, so the API docs work without internet.
"""

from __future__ import annotations

import heapq
import html
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path as FilePath
from typing import Annotated, Any, Literal, get_args

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.openapi.docs import get_redoc_html
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from cache_store.keys import (
    key_of_record_id,
    record_id,
    split_record_id,
    validate_fingerprint,
    validate_sample_id,
    variant_counts,
)
from cache_store.recipes.augment import decompose_augmentation
from cache_store.sources.freshness import HashBudget
from cache_store.jobs.item_state import item_state
from cache_store.sources.files import SourceLimits
from cache_store.errors import CorruptRecord, RecordNotFound
from cache_store.format.decode import decode_arrays
from cache_store.format.header import read_header, record_checksum
from service.context import Context, ServiceContext
from service.errors import ERROR_RESPONSES
from service.records import Fingerprint, etag_matches
from service.preview import (
    MAX_SIZE,
    MIN_SIZE,
    VIEWS,
    PreviewRequest,
    drawn_fields,
    record_levels,
    render_record,
)

__all__ = ["router", "install_page", "PreviewCache", "STATIC_DIR"]

log = logging.getLogger(__name__)

STATIC_DIR = FilePath(__file__).parent / "static"
_DOCS_ASSETS_URL = "/docs-assets"
_PNG = "image/png"
#: The page and the docs may load nothing from anywhere but this service. (ReDoc's bundle
#: hard-codes a Redocly logo from cdn.redoc.ly; under this policy the browser never asks
#: for it, and ReDoc hides the image that did not load.)
_CSP_PAGE = (
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
#: Swagger UI: its start-up script is a file (ui/docs.js), so no inline script or style.
_CSP_SWAGGER = (
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "worker-src 'self' blob:; font-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
#: ReDoc builds its styles at run time (styled-components adds <style> elements), so its
#: style-src allows inline styles; scripts stay 'self' only (no inline script runs).
_CSP_REDOC = _CSP_SWAGGER.replace("style-src 'self';", "style-src 'self' 'unsafe-inline';")

router = APIRouter(tags=["page"])

View = Literal["iso", "front", "side", "top"]
if set(get_args(View)) != set(VIEWS):  # the schema's enum and the renderer's cameras
    raise RuntimeError(f"preview views {get_args(View)} do not match {sorted(VIEWS)}")


class PreviewCache:
    """Rendered PNGs by ETag (least recently used out first, ``max_bytes`` in all), and
    at most ``max_concurrent`` renders at a time (each holds a thread-pool thread)."""

    def __init__(self, max_bytes: int = 32 << 20, max_concurrent: int = 2) -> None:
        self.max_bytes = max_bytes
        self._pngs: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_concurrent)

    def get(self, etag: str) -> bytes | None:
        with self._lock:
            png = self._pngs.get(etag)
            if png is not None:
                self._pngs.move_to_end(etag)
            return png

    def put(self, etag: str, png: bytes) -> None:
        with self._lock:
            if etag in self._pngs or len(png) > self.max_bytes:
                return
            self._pngs[etag] = png
            self._bytes += len(png)
            while self._bytes > self.max_bytes:
                _, old = self._pngs.popitem(last=False)
                self._bytes -= len(old)

    def render(self, value: Any, request: PreviewRequest, key: str) -> bytes:
        with self._slots:
            return render_record(value, request, key=key)


def install_page(app: FastAPI) -> None:
    """Add the page, its assets, previews, sample search and the offline API docs.

    The app must be created with ``docs_url=None, redoc_url=None`` (these routes replace
    FastAPI's CDN-loading pages).
    """
    app.state.previews = PreviewCache()
    app.include_router(router, responses=ERROR_RESPONSES)
    app.mount("/ui", StaticFiles(directory=STATIC_DIR), name="ui")
    app.mount(_DOCS_ASSETS_URL, StaticFiles(directory=_docs_assets_dir()), name="docs-assets")


def _docs_assets_dir() -> FilePath:
    import fastapi_offline  # the pinned package that ships Swagger UI and ReDoc

    return FilePath(fastapi_offline.__file__).parent / "static"


@router.get("/", include_in_schema=False)
def status_page() -> FileResponse:
    """The status page (HTML)."""
    return FileResponse(
        STATIC_DIR / "index.html",
        media_type="text/html",
        headers={"Cache-Control": "no-cache", "Content-Security-Policy": _CSP_PAGE},
    )


def _with_csp(page: HTMLResponse, policy: str) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = policy
    return page


_SWAGGER_PAGE = """<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<link type="text/css" rel="stylesheet" href="{assets}/swagger-ui.css">
<link rel="shortcut icon" href="{assets}/favicon.png">
<title>spcache - API (Swagger UI)</title>
</head>
<body>
<div id="swagger-ui" data-openapi="{openapi}"></div>
<script src="{assets}/swagger-ui-bundle.js"></script>
<script src="{ui}/docs.js"></script>
</body>
</html>
"""


@router.get("/docs", include_in_schema=False)
def swagger_docs(request: Request) -> HTMLResponse:
    root = html.escape(request.scope.get("root_path", ""), quote=True)
    openapi = html.escape(str(request.app.openapi_url), quote=True)
    return _with_csp(
        HTMLResponse(
            _SWAGGER_PAGE.format(
                assets=f"{root}{_DOCS_ASSETS_URL}", openapi=f"{root}{openapi}", ui=f"{root}/ui"
            )
        ),
        _CSP_SWAGGER,
    )


@router.get("/redoc", include_in_schema=False)
def redoc_docs(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return _with_csp(
        get_redoc_html(
            openapi_url=f"{root}{request.app.openapi_url}",
            title="spcache - API (ReDoc)",
            redoc_js_url=f"{root}{_DOCS_ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{_DOCS_ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        ),
        _CSP_REDOC,
    )


def _preview(
    ctx: ServiceContext,
    cache: PreviewCache,
    key: str,
    level: int | None,
    view: str,
    size: int,
    queries: bool,
    if_none_match: str | None,
) -> tuple[str, bytes | None]:
    """``(ETag, PNG or None for 304)`` of a preview, read from the record in place.

    The record is looked at through the store's read view (the LMDB map: no copy of
    it); its ETag comes from the header; a picture already rendered for that ETag is
    served from the cache; otherwise only the drawn fields are decoded, with their bytes
    reserved in the read budget (503 past it) until the picture is made.
    """
    store = ctx.store()
    if store is None:
        raise RecordNotFound(key, str(ctx.cache))
    with store.read_view(key) as value:
        checksum = record_checksum(value, key=key)
        wanted = PreviewRequest(
            level=record_levels(value, key=key) if level is None else level,
            view=view,
            size=size,
            queries=queries,
        )
        wanted.check()
        etag = f'"{checksum}-{wanted.as_tag()}"'
        if etag_matches(if_none_match, etag):
            return etag, None
        png = cache.get(etag)
        if png is None:
            _, nbytes = drawn_fields(value, wanted, key=key)
            release = ctx.read_budget.reserve(nbytes, f"preview of {key!r}")
            try:
                png = cache.render(value, wanted, key)
            finally:
                release()
            cache.put(etag, png)
        return etag, png


@router.get(
    "/v1/caches/{fingerprint}/previews/{sample_id:path}",
    operation_id="get_preview",
    response_class=Response,
    responses={
        200: {"content": {_PNG: {}}, "description": "PNG picture of one level"},
        304: {"description": "not modified (If-None-Match)"},
    },
)
async def get_preview(
    fingerprint: Fingerprint,
    sample_id: str,
    request: Request,
    ctx: Context,
    level: Annotated[
        int | None, Query(ge=0, le=15, description="octree level (default: the record's deepest)")
    ] = None,
    view: Annotated[View, Query(description="camera: iso, front, side or top")] = "iso",
    size: Annotated[
        int, Query(ge=MIN_SIZE, le=MAX_SIZE, description="width = height, pixels")
    ] = 512,
    queries: Annotated[bool, Query(description="draw spc_query records' query points")] = True,
) -> Response:
    """A picture of one octree level of a record: occupied voxels as shaded cubes, query
    points green (voxel occupied at that level) or red. ETag = record checksum + params."""
    key = key_of_record_id(fingerprint, sample_id)  # a variant's too: a1#v3
    cache: PreviewCache = request.app.state.previews
    etag, png = await run_in_threadpool(
        _preview, ctx, cache, key, level, view, size, queries, request.headers.get("if-none-match")
    )
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if png is None:
        return Response(status_code=304, headers=headers)
    return Response(png, media_type=_PNG, headers=headers)


def _stored_variants(store: Any, fingerprint: str, sample_id: str) -> int:
    """How many variants of a sample are stored: ``keys.variant_counts`` over its record
    ids (variants ``0 .. n-1`` all there; 0 when variant 0 is not). Lists only the keys
    under ``<fp>/<id>#v``, not every id that starts like this one."""
    if store is None:
        return 0
    head = f"{fingerprint}/"
    ids = [key[len(head) :] for key in store.keys(f"{head}{sample_id}#v")]
    if store.has(head + sample_id):
        ids.append(sample_id)
    return variant_counts(ids).get(sample_id, 0)


def _variant_entry(store: Any, fingerprint: str, sample_id: str, variant: int) -> dict[str, Any]:
    """One variant of a sample as the page shows it: its record id and the augmentation
    applied (the stored ``augmentation`` matrix, its rotation and per-axis scale; all
    None for a record without the field, a recipe run without augmentation)."""
    rid = record_id(sample_id, variant)
    key = f"{fingerprint}/{rid}"
    entry: dict[str, Any] = {
        "variant": variant,
        "record_id": rid,
        "augmentation": None,
        "rotation_deg": None,
        "rotation_axis": None,
        "scale": None,
    }
    with store.read_view(key) as value:
        if "augmentation" not in read_header(value, key=key).tensors:
            return entry
        arrays, _ = decode_arrays(value, key=key, fields=["augmentation"])
    matrix = arrays["augmentation"]
    try:
        parts = decompose_augmentation(matrix)
    except ValueError as exc:
        raise CorruptRecord(key, str(exc)) from None
    entry.update(
        augmentation=matrix.astype(float).tolist(),
        rotation_deg=round(parts.angle_deg, 3),
        rotation_axis=[round(float(a), 4) for a in parts.axis],
        scale=[round(float(f), 4) for f in parts.scale],
    )
    return entry


def _sample_variants(ctx: ServiceContext, fingerprint: str, sample_id: str) -> dict[str, Any]:
    store = ctx.store()
    count = _stored_variants(store, fingerprint, sample_id)
    if count == 0:
        raise RecordNotFound(f"{fingerprint}/{sample_id}", str(ctx.cache))
    return {
        "fingerprint": fingerprint,
        "sample_id": sample_id,
        "variants": [_variant_entry(store, fingerprint, sample_id, k) for k in range(count)],
    }


@router.get("/v1/caches/{fingerprint}/variants/{sample_id:path}")
async def get_sample_variants(
    fingerprint: Fingerprint, sample_id: str, ctx: Context
) -> dict[str, Any]:
    """The stored variants of a sample (``0 .. n-1``), each with its record id (for its
    record and preview routes) and the augmentation it was computed with: the 4 x 4
    ``augmentation`` matrix, its rotation (degrees about a unit axis) and the factor of
    each axis (scale times fit); None where the record has no such field."""
    validate_fingerprint(fingerprint)
    sample_id = validate_sample_id(sample_id)
    return await run_in_threadpool(_sample_variants, ctx, fingerprint, sample_id)


def _sample_page(
    ctx: ServiceContext, fingerprint: str, prefix: str, after: str, limit: int
) -> dict[str, Any]:
    store = ctx.store()
    head = f"{fingerprint}/"

    def stored() -> Iterator[str]:
        if store is None:
            return
        for key in store.keys(head + prefix):
            sample_id, variant = split_record_id(key[len(head) :])
            # str order of code points == UTF-8 byte order; a variant's record (a1#v2)
            # is no sample: its sample's row counts it
            if variant == 0 and sample_id > after:
                yield sample_id

    queued = ctx.queue.sample_ids(fingerprint, prefix=prefix, after=after, limit=limit + 1)
    merged = (sid for sid, _ in itertools.groupby(heapq.merge(stored(), queued)))
    page = list(itertools.islice(merged, limit + 1))
    more = len(page) > limit
    page = page[:limit]
    # Each sample's source is compared by its stat signature; the few whose signature
    # changed are hashed within one budget for the whole page (the rest say "unchecked").
    settings = ctx.settings
    limits = SourceLimits.of(settings.source_roots, settings.max_hash_bytes)
    budget = HashBudget(settings.max_listing_hash_bytes)
    samples = [
        {
            **item_state(
                store, ctx.queue, fingerprint, sid, limits=limits, budget=budget
            ).as_json(),
            "variants": _stored_variants(store, fingerprint, sid),
        }
        for sid in page
    ]
    ctx.metrics.add_listing_hashed(budget.hashed)
    return {
        "fingerprint": fingerprint,
        "prefix": prefix,
        "after": after,
        "limit": limit,
        "samples": samples,
        "next": page[-1] if more else None,
    }


@router.get("/v1/caches/{fingerprint}/samples")
async def list_samples(
    fingerprint: Fingerprint,
    ctx: Context,
    prefix: str = Query("", max_length=448, description="sample ids starting with this"),
    after: str = Query(
        "", max_length=448, description="cursor: the last id of the previous page ('next')"
    ),
    limit: int = Query(50, ge=1, le=500),
) -> dict[str, Any]:
    """A page of a cache's samples (records and queued items), sorted by id, with each
    sample's state as ``/v1/caches/{fp}/items/{id}`` gives it; ``next`` is the cursor."""
    validate_fingerprint(fingerprint)
    return await run_in_threadpool(_sample_page, ctx, fingerprint, prefix, after, limit)
