"""Recipes, caches and records: ``/v1/recipes``, ``/v1/caches/...``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from cache_store.errors import (
    CacheNotFound,
    FingerprintLookupError,
    ParameterError,
    RecordNotFound,
    SpcacheError,
)
from cache_store.housekeeping.isolated import run_in_child
from cache_store.keys import key_of_record_id, validate_fingerprint
from cache_store.sources.freshness import HashBudget
from cache_store.jobs.failures import failure_counts, failures_of
from cache_store.jobs.item_state import item_state
from cache_store.recipes.registry import installed_recipes
from cache_store.sources.files import SourceLimits
from cache_store.recipes.registry import RECIPE_SPECS
from cache_store.format.descriptor import DIGEST_PATTERN, descriptor_name
from cache_store.format.encode import select_fields
from cache_store.format.header import record_checksum
from cache_store.format.tag import TAG_HEADER, sign_checksums
from cache_store.format.wire import BATCH_MEDIA_TYPE, encode_batch
from service.auth import require_token
from cache_store.errors import ResponseTooLarge
from service.budget import record_length
from service.context import Context
from service.errors import status_for
from service.read_through import not_ready_response, wait_for_records
from service.records import (
    RecordStream,
    RecordStreamResponse,
    RECORD_MEDIA_TYPE,
    Fingerprint,
    etag_matches,
    read_record,
    note_read_hourly,
    read_stored,
    record_etag,
    record_tag_header,
)
from service.warmup import request_source

__all__ = ["router", "BatchRequest"]

router = APIRouter(prefix="/v1", tags=["caches"])

_WAIT_DOC = (
    "on a miss, wait up to this many seconds (capped by max_wait_s) for a queued "
    "sample's record; 404 with its state if it does not land"
)


@router.get("/recipes")
def list_recipes() -> dict[str, Any]:
    """Every installed recipe: name, version, parameter schema, output fields, where it
    comes from (``origin``: package and version) and its code digest. Only installed
    recipes are ever computed: a request names one, it never carries code."""
    registry = installed_recipes()
    return {
        "recipes": [entry.as_json() for entry in registry.recipes.values()],
        "problems": list(registry.problems),
    }


@router.get("/caches")
def list_caches(ctx: Context) -> dict[str, Any]:
    # from the walk in a child process: a damaged page answers 503, never kills us
    failed = failure_counts(ctx.cache)
    out = [
        {
            "fingerprint": fp,
            "recipe": entry["recipe"],
            "recipe_version": entry["recipe_version"],
            "params": dict(entry["params"]),
            "samples": int(entry["samples"]),
            "created": entry.get("created") or None,
            "failed": failed.get(fp, 0),
        }
        for fp, entry in ctx.cache_walk().items()
        if "recipe" in entry
    ]
    return {"caches": out}


@router.get("/caches/{fingerprint}")
def get_cache(
    fingerprint: Fingerprint,
    ctx: Context,
    offset: int = Query(0, ge=0, le=10**9),
    limit: int = Query(1000, ge=0, le=100_000),
) -> dict[str, Any]:
    """A fingerprint's recipe, parameters, counts, bytes, (a page of) its index, when its
    index was first written (``created``, ISO 8601; null before one is) and its
    remembered failures (``failed``: ``{"count", "items": [{"id", "path", "reason",
    "when", "times"}]}``, from precompute, the worker and read-through alike)."""
    validate_fingerprint(fingerprint)
    walked = ctx.cache_walk(fingerprint)  # in a child process: raises CacheDamaged, never aborts us
    store = ctx.store()
    page = None  # the page of ids asked for, decoded alone (not the whole index per request)
    if store is not None and "recipe" in walked.get(fingerprint, {}):
        page = store.get_index_page(fingerprint, offset, limit)
    jobs = ctx.queue.jobs(fingerprint=fingerprint, limit=1000)
    if page is None and not jobs:
        raise FingerprintLookupError(f"no cache with fingerprint {fingerprint!r}")
    stats = ctx.cache_stats(fingerprint)  # records and bytes: the writers' summaries
    counts = {"records": stats.records, "indexed": 0 if page is None else page.total}
    for status in ("pending", "running"):
        counts[status] = sum(j.counts[status] for j in jobs)
    failed = failures_of(ctx.cache, fingerprint)
    counts["failed"] = failed["count"]
    if page is not None:
        recipe, version, params = page.recipe, page.recipe_version, page.params
    else:
        recipe, params = jobs[0].recipe, jobs[0].params
        version = RECIPE_SPECS[recipe].version
    return {
        "fingerprint": fingerprint,
        "recipe": recipe,
        "recipe_version": version,
        "params": params,
        "counts": counts,
        "bytes": stats.bytes,
        "created": None if page is None else (page.created or None),
        "failed": failed,
        "index": None
        if page is None
        else {"offset": offset, "limit": limit, "total": page.total, "sample_ids": page.sample_ids},
        "jobs": [j.id for j in jobs],
    }


@router.delete("/caches/{fingerprint}", dependencies=[Depends(require_token)])
async def remove_cache(fingerprint: Fingerprint, ctx: Context) -> dict[str, Any]:
    """Remove a fingerprint as ``spcache rm`` does (token): its queued items are
    cancelled, its records, index and remembered failures removed. Readers of other
    fingerprints never notice; readers of this one get ``FingerprintRemoved``. The disk
    is given back by ``spcache compact``."""
    validate_fingerprint(fingerprint)
    report = await run_in_threadpool(remove_in_child, ctx.cache, fingerprint)
    ctx.forget_walk()
    return report


def remove_in_child(cache: Any, fingerprint: str, *, timeout_s: float = 600.0) -> dict[str, Any]:
    """``rm`` of ``fingerprint`` in a child process (:func:`run_in_child`, the protocol
    of every housekeeping child), so the service's own store stays read-only: a writable
    handle here would re-open it under its readers. The child's error comes back as its
    own class, which the service's one error map answers (an unknown or removed
    fingerprint 404, a store busy being compacted 503); a cache with nothing in it holds
    no such fingerprint either."""
    try:
        (report,) = run_in_child("rm", cache, fingerprint, timeout_s=timeout_s)
    except CacheNotFound as exc:
        raise FingerprintLookupError(f"no cache with fingerprint {fingerprint!r}: {exc}") from exc
    return dict(report)


@router.head("/caches/{fingerprint}/records/{sample_id:path}", include_in_schema=False)
@router.get(
    "/caches/{fingerprint}/records/{sample_id:path}",
    operation_id="get_record",
    response_class=Response,
    responses={
        200: {"content": {RECORD_MEDIA_TYPE: {}}, "description": "the record, safetensors bytes"},
        304: {"description": "not modified (If-None-Match)"},
    },
)
async def get_record(
    fingerprint: Fingerprint,
    sample_id: str,
    request: Request,
    ctx: Context,
    fields: str | None = Query(None, max_length=4096, description="comma-separated field names"),
    wait: float | None = Query(None, ge=0, le=3600, description=_WAIT_DOC),
) -> Response:
    """The record's safetensors bytes; strong ETag = record checksum; ``?fields=`` subsets;
    ``?wait=`` waits for a queued sample (read-through, :mod:`service.read_through`)."""
    try:
        value, etag, release = read_record(ctx, fingerprint, sample_id, fields)
    except RecordNotFound:
        if not wait:
            raise
        validate_fingerprint(fingerprint)
        not_ready = await wait_for_records(ctx, fingerprint, [sample_id], wait)
        if not_ready:
            return not_ready_response(fingerprint, not_ready[sample_id])
        value, etag, release = read_record(ctx, fingerprint, sample_id, fields)
    headers = {
        "ETag": etag,
        "Cache-Control": "no-cache",
        **record_tag_header(ctx, key_of_record_id(fingerprint, sample_id), etag),
    }
    if etag_matches(request.headers.get("if-none-match"), etag):
        release()
        return Response(status_code=304, headers=headers)
    ctx.metrics.add_records(1)
    if isinstance(value, RecordStream):  # a large record: chunks from the map, budget held
        return RecordStreamResponse(value, headers, release, f"record {sample_id!r}")
    return Response(
        value, media_type=RECORD_MEDIA_TYPE, headers=headers, background=BackgroundTask(release)
    )


#: Route path parameter: a descriptor's digest.
Digest = Annotated[
    str, Path(pattern=f"^{DIGEST_PATTERN}$", description="32 lowercase hex characters")
]


@router.get(
    "/caches/{fingerprint}/descriptors/{digest}",
    response_class=Response,
    responses={200: {"content": {"application/json": {}}, "description": "the descriptor"}},
)
def get_descriptor(fingerprint: Fingerprint, digest: Digest, ctx: Context) -> Response:
    """The descriptor ``digest`` that format-2 records of ``fingerprint`` name: what its
    records share (recipe, version, parameters, schema, code digest, backend, device),
    as stored. Named by the digest of its text, so it never changes (cached forever);
    a reader checks the text against the digest its record holds."""
    validate_fingerprint(fingerprint)
    store = ctx.store()
    text = None if store is None else store.load_descriptor(fingerprint, digest)
    if text is None:
        raise FingerprintLookupError(f"no {descriptor_name(fingerprint, digest)} here")
    return Response(
        text,
        media_type="application/json",
        headers={"ETag": f'"{digest}"', "Cache-Control": "public, max-age=31536000, immutable"},
    )


class ChecksumsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ids: list[str] = Field(min_length=1, description="sample ids")
    nonce: str = Field(
        min_length=16,
        max_length=128,
        description="the reader's fresh random value, signed with the answer",
    )


@router.post("/caches/{fingerprint}/checksums")
def get_checksums(
    fingerprint: Fingerprint,
    body: ChecksumsRequest,
    ctx: Context,
) -> dict[str, Any]:
    """The checksum of the record stored now under each id (null: none), signed with the
    service's record key together with the reader's nonce: a reader holding the key
    refuses a replayed (older, validly tagged) record. 404 without a record key."""
    validate_fingerprint(fingerprint)
    secret = ctx.settings.record_key
    if secret is None:
        raise FingerprintLookupError(
            "this service has no record key (SPCACHE_RECORD_KEY): its records are not signed"
        )
    if len(body.ids) > ctx.settings.max_batch_records:
        raise ParameterError(
            [(f"ids: {len(body.ids)} ids, at most {ctx.settings.max_batch_records} per request")],
            what="request",
        )
    store = ctx.store()
    checksums: dict[str, str | None] = {}
    for sample_id in dict.fromkeys(body.ids):
        key = key_of_record_id(fingerprint, sample_id)
        try:
            if store is None:
                raise RecordNotFound(key, str(ctx.cache))
            with store.read_view(key) as value:
                checksums[sample_id] = record_checksum(value, key=key)
        except RecordNotFound:
            checksums[sample_id] = None
    signature = sign_checksums(
        secret.get_secret_value().encode("utf-8"), fingerprint, body.nonce, checksums
    )
    return {
        "fingerprint": fingerprint,
        "nonce": body.nonce,
        "checksums": checksums,
        "signature": signature,
    }


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ids: list[str] = Field(
        min_length=1,
        description="record ids (a sample id; <id>#v<k> for its variant k), answered in this order",
    )
    fields: list[str] | None = Field(
        None, min_length=1, description="subset of fields (default: all)"
    )


@router.post(
    "/caches/{fingerprint}/batch",
    response_class=Response,
    responses={
        200: {
            "content": {BATCH_MEDIA_TYPE: {}},
            "description": "records framed as in cache_store.format.wire",
        }
    },
)
async def get_batch(
    fingerprint: Fingerprint,
    body: BatchRequest,
    ctx: Context,
    wait: float | None = Query(None, ge=0, le=3600, description=_WAIT_DOC),
) -> Response:
    """Many records in one response; a missing or bad sample is listed, the rest still come.
    ``?wait=`` first waits for the missing ones that are queued (read-through)."""
    validate_fingerprint(fingerprint)
    if len(body.ids) > ctx.settings.max_batch_records:
        raise ParameterError(
            [(f"ids: {len(body.ids)} ids, at most {ctx.settings.max_batch_records} per batch")],
            what="batch request",
        )
    if body.fields is not None and not body.fields:
        raise ParameterError(
            ["fields: empty list; leave it out to get every field"], what="batch request"
        )

    ids = list(dict.fromkeys(body.ids))  # a repeated id is read (and sent) once
    reserved: list[Callable[[], None]] = []
    secret = ctx.settings.record_key

    def collect() -> tuple[list[tuple[str, bytes]], list[tuple[str, str, str]], list[str]]:
        store = ctx.store()
        note_read_hourly(ctx.cache, fingerprint)
        sizes: dict[str, int] = {}
        missing: list[tuple[str, str, str]] = []
        for sample_id in ids:
            try:
                key = key_of_record_id(fingerprint, sample_id)
                if store is None:
                    raise RecordNotFound(key, str(ctx.cache))
                sizes[sample_id] = record_length(store, key)
            except SpcacheError as exc:
                if status_for(exc) == 503:  # back-pressure: the whole batch is retried
                    raise
                missing.append((sample_id, type(exc).__name__, str(exc)))
        total = sum(sizes.values())
        limit = ctx.settings.max_response_bytes
        if total > limit:
            raise ResponseTooLarge(
                f"batch of {len(sizes)} records is {total} bytes, over the "
                f"{limit}-byte response limit; ask for fewer ids"
            )
        # the records, then the framed answer: twice the bytes at the peak
        reserved.append(ctx.read_budget.reserve(2 * total, f"batch of {len(sizes)} records"))
        found: list[tuple[str, bytes]] = []
        tags: list[str] = []
        for sample_id in sizes:
            try:
                key = key_of_record_id(fingerprint, sample_id)
                value = read_stored(ctx, key)
                if body.fields is not None:
                    value = select_fields(value, body.fields, key=key)
                found.append((sample_id, value))
                if secret is not None:
                    tags.append(
                        record_tag_header(ctx, key, record_etag(value, key=key))[TAG_HEADER]
                    )
            except SpcacheError as exc:
                if status_for(exc) == 503:
                    raise
                missing.append((sample_id, type(exc).__name__, str(exc)))
        return found, missing, tags

    def release() -> None:
        for done in reserved:
            done()
        reserved.clear()

    try:
        found, missing, tags = await run_in_threadpool(collect)
        if wait and any(error == "RecordNotFound" for _, error, _ in missing):
            release()  # nothing read so far is sent: hold no read budget while waiting
            not_ready = await wait_for_records(
                ctx,
                fingerprint,
                [sid for sid, error, _ in missing if error == "RecordNotFound"],
                wait,
            )
            found, missing, tags = await run_in_threadpool(collect)
            missing = [
                (sid, not_ready[sid].error, not_ready[sid].detail(fingerprint))
                if sid in not_ready
                else (sid, error, detail)
                for sid, error, detail in missing
            ]
        ctx.metrics.add_records(len(found))
        answer = await run_in_threadpool(
            encode_batch, found, missing, tags if secret is not None else None
        )
    except BaseException:
        release()
        raise
    return Response(answer, media_type=BATCH_MEDIA_TYPE, background=BackgroundTask(release))


@router.get("/caches/{fingerprint}/items/{sample_id:path}")
def get_item_state(
    fingerprint: Fingerprint,
    sample_id: str,
    ctx: Context,
    path: str | None = Query(None, max_length=4096, description="source to compare against"),
) -> dict[str, Any]:
    """Why a sample is (not) ready: ``ready``, ``stale``, ``failed``, ``queued`` or ``missing``."""
    settings = ctx.settings
    # The gate bounds the one file this may hash: it refuses a source over max_hash_bytes
    # on the descriptor it reads (no stat-then-hash race), and the budget caps the request.
    limits = SourceLimits.of(settings.source_roots, settings.max_hash_bytes)
    source = None
    if path is not None:
        source = str(request_source(path, settings.source_roots, settings.max_hash_bytes))
    return item_state(
        ctx.store(),
        ctx.queue,
        fingerprint,
        sample_id,
        path=source,
        limits=limits,
        budget=HashBudget(settings.max_hash_bytes),
    ).as_json()
