"""The read-through protocol: what the service, its worker and the two read-through
clients (:mod:`cache_store.readers.queue_read_through` over the queue,
:mod:`cache_store.readers.http_read_through` over HTTP) must agree on.

* the headers of a not-ready answer (a HEAD answer carries no body);
* how a queue item's status maps to the state of a sample waited for;
* when a worker counts as alive, how often waiters look, and what they are told when
  no worker is alive.
"""

from __future__ import annotations

__all__ = [
    "ERROR_HEADER",
    "STATE_HEADER",
    "TAG_HEADER",
    "RETRY_AFTER_HEADER",
    "NO_WORKER_ERROR",
    "QUEUED",
    "FAILED",
    "MISSING",
    "SAMPLE_STATES",
    "sample_state",
    "STATES_EVERY_S",
    "LIVENESS_EVERY_S",
    "POLL_FIRST_S",
    "POLL_GROWTH",
    "WAIT_CHUNK_S",
    "no_worker_message",
]

#: Every error answer: the error's class name (``NoWorkerAlive``, ``RecordNotFound``...).
ERROR_HEADER = "X-Spcache-Error"
#: A not-ready record answer (404): the sample's state, one of :data:`SAMPLE_STATES`.
STATE_HEADER = "X-Spcache-Item-State"
#: A record's keyed tag (see :mod:`cache_store.format.tag`).
TAG_HEADER = "X-Spcache-Record-Tag"
RETRY_AFTER_HEADER = "Retry-After"
#: The error name of "no worker is alive to compute a miss" (HTTP 503, never retried).
NO_WORKER_ERROR = "NoWorkerAlive"

QUEUED, FAILED, MISSING = "queued", "failed", "missing"
SAMPLE_STATES = (QUEUED, FAILED, MISSING)

#: Queue item status -> state of a sample whose record is not stored. ``done`` without
#: a record means it was deleted since (or lands this instant: callers look at the
#: store again): queue it anew, as a ``cancelled`` one.
_BY_ITEM_STATUS = {
    "pending": QUEUED,
    "running": QUEUED,
    "failed": FAILED,
    "done": MISSING,
    "cancelled": MISSING,
}


def sample_state(item_status: str | None) -> str:
    """The state of a sample with no record, from its latest queue item's status
    (``None``: never queued)."""
    return _BY_ITEM_STATUS.get(item_status or "", MISSING)


#: How often a waiter looks at the queue items it waits for, and at the heartbeats.
STATES_EVERY_S = 0.25
LIVENESS_EVERY_S = 1.0
#: A waiter's looks at the store back off from this delay, by this factor.
POLL_FIRST_S = 0.005
POLL_GROWTH = 1.5
#: The longest one ``?wait=`` request of the HTTP client (the service caps it too).
WAIT_CHUNK_S = 30.0


def no_worker_message(what: str, cache: str, stale_s: float | None = None) -> str:
    """``NoWorkerAlive``'s text: what cannot be computed, and the commands that start a
    worker for ``cache``; ``stale_s``: how old a heartbeat may be (the queue's rule,
    :data:`cache_store.jobs.liveness.WORKER_STALE_S`), said when known."""
    within = "" if stale_s is None else f" (no heartbeat within {stale_s:g} s)"
    return (
        f"{what}: no spcache worker is alive for cache {cache}{within}. Start one on the "
        f"cache's machine: `spcache worker --cache {cache}` (or `python -m spcache worker "
        f"--cache {cache}`), or run `spcache serve` without --no-worker, which starts "
        f"one; or precompute with `spcache precompute`."
    )
