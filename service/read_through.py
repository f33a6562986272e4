"""Read-through over HTTP: a record read that waits (``?wait=SECONDS``) for a queued sample.

A remote trainer (``CachedDataset("http://...", recipe, sources=...)``, see
:mod:`cache_store.readers.http_read_through`) first queues its misses with ``POST /v1/warmup``
(``dedupe: true``, ``require_worker: true``: :meth:`JobQueue.enqueue_once` semantics,
so a sample is queued once however many loaders miss it), then reads them with
``GET``/``HEAD`` ``/v1/caches/{fp}/records/{id}?wait=S`` or ``POST .../batch?wait=S``.
On a miss such a read:

1. takes one of ``max_waiting_requests`` wait slots, or is answered 503 +
   ``Retry-After`` at once (:class:`WaitingFull`);
2. fails fast with 503 :class:`~cache_store.errors.NoWorkerAlive` (the detail names the
   command that starts a worker) when no worker heartbeat is fresh and no supervisor
   (``spcache serve``'s) is restarting one;
3. polls ``store.has`` in the thread pool (one short read transaction per key, never
   held across a sleep) with ``asyncio.sleep`` between polls, backing off from 10 ms to
   250 ms, and the queue's latest item of each sample four times a second;
4. stops waiting for a sample whose item is ``failed`` (or not queued at all): the
   route then answers 404 naming its state (``SampleFailed`` with the worker's reason,
   or ``RecordNotFound``); likewise when ``wait`` runs out (state ``queued``).

The headers, states, intervals and messages are :mod:`cache_store.service_api.protocol`'s.
Nothing here blocks the event loop or imports ``workers``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from cache_store.errors import CacheNotFound, NoWorkerAlive
from cache_store.service_api.protocol import (
    FAILED,
    LIVENESS_EVERY_S,
    MISSING,
    POLL_GROWTH,
    QUEUED,
    STATE_HEADER,
    STATES_EVERY_S,
    no_worker_message,
    sample_state,
)
from cache_store.jobs.liveness import WORKER_STALE_S
from cache_store.keys import key_of_record_id, split_record_id
from service.context import ServiceContext
from service.errors import error_response
from service.warmup import WarmupPlan

__all__ = [
    "ItemWait",
    "wait_for_records",
    "not_ready_response",
    "require_worker",
    "dedupe_warmup",
    "STATE_HEADER",
]

log = logging.getLogger(__name__)

#: The longest sleep between two looks at the store (many requests may be waiting).
_POLL_MAX_S = 0.25
#: The first one (the protocol's POLL_FIRST_S is for a single loader's own process).
_POLL_FIRST_S = 0.01


@dataclass(frozen=True)
class ItemWait:
    """Why a waited-for sample has no record yet."""

    sample_id: str
    state: str  # a protocol.SAMPLE_STATES value
    reason: str
    path: str | None = None

    @property
    def error(self) -> str:
        return "SampleFailed" if self.state == FAILED else "RecordNotFound"

    def detail(self, fingerprint: str) -> str:
        if self.state == FAILED:
            return f"sample {self.sample_id!r} ({self.path}) failed: {self.reason}"
        return (
            f"no record {key_of_record_id(fingerprint, self.sample_id)!r} yet: "
            f"{self.state} ({self.reason})"
        )


def require_worker(ctx: ServiceContext, what: str) -> None:
    """Raise :class:`NoWorkerAlive` naming the command to start one when none is alive."""
    if not ctx.queue.worker_expected(stale_s=WORKER_STALE_S):
        raise NoWorkerAlive(no_worker_message(what, str(ctx.cache), WORKER_STALE_S))


def _missing(ctx: ServiceContext, fingerprint: str, ids: Sequence[str]) -> list[str]:
    store = ctx.store()
    if store is None:
        return list(ids)
    out = []
    for sid in ids:
        try:
            if not store.has(key_of_record_id(fingerprint, sid)):
                out.append(sid)
        except CacheNotFound:
            out.append(sid)
    return out


def _states(ctx: ServiceContext, fingerprint: str, ids: Sequence[str]) -> dict[str, ItemWait]:
    out = {}
    for sid in ids:
        latest = ctx.queue.latest_item(fingerprint, split_record_id(sid)[0])
        if latest is None:
            out[sid] = ItemWait(sid, MISSING, "not queued: POST /v1/warmup it first")
            continue
        state = sample_state(latest["status"])
        if state == QUEUED:
            reason = f"{latest['status']}, attempt {latest['attempts']} of job {latest['job_id']}"
        elif state == FAILED:
            reason = latest["last_error"] or "failed"
        else:  # cancelled, or done and deleted since (a record landing now is looked for)
            reason = f"job {latest['job_id']} was {latest['status']}"
        out[sid] = ItemWait(sid, state, reason, latest["path"])
    return out


async def wait_for_records(
    ctx: ServiceContext, fingerprint: str, ids: Sequence[str], wait_s: float
) -> dict[str, ItemWait]:
    """Wait up to ``wait_s`` for the records of ``ids``; the ones still missing, and why.

    Returns at once for samples that cannot land (failed, not queued). Raises
    :class:`WaitingFull` (no slot) or :class:`NoWorkerAlive`.
    """
    wait_s = min(float(wait_s), ctx.settings.max_wait_s)
    with ctx.waits.slot():
        start = time.monotonic()
        deadline = start + wait_s
        next_states, next_liveness = start, start
        delay = _POLL_FIRST_S
        pending = list(dict.fromkeys(ids))
        states: dict[str, ItemWait] = {}
        while True:
            pending = await run_in_threadpool(_missing, ctx, fingerprint, pending)
            if not pending:
                return {}
            now = time.monotonic()
            # states first: a sample nobody queued (or that failed) is answered at once,
            # whether or not a worker is alive; only a queued one needs a worker to wait on
            if now >= next_states or now >= deadline:
                next_states = now + STATES_EVERY_S
                states = await run_in_threadpool(_states, ctx, fingerprint, pending)
                if now >= deadline or all(s.state != QUEUED for s in states.values()):
                    # a sample that landed since the last look is not "not ready"
                    landed = set(pending) - set(
                        await run_in_threadpool(_missing, ctx, fingerprint, pending)
                    )
                    return {sid: s for sid, s in states.items() if sid not in landed}
            if now >= next_liveness:
                next_liveness = now + LIVENESS_EVERY_S
                await run_in_threadpool(
                    require_worker, ctx, f"{len(pending)} record(s) of {fingerprint} missing"
                )
            await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
            delay = min(delay * POLL_GROWTH, _POLL_MAX_S)


def not_ready_response(fingerprint: str, state: ItemWait) -> JSONResponse:
    """404 naming the sample's state (and, when it failed, the worker's reason)."""
    response = error_response(
        404, state.error, state.detail(fingerprint), headers={STATE_HEADER: state.state}
    )
    return response


def dedupe_warmup(ctx: ServiceContext, plan: WarmupPlan, priority: int) -> dict[str, Any]:
    """``POST /v1/warmup`` with ``dedupe``: :meth:`JobQueue.enqueue_once` over the plan's
    items to do, so a sample that many loaders miss is queued once. Answers, besides the
    usual counts, each item's queue status (``items``: id, status, error, reused)."""
    rows = (
        ctx.queue.enqueue_once(
            plan.recipe,
            plan.params,
            plan.fingerprint,
            plan.todo,
            priority=priority,
            stale=plan.stale,
            roots=ctx.settings.source_roots,
            variants=plan.variants,
        )
        if plan.todo
        else []
    )
    new_jobs = sorted({r.job_id for r in rows if not r.reused})
    return {
        "job_id": new_jobs[0] if new_jobs else None,
        "fingerprint": plan.fingerprint,
        "recipe": plan.recipe,
        "recipe_version": plan.recipe_version,
        "params": plan.params,
        "variants": plan.variants,
        "queued": sum(1 for r in rows if not r.reused),
        "reused": sum(1 for r in rows if r.reused),
        "already_ready": len(plan.ready),
        "items": [
            {"id": r.sample_id, "status": r.status, "error": r.last_error, "reused": r.reused}
            for r in rows
        ],
    }
