"""``spcache worker``: drain the cache's job queue on one device, until told to stop.

The loop claims a few items of one job under a lease, runs the engine on them (which
skips any whose record is already stored with the same source hash, so an item
reclaimed after a crash is never computed twice), and reports each item back as the
engine reports it: ``done``/``skipped`` -> done, ``failed`` -> failed with its reason
(a bad sample fails alone; it is not retried, the engine already gave it its chances).
If the engine itself crashes, the items it did not report go back to the queue as a
failed *attempt* and are retried while attempts remain. If the whole process dies (a
native library calling ``exit()``, a segfault), the supervisor starts it again and the
held items come back when their leases run out, each lost claim counted as an attempt; an
item on a later attempt is run in a batch of its own, so one sample that kills the
process spends only its own attempts and fails when they run out.

A sample's stage run in this process (``compute``; loading too with ``--loaders 0``) past
its time limit ends the process (:mod:`workers.time_limits`): that item's attempt fails
in the queue naming the limit, the other items held are handed back, and the worker
exits with :data:`~cache_store.jobs.worker_state.OVERRUN_EXIT`; the service's supervisor
starts a fresh one at once (a plain ``spcache worker`` needs whatever runs it to do so:
systemd's ``Restart=``, say). After its attempts the sample fails for good, naming the
limit. A load in a loader process past the limit replaces the loaders and fails that
sample at once (loading is CPU work the same every time).

A background thread renews the leases of held items and writes a heartbeat (every few
seconds; it names the sample being computed, and is written at once when one is stuck:
:mod:`cache_store.jobs.worker_state`). SIGTERM or
SIGINT asks the loop to stop: the current claim is finished (it is small), nothing new
is claimed, and the loop exits 0. A second signal interrupts the engine (which still
commits what it computed); whatever is left unreported is released, not lost.

The fingerprint's dataset index is written by the engine at the end of each run.

Why one module: the claim loop, the lease keeper and the time-limit handler all act on
the items this worker holds (the same table, under one lock) and on its heartbeat;
:func:`run_worker`'s checks before the first claim are the loop's own preconditions.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

from cache_store.engine_options import EngineOptions
from cache_store.errors import UsageError
from cache_store.jobs.queue import ClaimedItem, JobQueue
from cache_store.jobs.worker_state import OVERRUN_EXIT
from cache_store.process_local import this_process_only
from cache_store.sources.files import narrow_roots
from cache_store.stores.base import Store
from cache_store.stores.opener import open_store
from workers.time_limits import Overrun, SampleClock

__all__ = ["WorkerLoop", "run_worker"]

log = logging.getLogger(__name__)

#: the longest time between two heartbeats (a lease's third when shorter)
HEARTBEAT_S = 5.0


class WorkerLoop:
    """One worker draining ``<cache>/jobs.sqlite`` into ``<cache>``'s store.

    Args:
        cache: the cache directory.
        options: how its engines run (:class:`cache_store.engine_options.EngineOptions`:
            device, backend, loaders, ...; its defaults where not given). Its
            ``source_roots`` are the directories every source must resolve into, checked
            again when the engine opens the file (the service checked the path earlier);
            None: any. The roots a job was accepted under travel with it in the queue and
            are enforced too: a source must lie inside both (a job without roots, e.g. a
            local read-through's, is bound by these alone).
        batch: items per claim (one engine run).
        lease_s: lease length; renewed every third of it while held.
        poll_s: sleep between claims when the queue is empty.
        drain: exit (0) once the queue has nothing claimable, instead of polling.
        max_attempts: claims per item before it fails (queue setting).
        worker_id: name in leases and heartbeats (default ``host:pid``).
        max_size: keep the records under this many bytes: after each claimed batch, the
            least recently used fingerprints are removed (never the one being written,
            nor one with queued or running items); see
            :class:`cache_store.housekeeping.SizeLimit`.
        **fields: options given one by one (``device="cpu", loaders=0``).
    """

    def __init__(
        self,
        cache: str | os.PathLike[str],
        *,
        options: EngineOptions | None = None,
        batch: int = 8,
        lease_s: float = 120.0,
        poll_s: float = 1.0,
        drain: bool = False,
        max_attempts: int = 3,
        worker_id: str | None = None,
        max_size: int | None = None,
        **fields: Any,
    ) -> None:
        if batch < 1 or lease_s <= 0 or poll_s <= 0:
            raise UsageError("batch >= 1, lease_s > 0 and poll_s > 0 needed")
        self.options = EngineOptions.of(options, **fields)
        self.cache = Path(cache)
        self.device = self.options.device
        self.backend = self.options.backend
        self.batch = batch
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.drain = drain
        self.max_attempts = max_attempts
        self._own_roots = self.options.source_limits().roots
        self.size_limit = None
        if max_size is not None:
            from cache_store.housekeeping import SizeLimit

            self.size_limit = SizeLimit(self.cache, max_size)
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.stop_requested = threading.Event()
        self.processed = 0
        self._held: dict[int, ClaimedItem] = {}
        self._held_lock = threading.Lock()
        self._engines: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._signals = 0
        #: the time limits of the stages this process runs (workers.time_limits)
        self.clock = SampleClock(on_overrun=self._overran, on_stuck=self._stuck)
        self._claim: dict[str, ClaimedItem] = {}  # the claim being run, by sample id
        self._time_limit_s: float | None = None  # the current engine's

    # -- signals ---------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the loop (see the module doc), in this process only: a
        child a recipe forks (a ``multiprocessing.Pool``) ends on them as by default."""
        handler = this_process_only(self._on_signal)
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info(
                "worker %s: %s received; finishing the current items, then stopping",
                self.worker_id,
                signal.Signals(signum).name,
            )
            self.stop_requested.set()
            return
        log.warning("worker %s: second signal; interrupting", self.worker_id)
        raise KeyboardInterrupt

    # -- the backend -------------------------------------------------------------------

    def choose_backend(self) -> tuple[str, str]:
        """The SPC ops backend this worker's engines will use, and why (one phrase).

        Raises :class:`~cache_store.errors.BackendUnavailable` for a combination that cannot
        run (``--backend kaolin`` on a CPU device, or where Kaolin or CUDA is missing) and
        :class:`~cache_store.errors.UnknownName` for an unknown backend: the caller refuses
        to start (exit 2) rather than fail every claimed sample. Never initialises CUDA.
        """
        from workers.ops import select_backend  # late: imports torch

        backend, why = select_backend(self.backend, self.device)
        return backend.name, why

    def log_backend(self) -> None:
        """One line at start: which backend runs and why (WARNING when a CUDA device falls
        back to the torch ops, which is slower than Kaolin's kernels)."""
        from workers.ops import device_type

        name, why = self.choose_backend()
        fell_back = (
            self.backend == "auto" and name == "torch" and device_type(self.device) == "cuda"
        )
        device = str(self.device)
        if device == "auto":  # say what auto is on this machine
            device = f"auto ({device_type(self.device)} here)"
        log.log(
            logging.WARNING if fell_back else logging.INFO,
            "worker %s: backend: %s (%s); device %s",
            self.worker_id,
            name,
            why,
            device,
        )

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> int:
        self.log_backend()  # raises, before anything is claimed, for a backend that cannot run
        queue = JobQueue(self.cache, max_attempts=self.max_attempts)
        store = open_store(self.cache, readonly=False)
        keeper = threading.Thread(
            target=self._keep_leases, args=(queue,), daemon=True, name="spcache-lease-keeper"
        )
        keeper.start()
        log.info(
            "worker %s: draining %s on device %s (backend %s)",
            self.worker_id,
            self.cache,
            self.device,
            self.backend,
        )
        try:
            queue.heartbeat(self.worker_id, self._info())
            if self.size_limit is not None:
                self.size_limit.after_batch(None)  # over the limit already: evict first
            while not self.stop_requested.is_set():
                claimed_at = time.time()
                claimed = queue.claim(self.worker_id, limit=self.batch, lease_s=self.lease_s)
                if not claimed:
                    if self.drain:
                        break
                    self.stop_requested.wait(self.poll_s)
                    continue
                claimed = self._isolate_suspects(queue, claimed)
                with self._held_lock:
                    self._held.update({c.item_id: c for c in claimed})
                self._process(queue, store, claimed, claimed_at)
                if self.size_limit is not None:
                    self._keep_under_limit(claimed[0].fingerprint)
        except KeyboardInterrupt:
            log.warning("worker %s interrupted", self.worker_id)
        finally:
            with self._held_lock:
                left = list(self._held)
                self._held.clear()
            if left:
                released = queue.release(self.worker_id, left)
                log.info("worker %s: released %d unfinished item(s)", self.worker_id, released)
            self.stop_requested.set()
            keeper.join(timeout=5)
            queue.heartbeat(self.worker_id, {**self._info(), "stopped": True})
            self._close_engines()
            store.close()
            queue.close()
        log.info("worker %s stopped after %d item(s)", self.worker_id, self.processed)
        return 0

    def _isolate_suspects(self, queue: JobQueue, claimed: list[ClaimedItem]) -> list[ClaimedItem]:
        """Run an item that an earlier claim did not finish on its own.

        An item on its second or later attempt was held when a worker died (a native
        library calling ``exit()``, such as Kaolin's ``CubDebugExit`` on a CUB error, or a
        segfault: the supervisor restarts the worker and the lease runs out) or when an
        engine run crashed. Run together with the others, it would kill them again and
        spend their attempts too. So the items before the first such item are kept (they
        were claimed in order, so they are the ones the dead run had finished or not
        reached), or that item alone when it comes first; the rest are released without
        spending an attempt. The queue fails the item itself once its attempts run out.
        """
        suspects = [i for i, c in enumerate(claimed) if c.attempts > 1]
        if not suspects or len(claimed) == 1:
            return claimed
        keep = claimed[: suspects[0]] or claimed[:1]
        rest = claimed[len(keep) :]
        queue.release(self.worker_id, [c.item_id for c in rest])
        suspect = claimed[suspects[0]]
        log.warning(
            "worker %s: sample %s is on attempt %d (an earlier claim did not finish "
            "it); it runs in a batch of its own%s",
            self.worker_id,
            suspect.sample_id,
            suspect.attempts,
            "" if suspects[0] == 0 else ", after the items before it",
        )
        return keep

    def _keep_under_limit(self, writing: str) -> None:
        """``--max-size``: after each batch, evict least recently used fingerprints (never
        the one being written, nor one with queued or running items)."""
        assert self.size_limit is not None
        try:
            self.size_limit.after_batch(writing)
        except Exception:  # eviction is housekeeping: the work goes on
            log.exception("worker %s: keeping the cache under --max-size failed", self.worker_id)

    def _process(
        self,
        queue: JobQueue,
        store: Store,
        claimed: list[ClaimedItem],
        claimed_at: float | None = None,
    ) -> None:
        first = claimed[0]
        by_id = {c.sample_id: c for c in claimed}
        self._claim = by_id
        reported: set[int] = set()
        # Done items are completed only once the run has ended well, its records and the
        # dataset index committed: a job that reads "done" always has every one of its ids
        # in the index. A run that raises (the index not written, say) leaves them to the
        # failed-attempt path below, and the next attempt skips their stored records.
        finished: list[ClaimedItem] = []
        # an item is settled once the engine reported each of its job's variants: done
        # when all are stored, else failed with the first failure's reason
        results: dict[int, list[Any]] = {}

        def on_result(result: Any) -> None:
            item = by_id.get(result.sample_id)
            if item is None:
                log.warning("engine reported unknown sample %r", result.sample_id)
                return
            got = results.setdefault(item.item_id, [])
            got.append(result)
            if len(got) < item.variants:
                return
            reported.add(item.item_id)
            failed = [r for r in got if r.status not in ("done", "skipped")]
            if not failed:
                finished.append(item)
                return
            reason = failed[0].reason or "failed"
            if item.variants > 1:
                reason = f"{len(failed)} of {item.variants} variants failed; {failed[0].record_id}: {reason}"
            # the sample's own failure is final; a failed write (a full disk) is retried
            queue.fail(
                self.worker_id,
                item.item_id,
                reason,
                permanent=not any(r.transient for r in failed),
            )
            with self._held_lock:
                self._held.pop(item.item_id, None)
            self.processed += 1

        def complete_finished() -> None:
            for item in finished:
                queue.complete(self.worker_id, item.item_id)
                with self._held_lock:
                    self._held.pop(item.item_id, None)
                self.processed += 1
            finished.clear()

        start = time.perf_counter()
        roots = narrow_roots(first.roots, self._own_roots)
        if roots is None:
            reason = (
                f"the job's source roots ({', '.join(first.roots)}) and this worker's "
                f"--source-root ({', '.join(self._own_roots)}) share no directory; "
                f"nothing of this job may be read here"
            )
            log.error("worker %s: job %s: %s", self.worker_id, first.job_id, reason)
            for c in claimed:
                queue.fail(self.worker_id, c.item_id, reason, permanent=True)
                with self._held_lock:
                    self._held.pop(c.item_id, None)
            return
        try:
            engine = self._engine(store, first, roots)
            # asked for when claimed: a removal of the fingerprint after that refuses its writes
            engine.requested_at = claimed_at
            engine.run(
                [(c.sample_id, c.path) for c in claimed],
                on_result=on_result,
                variants=first.variants,
            )
        except KeyboardInterrupt:  # what it finished is released with the rest, not done
            raise
        except Exception as exc:  # a crashed run must not kill the worker
            reason = f"engine run failed: {type(exc).__name__}: {exc}"
            log.exception("worker %s: job %s: %s", self.worker_id, first.job_id, reason)
            unfinished = {c.item_id for c in finished}
            for c in claimed:
                if c.item_id not in reported or c.item_id in unfinished:
                    queue.fail(self.worker_id, c.item_id, reason)
                    with self._held_lock:
                        self._held.pop(c.item_id, None)
        else:
            complete_finished()
        self._log_batch(queue, first.job_id, len(claimed), time.perf_counter() - start)

    def _log_batch(self, queue: JobQueue, job_id: str, count: int, seconds: float) -> None:
        """One INFO line per finished batch: the job, its progress and this batch's rate."""
        try:
            info = queue.job(job_id, errors_limit=0)
        except Exception:  # progress is informational; the work is done
            log.exception("worker %s: job %s: cannot read its progress", self.worker_id, job_id)
            return
        finished = info.counts.get("done", 0) + info.counts.get("failed", 0)
        log.info(
            "worker %s: job %s: %d/%d items finished (%d failed); this batch: %d item(s) "
            "in %.1fs, %.2f samples/s",
            self.worker_id,
            job_id,
            finished,
            info.total,
            info.counts.get("failed", 0),
            count,
            seconds,
            count / seconds if seconds > 0 else 0.0,
        )

    def _engine(self, store: Store, item: ClaimedItem, roots: tuple[str, ...]) -> Any:
        """The engine for the item's fingerprint, reading sources only inside ``roots``
        (the job's roots narrowed by this worker's own; empty: any path)."""
        engine = self._engines.get((item.fingerprint, roots))
        if engine is None:
            from workers.engine import Engine  # late: imports torch and the ops

            engine = Engine(
                store,
                item.recipe,
                item.params,
                options=replace(self.options, source_roots=roots or None),
                clock=self.clock,
            )
            if engine.fingerprint != item.fingerprint:
                raise RuntimeError(
                    f"job {item.job_id}: fingerprint {item.fingerprint} was "
                    f"queued, this worker computes {engine.fingerprint} for the "
                    f"same recipe and parameters (different recipe version?)"
                )
            # One loader pool for this worker's life instead of one per claim. Engines of
            # other fingerprints are closed first: their pools would sit idle.
            self._close_engines()
            engine.open()
            self._engines[(item.fingerprint, roots)] = engine
        self._time_limit_s = engine.time_limit_s
        return engine

    def _close_engines(self) -> None:
        for fingerprint, engine in list(self._engines.items()):
            try:
                engine.close()
            except Exception:  # a broken pool must not stop the worker
                log.exception("closing the engine of %s failed", fingerprint)
            del self._engines[fingerprint]

    def _overran(self, overrun: Overrun) -> None:
        """A stage ran past its time limit (the clock's thread): fail that item's attempt
        naming the limit, hand back the others, exit with ``OVERRUN_EXIT``."""
        item = self._claim.get(overrun.sample_id)
        reason = f"recipe {item.recipe if item else '?'!r}: {overrun.reason}"
        log.error(
            "worker %s: sample %s (%s): %s; the worker exits to be restarted (attempt %s of %d)",
            self.worker_id,
            overrun.sample_id,
            overrun.path,
            reason,
            item.attempts if item else "?",
            self.max_attempts,
        )
        try:
            queue = JobQueue(self.cache, max_attempts=self.max_attempts)
            if item is not None:
                status = queue.fail(self.worker_id, item.item_id, reason)
                log.error("worker %s: sample %s is %s", self.worker_id, overrun.sample_id, status)
            with self._held_lock:
                others = [i for i in self._held if item is None or i != item.item_id]
            queue.release(self.worker_id, others)
            queue.heartbeat(self.worker_id, {**self._info(), "stopped": True})
            queue.close()
        except Exception:  # the exit matters more: its leases then run out
            log.exception("worker %s: handing back its items failed", self.worker_id)
        finally:
            logging.shutdown()
            os._exit(OVERRUN_EXIT)

    def _stuck(self, overrun: Overrun) -> None:
        """A stage has run half its limit: say so in a heartbeat now (``/readyz``)."""
        log.warning(
            "worker %s: sample %s (%s) has been in %s for %.0f s of its %g s time limit",
            self.worker_id,
            overrun.sample_id,
            overrun.path,
            overrun.stage,
            time.time() - overrun.started,
            overrun.limit_s,
        )
        queue = JobQueue(self.cache)
        try:
            queue.heartbeat(self.worker_id, self._info())
        finally:
            queue.close()

    def _keep_leases(self, queue: JobQueue) -> None:
        every = self._heartbeat_s
        while True:
            stopping = self.stop_requested.wait(every)
            with self._held_lock:
                ids = list(self._held)
            if stopping and not ids:
                break
            try:
                if ids:
                    held = queue.renew(self.worker_id, ids, lease_s=self.lease_s)
                    with self._held_lock:
                        for lost in set(ids) - held:
                            self._held.pop(lost, None)
                queue.heartbeat(self.worker_id, self._info())
            except Exception:  # keep renewing; the next round may work
                log.exception("worker %s: lease renewal failed", self.worker_id)
            if stopping:  # still finishing the last claim: keep its leases alive
                time.sleep(every)
        queue.close()

    def _info(self) -> dict[str, Any]:
        current = self.clock.current()
        return {
            "device": self.device,
            "backend": self.backend,
            "processed": self.processed,
            "held": len(self._held),
            "cache": str(self.cache),
            "heartbeat_s": self._heartbeat_s,
            "time_limit_s": self._time_limit_s,
            "current": current.as_json() if current is not None else None,
        }

    @property
    def _heartbeat_s(self) -> float:
        return max(min(self.lease_s / 3.0, HEARTBEAT_S), 0.05)


def run_worker(
    cache: Path,
    *,
    options: EngineOptions,
    under_service: bool = False,
    **loop_options: Any,
) -> int:
    """``spcache worker``: check, lock, then drain ``cache`` until a signal (or, with
    ``drain=True``, until nothing is left); returns the loop's exit status (0).

    A worker never creates its cache (a mistyped path would otherwise get a new, empty
    queue that nobody fills); a backend that cannot run here, a size limit smaller than a
    fingerprint already stored (unless ``under_service``: the service checked it at its
    start, and a refusal would only restart-loop its child) and a cache that another live
    worker owns are refused before any item is claimed. The lock (``worker.lock``) is
    held while the loop runs. ``loop_options``: :class:`WorkerLoop`'s other arguments.

    Raises :class:`~cache_store.errors.UsageError` (bad path, cache owned, lock not
    taken), :class:`~cache_store.errors.BackendUnavailable`,
    :class:`~cache_store.errors.LimitTooSmall`.
    """
    from cache_store.errors import CacheOwned, LimitTooSmall
    from cache_store.jobs.owner_lock import WorkerLock
    from cache_store.location import check_cache_dir
    from workers.engine import check_device

    if not cache.exists():
        raise UsageError(
            f"{cache}: no such cache directory (a worker drains an existing cache: check "
            f"the path, or create it first)"
        )
    check_cache_dir(cache, write=True)
    loop = WorkerLoop(cache, options=options, **loop_options)
    check_device(options.device)  # a CUDA device this machine lacks: refused likewise
    loop.choose_backend()  # a backend that cannot run here: refused before any claim
    if loop.size_limit is not None:
        try:
            loop.size_limit.check_start()
        except LimitTooSmall as exc:
            if not under_service:
                raise
            log.warning("%s; evicting what can be evicted", exc)
    lock = WorkerLock(cache)
    try:
        lock.acquire(worker_id=loop.worker_id, device=options.device)
    except CacheOwned as exc:
        raise UsageError(f"{exc}; stop it first, or point --cache elsewhere") from exc
    except OSError as exc:
        raise UsageError(f"{cache}: cannot take the worker lock: {exc}") from exc
    try:
        loop.install_signal_handlers()
        return loop.run()
    finally:
        lock.release()
