"""The engine: runs one recipe over many samples on one device, into a store.

Three stages overlap:

1. **Loading** (CPU, in parallel): a process pool reads each source file, hashes its
   bytes, skips it when the store already holds a record with that source hash, else
   parses, validates, normalises and draws the sample's random numbers
   (the recipe's ``prepare``). The pool's processes start from the forkserver without
   the caller's ``__main__`` (``spawn`` where there is none) and the pool is created
   before the device is touched, so no process that holds CUDA is ever forked.
   ``loaders=0`` loads in the calling process instead, and so does a pool whose
   processes cannot work at all (said once). (:mod:`workers.loader`)
2. **Device compute** (the calling thread): the recipe's ``compute`` (for the built-ins:
   octree, scan, point hierarchy and chunked queries through the ops backend), its
   outputs checked against the declared fields. Out of device memory on a chunk run
   through the recipe's :class:`~cache_store.recipes.api.ChunkBudget` empties the
   cache, halves the chunk and retries.
3. **Writing** (a writer thread, :mod:`workers.record_writer`): records are encoded
   and written in batched transactions (``store.put_many``).

A run may ask for ``variants=K``: K records of each sample (variant 0, the sample as
without variants, and K-1 more, each prepared from the same loaded source with its own
seeded generator: :mod:`cache_store.recipes.augment`). Records already stored and
current are skipped, so asking for 6 after 4 computes the 2 new ones. The summary
counts records.

A record that fails at any stage is recorded with its reason in the :class:`Summary`;
the run goes on. ``on_result`` is called in the calling thread for every item, and for
a computed item only after its record has committed. When the run ends (or is
interrupted) the fingerprint's index is written: the ids it held before, in their
order, followed by this run's newly stored ids, in input order (the bookkeeping shared
with the Ray engine: :mod:`workers.run_ledger`).

Why one module: the local run's pipeline (loaders ahead, the device step, the writer
behind) shares one set of queues and one ledger; the loader pool, the writer thread and
the bookkeeping are their own modules (loader.py, record_writer.py, run_ledger.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import torch

from cache_store.version import __version__ as SPCACHE_VERSION
from cache_store.engine_options import EngineOptions
from cache_store.errors import (
    ParameterError,
    SourceError,
    StoreFull,
    UsageError,
    REASON_MAX,
    one_line,
)
from cache_store.jobs.failures import FailureLog
from cache_store.sources.freshness import STAT_FIELD
from cache_store.keys import (
    canonical_json,
    compute_fingerprint,
    record_key,
    validate_variant_count,
)
from cache_store.stores.base import Store
from workers.claimed_work import WAITING, claimed, claims_beside
from workers.loader import LoaderPool, LoadOutcome, VariantOutcome
from cache_store.recipes.api import ReadOnlyParams, is_out_of_memory
from cache_store.recipes.registry import LOCAL_KIND, get_entry
from cache_store.recipes.api import ChunkBudget, Recipe, check_outputs
from workers.record_writer import PendingRecord, RecordWriter
from workers.time_limits import Overrun, SampleClock, SampleTimeLimit, limit_for
from workers.run_ledger import (
    ItemResult,
    RunLedger,
    SampleError,
    Summary,
    WorkItem,
    run_all,
)

__all__ = [
    "Engine",
    "LocalRun",
    "Summary",
    "SampleError",
    "ItemResult",
    "check_device",
    "resolve_device",
]

logger = logging.getLogger(__name__)

#: End of a run's items (``None`` is ``claimed_work.WAITING``).
_END: Any = object()
#: How long a run whose items left are other runs' waits before it looks again.
_WAIT_S = 0.5


def check_device(device: str) -> None:
    """Raise ParameterError when ``device`` names a CUDA device this machine does not
    have (no CUDA at all, or an index past the last device); ``auto`` and ``cpu`` always
    pass. Never initialises CUDA (availability and count only), so a process that forks
    afterwards may call it; the one availability rule :func:`resolve_device` and the
    worker's start-up check share."""
    if device == "auto":
        return
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ParameterError(
            [f"device: {device!r} requested but CUDA is not available"], what="engine options"
        )
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ParameterError(
            [
                (
                    f"device: {device!r} requested but only "
                    f"{torch.cuda.device_count()} CUDA device(s) exist"
                )
            ],
            what="engine options",
        )


