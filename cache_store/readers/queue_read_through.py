"""Read-through: a loader's miss is queued for the worker and waited for.

A :class:`~cache_store.readers.dataset.CachedDataset` built over sources with
``on_miss="compute"`` hands its misses to a :class:`QueueReadThrough` (a cache
directory: the SQLite job queue in ``<cache>/jobs.sqlite``). It

1. checks that a worker is alive (``spcache worker --cache DIR`` or the one ``spcache
   serve`` runs, which counts as alive while ``serve`` restarts it;
   :meth:`JobQueue.worker_expected`) and fails at once, naming the command to start one,
   when none is: never a silent hang;
2. queues the missing samples, plus the next ``warm_ahead`` uncached ones in index
   order, as one high-priority job through :meth:`JobQueue.enqueue_once`, which reuses
   an item another loader process already queued, so a sample is computed once however
   many processes miss it;
3. polls the store (one short read transaction per key, backing off from 5 ms to
   ``poll_max_s``) until every missing record is there, looking at the queue items'
   status a few times a second (a failed item raises :class:`SampleFailed` with the
   worker's recorded reason) and at the workers' heartbeats once a second.

Nothing here imports torch's CUDA or ``workers``: loaders read; the worker computes.
Over HTTP the service does the same for the client (``service/read_through.py``); the
rules both follow are in :mod:`cache_store.service_api.protocol`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cache_store.errors import MissTimeout, NoWorkerAlive, SampleFailed
from cache_store.service_api.protocol import (
    FAILED,
    LIVENESS_EVERY_S,
    POLL_FIRST_S,
    POLL_GROWTH,
    QUEUED,
    STATES_EVERY_S,
    no_worker_message,
    sample_state,
)
from cache_store.jobs.liveness import WORKER_STALE_S
from cache_store.jobs.queue import JobQueue, QueuedItem
from cache_store.keys import record_key

__all__ = ["QueueReadThrough", "ON_MISS_CHOICES"]

log = logging.getLogger(__name__)

ON_MISS_CHOICES = ("error", "compute")


class QueueReadThrough:
    """Misses of one fingerprint of a cache directory, computed by its queue's worker.

    Args:
        cache_dir: the cache directory (records and ``jobs.sqlite``).
        recipe, params, fingerprint: the resolved recipe the records are computed with.
        priority: of the jobs it queues (warm-ups default to 0: misses go first).
        miss_timeout: seconds to wait for a record before :class:`MissTimeout`.
        worker_stale_s: a worker whose last heartbeat is older is taken for dead.
        poll_max_s: the longest sleep between two looks at the store.
        variants: records queued per sample (variants 0 .. variants - 1): the worker
            computes every missing one of a sample it is given.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        recipe: str,
        params: dict[str, Any],
        fingerprint: str,
        *,
        priority: int = 100,
        miss_timeout: float = 120.0,
        worker_stale_s: float = WORKER_STALE_S,
        poll_max_s: float = 0.05,
        variants: int = 1,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        self.recipe = recipe
        self.params = dict(params)
        self.fingerprint = fingerprint
        self.priority = priority
        self.miss_timeout = miss_timeout
        self.worker_stale_s = worker_stale_s
        self.poll_max_s = poll_max_s
        self.variants = variants
        self.queue = JobQueue(self.cache_dir)
        #: items this process queued itself (not reused): tests and the benchmark count them
        self.queued = 0

    def close(self) -> None:
        self.queue.close()

    def _require_worker(self, missing: Sequence[str]) -> None:
        if not self.queue.worker_expected(stale_s=self.worker_stale_s):
            first = ", ".join(repr(m) for m in missing[:3]) + (" ..." if len(missing) > 3 else "")
            raise NoWorkerAlive(
                no_worker_message(
                    f"{len(missing)} sample(s) missing ({first})",
                    str(self.cache_dir),
                    self.worker_stale_s,
                )
            )

    def fetch(
        self,
        has: Callable[[str], bool],
        wanted: Sequence[tuple[str, str]],
        ahead: Sequence[tuple[str, str]] = (),
        *,
        stale: Sequence[str] = (),
        picks: Mapping[str, int] | None = None,
    ) -> None:
        """Return once every ``(sample id, path)`` of ``wanted`` has a record (of the
        variant ``picks`` names for it, else variant 0).

        ``has(key)`` says whether the store holds a (current) record. ``ahead`` are
        samples the caller will want soon (not waited for). ``stale`` are ids whose
        stored record is out of date with its source: a done queue item is not reused for
        them (:meth:`JobQueue.enqueue_once`). Raises :class:`NoWorkerAlive`,
        :class:`SampleFailed` (the first failed wanted sample) or :class:`MissTimeout`.
        """
        if not wanted:
            return
        self._require_worker([sid for sid, _ in wanted])
        rows = self.queue.enqueue_once(
            self.recipe,
            self.params,
            self.fingerprint,
            [*wanted, *ahead],
            priority=self.priority,
            stale=stale,
            variants=self.variants,
        )
        self.queued += sum(1 for r in rows if not r.reused)
        keys = {
            sid: record_key(self.fingerprint, sid, (picks or {}).get(sid, 0)) for sid, _ in wanted
        }
        waiting = {r.sample_id: r for r in rows if r.sample_id in keys}
        for row in waiting.values():
            if row.status == "failed" and not has(keys[row.sample_id]):
                raise SampleFailed(row.sample_id, row.path, row.last_error or "failed")
        self._wait(has, waiting, keys)

    def queue_ahead(self, items: Sequence[tuple[str, str]]) -> None:
        """Queue ``(sample id, path)`` items the caller will want soon, without waiting
        (a sampler's read-ahead); each once, as :meth:`fetch` queues. Raises
        :class:`NoWorkerAlive`."""
        if not items:
            return
        self._require_worker([sid for sid, _ in items])
        rows = self.queue.enqueue_once(
            self.recipe,
            self.params,
            self.fingerprint,
            items,
            priority=self.priority,
            variants=self.variants,
        )
        self.queued += sum(1 for r in rows if not r.reused)

    def _wait(
        self, has: Callable[[str], bool], waiting: dict[str, QueuedItem], keys: Mapping[str, str]
    ) -> None:
        start = time.monotonic()
        deadline = start + self.miss_timeout
        next_status = start + STATES_EVERY_S
        next_liveness = start + LIVENESS_EVERY_S
        delay = POLL_FIRST_S
        while True:
            for sid in [s for s in waiting if has(keys[s])]:
                del waiting[sid]
            if not waiting:
                return
            now = time.monotonic()
            if now >= next_status:
                next_status = now + STATES_EVERY_S
                self._check_items(has, waiting, keys)
            if now >= next_liveness:
                next_liveness = now + LIVENESS_EVERY_S
                self._require_worker(sorted(waiting))
            if now >= deadline:
                states = self.queue.item_statuses(r.item_id for r in waiting.values())
                listed = "; ".join(
                    f"{sid}: {states.get(r.item_id, ('gone', None))[0]}"
                    for sid, r in list(waiting.items())[:5]
                )
                raise MissTimeout(
                    f"{len(waiting)} record(s) of {self.fingerprint} in "
                    f"{self.cache_dir} did not land within "
                    f"{self.miss_timeout:g} s ({listed}); the worker may be "
                    f"busy with a long queue: raise miss_timeout or warm up first"
                )
            time.sleep(min(delay, max(deadline - now, 0.0)))
            delay = min(delay * POLL_GROWTH, self.poll_max_s)

    def _check_items(
        self,
        has: Callable[[str], bool],
        waiting: dict[str, QueuedItem],
        keys: Mapping[str, str] | None = None,
    ) -> None:
        """``keys``: the record key waited for of each sample (default: variant 0's)."""
        if keys is None:
            keys = {sid: record_key(self.fingerprint, sid) for sid in waiting}
        states = self.queue.item_statuses(r.item_id for r in waiting.values())
        for sid, row in list(waiting.items()):
            status, error = states.get(row.item_id, ("gone", None))
            state = sample_state(status)
            if state == QUEUED:
                continue
            if has(keys[sid]):
                del waiting[sid]
            elif state == FAILED:
                raise SampleFailed(sid, row.path, error or "failed")
            else:  # cancelled, gone, or done with no current record: queue it again
                log.info(
                    "read-through: item %s of %r was %s; queueing it again",
                    row.item_id,
                    sid,
                    status,
                )
                # as stale: a done item is not reused (its record was deleted since, or
                # the source changed while it ran), else the wait would end in MissTimeout
                again = self.queue.enqueue_once(
                    self.recipe,
                    self.params,
                    self.fingerprint,
                    [(sid, row.path)],
                    priority=self.priority,
                    stale=[sid],
                    variants=self.variants,
                )
                self.queued += sum(1 for r in again if not r.reused)
                waiting[sid] = again[0]
