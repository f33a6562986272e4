"""Warm-up and the job queue: ``/v1/warmup``, ``/v1/jobs``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from cache_store.errors import ParameterError
from cache_store.keys import MAX_VARIANTS
from cache_store.recipes.registry import RECIPE_SPECS
from service.auth import require_token
from service.context import Context
from service.read_through import dedupe_warmup, require_worker
from service.warmup import expand_glob, plan_warmup

__all__ = ["router", "WarmupRequest", "WarmupItem"]

router = APIRouter(prefix="/v1", tags=["jobs"])


class WarmupItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(
        min_length=1, max_length=512, description="sample id (relative path, no extension)"
    )
    path: str = Field(
        min_length=1, max_length=4096, description="source file, inside a source root"
    )


# typed as plain dicts: pydantic's JsonDict would not accept the inferred list[str] values
_ITEMS_OR_GLOB: dict[str, Any] = {
    "oneOf": [{"required": ["items"]}, {"required": ["root", "glob"]}]
}


def _recipe_enum(schema: dict[str, Any]) -> None:
    """The installed recipes as the field's ``enum``, when the OpenAPI schema is built
    (not at import: finding the recipes imports their classes)."""
    schema["enum"] = sorted(RECIPE_SPECS)


class WarmupRequest(BaseModel):
    """Either ``items`` or ``root`` + ``glob`` (ids are the matches' paths without extension)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_ITEMS_OR_GLOB)

    recipe: str = Field(min_length=1, max_length=64, json_schema_extra=_recipe_enum)
    params: dict[str, Any] = Field(default_factory=dict)
    items: list[WarmupItem] | None = None
    root: str | None = Field(None, min_length=1, max_length=4096)
    glob: str | None = Field(None, min_length=1, max_length=1024)
    priority: int = Field(0, ge=-1000, le=1000)
    variants: int = Field(
        1,
        ge=1,
        le=MAX_VARIANTS,
        description="records per sample: variant 0 (the sample itself) and variants - 1 "
        "more, each from its own seeded generator (augmented as the recipe's parameters "
        "say); an item is ready when all of them are stored",
    )
    dedupe: bool = Field(
        False,
        description="read-through: reuse the queue's pending, "
        "running, done or (source unchanged) failed item of a sample "
        "instead of queueing it again; answers each item's status",
    )
    require_worker: bool = Field(
        False,
        description="503 NoWorkerAlive (naming the command "
        "to start one) instead of queueing when no worker is alive",
    )

    @model_validator(mode="after")
    def _one_source_of_items(self) -> WarmupRequest:
        if (self.items is None) == (self.root is None or self.glob is None):
            raise ValueError("give either 'items' or both 'root' and 'glob'")
        if self.items is not None and not self.items:
            raise ValueError("'items' is empty")
        if self.items is None and (self.root is None) != (self.glob is None):
            raise ValueError("'root' and 'glob' go together")
        return self


@router.post("/warmup", status_code=202, dependencies=[Depends(require_token)])
async def warmup(body: WarmupRequest, ctx: Context) -> dict[str, Any]:
    """Queue the computation of every item not already ready; returns the job."""
    settings = ctx.settings
    roots = settings.source_roots

    def plan_and_submit() -> dict[str, Any]:
        if body.items is not None:
            if len(body.items) > settings.max_warmup_items:
                raise ParameterError(
                    [
                        (
                            f"items: {len(body.items)} items, at most "
                            f"{settings.max_warmup_items} per request"
                        )
                    ],
                    what="warm-up request",
                )
            pairs = [(it.id, it.path) for it in body.items]
        else:
            assert body.root is not None and body.glob is not None
            pairs = expand_glob(
                body.root,
                body.glob,
                roots,
                settings.max_warmup_items,
                max_entries=settings.glob_max_entries,
                max_seconds=settings.glob_max_seconds,
            )
        plan = plan_warmup(body.recipe, body.params, pairs, roots, ctx.store(), body.variants)
        if body.require_worker and plan.todo:
            require_worker(ctx, f"warm-up of {len(plan.todo)} item(s) of {plan.fingerprint}")
        if body.dedupe:
            return dedupe_warmup(ctx, plan, body.priority)
        # the roots travel with the job: whichever worker reads its files enforces them
        job_id = ctx.queue.submit(
            plan.recipe,
            plan.params,
            plan.fingerprint,
            plan.todo,
            priority=body.priority,
            ready=plan.ready,
            roots=roots,
            variants=plan.variants,
        )
        info = ctx.queue.job(job_id, errors_limit=0)
        return {
            "job_id": job_id,
            "fingerprint": plan.fingerprint,
            "recipe": plan.recipe,
            "recipe_version": plan.recipe_version,
            "params": plan.params,
            "variants": plan.variants,
            "queued": len(plan.todo),
            "already_ready": len(plan.ready),
            "status": info.status,
            "counts": info.counts,
        }

    return await run_in_threadpool(plan_and_submit)


#: errors listed per job by ``GET /v1/jobs`` (its ``counts.failed`` is the exact number)
LISTED_JOB_ERRORS = 10


@router.get("/jobs")
def list_jobs(
    ctx: Context,
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=10**9),
    fingerprint: str | None = Query(None, max_length=64),
) -> dict[str, Any]:
    """Jobs, newest first; a job with failed items lists its first
    ``LISTED_JOB_ERRORS`` errors (``GET /v1/jobs/{id}`` pages through all of them)."""
    jobs = ctx.queue.jobs(
        limit=limit, offset=offset, fingerprint=fingerprint, errors_limit=LISTED_JOB_ERRORS
    )
    return {"jobs": [j.as_json() for j in jobs], "offset": offset, "limit": limit}


@router.get("/jobs/{job_id}")
def get_job(
    job_id: str,
    ctx: Context,
    errors_offset: int = Query(0, ge=0, le=10**9),
    errors_limit: int | None = Query(None, ge=0, le=10_000),
) -> dict[str, Any]:
    """A job's status and counts, with one page of its failed items' errors."""
    limit = ctx.settings.job_errors_page if errors_limit is None else errors_limit
    info = ctx.queue.job(job_id, errors_offset=errors_offset, errors_limit=limit)
    out = info.as_json()
    out["errors_page"] = {"offset": errors_offset, "limit": limit, "failed": info.counts["failed"]}
    return out


@router.delete("/jobs/{job_id}", dependencies=[Depends(require_token)])
def cancel_job(job_id: str, ctx: Context) -> dict[str, Any]:
    """Cancel a job: pending items are dropped, running ones finish."""
    return ctx.queue.cancel(job_id).as_json()