def resolve_device(device: str) -> torch.device:
    """``auto`` -> the current CUDA device if CUDA works here, else ``cpu``.

    Raises ParameterError for a CUDA device that is not available (:func:`check_device`).
    """
    if device == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    check_device(device)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class Engine:
    """Run ``recipe`` with ``params`` over samples on one device, writing into ``store``.

    Args:
        store: an open, writable :class:`cache_store.stores.base.Store`.
        recipe: an installed recipe's name (or a :class:`spcache.recipes.Recipe` instance,
            which must be installed too: loader processes find it by name).
        params: recipe parameters; validated and completed with defaults here.
        options: how to run (:class:`cache_store.engine_options.EngineOptions`: device,
            backend, loaders, query chunk, write batch, prefetch, source roots and size
            limit, skip-failed; its defaults where not given).
        progress: show a tqdm progress bar on stderr.
        before_query_chunk: test hook called before every query chunk with its size (may
            raise ``torch.cuda.OutOfMemoryError``).
        failure_log: where failures are remembered; default: ``<cache>/failures.sqlite``
            for a local LMDB cache (:mod:`cache_store.jobs.failures`), none for other stores.
        clock: the watchdog of the time limits of the stages run in this process
            (:mod:`workers.time_limits`); default: one that interrupts a stage past its
            limit, so that sample fails alone.
        **fields: options given one by one (``device="cpu", loaders=0``): the fields of
            ``options`` they replace.

    Raises :class:`~cache_store.errors.UsageError` for options out of range, and for
    ``skip_failed`` on a store that keeps no failure log.
    """

    def __init__(
        self,
        store: Store,
        recipe: str | Recipe,
        params: Mapping[str, Any] | None = None,
        *,
        options: EngineOptions | None = None,
        progress: bool = False,
        before_query_chunk: Callable[[int], None] | None = None,
        failure_log: FailureLog | None = None,
        clock: SampleClock | None = None,
        **fields: Any,
    ) -> None:
        options = EngineOptions.of(options, **fields)
        entry = get_entry(recipe.name if isinstance(recipe, Recipe) else recipe)
        self.recipe = recipe if isinstance(recipe, Recipe) else entry.new()
        self.recipe_spec = entry.spec
        #: digest of the recipe's code, stored in every record (``code_digest``)
        self.code_digest = entry.code_digest
        #: the resolved parameters, read-only: they name the fingerprint (and go in
        #: every record)
        self.params = ReadOnlyParams(self.recipe_spec.resolve(params))
        #: what prepare and compute get: every parameter, defaults filled in, read-only
        self.run_params = ReadOnlyParams(self.recipe_spec.with_defaults(self.params))
        if failure_log is None:
            failure_log = failure_log_beside(store)
        if options.skip_failed and failure_log is None:
            raise UsageError(f"skip_failed: {store!r} keeps no failure log to skip by")
        self.options = options
        self.store = store
        self.device = options.device
        self.backend = options.backend
        self.loaders = options.loader_count
        if entry.origin.get("kind") == LOCAL_KIND and self.loaders:
            # a loader process starts without this process's __main__ (a notebook, a
            # script): a recipe made here (spcache.recipe) is prepared here
            logger.info("recipe %r was made in this process: loading in it", entry.name)
            self.loaders = 0
        self.query_chunk = options.query_chunk
        self.min_query_chunk = options.min_query_chunk
        self.write_batch = options.write_batch
        self.prefetch = options.prefetch if options.prefetch is not None else 2 * self.loaders + 2
        self.before_query_chunk = before_query_chunk
        self.progress = progress
        self.source_limits = options.source_limits()
        self.skip_failed = options.skip_failed
        self.failure_log = failure_log
        self.fingerprint = compute_fingerprint(
            self.recipe_spec.name, self.recipe_spec.version, self.params
        )
        #: what seeds each sample's generators: the fingerprint without the augmentation
        #: parameters (variant 0 of an augmented run is the record of the plain run)
        self.seed_fingerprint = compute_fingerprint(
            self.recipe_spec.name,
            self.recipe_spec.version,
            self.recipe_spec.seed_params(self.params),
        )
        #: seconds each stage of a sample may take (the run's option, else the recipe's)
        self.time_limit_s = limit_for(self.recipe, options.time_limit_s)
        self.clock = clock if clock is not None else SampleClock()
        self._loader_pool: LoaderPool | None = None

    def key(self, sample_id: str, variant: int = 0) -> str:
        return record_key(self.fingerprint, sample_id, variant)

    def loader_pool(self, count: int | None = None) -> LoaderPool:
        """A new, unopened loader pool for this engine's recipe (``count``: items it will
        see, when known)."""
        return LoaderPool(
            self.recipe_spec.name,
            dict(self.run_params),
            self.seed_fingerprint,
            loaders=self.loaders,
            count=count,
            limits=self.source_limits,
            limit_s=self.time_limit_s,
            clock=self.clock,
        )

    def open(self) -> Engine:
        """Start the loader pool now and keep it for every later :meth:`run` (a long-lived
        worker calls this once; without it each run starts and stops its own pool)."""
        if self._loader_pool is None:
            pool = self.loader_pool()
            pool.open()
            self._loader_pool = pool
        return self

    def close(self) -> None:
        """Stop the loader pool started by :meth:`open` (safe to call twice)."""
        if self._loader_pool is not None:
            self._loader_pool.close()
            self._loader_pool = None

    def __enter__(self) -> Engine:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    #: when the work was asked for (the worker's claim time; None: each run's start). A
    #: removal of the fingerprint after it refuses the run's writes; see RunLedger.
    requested_at: float | None = None

    def run(
        self,
        items: Iterable[tuple[str, str | os.PathLike[str]]],
        on_result: Callable[[ItemResult], None] | None = None,
        *,
        variants: int = 1,
    ) -> Summary:
        """Compute ``variants`` records of every ``(sample_id, path)`` item; return the
        :class:`Summary` (``on_result`` is called once per record)."""
        return LocalRun(self, list(items), on_result, validate_variant_count(variants)).execute()


