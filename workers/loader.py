"""Loading: read, hash, parse and prepare samples in a pool of CPU processes.

:func:`load_sample` is one sample's CPU work (it runs in a loader process, or in the
calling process when the engine has no loaders) and returns a :class:`LoadOutcome`.
:class:`LoaderPool` runs it in a process pool started from the forkserver without the
caller's ``__main__`` (:mod:`workers.loader_process`), recovers when one of its processes
dies, and loads in the calling process when loader processes cannot work at all. The
pool is created before the engine touches the device, so no process that holds CUDA is
ever forked.

A sample fails only for a reason of its own. :func:`load_sample` returns every such
reason as an outcome; whatever it raises is the loader's (the recipe not found in the
loader process, a result that cannot be sent back), and so is a process that cannot be
started or ends as it starts: those never fail a sample.

Loading one sample has a time limit (:mod:`workers.time_limits`). A loader process notes
in a table shared with the engine (:class:`StartTable`) when it began each sample; past
the limit the engine terminates the pool's processes and starts fresh ones, that sample
fails naming the limit and the others are loaded again. Loading in the engine's own
process is watched by the engine's :class:`~workers.time_limits.SampleClock`.

Why one module: the pool's ways of going on (a loader that died, one stuck past the
time limit, loaders that cannot work at all) share its process pool, its start table
and the fall-back to loading in this process; :func:`load_sample` is what those
processes run, and its outcomes are what the recovery decides on.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing.spawn
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple

import torch

from cache_store.errors import SourceError, REASON_MAX, one_line
from cache_store.processes import pid_alive
from cache_store.sources.freshness import stale_variants, trusted_signature
from cache_store.recipes.api import ReadOnlyParams, Recipe
from cache_store.recipes.registry import ENV_VAR as RECIPES_ENV_VAR
from cache_store.recipes.registry import report_problems_here
from workers.recipe_run import get_recipe, make_generator
from workers.loader_process import loader_context
from workers.run_ledger import WorkItem
from workers.time_limits import Overrun, SampleClock, SampleTimeLimit
from cache_store.sources.files import SourceLimits, source_signature
from workers.source_load import hash_bytes, load_source, read_source_bytes

__all__ = [
    "LOADER_DIED",
    "LoadOutcome",
    "VariantOutcome",
    "LoaderPool",
    "LoaderUnusable",
    "StartTable",
    "interrupts_held",
    "load_sample",
    "loader_ready",
    "stop_executor",
]

logger = logging.getLogger(__name__)


class LoaderUnusable(Exception):
    """A loader process cannot do its work; no sample's failure. Its one argument is the
    message, so it pickles back to the engine whatever the cause was."""


def _recipe_here(recipe_name: str) -> Recipe:
    try:
        return get_recipe(recipe_name)
    except Exception as exc:  # noqa: BLE001 - the loader's problem, raised as one
        raise LoaderUnusable(
            f"recipe {recipe_name!r} is not found in a loader process "
            f"({one_line(exc, with_class=True, limit=REASON_MAX)})"
        ) from None


class VariantOutcome(NamedTuple):
    """One wanted record of a loaded sample: ``status`` ``"skipped"`` (stored, current),
    ``"prepared"`` (``prepared``: what the recipe's ``prepare`` returned for this
    variant) or ``"failed"`` (``reason``)."""

    variant: int
    status: str
    prepared: dict[str, Any] | None = None
    reason: str = ""


class LoadOutcome(NamedTuple):
    """What loading one sample came to.

    ``status`` is ``"loaded"`` (``variants`` says what became of each wanted record:
    :class:`VariantOutcome`), ``"skipped-failed"`` (the file is unchanged since this
    sample failed, and the run skips those) or ``"failed"`` (``reason`` says why: every
    wanted record fails); ``seconds`` is the time it took; ``source_hash`` the file's
    content hash once it was read; ``source_stat`` its stat signature, taken before the
    read (``""`` when the file changed too recently to trust one:
    :func:`trusted_signature`).
    """

    status: str
    seconds: float
    reason: str = ""
    source_hash: str = ""
    source_stat: str = ""
    variants: tuple[VariantOutcome, ...] = ()


def load_sample(
    recipe_name: str,
    params: dict[str, Any],
    fingerprint: str,
    sample_id: str,
    path: str,
    stored_hashes: tuple[str | None, ...],
    failed_hash: str | None = None,
    limits: SourceLimits | None = None,
    ticket: int | None = None,
) -> LoadOutcome:
    """Read, hash and (unless its stored record is current) prepare each wanted variant
    of one sample: ``stored_hashes`` holds the stored record's source hash of variants
    ``0 .. K-1`` (None: none stored). The file is read and parsed once; each variant is
    prepared from it with its own generator (:func:`make_generator`) and
    ``source.variant`` set.

    Runs in a loader process: only plain values and the picklable :class:`LoadOutcome`
    cross the process boundary. ``limits`` bound how the file is opened and read
    (:mod:`cache_store.sources.files`). A recipe this process cannot find raises
    :class:`LoaderUnusable`: that is the process's problem, not the sample's. ``ticket``
    (in a loader process): this load's number, noted with its start in the pool's
    :class:`StartTable`.
    """
    start = time.perf_counter()
    StartTable.mark(ticket)
    recipe = _recipe_here(recipe_name)
    digest = ""
    try:
        # The signature is taken before the read: an edit in between leaves the record
        # with an older signature (hashed again when checked), never a newer one.
        signature = trusted_signature(source_signature(path, limits))
        data = read_source_bytes(path, limits)
        digest = hash_bytes(data)
        todo = stale_variants(stored_hashes, digest)
        if not todo:
            skipped = tuple(VariantOutcome(v, "skipped") for v in range(len(stored_hashes)))
            return LoadOutcome(
                "loaded", time.perf_counter() - start, source_hash=digest, variants=skipped
            )
        if failed_hash is not None and digest == failed_hash:
            return LoadOutcome("skipped-failed", time.perf_counter() - start, source_hash=digest)
        source = load_source(path, data)
    except Exception as exc:  # noqa: BLE001 - this sample's failure; _failure_reason logs it
        reason = _failure_reason(exc, step=f"loading {path}")
        return LoadOutcome("failed", time.perf_counter() - start, reason=reason, source_hash=digest)
    outcomes = [
        VariantOutcome(v, "skipped")
        if v not in todo
        else _prepare(recipe, recipe_name, params, fingerprint, sample_id, source, v)
        for v in range(len(stored_hashes))
    ]
    return LoadOutcome(
        "loaded",
        time.perf_counter() - start,
        source_hash=digest,
        source_stat=signature,
        variants=tuple(outcomes),
    )


def _prepare(
    recipe: Recipe,
    recipe_name: str,
    params: dict[str, Any],
    fingerprint: str,
    sample_id: str,
    source: Any,
    variant: int,
) -> VariantOutcome:
    """The recipe's ``prepare`` of one variant of a loaded source."""
    if variant:
        source = dataclasses.replace(source, variant=variant)
    try:
        prepared = recipe.prepare(
            source, ReadOnlyParams(params), make_generator(fingerprint, sample_id, variant)
        )
    except Exception as exc:  # noqa: BLE001 - this record's failure; logged there
        step = f"recipe {recipe_name!r}: prepare() on {source.path}"
        reason = _failure_reason(
            exc, step=step, prefix=f"recipe {recipe_name!r}: prepare() raised "
        )
        return VariantOutcome(variant, "failed", reason=reason)
    if not isinstance(prepared, dict):
        return VariantOutcome(
            variant,
            "failed",
            reason=f"recipe {recipe_name!r}: prepare() returned "
            f"{type(prepared).__name__}, expected a dict of arrays",
        )
    return VariantOutcome(variant, "prepared", prepared)


