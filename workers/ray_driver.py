"""The Ray driver: admits the items, skips what is cached, hands shards to actors,
commits what comes back and writes the index (see :mod:`workers.ray_engine`).

:class:`RayRun` holds a :class:`workers.run_ledger.RunLedger` for the bookkeeping it
shares with the local engine; the scheduling (shards, actor slots, retries after an
actor died) is its own.

Why one module: the scheduler's state (shards, actor slots, retries, commits) is one
state machine. Starting, placing and releasing the actors is ray_pool.py's; the actor
side and what both share are in ray_actor.py and ray_common.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cache_store.errors import SourceError, StoreFull, REASON_MAX, one_line
from cache_store.format.descriptor import parse_descriptor
from cache_store.jobs.failures import FailureLog
from cache_store.keys import record_id, split_record_id
from cache_store.sources.freshness import stale_variants
from cache_store.stores.base import Store
from workers.ray_common import (
    RaySummary,
    RayUnavailable,
    import_ray,
    raise_local,
    ray_get,
)
from workers.ray_pool import (
    WAIT_TICK_S,
    ActorSlot,
    Shard,
    connect,
    describe_actors,
    release_actors,
    start_actors,
)
from workers.run_ledger import ItemResult, RunLedger, WorkItem, run_all
from cache_store.sources.files import SourceLimits, hash_source_file

__all__ = ["RayRunOptions", "RayRun", "Shard"]

logger = logging.getLogger(__name__)

#: Threads the driver uses to hash the sources of already-stored records.
_HASH_THREADS = 8
#: Largest automatic shard; a bigger one only delays the load balancing at the end.
_MAX_AUTO_SHARD = 512
#: Batches an actor may have produced that the driver has not taken yet.
_STREAM_AHEAD = 4


@dataclass(frozen=True)
class RayRunOptions:
    """Everything one run needs from its :class:`~workers.ray_engine.RayEngine`, fixed
    when the run starts (built by :meth:`RayEngine.run_options`)."""

    store: Store
    fingerprint: str
    recipe: str
    recipe_version: int
    params: Mapping[str, Any]
    #: ``auto``, ``cpu`` or ``cuda``; ``backend`` as the engine resolved it.
    device: str
    backend: str
    #: The keyword arguments of each actor's local engine (``device`` is set per run).
    actor_options: Mapping[str, Any]
    source_limits: SourceLimits
    address: str | None = None
    ray_init: Mapping[str, Any] = field(default_factory=dict)
    actors: int | None = None
    shard_size: int | None = None
    max_attempts: int = 3
    actor_restarts: int = 2
    placement_timeout_s: float = 600.0
    actor_fault: Callable[[str], None] | None = None
    #: Ray ``runtime_env`` of the actors (empty: the cluster's own).
    actor_runtime_env: Mapping[str, Any] = field(default_factory=dict)
    progress: bool = False
    skip_failed: bool = False
    failure_log: FailureLog | None = None
    #: the installed recipe's code digest: skipped records by other code are reported
    code_digest: str | None = None
    #: Where the actors write their records themselves (``{"location",
    #: "storage_options"}`` of a sharded snapshot); None: they send them here.
    sink: Mapping[str, Any] | None = None
    #: Seconds between merges of the sink's manifests into its index during a run.
    merge_every_s: float = 30.0


class RayRun:
    """One :meth:`RayEngine.run`: the local run's admission, reporting and index (its
    :class:`RunLedger`), with the compute loop replaced by the actors."""

    def __init__(
        self,
        options: RayRunOptions,
        items: list[tuple[str, Any]],
        on_result: Callable[[ItemResult], None] | None,
        variants: int = 1,
    ) -> None:
        self.options = options
        self.items = items
        self.variants = variants
        # record ids reported so far: a shard retried after its actor died reports its
        # committed records again (skipped: they are stored), and those are not news
        self.reported: set[str] = set()
        self.summary = RaySummary(
            options.fingerprint, options.recipe, options.recipe_version, dict(options.params)
        )
        self.ledger = RunLedger(
            options.store,
            self.summary,
            on_result,
            progress=options.progress,
            failures=options.failure_log,
            skip_failed=options.skip_failed,
            code_digest=options.code_digest,
        )
        self.slots: list[ActorSlot] = []
        self.shards: deque[Shard] = deque()
        self.run_token = ""  # names this run's actors (set when they start)

    def execute(self) -> RaySummary:
        start = time.perf_counter()

        # The cleanup steps, defined before the work so that the ``finally`` is one call
        # (``run_all`` runs them all even if a SIGTERM lands in one).
        def close_failure_log() -> None:
            if self.options.failure_log is not None:
                self.options.failure_log.close()

        def stop_clock() -> None:
            self.summary.wall_s = time.perf_counter() - start

        try:
            work = self.ledger.admit(self.items, self.variants)
            self.ledger.open_progress(len(self.items) * self.variants)
            todo = self._skip_cached(work)
            if todo:
                self._run_on_ray(todo)
            else:
                self.summary.device, self.summary.backend = (
                    self.options.device,
                    self.options.backend,
                )
        finally:
            run_all(
                self.ledger.write_index,
                self._merge_final,
                self.ledger.close_progress,
                self.ledger.report_other_code,
                close_failure_log,
                stop_clock,
            )
        if self.ledger.index_unwritten is not None:
            raise self.ledger.index_unwritten
        s = self.summary
        logger.info(
            "fingerprint %s on %d Ray actor(s): %d done, %d skipped, %d failed in %.1fs",
            s.fingerprint,
            len(s.actors),
            s.done,
            s.skipped,
            s.failed,
            s.wall_s,
        )
        return s

    # -- resume -----------------------------------------------------------------------
    def _skip_cached(self, work: list[WorkItem]) -> list[WorkItem]:
        """Items left to compute; those whose every wanted record is stored and unchanged
        are reported skipped (and, with ``skip_failed``, the unchanged ones that failed
        before, failed). An item with some variants current goes to an actor with their
        hashes: its engine computes the others (:func:`stale_variants`, the local rule).

        Only files that have a stored record or a remembered failure are hashed (in
        threads: it is reading).
        """
        stored = [
            item
            for item in work
            if any(h is not None for h in item.stored_hashes) or item.failed_hash is not None
        ]
        hashes: dict[str, str | SourceError] = {}
        if stored:
            with cf.ThreadPoolExecutor(min(_HASH_THREADS, len(stored))) as pool:
                digests = pool.map(
                    _hash_or_error,
                    [i.path for i in stored],
                    [self.options.source_limits] * len(stored),
                )
                for item, digest in zip(stored, digests, strict=True):
                    hashes[item.sample_id] = digest
        todo = []
        for item in work:
            found = hashes.get(item.sample_id)
            if found is None:
                todo.append(item)
            elif isinstance(found, SourceError):
                self.ledger.finish_all(item, "failed", reason=found.reason)
            elif not stale_variants(item.stored_hashes, found):
                self.ledger.finish_all(item, "skipped", source_hash=found)
            elif found == item.failed_hash:
                self.ledger.skip_failures(item, found)
            else:
                todo.append(item)
        return todo

    # -- the actors -------------------------------------------------------------------
    def _run_on_ray(self, todo: list[WorkItem]) -> None:
        ray = import_ray()
        opts = self.options
        started = connect(ray, opts.address, opts.ray_init)
        try:
            start = time.perf_counter()
            self.run_token = uuid.uuid4().hex[:8]
            start_actors(
                ray,
                self.slots,
                self.run_token,
                count=len(todo),
                device=opts.device,
                actors=opts.actors,
                recipe=opts.recipe,
                params=opts.params,
                actor_options=opts.actor_options,
                actor_restarts=opts.actor_restarts,
                actor_runtime_env=opts.actor_runtime_env,
                actor_fault=opts.actor_fault,
                sink=opts.sink,
            )
            describe_actors(ray, self.slots, opts.placement_timeout_s)
            self.summary.device = ",".join(sorted({s.stats.device for s in self.slots}))
            self.summary.backend = ",".join(sorted({s.stats.backend for s in self.slots}))
            self.summary.actor_start_s = time.perf_counter() - start
            self.shards.extend(
                Shard(part, number=n)
                for n, part in enumerate(_cut(todo, self._shard_size(len(todo))), start=1)
            )
            self._schedule(ray)
        finally:
            for slot in self.slots:
                if slot.state == "busy":
                    slot.stats.busy_s += time.perf_counter() - slot.since
            self.summary.actors = [slot.stats for slot in self.slots]
            run_all(
                lambda: release_actors(ray, self.slots, self.run_token),
                lambda: ray.shutdown() if started else None,
            )

    def _shard_size(self, count: int) -> int:
        if self.options.shard_size is not None:
            return self.options.shard_size
        return max(1, min(_MAX_AUTO_SHARD, math.ceil(count / (4 * len(self.slots)))))

    def _schedule(self, ray: Any) -> None:
        last_merge = time.monotonic()
        while True:
            self._dispatch()
            if (
                self.options.sink is not None
                and time.monotonic() - last_merge > self.options.merge_every_s
            ):
                self._merge_sink()
                last_merge = time.monotonic()
            waiting = {slot.stream: slot for slot in self.slots if slot.state == "busy"}
            if self.shards:
                waiting.update(
                    {slot.probe: slot for slot in self.slots if slot.state == "restarting"}
                )
            if not waiting:
                break
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=WAIT_TICK_S)
            for ref in ready:
                slot = waiting[ref]
                if slot.state == "busy":
                    self._receive(ray, slot)
                else:
                    self._probe_answered(ray, slot)
            self._give_up_on_lost_actors()
        if self.shards:  # every actor is gone for good
            for shard in self.shards:
                for item in shard.items:
                    self._fail_rest(
                        item,
                        "no Ray actor left to compute it (every actor died and was not restarted)",
                        transient=True,  # the cluster's failure, not the sample's
                    )
            self.shards.clear()

    def _merge_sink(self) -> None:
        """Merge the manifests committed so far into the snapshot's index, so readers
        (and a driver that dies now) start from a recent one. Advice: a failure is
        logged and the run goes on; the final index is written at the end."""
        from cache_store.snapshot.sharded import ShardedSnapshot, merge_into

        store = self.options.store
        if not isinstance(store, ShardedSnapshot):  # a sink is only set for one
            return
        try:
            merge_into(
                store,
                self.options.fingerprint,
                order=self.ledger.admitted,
                describe={
                    "recipe": self.options.recipe,
                    "recipe_version": self.options.recipe_version,
                    "params": dict(self.options.params),
                },
            )
        except Exception:  # see the docstring: advice, logged
            logger.exception("merging the manifests of %s failed", self.options.fingerprint)

    def _merge_final(self) -> None:
        if self.options.sink is not None:
            self._merge_sink()

    def _dispatch(self) -> None:
        live = {slot.stats.actor for slot in self.slots if slot.state != "gone"}
        for slot in self.slots:
            if slot.state != "ready":
                continue
            shard = self._next_shard(slot.stats.actor, live)
            if shard is None:
                continue
            slot.state, slot.shard, slot.since = "busy", shard, time.perf_counter()
            slot.outstanding = {
                rid: item
                for item in shard.items
                for rid in (record_id(item.sample_id, v) for v in range(item.variants))
                if rid not in self.reported
            }
            slot.stats.shards += 1
            # Backpressure: an actor that is _STREAM_AHEAD batches ahead of the writer
            # pauses (its engine blocks in on_result), so a slow writer bounds memory.
            slot.stream = slot.handle.run_shard.options(
                num_returns="streaming",
                _generator_backpressure_num_objects=_STREAM_AHEAD,
            ).remote(
                [[item.sample_id, item.path, list(item.stored_hashes)] for item in shard.items],
                f"s{shard.number:05d}-a{shard.deaths + 1}",
                self.variants,
            )

    def _next_shard(self, actor: int, live: set[int]) -> Shard | None:
        """The first shard that does not avoid this actor, else one every live actor
        is avoided by (then this actor is as good as any)."""
        for i, shard in enumerate(self.shards):
            if actor not in shard.avoid or live <= shard.avoid:
                del self.shards[i]
                return shard
        return None

    def _probe_answered(self, ray: Any, slot: ActorSlot) -> None:
        """A restarted actor answered (ready again), or Ray gave it up (gone)."""
        try:
            info = ray_get(ray, slot.probe)
        except RayUnavailable as exc:
            logger.warning(
                "Ray actor %d did not come back (%s); going on without it", slot.stats.actor, exc
            )
            slot.state, slot.probe = "gone", None
            return
        slot.stats.node, slot.stats.gpus = info["node"], info["gpus"]  # maybe another node
        slot.state, slot.probe = "ready", None

    def _give_up_on_lost_actors(self) -> None:
        """An actor Ray cannot place again (its node is lost and no other fits) is gone."""
        now = time.perf_counter()
        for slot in self.slots:
            if slot.state == "restarting" and now - slot.since > self.options.placement_timeout_s:
                logger.warning(
                    "Ray actor %d was not restarted within %.0fs; going on without it",
                    slot.stats.actor,
                    self.options.placement_timeout_s,
                )
                slot.state, slot.probe = "gone", None

    def _receive(self, ray: Any, slot: ActorSlot) -> None:
        try:
            ref = next(slot.stream)
        except StopIteration:
            self._shard_finished(slot)
            return
        try:
            message = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            self._actor_died(ray, slot, exc)
            return
        except ray.exceptions.RayTaskError as exc:
            raise_local(exc)
        if "summary" in message:
            self._add_timings(message["summary"])
        else:
            self._commit(slot, message)

    def _commit(self, slot: ActorSlot, message: dict[str, Any]) -> None:
        """Write one batch in one transaction, then report its items."""
        records = [(key, value) for key, value in message["records"]]
        write_error = ""
        full: StoreFull | None = None
        # SIGTERM may land between the commit and the reports below: the ledger then
        # finds these records in the store when it writes the index
        self.ledger.committing = {
            record_id(sample_id, variant): source_hash
            for sample_id, _, status, _, _, source_hash, variant in message["results"]
            if status == "done"
        }
        if records:
            start = time.perf_counter()
            try:
                descriptors = [  # those the records name, as the actor's store kept them
                    parse_descriptor(text, fingerprint=fingerprint, digest=digest)
                    for fingerprint, digest, text in message.get("descriptors", [])
                ]
                self.options.store.put_many(records, descriptors)
            except Exception as exc:  # the batch fails with its reason, the run goes on
                logger.exception("writing %d records failed", len(records))
                write_error = f"store write failed: {one_line(exc, limit=REASON_MAX)}"
                full = exc if isinstance(exc, StoreFull) else None
            self.summary.write_s += time.perf_counter() - start
        for sample_id, path, status, key, reason, source_hash, variant in message["results"]:
            rid = record_id(sample_id, variant)
            item = slot.outstanding.pop(rid, None)
            if item is None:
                if rid not in self.reported:
                    logger.warning(
                        "actor %d reported %s, which it was not given; ignored",
                        slot.stats.actor,
                        rid,
                    )
                continue
            transient = False
            if status == "done" and write_error:
                status, key, reason, transient = "failed", "", write_error, True
            if status == "done":
                slot.stats.done += 1
                _note_stored(item, variant, source_hash)  # a retried shard skips it
            elif status == "failed":
                slot.stats.failed += 1
            self._finish(
                ItemResult(
                    sample_id,
                    path,
                    status,
                    key=key,
                    reason=reason,
                    source_hash=source_hash,
                    transient=transient,
                    variant=variant,
                )
            )
        self.ledger.committing = {}
        if full is not None:  # every later write would fail the same way: the run ends
            raise StoreFull(full.path, full.reason) from full

    def _add_timings(self, timings: dict[str, Any]) -> None:
        s = self.summary
        s.load_s += float(timings["load_s"])
        s.compute_s += float(timings["compute_s"])
        s.oom_backoffs += int(timings["oom_backoffs"])

    def _finish(self, result: ItemResult) -> None:
        """Report one record's result (once)."""
        self.reported.add(result.record_id)
        self.ledger.finish(result)

    def _fail_rest(self, item: WorkItem, reason: str, transient: bool = False) -> None:
        """Fail each wanted record of ``item`` not reported yet."""
        for variant in range(item.variants):
            if record_id(item.sample_id, variant) not in self.reported:
                self._finish(
                    ItemResult(
                        item.sample_id,
                        item.path,
                        "failed",
                        reason=reason,
                        transient=transient,
                        variant=variant,
                    )
                )

    def _shard_finished(self, slot: ActorSlot) -> None:
        slot.stats.busy_s += time.perf_counter() - slot.since
        for rid, item in slot.outstanding.items():  # the engine reports every item; defensive
            self._finish(
                ItemResult(
                    item.sample_id,
                    item.path,
                    "failed",
                    reason="the Ray actor finished its shard without a result for this sample",
                    transient=True,  # the engine's failure, not the sample's
                    variant=split_record_id(rid)[1],
                )
            )
        slot.state, slot.shard, slot.stream, slot.outstanding = "ready", None, None, {}

    def _actor_died(self, ray: Any, slot: ActorSlot, exc: BaseException) -> None:
        """Queue the items that had not come back; retire the actor if Ray will not
        restart it."""
        shard = slot.shard
        assert shard is not None
        slot.stats.busy_s += time.perf_counter() - slot.since
        slot.stats.deaths += 1
        waiting = {id(item) for item in slot.outstanding.values()}
        left = [item for item in shard.items if id(item) in waiting]
        slot.shard, slot.stream, slot.outstanding = None, None, {}
        gone = isinstance(exc, ray.exceptions.ActorDiedError)
        if gone:
            slot.state = "gone"
        else:
            # Calls made before Ray has noticed the death would fail too: wait for a
            # probe (retried by Ray until the actor is back) before the next shard.
            slot.state, slot.since = "restarting", time.perf_counter()
            slot.probe = slot.handle.describe.options(max_task_retries=-1).remote()
        logger.warning(
            "Ray actor %d died (%s) with %d of its shard's %d item(s) not back; %s",
            slot.stats.actor,
            type(exc).__name__,
            len(left),
            len(shard.items),
            "it will not be restarted" if gone else "Ray restarts it",
        )
        if left:
            self._requeue(
                Shard(left, shard.deaths + 1, shard.avoid | {slot.stats.actor}, shard.number)
            )

    def _requeue(self, shard: Shard) -> None:
        """Queue a shard whose actor died, first in line. A shard that killed an actor a
        second time is halved (a sample that crashes every actor is then isolated); a
        single sample fails once it has killed ``max_attempts`` actors."""
        items = shard.items
        if len(items) == 1 and shard.deaths >= self.options.max_attempts:
            self._fail_rest(
                items[0],
                f"the Ray actor computing this sample died {shard.deaths} times (a crash, "
                "the OOM killer or a lost node)",
            )
            return
        self.summary.shard_retries += 1
        if len(items) == 1 or shard.deaths == 1:
            self.shards.appendleft(shard)
            return
        half = len(items) // 2
        self.shards.appendleft(Shard(items[half:], 1, set(shard.avoid), shard.number))
        self.shards.appendleft(Shard(items[:half], 1, set(shard.avoid), shard.number))


def _note_stored(item: WorkItem, variant: int, source_hash: str) -> None:
    """Note on ``item`` that its record of ``variant`` is now stored from ``source_hash``
    (what the next actor given it is told)."""
    hashes = list(item.stored_hashes)
    hashes[variant] = source_hash
    item.stored_hash, item.more = hashes[0], tuple(hashes[1:])


def _hash_or_error(path: str, limits: SourceLimits) -> str | SourceError:
    try:
        return hash_source_file(path, limits)
    except SourceError as exc:
        return exc


def _cut(items: list[WorkItem], size: int) -> list[list[WorkItem]]:
    return [items[i : i + size] for i in range(0, len(items), size)]
