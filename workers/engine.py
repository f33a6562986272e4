"""The engine: runs one recipe over many samples on one device, into a store.

Three stages overlap:

1. **Loading** (CPU, in parallel): a process pool reads each source file, hashes its
   bytes, skips it when the store already holds a record with that source hash, else
   parses, validates, normalises and draws the sample's random numbers
   (:meth:`workers.recipes.Recipe.prepare`). The pool uses a ``forkserver`` (or
   ``spawn``) context and is created before the device is touched, so no process that
   holds CUDA is ever forked. ``jobs=0`` loads in the calling process instead.
2. **Device compute** (the calling thread): octree, scan, point hierarchy and chunked
   queries through the ops backend. Out of device memory on a query chunk empties the
   cache, halves the chunk and retries (:class:`workers.recipes.ChunkBudget`).
3. **Writing** (a writer thread): records are encoded and written in batched
   transactions (``store.put_many``).

A sample that fails at any stage is recorded with its reason in the :class:`Summary`;
the run goes on. ``on_result`` is called in the calling thread for every item, and for
a computed item only after its record has committed. When the run ends (or is
interrupted) the fingerprint's index is written: the ids it held before, in their
order, followed by this run's newly stored ids, in input order.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import multiprocessing
import os
import queue
import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch

from cache_store import __version__ as SPCACHE_VERSION
from cache_store.errors import (
    CorruptRecord,
    FingerprintLookupError,
    InvalidSampleId,
    ParameterError,
    SourceError,
)
from cache_store.fingerprint import (
    canonical_json,
    compute_fingerprint,
    record_key,
    validate_sample_id,
)
from cache_store.freshness import is_current, stored_source_hash
from cache_store.record import encode_record
from cache_store.store import DatasetIndex, Store
from workers.recipes import (
    OOM_ERRORS,
    ChunkBudget,
    Prepared,
    Recipe,
    check_outputs,
    get_recipe,
    make_generator,
)
from workers.sources import hash_bytes, load_source, read_source_bytes

__all__ = ["DEVICE_PATTERN", "Engine", "Summary", "SampleError", "ItemResult", "resolve_device"]

logger = logging.getLogger(__name__)

#: What ``device`` may be: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class SampleError:
    """Why one sample has no record."""

    id: str
    path: str
    reason: str

    def as_json(self) -> dict[str, str]:
        return {"id": self.id, "path": self.path, "reason": self.reason}


@dataclass(frozen=True)
class ItemResult:
    """What happened to one item; handed to ``on_result``.

    ``status`` is ``"done"`` (record committed), ``"skipped"`` (an up-to-date record was
    already stored) or ``"failed"`` (``reason`` says why).
    """

    sample_id: str
    path: str
    status: str
    key: str = ""
    reason: str = ""


@dataclass
class Summary:
    """The outcome of :meth:`Engine.run`. Timings are seconds.

    ``load_s`` sums the loaders' time (over all pool processes), ``compute_s`` is device
    time in the calling thread, ``write_s`` the writer thread's encode-and-commit time,
    ``wall_s`` the whole run.
    """

    fingerprint: str
    recipe: str
    recipe_version: int
    params: dict[str, Any]
    device: str = ""
    backend: str = ""
    done: int = 0
    skipped: int = 0
    failed: int = 0
    errors: list[SampleError] = field(default_factory=list)
    load_s: float = 0.0
    compute_s: float = 0.0
    write_s: float = 0.0
    wall_s: float = 0.0
    oom_backoffs: int = 0

    @property
    def total(self) -> int:
        return self.done + self.skipped + self.failed

    def as_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "recipe": self.recipe,
            "recipe_version": self.recipe_version,
            "params": self.params,
            "device": self.device,
            "backend": self.backend,
            "done": self.done,
            "skipped": self.skipped,
            "failed": self.failed,
            "errors": [e.as_json() for e in self.errors],
            "timings": {"load_s": round(self.load_s, 4), "compute_s": round(self.compute_s, 4),
                        "write_s": round(self.write_s, 4), "wall_s": round(self.wall_s, 4)},
            "oom_backoffs": self.oom_backoffs,
        }


def resolve_device(device: str) -> torch.device:
    """``auto`` -> the current CUDA device if CUDA works here, else ``cpu``.

    Raises ParameterError for a CUDA device that is not available.
    """
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ParameterError([f"device: {device!r} requested but CUDA is not available"],
                                 what="engine options")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ParameterError([f"device: {device!r} requested but only "
                                  f"{torch.cuda.device_count()} CUDA device(s) exist"],
                                 what="engine options")
        dev = torch.device("cuda", index)
    return dev


class Engine:
    """Run ``recipe`` with ``params`` over samples on one device, writing into ``store``.

    Args:
        store: an open, writable :class:`cache_store.store.Store`.
        recipe: a recipe name (or :class:`workers.recipes.Recipe`).
        params: recipe parameters; validated and completed with defaults here.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        backend: ops backend name for :func:`workers.ops.get_backend` (``auto``, ``torch``,
            ``kaolin``).
        jobs: loader processes; 0 loads in the calling process.
        query_chunk: queries per device call before any back-off.
        min_query_chunk: the back-off gives up below this chunk size.
        write_batch: records per write transaction.
        prefetch: samples loaded ahead of the device (default ``2 * jobs + 2``).
        fault_hook: test hook called before every query chunk with its size (may raise
            ``torch.cuda.OutOfMemoryError``).
        progress: show a tqdm progress bar on stderr.
    """

    def __init__(self, store: Store, recipe: str | Recipe, params: Mapping[str, Any] | None = None,
                 *, device: str = "auto", backend: str = "auto", jobs: int = 2,
                 query_chunk: int = 1 << 18, min_query_chunk: int = 256, write_batch: int = 32,
                 prefetch: int | None = None, fault_hook: Callable[[int], None] | None = None,
                 progress: bool = False) -> None:
        self.recipe = recipe if isinstance(recipe, Recipe) else get_recipe(recipe)
        self.params = self.recipe.spec.resolve(params)
        problems = []
        if not DEVICE_PATTERN.match(str(device)):
            problems.append(f"device: {device!r} is not auto, cpu, cuda or cuda:N")
        if jobs < 0:
            problems.append(f"jobs: {jobs} is negative")
        if query_chunk < 1 or min_query_chunk < 1:
            problems.append("query_chunk and min_query_chunk must be positive")
        if write_batch < 1:
            problems.append(f"write_batch: {write_batch} must be positive")
        if prefetch is not None and prefetch < 1:
            problems.append(f"prefetch: {prefetch} must be positive")
        if problems:
            raise ParameterError(problems, what="engine options")
        self.store = store
        self.device = str(device)
        self.backend = backend
        self.jobs = int(jobs)
        self.query_chunk = int(query_chunk)
        self.min_query_chunk = int(min_query_chunk)
        self.write_batch = int(write_batch)
        self.prefetch = int(prefetch) if prefetch is not None else 2 * self.jobs + 2
        self.fault_hook = fault_hook
        self.progress = progress
        self.fingerprint = compute_fingerprint(self.recipe.name, self.recipe.version, self.params)
        self._loader: _Loader | None = None

    def key(self, sample_id: str) -> str:
        return record_key(self.fingerprint, sample_id)

    def open(self) -> Engine:
        """Start the loader pool now and keep it for every later :meth:`run` (a long-lived
        worker calls this once; without it each run starts and stops its own pool)."""
        if self._loader is None:
            loader = _Loader(self)
            loader.open()
            self._loader = loader
        return self

    def close(self) -> None:
        """Stop the loader pool started by :meth:`open` (safe to call twice)."""
        if self._loader is not None:
            self._loader.close()
            self._loader = None

    def __enter__(self) -> Engine:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, items: Iterable[tuple[str, str | os.PathLike[str]]],
            on_result: Callable[[ItemResult], None] | None = None) -> Summary:
        """Compute every ``(sample_id, path)`` item; return the :class:`Summary`."""
        return _Run(self, list(items), on_result).execute()


# --- one run -----------------------------------------------------------------------------


@dataclass
class _Item:
    sample_id: str
    path: str
    key: str = ""
    stored_hash: str | None = None


class _Run:
    """The state of one :meth:`Engine.run` call (pool, writer thread, counters)."""

    def __init__(self, engine: Engine, items: list[tuple[str, Any]],
                 on_result: Callable[[ItemResult], None] | None) -> None:
        self.engine = engine
        self.items = items
        self.on_result = on_result
        self.summary = Summary(engine.fingerprint, engine.recipe.name, engine.recipe.version,
                               dict(engine.params))
        self.stored_ids: set[str] = set()
        self.admitted: list[str] = []  # valid, unique sample ids in input order
        self.committed: queue.SimpleQueue[tuple[ItemResult, float]] = queue.SimpleQueue()
        self.bar = None

    # The order of work matters: the loader pool is created before the device is resolved
    # (which may initialise CUDA), so no CUDA-holding process is ever forked.
    def execute(self) -> Summary:
        start = time.perf_counter()
        work = self._admit(self.items)
        own_loader = self.engine._loader is None
        loader = _Loader(self.engine, len(work)) if own_loader else self.engine._loader
        writer: _Writer | None = None
        try:
            if own_loader:
                loader.open()
            device = resolve_device(self.engine.device)
            from workers.ops import get_backend  # the ops package imports Kaolin if present

            ops = get_backend(self.engine.backend, device)
            self.summary.device, self.summary.backend = str(device), str(ops.name)
            budget = ChunkBudget(self.engine.query_chunk, minimum=self.engine.min_query_chunk,
                                 fault_hook=self.engine.fault_hook)
            writer = _Writer(self.engine.store, self.engine.write_batch, self.committed)
            writer.start()
            self._open_progress(len(self.items))
            self._loop(work, loader, writer, device, ops, budget)
            writer.finish()
            self._drain_committed()
            self.summary.oom_backoffs = budget.backoffs
        finally:
            if own_loader:
                loader.close()
            if writer is not None and writer.is_alive():
                writer.finish()  # interrupted: still commit what was computed
                self._drain_committed(quiet=True)
            self._write_index()
            if self.bar is not None:
                self.bar.close()
            self.summary.wall_s = time.perf_counter() - start
        self.summary.write_s = writer.busy_s if writer is not None else 0.0
        logger.info("fingerprint %s: %d done, %d skipped, %d failed in %.1fs",
                    self.summary.fingerprint, self.summary.done, self.summary.skipped,
                    self.summary.failed, self.summary.wall_s)
        return self.summary

    def _admit(self, items: list[tuple[str, Any]]) -> list[_Item]:
        """Valid, unique items with their keys and stored source hashes; the rest fail now."""
        seen: dict[str, str] = {}
        work: list[_Item] = []
        for sample_id, path in items:
            path = str(path)
            try:
                sample_id = validate_sample_id(sample_id)
            except InvalidSampleId as exc:
                self._finish(ItemResult(str(sample_id), path, "failed", reason=str(exc)))
                continue
            if sample_id in seen:
                self._finish(ItemResult(sample_id, path, "failed",
                                        reason=f"duplicate sample id (first given for {seen[sample_id]})"))
                continue
            seen[sample_id] = path
            self.admitted.append(sample_id)
            key = self.engine.key(sample_id)
            work.append(_Item(sample_id, path, key, self._stored_hash(key)))
        return work

    def _stored_hash(self, key: str) -> str | None:
        return stored_source_hash(self.engine.store, key)

    def _loop(self, work: list[_Item], loader: _Loader, writer: _Writer,
              device: torch.device, ops: Any, budget: ChunkBudget) -> None:
        pending: deque[tuple[_Item, cf.Future]] = deque()
        try:
            self._drive(work, pending, loader, writer, device, ops, budget)
        finally:
            for _, future in pending:  # interrupted: loads nobody will wait for
                future.cancel()

    def _drive(self, work: list[_Item], pending: deque[tuple[_Item, cf.Future]],
               loader: _Loader, writer: _Writer, device: torch.device, ops: Any,
               budget: ChunkBudget) -> None:
        upcoming = iter(work)
        while True:
            while len(pending) < self.engine.prefetch:
                item = next(upcoming, None)
                if item is None:
                    break
                pending.append((item, loader.submit(item)))
            if not pending:
                return
            item, future = pending.popleft()
            outcome = loader.result(item, future, pending)
            self.summary.load_s += outcome[-1]
            if outcome[0] == "skipped":
                self._finish(ItemResult(item.sample_id, item.path, "skipped", key=item.key))
            elif outcome[0] == "failed":
                self._finish(ItemResult(item.sample_id, item.path, "failed", reason=outcome[1]))
            else:
                self._compute(item, outcome[1], writer, device, ops, budget)
            self._drain_committed()

    def _compute(self, item: _Item, prepared: Prepared, writer: _Writer, device: torch.device,
                 ops: Any, budget: ChunkBudget) -> None:
        start = time.perf_counter()
        try:
            tensors = self.engine.recipe.compute_prepared(
                prepared, self.engine.params, device=device, ops=ops, query_chunk=budget)
            check_outputs(self.engine.recipe.spec, tensors, self.engine.params)
        except OOM_ERRORS as exc:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            self._finish(ItemResult(item.sample_id, item.path, "failed",
                                    reason=f"out of device memory (after backing off to "
                                           f"{budget.size}-query chunks): {_one_line(exc)}"))
            return
        except SourceError as exc:
            self._finish(ItemResult(item.sample_id, item.path, "failed", reason=exc.reason))
            return
        except Exception as exc:  # noqa: BLE001 - one sample's failure is recorded, the run goes on
            logger.exception("sample %s (%s) failed on %s", item.sample_id, item.path, device)
            self._finish(ItemResult(item.sample_id, item.path, "failed",
                                    reason=f"{type(exc).__name__}: {_one_line(exc)}"))
            return
        finally:
            self.summary.compute_s += time.perf_counter() - start
        metadata = self._metadata(item, prepared, device, ops)
        writer.put(_Pending(item, tensors, metadata))

    def _metadata(self, item: _Item, prepared: Prepared, device: torch.device,
                  ops: Any) -> dict[str, str]:
        spec = self.engine.recipe.spec
        return {
            "recipe": spec.name,
            "recipe_version": str(spec.version),
            "fingerprint": self.engine.fingerprint,
            "sample_id": item.sample_id,
            "source_hash": prepared.source_hash,
            "backend": str(ops.name),
            "device": str(device),
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "spcache_version": SPCACHE_VERSION,
            "schema": json.dumps({k: f.as_json() for k, f in spec.fields.items()},
                                 sort_keys=True, separators=(",", ":")),
            "params": canonical_json(dict(self.engine.params)),
        }

    def _drain_committed(self, quiet: bool = False) -> None:
        while True:
            try:
                result, _ = self.committed.get_nowait()
            except queue.Empty:
                return
            try:
                self._finish(result)
            except Exception:  # noqa: BLE001 - on_result failing must not lose other results
                if not quiet:
                    raise
                logger.exception("on_result failed for %s", result.sample_id)

    def _finish(self, result: ItemResult) -> None:
        summary = self.summary
        if result.status == "done":
            summary.done += 1
            self.stored_ids.add(result.sample_id)
        elif result.status == "skipped":
            summary.skipped += 1
            self.stored_ids.add(result.sample_id)
        else:
            summary.failed += 1
            summary.errors.append(SampleError(result.sample_id, result.path, result.reason))
            logger.warning("%s (%s): %s", result.sample_id, result.path, result.reason)
        if self.bar is not None:
            self.bar.update(1)
        if self.on_result is not None:
            self.on_result(result)

    def _open_progress(self, total: int) -> None:
        if self.engine.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="sample", file=sys.stderr, dynamic_ncols=True,
                            initial=self.summary.total)

    def _write_index(self) -> None:
        """The index: ids already indexed, in order, then this run's stored ids in input order."""
        engine, store = self.engine, self.engine.store
        ran = [sid for sid in self.admitted if sid in self.stored_ids]
        try:
            old = store.get_index(engine.fingerprint).sample_ids.tolist()
        except FingerprintLookupError:
            old = []
        except CorruptRecord as exc:
            # Rebuild from what is stored: this run's ids first, then the others sorted.
            logger.warning("index of %s is unreadable (%s); rebuilding it", engine.fingerprint, exc)
            prefix = engine.fingerprint + "/"
            old = ran + sorted({key[len(prefix):] for key in store.keys(prefix)} - set(ran))
        known = set(old)
        new = [sid for sid in ran if sid not in known]
        if (old and not new) or not (old or new):
            return
        store.put_index(DatasetIndex(engine.fingerprint, engine.recipe.name,
                                     engine.recipe.version, dict(engine.params),
                                     np.array(old + new, dtype=str)))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