def _failure_reason(exc: Exception, *, step: str, prefix: str = "") -> str:
    """A sample's failure for the error one of its steps raised: a :class:`SourceError`
    gives its own reason, running out of memory says so, anything else is logged with its
    traceback (naming ``step``) and named by its class after ``prefix``."""
    if isinstance(exc, SourceError):
        return exc.reason
    if isinstance(exc, MemoryError):
        return "out of memory while loading"
    logger.error("%s failed", step, exc_info=exc)
    return prefix + one_line(exc, with_class=True, limit=REASON_MAX)


def _init_loader_process(engine_pid: int, recipes_env: str | None, started: Any = None) -> None:
    torch.set_num_threads(1)  # one core per loader; the pool is the parallelism
    StartTable.here = started
    # The forkserver's environment is the one it started with: find the recipes the
    # engine's process finds now (SPCACHE_RECIPES may have been set since).
    if recipes_env is None:
        os.environ.pop(RECIPES_ENV_VAR, None)
    else:
        os.environ[RECIPES_ENV_VAR] = recipes_env
    report_problems_here(False)  # the engine's process named any unusable recipe already
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    threading.Thread(
        target=_exit_when_orphaned, args=(engine_pid,), daemon=True, name="spcache-orphan-watch"
    ).start()


def _exit_when_orphaned(engine_pid: int) -> None:
    """End this loader soon after the engine's process is gone.

    A pool worker blocks on its task queue forever when the engine is killed (SIGKILL
    leaves no chance to shut the pool down), and with a forkserver its parent is not the
    engine, so the engine's pid is watched directly.
    """
    while pid_alive(engine_pid):
        time.sleep(0.5)
    os._exit(1)


