"""The Ray driver: admits the items, skips what is cached, hands shards to actors,
commits what comes back and writes the index (see :mod:`workers.ray_engine`).

:class:`RayRun` holds a :class:`workers.run_ledger.RunLedger` for the bookkeeping it
shares with the local engine; the scheduling (shards, actor slots, retries after an
actor died) is its own.

Why one module: the scheduler's state (shards, actor slots, retries, commits) is one
state machine; the actor side and what both share are in ray_actor.py and ray_common.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cache_store.errors import ParameterError, SourceError, StoreFull
from cache_store.format.descriptor import parse_descriptor
from cache_store.jobs.failures import FailureLog
from cache_store.sources.freshness import is_current
from cache_store.stores.base import Store
from workers.ray_actor import ShardWorker
from workers.ray_common import (
    ActorStats,
    RaySummary,
    RayUnavailable,
    import_ray,
    raise_local,
    ray_get,
)
from workers.run_ledger import ItemResult, RunLedger, WorkItem, one_line, run_all
from cache_store.sources.files import SourceLimits, hash_source_file

__all__ = ["RayRunOptions", "RayRun", "Shard", "ActorSlot"]

logger = logging.getLogger(__name__)

#: Threads the driver uses to hash the sources of already-stored records.
_HASH_THREADS = 8
#: Largest automatic shard; a bigger one only delays the load balancing at the end.
_MAX_AUTO_SHARD = 512
#: Batches an actor may have produced that the driver has not taken yet.
_STREAM_AHEAD = 4
#: Seconds between checks for Ctrl-C while waiting on actors, and between "still
#: waiting for actors" log lines.
_WAIT_TICK_S = 1.0
_PLACEMENT_LOG_EVERY_S = 30.0
#: Longest wait, after ``ray.kill``, for this run's actors to leave Ray's actor table.
_RELEASE_TIMEOUT_S = 30.0


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


@dataclass
class Shard:
    items: list[WorkItem]
    deaths: int = 0
    avoid: set[int] = field(default_factory=set)
    number: int = 0  # names its parts in a sink, with the attempt (deaths + 1)


@dataclass
class ActorSlot:
    """One actor: ``ready`` for a shard, ``busy`` with one, ``restarting`` after a death
    (``probe`` answers once Ray has it back) or ``gone``."""

    stats: ActorStats
    handle: Any
    state: str = "ready"
    shard: Shard | None = None
    stream: Any = None
    outstanding: dict[str, WorkItem] = field(default_factory=dict)
    since: float = 0.0
    probe: Any = None


class RayRun:
    """One :meth:`RayEngine.run`: the local run's admission, reporting and index (its
    :class:`RunLedger`), with the compute loop replaced by the actors."""

    def __init__(
        self,
        options: RayRunOptions,
        items: list[tuple[str, Any]],
        on_result: Callable[[ItemResult], None] | None,
    ) -> None:
        self.options = options
        self.items = items
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
            work = self.ledger.admit(self.items)
            self.ledger.open_progress(len(self.items))
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
        """Items left to compute; the stored and unchanged ones are reported skipped (and,
        with ``skip_failed``, the unchanged ones that failed before, failed).

        Only files that have a stored record or a remembered failure are hashed (in
        threads: it is reading).
        """
        stored = [
            item for item in work if item.stored_hash is not None or item.failed_hash is not None
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
                self.ledger.finish(
                    ItemResult(item.sample_id, item.path, "failed", reason=found.reason)
                )
            elif is_current(item.stored_hash, found):
                self.ledger.finish(
                    ItemResult(
                        item.sample_id, item.path, "skipped", key=item.key, source_hash=found
                    )
                )
            elif found == item.failed_hash:
                self.ledger.finish(self.ledger.skipped_failure(item, found))
            else:
                todo.append(item)
        return todo

    # -- the actors -------------------------------------------------------------------
    def _run_on_ray(self, todo: list[WorkItem]) -> None:
        ray = import_ray()
        started = self._connect(ray)
        try:
            start = time.perf_counter()
            self._start_actors(ray, len(todo))
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
            run_all(lambda: self._release_actors(ray), lambda: ray.shutdown() if started else None)

    def _release_actors(self, ray: Any) -> None:
        """Kill this run's actors and wait (boundedly) until Ray no longer lists them.

        ``ray.kill`` only asks; the actor is torn down asynchronously. A caller that keeps
        Ray running (a notebook, a test, a driver doing several runs) must get the CPUs
        and GPUs back when :meth:`RayEngine.run` returns, not some time later.
        """
        for slot in self.slots:
            try:
                ray.kill(slot.handle)
            except Exception as exc:  # noqa: BLE001 - already gone; nothing to release
                logger.debug("ray.kill(actor %d): %s", slot.stats.actor, exc)
        if not self.run_token or not self.slots:
            return
        prefix = f"spcache-shard-{self.run_token}-"
        deadline = time.monotonic() + _RELEASE_TIMEOUT_S
        while True:
            try:
                left = [n for n in ray.util.list_named_actors() if n.startswith(prefix)]
            except Exception as exc:  # noqa: BLE001 - Ray itself is going; nothing to wait on
                logger.debug("list_named_actors: %s", exc)
                return
            if not left:
                return
            if time.monotonic() > deadline:
                logger.warning(
                    "%d Ray actor(s) still listed %.0fs after ray.kill: %s",
                    len(left),
                    _RELEASE_TIMEOUT_S,
                    ", ".join(sorted(left)),
                )
                return
            time.sleep(0.05)

    def _connect(self, ray: Any) -> bool:
        """Initialise Ray unless it already is; True when this run started it."""
        if ray.is_initialized():
            if self.options.address is not None:
                logger.warning(
                    "Ray is already initialised in this process; using it, not %s",
                    self.options.address,
                )
            return False
        options: dict[str, Any] = {"logging_level": logging.WARNING}
        if self.options.address is None:
            options.update(address="local", include_dashboard=False)
        else:
            options["address"] = self.options.address
        options.update(self.options.ray_init)
        main_thread = threading.current_thread() is threading.main_thread()
        sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
        try:
            ray.init(**options)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayUnavailable(
                f"cannot start or join Ray at {options['address']}: {exc}"
            ) from exc
        finally:
            # ray.init installs its own SIGTERM handler, which ends the process on the
            # spot; the caller's (the CLI's: stop like Ctrl-C, committing and indexing
            # what was computed) must stay in charge.
            if sigterm is not None:
                signal.signal(signal.SIGTERM, sigterm)
        return True

    def _start_actors(self, ray: Any, count: int) -> None:
        opts = self.options
        resources = ray.cluster_resources()
        cluster_gpus, cluster_cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
        use_gpu = opts.device == "cuda" or (opts.device == "auto" and cluster_gpus > 0)
        if opts.device == "cuda" and cluster_gpus == 0:
            raise ParameterError(
                ["device: 'cuda' requested but the Ray cluster has no GPU"],
                what="ray engine options",
            )
        capacity = cluster_gpus if use_gpu else cluster_cpus
        wanted = opts.actors if opts.actors is not None else capacity
        if capacity < 1 or wanted > capacity:
            unit = "GPU" if use_gpu else "CPU"
            raise RayUnavailable(
                f"{wanted} actor(s) of one {unit} each asked for, but the Ray "
                f"cluster has {capacity} {unit}(s)"
            )
        wanted = max(1, min(wanted, count))
        options = dict(opts.actor_options)
        options["device"] = "cuda" if use_gpu else "cpu"
        remote = ray.remote(ShardWorker)
        level = logging.getLogger("workers").getEffectiveLevel()
        self.run_token = uuid.uuid4().hex[:8]
        for index in range(wanted):
            # Named, so that `ray list actors` (and a test) can tell them apart.
            handle = remote.options(
                name=f"spcache-shard-{self.run_token}-{index}",
                num_cpus=1,
                num_gpus=1 if use_gpu else 0,
                max_restarts=opts.actor_restarts,
                max_task_retries=0,
                **({"runtime_env": dict(opts.actor_runtime_env)} if opts.actor_runtime_env else {}),
            ).remote(
                opts.recipe,
                dict(opts.params),
                options,
                level,
                opts.actor_fault,
                None if opts.sink is None else dict(opts.sink),
            )
            self.slots.append(ActorSlot(ActorStats(index), handle))
        self._describe_actors(ray)

    def _describe_actors(self, ray: Any) -> None:
        """Wait until every actor is placed and has resolved its device and backend."""
        pending = {slot.handle.describe.remote(): slot for slot in self.slots}
        deadline = time.monotonic() + self.options.placement_timeout_s
        last_log = time.monotonic()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=_WAIT_TICK_S)
            for ref in ready:
                slot = pending.pop(ref)
                info = ray_get(ray, ref)
                slot.stats.node, slot.stats.device = info["node"], info["device"]
                slot.stats.backend, slot.stats.gpus = info["backend"], info["gpus"]
                logger.info(
                    "actor %d on %s: %s (%s), %d loader process(es), %d torch thread(s)",
                    slot.stats.actor,
                    info["node"],
                    info["device"],
                    info["backend"],
                    info["loaders"],
                    info["threads"],
                )
            now = time.monotonic()
            if pending and now > deadline:
                raise RayUnavailable(
                    f"{len(pending)} of {len(self.slots)} Ray actor(s) were not "
                    f"placed within {self.options.placement_timeout_s:.0f}s"
                )
            if pending and now - last_log > _PLACEMENT_LOG_EVERY_S:
                logger.warning("waiting for the Ray cluster to place %d actor(s)", len(pending))
                last_log = now
        self.summary.device = ",".join(sorted({s.stats.device for s in self.slots}))
        self.summary.backend = ",".join(sorted({s.stats.backend for s in self.slots}))

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
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=_WAIT_TICK_S)
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
                    self.ledger.finish(
                        ItemResult(
                            item.sample_id,
                            item.path,
                            "failed",
                            reason="no Ray actor left to compute it (every "
                            "actor died and was not restarted)",
                            transient=True,  # the cluster's failure, not the sample's
                        )
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
            slot.outstanding = {item.sample_id: item for item in shard.items}
            slot.stats.shards += 1
            # Backpressure: an actor that is _STREAM_AHEAD batches ahead of the writer
            # pauses (its engine blocks in on_result), so a slow writer bounds memory.
            slot.stream = slot.handle.run_shard.options(
                num_returns="streaming",
                _generator_backpressure_num_objects=_STREAM_AHEAD,
            ).remote(
                [[item.sample_id, item.path] for item in shard.items],
                f"s{shard.number:05d}-a{shard.deaths + 1}",
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
            sample_id: source_hash
            for sample_id, _, status, _, _, source_hash in message["results"]
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
                write_error = f"store write failed: {one_line(exc)}"
                full = exc if isinstance(exc, StoreFull) else None
            self.summary.write_s += time.perf_counter() - start
        for sample_id, path, status, key, reason, source_hash in message["results"]:
            if slot.outstanding.pop(sample_id, None) is None:
                logger.warning(
                    "actor %d reported %s, which it was not given; ignored",
                    slot.stats.actor,
                    sample_id,
                )
                continue
            transient = False
            if status == "done" and write_error:
                status, key, reason, transient = "failed", "", write_error, True
            if status == "done":
                slot.stats.done += 1
            elif status == "failed":
                slot.stats.failed += 1
            self.ledger.finish(
                ItemResult(
                    sample_id,
                    path,
                    status,
                    key=key,
                    reason=reason,
                    source_hash=source_hash,
                    transient=transient,
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

    def _shard_finished(self, slot: ActorSlot) -> None:
        slot.stats.busy_s += time.perf_counter() - slot.since
        for item in slot.outstanding.values():  # the engine reports every item; defensive
            self.ledger.finish(
                ItemResult(
                    item.sample_id,
                    item.path,
                    "failed",
                    reason="the Ray actor finished its shard without a result for this sample",
                    transient=True,  # the engine's failure, not the sample's
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
        left = [item for item in shard.items if item.sample_id in slot.outstanding]
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
            item = items[0]
            self.ledger.finish(
                ItemResult(
                    item.sample_id,
                    item.path,
                    "failed",
                    reason=f"the Ray actor computing this sample died "
                    f"{shard.deaths} times (a crash, the OOM killer or "
                    f"a lost node)",
                )
            )
            return
        self.summary.shard_retries += 1
        if len(items) == 1 or shard.deaths == 1:
            self.shards.appendleft(shard)
            return
        half = len(items) // 2
        self.shards.appendleft(Shard(items[half:], 1, set(shard.avoid), shard.number))
        self.shards.appendleft(Shard(items[:half], 1, set(shard.avoid), shard.number))


def _hash_or_error(path: str, limits: SourceLimits) -> str | SourceError:
    try:
        return hash_source_file(path, limits)
    except SourceError as exc:
        return exc


def _cut(items: list[WorkItem], size: int) -> list[list[WorkItem]]:
    return [items[i : i + size] for i in range(0, len(items), size)]