def failure_log_beside(store: Store) -> FailureLog | None:
    """The failure log of a local LMDB cache directory; None for other stores."""
    from cache_store.stores.lmdb import LMDBStore

    return FailureLog(store.path) if isinstance(store, LMDBStore) else None


# --- one run -----------------------------------------------------------------------------


class LocalRun:
    """One :meth:`Engine.run` on this machine: load, compute on the device, write.

    The bookkeeping (admission, per-item results, the index) is its :class:`RunLedger`.
    """

    def __init__(
        self,
        engine: Engine,
        items: list[tuple[str, Any]],
        on_result: Callable[[ItemResult], None] | None,
        variants: int = 1,
    ) -> None:
        self.engine = engine
        self.items = items
        self.variants = variants
        self.ledger = RunLedger(
            engine.store,
            Summary(
                engine.fingerprint,
                engine.recipe_spec.name,
                engine.recipe_spec.version,
                dict(engine.params),
            ),
            on_result,
            progress=engine.progress,
            failures=engine.failure_log,
            skip_failed=engine.skip_failed,
            requested_at=engine.requested_at,
            code_digest=engine.code_digest,
        )
        self.summary = self.ledger.summary
        self.committed: queue.SimpleQueue[tuple[ItemResult, float]] = queue.SimpleQueue()
        self.writer: RecordWriter | None = None

    # The order of work matters: the loader pool is created before the device is resolved
    # (which may initialise CUDA), so no CUDA-holding process is ever forked.
    def execute(self) -> Summary:
        start = time.perf_counter()
        work = self.ledger.admit(self.items, self.variants)
        shared_pool = self.engine._loader_pool
        own_pool = shared_pool is None
        pool = self.engine.loader_pool(len(work)) if shared_pool is None else shared_pool
        claims = claims_beside(self.engine.store, self.engine.fingerprint)

        # The cleanup steps, defined before the work so that the ``finally`` is one call
        # (``run_all`` runs them all even if a SIGTERM lands in one).
        interrupted = False

        def close_pool() -> None:
            if own_pool:
                if interrupted:
                    pool.abort()
                else:
                    pool.close()

        def finish_writer() -> None:
            writer = self.writer
            if writer is not None:
                if writer.is_alive():
                    writer.finish()  # interrupted: still commit what was computed
                self._report_committed(quiet=True)
                self.ledger.add_committed(writer.stored)

        def release_claims() -> None:  # after the writer committed what this run holds
            if claims is not None:
                claims.close()

        def close_failure_log() -> None:
            if self.engine.failure_log is not None:
                self.engine.failure_log.close()

        def stop_clock() -> None:
            self.summary.wall_s = time.perf_counter() - start

        try:
            with self.engine.clock.interruptible():
                self._run(claimed(work, claims, self.ledger, self.engine.prefetch), pool, own_pool)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop the loaders now, not after them
            interrupted = True
            raise
        finally:
            run_all(
                close_pool,
                finish_writer,
                release_claims,
                self.ledger.write_index,
                self.ledger.close_progress,
                self.ledger.report_other_code,
                close_failure_log,
                stop_clock,
            )
        self.summary.write_s = self.writer.busy_s if self.writer is not None else 0.0
        if self.ledger.index_unwritten is not None:
            raise self.ledger.index_unwritten
        logger.info(
            "fingerprint %s: %d done, %d skipped, %d failed in %.1fs",
            self.summary.fingerprint,
            self.summary.done,
            self.summary.skipped,
            self.summary.failed,
            self.summary.wall_s,
        )
        return self.summary

    def _run(self, upcoming: Iterator[WorkItem | None], pool: LoaderPool, own_pool: bool) -> None:
        """The run itself, between its admission and its clean-up: ``upcoming`` is the
        admitted items as :func:`workers.claimed_work.claimed` hands them out."""
        if own_pool:
            pool.open()
        device = resolve_device(self.engine.device)
        from workers.ops import get_backend  # the ops package imports Kaolin if present

        ops = get_backend(self.engine.backend, device)
        self.summary.device, self.summary.backend = str(device), str(ops.name)
        budget = ChunkBudget(
            self.engine.query_chunk,
            minimum=self.engine.min_query_chunk,
            before_query_chunk=self.engine.before_query_chunk,
        )
        self.engine.recipe.chunks = budget
        self.writer = writer = RecordWriter(
            self.engine.store, self.engine.write_batch, self.committed
        )
        writer.start()
        self.ledger.open_progress(len(self.items) * self.variants)
        self._pipeline(upcoming, pool, writer, device, ops, budget)
        writer.finish()
        self._report_committed()
        self._stop_if_full(writer)
        self.summary.oom_backoffs = budget.backoffs

    def _pipeline(
        self,
        upcoming: Iterator[WorkItem | None],
        pool: LoaderPool,
        writer: RecordWriter,
        device: torch.device,
        ops: Any,
        budget: ChunkBudget,
    ) -> None:
        """Keep ``prefetch`` loads in flight; compute each loaded sample in input order."""
        pending: deque[tuple[WorkItem, cf.Future]] = deque()
        try:
            while True:
                waiting = False
                while len(pending) < self.engine.prefetch:
                    item = next(upcoming, _END)
                    if item is _END:
                        break
                    if item is WAITING:  # the rest are other runs' (claimed_work)
                        waiting = True
                        break
                    pending.append((item, pool.submit(item)))
                if not pending:
                    if not waiting:
                        return
                    self._report_committed()
                    time.sleep(_WAIT_S)
                    continue
                item, future = pending.popleft()
                outcome = pool.result(item, future, pending)
                self.summary.load_s += outcome.seconds
                if outcome.status == "skipped-failed":
                    self.ledger.skip_failures(item, outcome.source_hash)
                elif outcome.status == "failed":
                    self.ledger.finish_all(
                        item, "failed", reason=outcome.reason, source_hash=outcome.source_hash
                    )
                for part in outcome.variants:
                    self._record(item, part, outcome, writer, device, ops, budget)
                self._report_committed()
                self._stop_if_full(writer)
        finally:
            for _, future in pending:  # interrupted: loads nobody will wait for
                future.cancel()

    def _record(
        self,
        item: WorkItem,
        part: VariantOutcome,
        outcome: LoadOutcome,
        writer: RecordWriter,
        device: torch.device,
        ops: Any,
        budget: ChunkBudget,
    ) -> None:
        """One wanted record of a loaded sample: skipped, failed, or computed and queued
        for the writer."""
        variant = part.variant
        if part.status == "prepared":
            assert part.prepared is not None
            self._compute(
                item,
                variant,
                part.prepared,
                outcome.source_hash,
                writer,
                device,
                ops,
                budget,
                outcome.source_stat,
            )
            return
        key = self.engine.key(item.sample_id, variant) if part.status == "skipped" else ""
        self.ledger.finish(
            ItemResult(
                item.sample_id,
                item.path,
                part.status,
                key=key,
                reason=part.reason,
                source_hash=outcome.source_hash,
                variant=variant,
            )
        )

    @staticmethod
    def _stop_if_full(writer: RecordWriter) -> None:
        """A full store ends the run: every later write would fail the same way. What was
        committed stays; the caller gets :class:`StoreFull` naming the cache."""
        if writer.full is not None:
            raise StoreFull(writer.full.path, writer.full.reason) from writer.full

    def _compute(
        self,
        item: WorkItem,
        variant: int,
        prepared: dict[str, Any],
        source_hash: str,
        writer: RecordWriter,
        device: torch.device,
        ops: Any,
        budget: ChunkBudget,
        source_stat: str = "",
    ) -> None:
        start = time.perf_counter()
        spec = self.engine.recipe_spec
        stage = "compute() raised"
        try:
            with self.engine.clock.watch(
                item.sample_id, item.path, "compute", self.engine.time_limit_s
            ):
                tensors = self.engine.recipe.compute(prepared, self.engine.run_params, device, ops)
            stage = "outputs"
            check_outputs(spec, tensors, self.engine.run_params)
        except Exception as exc:  # one sample's failure is recorded, the run goes on
            if is_out_of_memory(exc):
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                how = (
                    f"after backing off to {budget.size}-item chunks"
                    if budget.backoffs
                    else "outside any chunked step: nothing to back off"
                )
                reason = f"recipe {spec.name!r}: out of device memory ({how}): {one_line(exc, limit=REASON_MAX)}"
            elif isinstance(exc, SourceError):
                reason = exc.reason
            elif stage == "outputs":
                reason = one_line(exc, limit=REASON_MAX)
            else:
                logger.exception("sample %s (%s) failed on %s", item.sample_id, item.path, device)
                reason = f"recipe {spec.name!r}: {stage} {one_line(exc, with_class=True, limit=REASON_MAX)}"
            self.ledger.finish(
                ItemResult(
                    item.sample_id,
                    item.path,
                    "failed",
                    reason=reason,
                    source_hash=source_hash,
                    variant=variant,
                )
            )
            return
        except SampleTimeLimit:  # stopped at its time limit: this sample's failure alone
            overrun = Overrun(item.sample_id, item.path, "compute", self.engine.time_limit_s, 0)
            self.ledger.finish(
                ItemResult(
                    item.sample_id,
                    item.path,
                    "failed",
                    reason=f"recipe {spec.name!r}: {overrun.reason}",
                    source_hash=source_hash,
                )
            )
            return
        finally:
            self.summary.compute_s += time.perf_counter() - start
        metadata = self._metadata(item, source_hash, device, ops)
        if variant:  # the record's key says it too (cache_store.keys.record_key)
            metadata["variant"] = str(variant)
        if source_stat:  # readers compare it before hashing (cache_store.sources.freshness)
            metadata[STAT_FIELD] = source_stat
        writer.put(
            PendingRecord(
                item, tensors, metadata, variant, self.engine.key(item.sample_id, variant)
            )
        )

    def _metadata(
        self, item: WorkItem, source_hash: str, device: torch.device, ops: Any
    ) -> dict[str, str]:
        spec = self.engine.recipe_spec
        return {
            "recipe": spec.name,
            "recipe_version": str(spec.version),
            "fingerprint": self.engine.fingerprint,
            "sample_id": item.sample_id,
            "source_hash": source_hash,
            "backend": str(ops.name),
            "device": str(device),
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "spcache_version": SPCACHE_VERSION,
            "schema": json.dumps(
                {k: f.as_json() for k, f in spec.fields_for(self.engine.params).items()},
                sort_keys=True,
                separators=(",", ":"),
            ),
            "params": canonical_json(dict(self.engine.params)),
            "code_digest": self.engine.code_digest,
        }

    def _report_committed(self, quiet: bool = False) -> None:
        """Report what the writer committed (or failed to) since the last call."""
        while True:
            try:
                result, _ = self.committed.get_nowait()
            except queue.Empty:
                return
            try:
                self.ledger.finish(result)
            except Exception:  # on_result failing must not lose other results
                if not quiet:
                    raise
                logger.exception("on_result failed for %s", result.sample_id)