class StartTable:
    """When each load in flight began, shared by the engine and its loader processes (one
    shared array per pool, two doubles per slot: the load's ticket, then its start on the
    monotonic clock, which every process of the machine shares). Tickets in flight never
    exceed the prefetch, far below :data:`SLOTS`."""

    SLOTS = 1024
    #: in a loader process: its pool's table (set when the process starts)
    here: Any = None

    def __init__(self, context: Any) -> None:
        self.cells = context.RawArray("d", 2 * self.SLOTS)
        for slot in range(self.SLOTS):
            self.cells[2 * slot] = -1.0

    @classmethod
    def mark(cls, ticket: int | None) -> None:
        """In a loader process: load ``ticket`` begins now."""
        if ticket is None or cls.here is None:
            return
        slot = 2 * (ticket % cls.SLOTS)
        cls.here[slot + 1] = time.monotonic()
        cls.here[slot] = float(ticket)

    def started(self, ticket: int) -> float | None:
        """When load ``ticket`` began (monotonic), or None before it did."""
        slot = 2 * (ticket % self.SLOTS)
        if self.cells[slot] != float(ticket):
            return None
        return float(self.cells[slot + 1])


#: The reason of a sample whose file killed its loader twice (see :class:`LoaderPool`).
LOADER_DIED = "the loader process died while reading this file (crash or out of memory)"


def loader_ready(recipe_name: str) -> int:
    """Run in a loader process: it started, and it finds the recipe. Returns its pid."""
    _recipe_here(recipe_name)
    return os.getpid()