# --- loading -------------------------------------------------------------------------------


def _load_task(recipe_name: str, params: dict[str, Any], fingerprint: str, sample_id: str,
               path: str, stored_hash: str | None) -> tuple:
    """Runs in a loader process: ``("skipped", s)``, ``("failed", reason, s)`` or
    ``("prepared", Prepared, s)`` where ``s`` is the seconds it took."""
    start = time.perf_counter()
    try:
        data = read_source_bytes(path)
        if is_current(stored_hash, hash_bytes(data)):
            return ("skipped", time.perf_counter() - start)
        source = load_source(path, data)
        recipe = get_recipe(recipe_name)
        prepared = recipe.prepare(source, sample_id, params, make_generator(fingerprint, sample_id))
        return ("prepared", prepared, time.perf_counter() - start)
    except SourceError as exc:
        return ("failed", exc.reason, time.perf_counter() - start)
    except MemoryError:
        return ("failed", "out of memory while loading", time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - reported as this sample's failure, never swallowed
        logger.exception("loading %s failed", path)
        return ("failed", f"{type(exc).__name__}: {_one_line(exc)}", time.perf_counter() - start)


def _init_loader_process(engine_pid: int) -> None:
    torch.set_num_threads(1)  # one core per loader; the pool is the parallelism
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    threading.Thread(target=_exit_when_orphaned, args=(engine_pid,), daemon=True,
                     name="spcache-orphan-watch").start()


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


class _Loader:
    """The loader pool, and recovery when one of its processes dies.

    A pool whose process died (a parser crash, the OOM killer) fails every pending task.
    The head item is then retried alone in a fresh pool: if it kills that one too it is
    the culprit and fails with a reason; the other pending items are resubmitted.
    """

    def __init__(self, engine: Engine, count: int | None = None) -> None:
        self.engine = engine
        self.count = engine.jobs if count is None else count  # no more processes than items
        self.pool: cf.ProcessPoolExecutor | None = None

    def open(self) -> None:
        if self.engine.jobs > 0 and self.count > 0:
            self.pool = self._new_pool()

    def _new_pool(self) -> cf.ProcessPoolExecutor:
        if "forkserver" in multiprocessing.get_all_start_methods():
            context = multiprocessing.get_context("forkserver")
            # Import the heavy modules once in the server (CPU only: it never runs an op),
            # so each loader forks ready instead of importing torch and trimesh itself.
            # Takes effect when this process first starts its forkserver.
            context.set_forkserver_preload(["workers.engine", "trimesh"])
        else:
            context = multiprocessing.get_context("spawn")
        return cf.ProcessPoolExecutor(max_workers=min(self.engine.jobs, self.count),
                                      mp_context=context, initializer=_init_loader_process,
                                      initargs=(os.getpid(),))

    def _args(self, item: _Item) -> tuple:
        e = self.engine
        return (e.recipe.name, dict(e.params), e.fingerprint, item.sample_id, item.path,
                item.stored_hash)

    def submit(self, item: _Item) -> cf.Future:
        if self.pool is None:
            future: cf.Future = cf.Future()
            future.set_result(_load_task(*self._args(item)))
            return future
        try:
            return self.pool.submit(_load_task, *self._args(item))
        except BrokenProcessPool:  # a process died since the last submit
            self._restart()
            return self.pool.submit(_load_task, *self._args(item))

    def result(self, item: _Item, future: cf.Future,
               pending: deque[tuple[_Item, cf.Future]]) -> tuple:
        try:
            return future.result()
        except BrokenProcessPool:
            pass
        logger.warning("a loader process died; retrying %s alone", item.path)
        self._restart()
        try:
            outcome = self.pool.submit(_load_task, *self._args(item)).result()
        except BrokenProcessPool:
            self._restart()
            outcome = ("failed", "the loader process died while reading this file "
                                 "(crash or out of memory)", 0.0)
        for i, (other, earlier) in enumerate(pending):
            if earlier.done() and not earlier.cancelled() and earlier.exception() is None:
                continue  # finished before the pool broke: its result stands
            pending[i] = (other, self.submit(other))
        return outcome

    def _restart(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.pool = self._new_pool()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


# --- writing -------------------------------------------------------------------------------


@dataclass
class _Pending:
    item: _Item
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]


class _Writer(threading.Thread):
    """Encodes records and commits them in batches; reports each commit on ``committed``."""

    _STOP = object()

    def __init__(self, store: Store, batch: int,
                 committed: queue.SimpleQueue[tuple[ItemResult, float]]) -> None:
        super().__init__(name="spcache-writer", daemon=True)
        self.store = store
        self.batch = batch
        self.committed = committed
        self.inbox: queue.Queue = queue.Queue(maxsize=2 * batch)
        self.busy_s = 0.0

    def put(self, pending: _Pending) -> None:
        self.inbox.put(pending)

    def finish(self) -> None:
        self.inbox.put(self._STOP)
        self.join()

    def run(self) -> None:
        stopping = False
        while not stopping:
            batch = [self.inbox.get()]
            while len(batch) < self.batch:
                try:
                    batch.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            if batch[-1] is self._STOP:
                batch.pop()
                stopping = True
            if batch:
                self._commit(batch)

    def _commit(self, batch: list[_Pending]) -> None:
        start = time.perf_counter()
        encoded: list[tuple[str, bytes]] = []
        ok: list[_Pending] = []
        for pending in batch:
            item = pending.item
            try:
                encoded.append((item.key, encode_record(pending.tensors, pending.metadata)))
                ok.append(pending)
            except Exception as exc:  # noqa: BLE001 - this record fails alone
                logger.exception("encoding the record of %s failed", item.sample_id)
                self._report(item, "failed", f"cannot encode record: {_one_line(exc)}")
        if encoded:
            try:
                self.store.put_many(encoded)
            except Exception as exc:  # noqa: BLE001 - the batch fails with its reason, the run goes on
                logger.exception("writing %d records failed", len(encoded))
                for pending in ok:
                    self._report(pending.item, "failed", f"store write failed: {_one_line(exc)}")
                ok = []
        self.busy_s += time.perf_counter() - start
        for pending in ok:
            self._report(pending.item, "done", "")

    def _report(self, item: _Item, status: str, reason: str) -> None:
        self.committed.put((ItemResult(item.sample_id, item.path, status,
                                       key=item.key if status == "done" else "",
                                       reason=reason), time.perf_counter()))
