"""Loading: read, hash, parse and prepare samples in a pool of CPU processes.

:func:`load_sample` is one sample's CPU work (it runs in a loader process, or in the
calling process when the engine has no loaders) and returns a :class:`LoadOutcome`.
:class:`LoaderPool` runs it in a ``forkserver`` (or ``spawn``) process pool and recovers
when one of its processes dies. The pool is created before the engine touches the device,
so no process that holds CUDA is ever forked.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import multiprocessing
import multiprocessing.context
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple

import torch

from cache_store.errors import SourceError
from cache_store.sources.freshness import is_current, trusted_signature
from cache_store.recipes.registry import report_problems_here
from workers.recipe_run import get_recipe, make_generator
from workers.run_ledger import WorkItem, one_line
from cache_store.sources.files import SourceLimits, source_signature
from workers.source_load import hash_bytes, load_source, read_source_bytes

__all__ = ["LoadOutcome", "LoaderPool", "interrupts_held", "load_sample", "stop_executor"]

logger = logging.getLogger(__name__)


class LoadOutcome(NamedTuple):
    """What loading one sample came to.

    ``status`` is ``"skipped"`` (the stored record's source hash matches the file),
    ``"skipped-failed"`` (the file is unchanged since this sample failed, and the run
    skips those), ``"failed"`` (``reason`` says why) or ``"prepared"`` (``prepared`` is
    set: what the recipe's ``prepare`` returned); ``seconds`` is the time it took;
    ``source_hash`` the file's content hash once it was read; ``source_stat`` its stat
    signature, taken before the read (``""`` when the file changed too recently to trust
    one: :func:`trusted_signature`).
    """

    status: str
    seconds: float
    prepared: dict[str, Any] | None = None
    reason: str = ""
    source_hash: str = ""
    source_stat: str = ""


def load_sample(
    recipe_name: str,
    params: dict[str, Any],
    fingerprint: str,
    sample_id: str,
    path: str,
    stored_hash: str | None,
    failed_hash: str | None = None,
    limits: SourceLimits | None = None,
) -> LoadOutcome:
    """Read, hash and (unless the stored record is current) prepare one sample.

    Runs in a loader process: only plain values and the picklable :class:`LoadOutcome`
    cross the process boundary. ``limits`` bound how the file is opened and read
    (:mod:`cache_store.sources.files`).
    """
    start = time.perf_counter()
    digest = ""
    try:
        # The signature is taken before the read: an edit in between leaves the record
        # with an older signature (hashed again when checked), never a newer one.
        signature = trusted_signature(source_signature(path, limits))
        data = read_source_bytes(path, limits)
        digest = hash_bytes(data)
        if is_current(stored_hash, digest):
            return LoadOutcome("skipped", time.perf_counter() - start, source_hash=digest)
        if failed_hash is not None and digest == failed_hash:
            return LoadOutcome("skipped-failed", time.perf_counter() - start, source_hash=digest)
        source = load_source(path, data)
        recipe = get_recipe(recipe_name)
    except SourceError as exc:
        return LoadOutcome(
            "failed", time.perf_counter() - start, reason=exc.reason, source_hash=digest
        )
    except MemoryError:
        return LoadOutcome(
            "failed",
            time.perf_counter() - start,
            reason="out of memory while loading",
            source_hash=digest,
        )
    except Exception as exc:  # reported as this sample's failure, never swallowed
        logger.exception("loading %s failed", path)
        return LoadOutcome(
            "failed",
            time.perf_counter() - start,
            reason=f"{type(exc).__name__}: {one_line(exc)}",
            source_hash=digest,
        )
    try:
        prepared = recipe.prepare(source, params, make_generator(fingerprint, sample_id))
        if not isinstance(prepared, dict):
            return LoadOutcome(
                "failed",
                time.perf_counter() - start,
                source_hash=digest,
                reason=f"recipe {recipe_name!r}: prepare() returned "
                f"{type(prepared).__name__}, expected a dict of arrays",
            )
        return LoadOutcome(
            "prepared",
            time.perf_counter() - start,
            prepared=prepared,
            source_hash=digest,
            source_stat=signature,
        )
    except SourceError as exc:
        return LoadOutcome(
            "failed", time.perf_counter() - start, reason=exc.reason, source_hash=digest
        )
    except MemoryError:
        return LoadOutcome(
            "failed",
            time.perf_counter() - start,
            reason="out of memory while loading",
            source_hash=digest,
        )
    except Exception as exc:  # reported as this sample's failure, never swallowed
        logger.exception("recipe %r: prepare() failed on %s", recipe_name, path)
        return LoadOutcome(
            "failed",
            time.perf_counter() - start,
            reason=f"recipe {recipe_name!r}: prepare() raised "
            f"{type(exc).__name__}: {one_line(exc)}",
            source_hash=digest,
        )


def _init_loader_process(engine_pid: int) -> None:
    torch.set_num_threads(1)  # one core per loader; the pool is the parallelism
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
    while _process_alive(engine_pid):
        time.sleep(0.5)
    os._exit(1)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process stays a zombie until reaped; on Linux, tell the two apart
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


class LoaderPool:
    """The loader processes, and recovery when one of them dies.

    A pool whose process died (a parser crash, the OOM killer) fails every pending task.
    The head item is then retried alone in a fresh pool: if it kills that one too it is
    the culprit and fails with a reason; the other pending items are resubmitted.

    Args:
        recipe_name, params, fingerprint: what every sample is prepared for.
        loaders: loader processes; 0 loads in the calling process (no pool).
        count: items the pool will see, when known (no more processes than items).
        limits: how sources may be opened and read.
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
    ) -> None:
        self.recipe_name = recipe_name
        self.limits = limits or SourceLimits()
        self.params = dict(params)
        self.fingerprint = fingerprint
        self.loaders = loaders
        self.count = loaders if count is None else count
        self.pool: cf.ProcessPoolExecutor | None = None

    def open(self) -> None:
        if self.loaders > 0 and self.count > 0:
            self.pool = self._new_pool()

    def _new_pool(self) -> cf.ProcessPoolExecutor:
        context: multiprocessing.context.BaseContext
        if "forkserver" in multiprocessing.get_all_start_methods():
            context = multiprocessing.get_context("forkserver")
            # Import the heavy modules once in the server (CPU only: it never runs an op),
            # so each loader forks ready instead of importing torch and trimesh itself.
            # Takes effect when this process first starts its forkserver.
            context.set_forkserver_preload(["workers.loader_preload", "workers.loader", "trimesh"])
        else:
            context = multiprocessing.get_context("spawn")
        return cf.ProcessPoolExecutor(
            max_workers=min(self.loaders, self.count),
            mp_context=context,
            initializer=_init_loader_process,
            initargs=(os.getpid(),),
        )

    def _args(self, item: WorkItem) -> tuple:
        return (
            self.recipe_name,
            self.params,
            self.fingerprint,
            item.sample_id,
            item.path,
            item.stored_hash,
            item.failed_hash,
            self.limits,
        )

    def submit(self, item: WorkItem) -> cf.Future:
        if self.pool is None:
            future: cf.Future = cf.Future()
            future.set_result(load_sample(*self._args(item)))
            return future
        with interrupts_held():  # a submit may start a loader process
            try:
                return self.pool.submit(load_sample, *self._args(item))
            except BrokenProcessPool:  # a process died since the last submit
                self._restart()
                return self.pool.submit(load_sample, *self._args(item))

    def result(
        self, item: WorkItem, future: cf.Future, pending: deque[tuple[WorkItem, cf.Future]]
    ) -> LoadOutcome:
        """``item``'s outcome; if the pool broke, retry it alone and resubmit ``pending``."""
        try:
            return future.result()
        except BrokenProcessPool:
            pass
        logger.warning("a loader process died; retrying %s alone", item.path)
        pool = self._restart()
        try:
            with interrupts_held():
                future = pool.submit(load_sample, *self._args(item))
            outcome = future.result()
        except BrokenProcessPool:
            self._restart()
            outcome = LoadOutcome(
                "failed",
                0.0,
                reason="the loader process died while reading this file (crash or out of memory)",
            )
        for i, (other, earlier) in enumerate(pending):
            if earlier.done() and not earlier.cancelled() and earlier.exception() is None:
                continue  # finished before the pool broke: its result stands
            pending[i] = (other, self.submit(other))
        return outcome

    def _restart(self) -> cf.ProcessPoolExecutor:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.pool = self._new_pool()
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None

    def abort(self, timeout_s: float = 1.0) -> None:
        """Stop now (an interrupted run): queued loads are dropped and the loader
        processes, which only read and parse sources, are terminated rather than waited
        for; a large mesh half parsed would otherwise hold the run for its whole parse."""
        pool, self.pool = self.pool, None
        if pool is not None:
            stop_executor(pool, timeout_s)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) for the duration, then deliver it to the handler that was there.

    For the moments the process pool starts a loader: the forkserver forks the child,
    then the executor records it. A KeyboardInterrupt between the two leaves a loader
    that :func:`stop_executor` never sees; it outlives the run and prints a traceback on
    the terminal once the parent has removed the pool's semaphores. Off the main thread
    (where signal handlers cannot be changed) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            if callable(previous):
                previous(signal.SIGINT, None)
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


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
    # shutdown() drops the executor's reference to the result queue: take it first
    result_queue = getattr(pool, "_result_queue", None)
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