class LoaderPool:
    """The loader processes, recovery when one of them dies, and loading in this process
    when they cannot work at all.

    A pool whose process died (a parser crash, the OOM killer) fails every pending task.
    A fresh pool is then checked (:func:`loader_ready`: a loader starts and finds the
    recipe); if it works, the head item is retried alone in it: if it kills that one too
    it is the culprit and fails with :data:`LOADER_DIED`; the other pending items are
    resubmitted.

    When loaders cannot work at all (no process can be started, they end as they start,
    or they do not find the recipe), no sample is blamed: one WARNING says why, and from
    then on this pool loads in the calling process, as with ``loaders=0``
    (:attr:`loading_here` holds the reason).

    Each load has ``limit_s`` seconds (:mod:`workers.time_limits`): one in a loader
    process past it gets the pool's processes terminated and replaced, and fails naming
    the limit; one in the calling process is watched by ``clock``.

    Args:
        recipe_name, params: what every sample is prepared for.
        fingerprint: what seeds each sample's generators: the fingerprint of the
            parameters without the augmentation ones (the engine's ``seed_fingerprint``).
        loaders: loader processes; 0 loads in the calling process (no pool).
        count: items the pool will see, when known (no more processes than items).
        limits: how sources may be opened and read.
        limit_s: the time limit of loading one sample (None: none).
        clock: the watchdog of loads in the calling process (None: not watched).
    """

    def __init__(
        self,
        recipe_name: str,
        params: dict[str, Any],
        fingerprint: str,
        *,
        loaders: int,
        count: int | None = None,
        limits: SourceLimits | None = None,
        limit_s: float | None = None,
        clock: SampleClock | None = None,
    ) -> None:
        self.recipe_name = recipe_name
        self.limit_s = limit_s
        self.clock = clock
        self.starts: StartTable | None = None
        self._tickets = itertools.count()
        self.limits = limits or SourceLimits()
        self.params = dict(params)
        self.fingerprint = fingerprint
        self.loaders = loaders
        self.count = loaders if count is None else count
        self.pool: cf.ProcessPoolExecutor | None = None
        #: why this pool loads in the calling process although it has loaders ("": it does not)
        self.loading_here = ""

    def open(self) -> None:
        if self.loaders > 0 and self.count > 0 and not self.loading_here:
            try:
                self.pool = self._new_pool()
            except Exception as exc:  # noqa: BLE001 - said once; no sample's failure
                self._load_here(_cannot_start(exc))

    def _new_pool(self) -> cf.ProcessPoolExecutor:
        context = loader_context()
        self.starts = StartTable(context)
        return cf.ProcessPoolExecutor(
            max_workers=min(self.loaders, self.count),
            mp_context=context,
            initializer=_init_loader_process,
            initargs=(os.getpid(), os.environ.get(RECIPES_ENV_VAR), self.starts.cells),
        )

    def _args(self, item: WorkItem, ticket: int | None = None) -> tuple:
        return (
            self.recipe_name,
            self.params,
            self.fingerprint,
            item.sample_id,
            item.path,
            item.stored_hashes,
            item.failed_hash,
            self.limits,
            ticket,
        )

    def _submit_to_pool(self, item: WorkItem) -> cf.Future:
        assert self.pool is not None
        ticket = next(self._tickets)
        future = self.pool.submit(load_sample, *self._args(item, ticket))
        future.spcache_ticket = ticket  # type: ignore[attr-defined]
        return future

    def submit(self, item: WorkItem) -> cf.Future:
        if self.pool is not None:
            try:
                with interrupts_held():  # a submit may start a loader process
                    try:
                        return self._submit_to_pool(item)
                    except BrokenProcessPool:  # a process died since the last submit
                        self._restart()
                        return self._submit_to_pool(item)
            except Exception as exc:  # noqa: BLE001 - a loader process cannot be started
                self._load_here(_cannot_start(exc))
        future: cf.Future = cf.Future()
        future.set_result(self._load_here_now(item))
        return future

    def _load_here_now(self, item: WorkItem) -> LoadOutcome:
        """Load ``item`` in this process, watched by the clock for the time limit."""
        if self.clock is None or self.limit_s is None:
            return load_sample(*self._args(item))
        try:
            with self.clock.watch(item.sample_id, item.path, "prepare", self.limit_s):
                return load_sample(*self._args(item))
        except SampleTimeLimit:
            overrun = Overrun(item.sample_id, item.path, "prepare", self.limit_s, 0.0)
            return LoadOutcome("failed", self.limit_s, reason=self._reason(overrun))

    def _reason(self, overrun: Overrun) -> str:
        return f"recipe {self.recipe_name!r}: {overrun.reason}"

    def result(
        self, item: WorkItem, future: cf.Future, pending: deque[tuple[WorkItem, cf.Future]]
    ) -> LoadOutcome:
        """``item``'s outcome; if the pool broke, retry it alone and resubmit ``pending``;
        if its load ran past the time limit, replace the pool's processes, fail it and
        resubmit ``pending``."""
        try:
            return self._wait(item, future)
        except _LoadOverran as over:
            self._replace_pool()
            logger.warning(
                "%s (%s): %s; replacing the loader processes",
                item.sample_id,
                item.path,
                over.reason,
            )
            self._resubmit(pending)
            return LoadOutcome("failed", over.seconds, reason=over.reason)
        except BrokenProcessPool:
            problem = self._fresh_pool_problem()
        except Exception as exc:  # noqa: BLE001 - load_sample returns a sample's failures
            problem = _described(exc)
        if problem:
            self._load_here(problem)
            outcome = self.submit(item).result()
        else:
            logger.warning("a loader process died; retrying %s alone", item.path)
            outcome = self._alone(item)
        self._resubmit(pending)
        return outcome

    def _resubmit(self, pending: deque[tuple[WorkItem, cf.Future]]) -> None:
        """Submit again the loads of ``pending`` lost with a pool that broke or was
        replaced (one that finished before stands)."""
        for i, (other, earlier) in enumerate(pending):
            if earlier.done() and not earlier.cancelled() and earlier.exception() is None:
                continue  # finished before the pool broke: its result stands
            pending[i] = (other, self.submit(other))

    def _wait(self, item: WorkItem, future: cf.Future) -> LoadOutcome:
        """``future``'s result; :class:`_LoadOverran` once its load has run in a loader
        process for longer than the time limit."""
        ticket = getattr(future, "spcache_ticket", None)
        if ticket is None or self.limit_s is None or self.starts is None:
            return future.result()
        starts, limit = self.starts, self.limit_s
        while True:
            try:
                return future.result(timeout=0.5)
            except cf.TimeoutError:
                began = starts.started(ticket)
                if began is not None and time.monotonic() - began > limit:
                    overrun = Overrun(item.sample_id, item.path, "prepare", limit, 0.0)
                    raise _LoadOverran(self._reason(overrun), time.monotonic() - began) from None

    def _alone(self, item: WorkItem) -> LoadOutcome:
        """``item`` in a pool of its own: a pool it breaks again names it the culprit."""
        assert self.pool is not None
        try:
            with interrupts_held():
                future = self._submit_to_pool(item)
            return self._wait(item, future)
        except _LoadOverran as over:
            self._replace_pool()
            return LoadOutcome("failed", over.seconds, reason=over.reason)
        except BrokenProcessPool:
            problem = self._fresh_pool_problem()  # for the items after it
            if problem:
                self._load_here(problem)
            return LoadOutcome("failed", 0.0, reason=LOADER_DIED)

    def _replace_pool(self) -> None:
        """Terminate the pool's processes now (one is stuck past the time limit) and start
        a fresh pool."""
        pool, self.pool = self.pool, None
        if pool is not None:
            stop_executor(pool)
        try:
            self.pool = self._new_pool()
        except Exception as exc:  # noqa: BLE001 - said once; no sample's failure
            self._load_here(_cannot_start(exc))

    def _fresh_pool_problem(self) -> str:
        """Replace the pool with a fresh one and check that it works: "" when a loader
        starts in it and finds the recipe, else why not."""
        try:
            pool = self._restart()
            with interrupts_held():
                ready = pool.submit(loader_ready, self.recipe_name)
            ready.result()
        except BrokenProcessPool:
            return "loader processes end as they start (their error is on stderr)"
        except Exception as exc:  # noqa: BLE001 - the reason the caller reports
            return _described(exc)
        return ""

    def _load_here(self, reason: str) -> None:
        """Stop using loader processes: say why, once, and load in this process from now on."""
        pool, self.pool = self.pool, None
        if pool is not None:
            stop_executor(pool)
        if not self.loading_here:
            self.loading_here = reason
            logger.warning(
                "loader processes cannot be used (%s); loading the samples in this process "
                "instead, as with loaders=0",
                reason,
            )

    def _restart(self) -> cf.ProcessPoolExecutor:
        if self.pool is not None:
            end_pool(self.pool)
        self.pool = self._new_pool()
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            end_pool(self.pool)
            self.pool = None

    def abort(self, timeout_s: float = 1.0) -> None:
        """Stop now (an interrupted run): queued loads are dropped and the loader
        processes, which only read and parse sources, are terminated rather than waited
        for; a large mesh half parsed would otherwise hold the run for its whole parse."""
        pool, self.pool = self.pool, None
        if pool is not None:
            stop_executor(pool, timeout_s)


class _LoadOverran(Exception):
    def __init__(self, reason: str, seconds: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.seconds = seconds


def _cannot_start(exc: BaseException) -> str:
    executable = os.fsdecode(multiprocessing.spawn.get_executable())
    return f"a loader process cannot be started by {executable}: {_described(exc)}"


def _described(exc: BaseException) -> str:
    if isinstance(exc, LoaderUnusable):
        return one_line(exc, limit=REASON_MAX)
    return one_line(exc, with_class=True, limit=REASON_MAX)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold the interrupts (Ctrl-C; SIGTERM too while a Python handler turns it into one,
    as ``spcache precompute``'s does) for the duration, then deliver each to the handler
    that was there.

    For the moments the process pool starts a loader: the forkserver forks the child,
    then the executor records it. A KeyboardInterrupt between the two leaves a loader
    that :func:`stop_executor` never sees; it outlives the run and prints a traceback on
    the terminal once the parent has removed the pool's semaphores. The executor's
    ``submit`` also takes the lock of a ``queue.Queue`` its management thread reads: an
    interrupt inside it can leave that lock held, and the thread the interpreter joins
    at exit stuck. Off the main thread (where signal handlers cannot be changed) this
    does nothing; a SIGTERM whose handler is the default ends the process at once, and
    is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous: dict[int, Any] = {}
    for held_signal in (signal.SIGINT, signal.SIGTERM):
        if held_signal == signal.SIGINT or callable(signal.getsignal(held_signal)):
            previous[held_signal] = signal.signal(held_signal, lambda s, frame: held.append(s))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for came in dict.fromkeys(held):  # each once, in the order they came
            handler = previous[came]
            if callable(handler):
                handler(came, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(came)


def end_pool(pool: cf.ProcessPoolExecutor) -> None:
    """Shut ``pool`` down: a working one waits for its loads; a broken one (a loader
    died) is stopped (:func:`stop_executor`). The executor's own handling of a broken
    pool terminates the workers it knows of, then joins every worker: one that lives on
    (seen here, after a probe recipe crashed a loader: an idle loader that neither the
    termination nor the end-of-work message had ended) kept that join, and the run,
    waiting for ever."""
    if getattr(pool, "_broken", False):
        stop_executor(pool)
    else:
        pool.shutdown(wait=True, cancel_futures=True)


def stop_executor(pool: cf.ProcessPoolExecutor, timeout_s: float = 1.0) -> None:
    """Terminate a process pool's workers now (then kill what is left after ``timeout_s``)
    and let its management thread end.

    A worker terminated while it writes a result leaves half a message in the result pipe;
    the executor's thread would wait for the rest forever, and the interpreter joins that
    thread at exit (a run stopped by Ctrl-C then never ends). The parent holds the pipe's
    write end too, so closing it turns that wait into end-of-file: the executor sees a
    broken pool and its thread ends. The stdlib has no public way to do either before
    Python 3.14, so this reaches into the executor's process table and result queue."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    # shutdown() drops the executor's references to its result queue and its thread:
    # take them first
    result_queue = getattr(pool, "_result_queue", None)
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(timeout_s)
    writer = getattr(result_queue, "_writer", None)
    if writer is not None:
        writer.close()
    # The executor's thread of a broken pool joins its workers too, and may be the one
    # that reaps a killed worker: until it has stored the exit status, that worker still
    # reads as alive here (``is_alive`` finds the process gone and no status). Its end
    # says every worker's status is stored. Bounded: a caller stopping a run is not kept.
    if manager is not None and manager is not threading.current_thread():
        manager.join(max(timeout_s, 5.0))
