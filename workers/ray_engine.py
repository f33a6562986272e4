"""Precompute on Ray: one actor per GPU (or per CPU), one writer in the driver.

:class:`RayEngine` is an :class:`~workers.engine.Engine` whose :meth:`~RayEngine.run`
fans the work out over Ray actors. The driver (the process that calls ``run``):

1. admits the items exactly as the local engine does (valid, unique sample ids; keys;
   the source hash of any record already stored);
2. skips what is already cached: a file whose stored record carries its current content
   hash is not sent anywhere (the driver hashes only files that have a record);
3. cuts the rest into shards and hands one shard at a time to each idle actor;
4. writes what comes back into the store in batches (one ``put_many`` transaction per
   batch), reports every item through ``on_result`` after its record has committed, and
   writes the fingerprint's index at the end, as the local engine does.

Each actor (:class:`ShardWorker`) runs the *local* engine, :class:`workers.engine.Engine`,
on its shard: the same loader, recipe, device code, metadata and record encoding, so a
record computed on Ray is byte-for-byte the record the local engine writes (only the
``created`` time differs). The actor's engine writes into an in-memory buffer
(:class:`ShardBuffer`) instead of a cache, and the actor streams the encoded records back
in batches of ``write_batch`` through a Ray streaming generator. Only plain values cross
the wire: lists, dicts, strings, numbers and the records' safetensors bytes; Ray's own
transport carries them, spcache defines no pickled type.

Faults, as Ray users expect them:

- An actor that dies (a crash, the OOM killer, ``ray.kill``, a lost node) loses only the
  items of its shard that had not come back yet; they are queued again, for another
  actor where there is one. Ray restarts the dead actor (``max_restarts``) unless it was
  killed for good. A shard that kills its actor twice is halved, and halved again, so a
  sample that crashes every actor it touches is isolated and fails alone with a reason
  after ``max_attempts`` deaths; the rest of its shard is computed.
- A sample that fails (bad file, device error) is reported by the actor's engine exactly
  as the local engine reports it, and the run goes on.
- An error that is not about one sample (a backend missing on a node, CUDA requested on
  a node without it) stops the run; what was committed stays, and the index is written.
- The run is resumable exactly like the local one: run it again and the stored records
  are skipped.

The one writer is the ceiling of this design: every record passes through the driver.
``docs/SCALE_OUT.md`` says where that bites and the way past it.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import logging
import math
import os
import queue
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cache_store.errors import (
    BackendUnavailable,
    ParameterError,
    RecordNotFound,
    SourceError,
    SpcacheError,
)
from cache_store.freshness import is_current
from cache_store.store import DatasetIndex, Store
from workers.engine import Engine, ItemResult, Summary, _Item, _Run, resolve_device
from workers.recipes import Recipe
from workers.sources import hash_file

__all__ = [
    "RayEngine",
    "RaySummary",
    "ActorStats",
    "ShardWorker",
    "ShardBuffer",
    "CrashOnce",
    "RayUnavailable",
]

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


class RayUnavailable(BackendUnavailable):
    """Ray is not installed, or the cluster cannot be reached or cannot host the actors."""

    def __init__(self, reason: str) -> None:
        super().__init__("ray", reason)


class _RemoteError(Exception):
    """An spcache error raised in an actor, as plain values, so Ray can carry it back.

    spcache's errors take their own constructor arguments (``SourceError(path, reason)``),
    which Ray's exception transport cannot rebuild; this one is rebuilt by
    :func:`_local_error` in the driver as the original class with its attributes.
    """

    def __init__(self, module: str, name: str, message: str, attrs: dict[str, Any]) -> None:
        super().__init__(module, name, message, attrs)

    @classmethod
    def of(cls, exc: SpcacheError) -> _RemoteError:
        attrs = {k: v for k, v in vars(exc).items()
                 if isinstance(v, str | int | float | bool | list | tuple | type(None))}
        return cls(type(exc).__module__, type(exc).__qualname__, str(exc), attrs)


def _local_error(exc: BaseException) -> BaseException:
    """The error an actor raised, as the driver should raise it.

    A carried spcache error comes back as its own class (only classes of spcache's own
    packages are looked up); anything else is Ray's error, with the actor's traceback.
    """
    cause = getattr(exc, "cause", None)
    if isinstance(cause, _RemoteError):
        module, name, message, attrs = cause.args
        if module.split(".")[0] in ("cache_store", "workers"):
            cls = getattr(importlib.import_module(module), name, None)
            if isinstance(cls, type) and issubclass(cls, SpcacheError):
                error = cls.__new__(cls)
                error.args = (message,)
                vars(error).update(attrs)
                return error
        return SpcacheError(message)
    return exc


# --- summary -------------------------------------------------------------------------------


@dataclass
class ActorStats:
    """What one actor did during a run (kept by the driver, so a restart loses nothing).

    ``busy_s`` is the time the actor held a shard, from dispatch to its last batch;
    ``samples_per_s`` is ``done / busy_s``.
    """

    actor: int
    node: str = ""
    device: str = ""
    backend: str = ""
    gpus: list[str] = field(default_factory=list)
    shards: int = 0
    done: int = 0
    failed: int = 0
    deaths: int = 0
    busy_s: float = 0.0

    @property
    def samples_per_s(self) -> float:
        return self.done / self.busy_s if self.busy_s > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        return {"actor": self.actor, "node": self.node, "device": self.device,
                "backend": self.backend, "gpus": list(self.gpus), "shards": self.shards,
                "done": self.done, "failed": self.failed, "deaths": self.deaths,
                "busy_s": round(self.busy_s, 4), "samples_per_s": round(self.samples_per_s, 3)}


@dataclass
class RaySummary(Summary):
    """:class:`workers.engine.Summary` plus the Ray side of the run.

    ``load_s`` and ``compute_s`` are summed over the actors' engines; ``write_s`` is the
    driver's commit time (the one writer). ``actors`` has one entry per actor;
    ``shard_retries`` counts shards (or parts of shards) queued again after an actor
    died; ``actor_start_s`` is the time from joining Ray until every actor was placed
    and ready (part of ``wall_s``).
    """

    engine: str = "ray"
    actors: list[ActorStats] = field(default_factory=list)
    shard_retries: int = 0
    actor_start_s: float = 0.0

    def as_json(self) -> dict[str, Any]:
        data = super().as_json()
        data["engine"] = self.engine
        data["actors"] = [a.as_json() for a in self.actors]
        data["shard_retries"] = self.shard_retries
        data["timings"]["actor_start_s"] = round(self.actor_start_s, 4)
        return data

    def detail_lines(self) -> list[str]:
        """One human-readable line per actor (the CLI prints them under the summary)."""
        lines = []
        for a in self.actors:
            where = f"{a.node} {a.device}" + (f" gpu {','.join(a.gpus)}" if a.gpus else "")
            lines.append(f"  actor {a.actor} ({where}): {a.done} done, {a.failed} failed, "
                         f"{a.samples_per_s:.2f} samples/s over {a.busy_s:.1f}s busy"
                         + (f", died {a.deaths}x" if a.deaths else ""))
        if self.shard_retries:
            lines.append(f"  {self.shard_retries} shard(s) retried after an actor died")
        return lines


# --- the actor side ------------------------------------------------------------------------


class ShardBuffer(Store):
    """A write-only, in-memory store: the actor's engine writes here.

    It is empty when a shard starts (so the engine computes every item it is given: the
    driver has already skipped what is cached) and hands each record back once
    (:meth:`pop`). The index the engine writes at the end of a shard is dropped: the
    driver writes the real one.
    """

    def __init__(self) -> None:
        super().__init__("memory://shard", readonly=False)
        self._records: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes:
        with self._lock:
            try:
                return self._records[key]
            except KeyError:
                raise RecordNotFound(key, self.location) from None

    def put_many(self, items: Iterable[tuple[str, bytes]]) -> int:
        checked = self.check_items(items)
        with self._lock:
            self._records.update(checked)
        return len(checked)

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self._records

    def keys(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            found = sorted(k for k in self._records if k.startswith(prefix))
        return iter(found)

    def pop(self, key: str) -> bytes:
        with self._lock:
            try:
                return self._records.pop(key)
            except KeyError:
                raise RecordNotFound(key, self.location) from None

    def close(self) -> None:
        with self._lock:
            self._records.clear()

    def put_index(self, index: DatasetIndex) -> None:
        """Dropped (see the class doc)."""

    def get_index(self, fingerprint: str) -> DatasetIndex:
        raise self.index_missing(fingerprint)

    def fingerprints(self) -> list[str]:
        return []


@dataclass(frozen=True)
class CrashOnce:
    """Fault injection for tests: the actor process exits abruptly (``os._exit``) when
    its engine reports ``sample_id``, the first time only.

    "First time" is remembered across processes by creating ``marker`` (a path every
    actor can reach), so the retried shard goes through. ``always=True`` crashes every
    time: a poison sample.
    """

    sample_id: str
    marker: str
    always: bool = False

    def __call__(self, sample_id: str) -> None:
        if sample_id != self.sample_id:
            return
        if not self.always:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return
            os.close(fd)
        os._exit(17)


class ShardWorker:
    """The Ray actor: the local engine on shards of items, results streamed in batches.

    Plain class; :class:`RayEngine` wraps it with ``ray.remote`` and the resources of one
    GPU (or one CPU). Its constructor only stores its arguments; the first call
    (:meth:`describe`) builds one :class:`workers.engine.Engine` over a
    :class:`ShardBuffer` and opens it, so the loader pool lives as long as the actor and
    every shard runs on it.

    Args:
        recipe: recipe name.
        params: resolved recipe parameters.
        options: keyword arguments for :class:`workers.engine.Engine` (device, backend,
            jobs, query_chunk, min_query_chunk, write_batch, prefetch). ``write_batch`` is
            also the number of results per streamed batch. ``jobs=None`` picks loader
            processes from the node: 0 on a CPU actor, else the node's CPUs per GPU less
            one (1 to 8).
        log_level: level for this process's ``workers`` loggers.
        fault: test hook called with every sample id the engine reports.
    """

    def __init__(self, recipe: str, params: Mapping[str, Any], options: Mapping[str, Any],
                 log_level: int = logging.WARNING,
                 fault: Callable[[str], None] | None = None) -> None:
        self.recipe = recipe
        self.params = dict(params)
        self.options = dict(options)
        self.log_level = log_level
        self.fault = fault
        self._buffer: ShardBuffer | None = None
        self._engine: Engine | None = None

    def _configure(self) -> Engine:
        if self._engine is not None:
            return self._engine
        logging.basicConfig(level=self.log_level,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        # The driver reports every failed sample; the actor's copy of that warning would
        # print each one twice. Errors (with tracebacks) still come through.
        if self.log_level > logging.DEBUG:
            logging.getLogger("workers.engine").setLevel(max(self.log_level, logging.ERROR))
        if self.options.get("jobs") is None:
            self.options["jobs"] = _auto_jobs(self.options.get("device", "cpu"))
        self._buffer = ShardBuffer()
        engine = Engine(self._buffer, self.recipe, self.params, progress=False, **self.options)
        self._engine = engine.open()  # the loader pool starts now, once
        return self._engine

    def describe(self) -> dict[str, Any]:
        """Where this actor runs; resolves its device and ops backend (errors surface here)."""
        try:
            return self._describe()
        except SpcacheError as exc:
            raise _RemoteError.of(exc) from None

    def _describe(self) -> dict[str, Any]:
        import ray
        import torch

        from workers.ops import get_backend  # the ops package imports Kaolin if present

        self._configure()
        # The mesh loader's first import (trimesh, networkx: about half a second) is paid
        # here, while the actor starts, rather than by the first sample of the first shard.
        import trimesh  # noqa: F401

        device = resolve_device(self.options.get("device", "auto"))
        ops = get_backend(self.options.get("backend", "auto"), device)
        return {"node": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "device": str(device), "backend": str(ops.name),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "jobs": self.options["jobs"],
                "threads": torch.get_num_threads()}

    def run_shard(self, items: Sequence[Sequence[str]]) -> Iterator[dict[str, Any]]:
        """Run the engine over ``[sample_id, path]`` items; yield batches as they commit.

        Each yielded value is ``{"results": [[id, path, status, key, reason], ...],
        "records": [[key, bytes], ...]}`` with at most ``write_batch`` results, and the
        last is ``{"summary": {...}}`` (the shard's engine timings). An error that stops
        the engine (not one sample's failure) is raised from here.
        """
        try:
            engine = self._configure()
        except SpcacheError as exc:
            raise _RemoteError.of(exc) from None
        buffer, batch = self._buffer, engine.write_batch
        assert buffer is not None
        buffer.close()  # nothing is left over from a shard that stopped early
        # Bounded: when Ray holds the stream back, the engine waits here, not in memory.
        events: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=2 * batch)

        def on_result(result: ItemResult) -> None:
            if self.fault is not None:
                self.fault(result.sample_id)
            record = buffer.pop(result.key) if result.status == "done" else None
            events.put(("result", (result, record)))

        def work() -> None:
            try:
                events.put(("summary", engine.run([(i, p) for i, p in items], on_result)))
            except BaseException as exc:  # noqa: BLE001 - handed to the generator, raised there
                events.put(("error", exc))

        thread = threading.Thread(target=work, name="spcache-shard", daemon=True)
        thread.start()
        pending: list[tuple[ItemResult, bytes | None]] = []
        while True:
            kind, value = events.get()
            if kind == "result":
                pending.append(value)
                if len(pending) >= batch:
                    yield _batch_message(pending)
                    pending = []
                continue
            thread.join()
            if pending:
                yield _batch_message(pending)
            if kind == "error":
                raise _RemoteError.of(value) if isinstance(value, SpcacheError) else value
            yield {"summary": _summary_message(value)}
            return


def _batch_message(pending: list[tuple[ItemResult, bytes | None]]) -> dict[str, Any]:
    return {"results": [[r.sample_id, r.path, r.status, r.key, r.reason] for r, _ in pending],
            "records": [[r.key, record] for r, record in pending if record is not None]}


def _summary_message(summary: Summary) -> dict[str, Any]:
    return {"device": summary.device, "backend": summary.backend, "load_s": summary.load_s,
            "compute_s": summary.compute_s, "encode_s": summary.write_s,
            "oom_backoffs": summary.oom_backoffs}


def _auto_jobs(device: str) -> int:
    """Loader processes for one actor: none on a CPU actor, else this node's CPUs per GPU
    less one (for the actor itself), between 1 and 8."""
    if device == "cpu":
        return 0
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            cpus = float(node["Resources"].get("CPU", 1))
            gpus = max(1.0, float(node["Resources"].get("GPU", 1)))
            return int(max(1, min(8, cpus // gpus - 1)))
    return 1


# --- the driver side -----------------------------------------------------------------------


class RayEngine(Engine):
    """Run a recipe over many samples on Ray actors, writing into ``store`` from here.

    Takes the :class:`workers.engine.Engine` arguments (``jobs`` is per actor, and
    ``None`` lets each actor choose; ``device`` is ``auto``, ``cpu`` or ``cuda``, since
    Ray picks each actor's GPU) plus:

    Args:
        address: a Ray cluster to join (``"auto"``, ``"ray://host:10001"``,
            ``"host:6379"``). None starts a local Ray instance for the run and stops it
            after; when Ray is already initialised in this process, that instance is used
            and left running.
        actors: how many actors; default one per GPU of the cluster, or one per CPU when
            it has no GPU or ``device="cpu"``.
        shard_size: items handed to an actor at a time; default
            ``ceil(items / (4 * actors))``, at most 512.
        max_attempts: deaths of an actor a single sample may cause before it fails.
        actor_restarts: how often Ray restarts each actor that died (``max_restarts``).
        placement_timeout_s: how long to wait for the cluster to place the actors.
        ray_init: extra keyword arguments for ``ray.init`` when this engine calls it.
        fault: test hook handed to every actor (see :class:`CrashOnce`).
    """

    def __init__(self, store: Store, recipe: str | Recipe, params: Mapping[str, Any] | None = None,
                 *, device: str = "auto", backend: str = "auto", jobs: int | None = None,
                 query_chunk: int = 1 << 18, min_query_chunk: int = 256, write_batch: int = 32,
                 prefetch: int | None = None, progress: bool = False,
                 address: str | None = None, actors: int | None = None,
                 shard_size: int | None = None, max_attempts: int = 3, actor_restarts: int = 2,
                 placement_timeout_s: float = 600.0,
                 ray_init: Mapping[str, Any] | None = None,
                 fault: Callable[[str], None] | None = None) -> None:
        super().__init__(store, recipe, params, device=device, backend=backend,
                         jobs=0 if jobs is None else jobs, query_chunk=query_chunk,
                         min_query_chunk=min_query_chunk, write_batch=write_batch,
                         prefetch=prefetch, progress=progress)
        problems = []
        if str(device) not in ("auto", "cpu", "cuda"):
            problems.append(f"device: {device!r}: on Ray each actor owns the GPU Ray gives it; "
                            f"use auto, cpu or cuda")
        if actors is not None and actors < 1:
            problems.append(f"actors: {actors} must be at least 1")
        if shard_size is not None and shard_size < 1:
            problems.append(f"shard_size: {shard_size} must be at least 1")
        if max_attempts < 1:
            problems.append(f"max_attempts: {max_attempts} must be at least 1")
        if actor_restarts < 0:
            problems.append(f"actor_restarts: {actor_restarts} is negative")
        if placement_timeout_s <= 0:
            problems.append("placement_timeout_s must be positive")
        if problems:
            raise ParameterError(problems, what="ray engine options")
        self.actor_jobs = jobs
        self.prefetch_given = prefetch
        self.address = address
        self.actors = actors
        self.shard_size = shard_size
        self.max_attempts = int(max_attempts)
        self.actor_restarts = int(actor_restarts)
        self.placement_timeout_s = float(placement_timeout_s)
        self.ray_init = dict(ray_init or {})
        self.fault = fault

    def open(self) -> RayEngine:
        """Nothing to start here: each actor opens its own engine (and loader pool)."""
        return self

    def close(self) -> None:
        """Nothing to stop here: a run's actors end with the run."""

    def run(self, items: Iterable[tuple[str, str | os.PathLike[str]]],
            on_result: Callable[[ItemResult], None] | None = None) -> RaySummary:
        """Compute every ``(sample_id, path)`` item on Ray; return the :class:`RaySummary`."""
        return _RayRun(self, list(items), on_result).execute()

    def actor_options(self) -> dict[str, Any]:
        """The keyword arguments each actor's local :class:`Engine` is built with."""
        return {"device": self.device, "backend": self.backend, "jobs": self.actor_jobs,
                "query_chunk": self.query_chunk, "min_query_chunk": self.min_query_chunk,
                "write_batch": self.write_batch, "prefetch": self.prefetch_given}


@dataclass
class _Shard:
    items: list[_Item]
    deaths: int = 0
    avoid: set[int] = field(default_factory=set)


@dataclass
class _Slot:
    """One actor: ``ready`` for a shard, ``busy`` with one, ``restarting`` after a death
    (``probe`` answers once Ray has it back) or ``gone``."""

    stats: ActorStats
    handle: Any
    state: str = "ready"
    shard: _Shard | None = None
    stream: Any = None
    outstanding: dict[str, _Item] = field(default_factory=dict)
    since: float = 0.0
    probe: Any = None


class _RayRun(_Run):
    """One :meth:`RayEngine.run`: the local run's admission, reporting and index, with
    the compute loop replaced by the actors."""

    engine: RayEngine

    def __init__(self, engine: RayEngine, items: list[tuple[str, Any]],
                 on_result: Callable[[ItemResult], None] | None) -> None:
        super().__init__(engine, items, on_result)
        self.summary = RaySummary(engine.fingerprint, engine.recipe.name, engine.recipe.version,
                                  dict(engine.params))
        self.slots: list[_Slot] = []
        self.shards: deque[_Shard] = deque()

    def execute(self) -> RaySummary:
        start = time.perf_counter()
        try:
            work = self._admit(self.items)
            self._open_progress(len(self.items))
            todo = self._skip_cached(work)
            if todo:
                self._run_on_ray(todo)
            else:
                self.summary.device, self.summary.backend = self.engine.device, self.engine.backend
        finally:
            self._write_index()
            if self.bar is not None:
                self.bar.close()
            self.summary.wall_s = time.perf_counter() - start
        s = self.summary
        logger.info("fingerprint %s on %d Ray actor(s): %d done, %d skipped, %d failed in %.1fs",
                    s.fingerprint, len(s.actors), s.done, s.skipped, s.failed, s.wall_s)
        return s

    # -- resume -----------------------------------------------------------------------
    def _skip_cached(self, work: list[_Item]) -> list[_Item]:
        """Items left to compute; the stored and unchanged ones are reported skipped.

        Only files that have a stored record are hashed (in threads: it is reading).
        """
        stored = [item for item in work if item.stored_hash is not None]
        hashes: dict[str, str | SourceError] = {}
        if stored:
            with cf.ThreadPoolExecutor(min(_HASH_THREADS, len(stored))) as pool:
                for item, digest in zip(stored, pool.map(_hash_or_error, [i.path for i in stored]),
                                        strict=True):
                    hashes[item.sample_id] = digest
        todo = []
        for item in work:
            digest = hashes.get(item.sample_id)
            if digest is None:
                todo.append(item)
            elif isinstance(digest, SourceError):
                self._finish(ItemResult(item.sample_id, item.path, "failed", reason=digest.reason))
            elif is_current(item.stored_hash, digest):
                self._finish(ItemResult(item.sample_id, item.path, "skipped", key=item.key))
            else:
                todo.append(item)
        return todo

    # -- the actors -------------------------------------------------------------------
    def _run_on_ray(self, todo: list[_Item]) -> None:
        ray = _import_ray()
        started = self._connect(ray)
        try:
            start = time.perf_counter()
            self._start_actors(ray, len(todo))
            self.summary.actor_start_s = time.perf_counter() - start
            self.shards.extend(_Shard(part) for part in _cut(todo, self._shard_size(len(todo))))
            self._schedule(ray)
        finally:
            for slot in self.slots:
                if slot.state == "busy":
                    slot.stats.busy_s += time.perf_counter() - slot.since
                try:
                    ray.kill(slot.handle)
                except Exception as exc:  # noqa: BLE001 - already gone; nothing to release
                    logger.debug("ray.kill(actor %d): %s", slot.stats.actor, exc)
            self.summary.actors = [slot.stats for slot in self.slots]
            if started:
                ray.shutdown()

    def _connect(self, ray: Any) -> bool:
        """Initialise Ray unless it already is; True when this run started it."""
        if ray.is_initialized():
            if self.engine.address is not None:
                logger.warning("Ray is already initialised in this process; using it, not %s",
                               self.engine.address)
            return False
        options: dict[str, Any] = {"logging_level": logging.WARNING}
        if self.engine.address is None:
            options.update(address="local", include_dashboard=False)
        else:
            options["address"] = self.engine.address
        options.update(self.engine.ray_init)
        main_thread = threading.current_thread() is threading.main_thread()
        sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
        try:
            ray.init(**options)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayUnavailable(f"cannot start or join Ray at {options['address']}: {exc}") from exc
        finally:
            # ray.init installs its own SIGTERM handler, which ends the process on the
            # spot; the caller's (the CLI's: stop like Ctrl-C, committing and indexing
            # what was computed) must stay in charge.
            if sigterm is not None:
                signal.signal(signal.SIGTERM, sigterm)
        return True

    def _start_actors(self, ray: Any, count: int) -> None:
        engine = self.engine
        resources = ray.cluster_resources()
        cluster_gpus, cluster_cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
        use_gpu = engine.device == "cuda" or (engine.device == "auto" and cluster_gpus > 0)
        if engine.device == "cuda" and cluster_gpus == 0:
            raise ParameterError(["device: 'cuda' requested but the Ray cluster has no GPU"],
                                 what="ray engine options")
        capacity = cluster_gpus if use_gpu else cluster_cpus
        wanted = engine.actors if engine.actors is not None else capacity
        if capacity < 1 or wanted > capacity:
            unit = "GPU" if use_gpu else "CPU"
            raise RayUnavailable(f"{wanted} actor(s) of one {unit} each asked for, but the Ray "
                                 f"cluster has {capacity} {unit}(s)")
        wanted = max(1, min(wanted, count))
        options = engine.actor_options()
        options["device"] = "cuda" if use_gpu else "cpu"
        remote = ray.remote(ShardWorker)
        level = logging.getLogger("workers").getEffectiveLevel()
        run_token = uuid.uuid4().hex[:8]
        for index in range(wanted):
            # Named, so that `ray list actors` (and a test) can tell them apart.
            handle = remote.options(
                name=f"spcache-shard-{run_token}-{index}", num_cpus=1,
                num_gpus=1 if use_gpu else 0, max_restarts=engine.actor_restarts,
                max_task_retries=0,
            ).remote(engine.recipe.name, dict(engine.params), options, level, engine.fault)
            self.slots.append(_Slot(ActorStats(index), handle))
        self._describe_actors(ray)

    def _describe_actors(self, ray: Any) -> None:
        """Wait until every actor is placed and has resolved its device and backend."""
        pending = {slot.handle.describe.remote(): slot for slot in self.slots}
        deadline = time.monotonic() + self.engine.placement_timeout_s
        last_log = time.monotonic()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=_WAIT_TICK_S)
            for ref in ready:
                slot = pending.pop(ref)
                info = _get(ray, ref)
                slot.stats.node, slot.stats.device = info["node"], info["device"]
                slot.stats.backend, slot.stats.gpus = info["backend"], info["gpus"]
                logger.info("actor %d on %s: %s (%s), %d loader process(es), %d torch "
                            "thread(s)", slot.stats.actor, info["node"], info["device"],
                            info["backend"], info["jobs"], info["threads"])
            now = time.monotonic()
            if pending and now > deadline:
                raise RayUnavailable(f"{len(pending)} of {len(self.slots)} Ray actor(s) were not "
                                     f"placed within {self.engine.placement_timeout_s:.0f}s")
            if pending and now - last_log > _PLACEMENT_LOG_EVERY_S:
                logger.warning("waiting for the Ray cluster to place %d actor(s)", len(pending))
                last_log = now
        self.summary.device = ",".join(sorted({s.stats.device for s in self.slots}))
        self.summary.backend = ",".join(sorted({s.stats.backend for s in self.slots}))

    def _shard_size(self, count: int) -> int:
        if self.engine.shard_size is not None:
            return self.engine.shard_size
        return max(1, min(_MAX_AUTO_SHARD, math.ceil(count / (4 * len(self.slots)))))

    def _schedule(self, ray: Any) -> None:
        while True:
            self._dispatch()
            waiting = {slot.stream: slot for slot in self.slots if slot.state == "busy"}
            if self.shards:
                waiting.update({slot.probe: slot for slot in self.slots
                                if slot.state == "restarting"})
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
                    self._finish(ItemResult(item.sample_id, item.path, "failed",
                                            reason="no Ray actor left to compute it (every "
                                                   "actor died and was not restarted)"))
            self.shards.clear()

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
                num_returns="streaming", _generator_backpressure_num_objects=_STREAM_AHEAD,
            ).remote([[item.sample_id, item.path] for item in shard.items])

    def _next_shard(self, actor: int, live: set[int]) -> _Shard | None:
        """The first shard that does not avoid this actor, else one every live actor
        is avoided by (then this actor is as good as any)."""
        for i, shard in enumerate(self.shards):
            if actor not in shard.avoid or live <= shard.avoid:
                del self.shards[i]
                return shard
        return None

    def _probe_answered(self, ray: Any, slot: _Slot) -> None:
        """A restarted actor answered (ready again), or Ray gave it up (gone)."""
        try:
            info = _get(ray, slot.probe)
        except RayUnavailable as exc:
            logger.warning("Ray actor %d did not come back (%s); going on without it",
                           slot.stats.actor, exc)
            slot.state, slot.probe = "gone", None
            return
        slot.stats.node, slot.stats.gpus = info["node"], info["gpus"]  # maybe another node
        slot.state, slot.probe = "ready", None

    def _give_up_on_lost_actors(self) -> None:
        """An actor Ray cannot place again (its node is lost and no other fits) is gone."""
        now = time.perf_counter()
        for slot in self.slots:
            if slot.state == "restarting" and now - slot.since > self.engine.placement_timeout_s:
                logger.warning("Ray actor %d was not restarted within %.0fs; going on without it",
                               slot.stats.actor, self.engine.placement_timeout_s)
                slot.state, slot.probe = "gone", None

    def _receive(self, ray: Any, slot: _Slot) -> None:
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
            _raise_local(exc)
        if "summary" in message:
            self._add_timings(message["summary"])
        else:
            self._commit(slot, message)

    def _commit(self, slot: _Slot, message: dict[str, Any]) -> None:
        """Write one batch in one transaction, then report its items."""
        records = [(key, value) for key, value in message["records"]]
        write_error = ""
        if records:
            start = time.perf_counter()
            try:
                self.engine.store.put_many(records)
            except Exception as exc:  # noqa: BLE001 - the batch fails with its reason, the run goes on
                logger.exception("writing %d records failed", len(records))
                write_error = f"store write failed: {' '.join(str(exc).split())[:300]}"
            self.summary.write_s += time.perf_counter() - start
        for sample_id, path, status, key, reason in message["results"]:
            if slot.outstanding.pop(sample_id, None) is None:
                logger.warning("actor %d reported %s, which it was not given; ignored",
                               slot.stats.actor, sample_id)
                continue
            if status == "done" and write_error:
                status, key, reason = "failed", "", write_error
            if status == "done":
                slot.stats.done += 1
            elif status == "failed":
                slot.stats.failed += 1
            self._finish(ItemResult(sample_id, path, status, key=key, reason=reason))

    def _add_timings(self, timings: dict[str, Any]) -> None:
        s = self.summary
        s.load_s += float(timings["load_s"])
        s.compute_s += float(timings["compute_s"])
        s.oom_backoffs += int(timings["oom_backoffs"])

    def _shard_finished(self, slot: _Slot) -> None:
        slot.stats.busy_s += time.perf_counter() - slot.since
        for item in slot.outstanding.values():  # the engine reports every item; defensive
            self._finish(ItemResult(item.sample_id, item.path, "failed",
                                    reason="the Ray actor finished its shard without a result "
                                           "for this sample"))
        slot.state, slot.shard, slot.stream, slot.outstanding = "ready", None, None, {}

    def _actor_died(self, ray: Any, slot: _Slot, exc: BaseException) -> None:
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
        logger.warning("Ray actor %d died (%s) with %d of its shard's %d item(s) not back; %s",
                       slot.stats.actor, type(exc).__name__, len(left), len(shard.items),
                       "it will not be restarted" if gone else "Ray restarts it")
        if left:
            self._requeue(_Shard(left, shard.deaths + 1, shard.avoid | {slot.stats.actor}))

    def _requeue(self, shard: _Shard) -> None:
        """Queue a shard whose actor died, first in line. A shard that killed an actor a
        second time is halved (a sample that crashes every actor is then isolated); a
        single sample fails once it has killed ``max_attempts`` actors."""
        items = shard.items
        if len(items) == 1 and shard.deaths >= self.engine.max_attempts:
            item = items[0]
            self._finish(ItemResult(item.sample_id, item.path, "failed",
                                    reason=f"the Ray actor computing this sample died "
                                           f"{shard.deaths} times (a crash, the OOM killer or "
                                           f"a lost node)"))
            return
        self.summary.shard_retries += 1
        if len(items) == 1 or shard.deaths == 1:
            self.shards.appendleft(shard)
            return
        half = len(items) // 2
        self.shards.appendleft(_Shard(items[half:], 1, set(shard.avoid)))
        self.shards.appendleft(_Shard(items[:half], 1, set(shard.avoid)))


def _hash_or_error(path: str) -> str | SourceError:
    try:
        return hash_file(path)
    except SourceError as exc:
        return exc


def _cut(items: list[_Item], size: int) -> list[list[_Item]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _get(ray: Any, ref: Any) -> Any:
    """``ray.get`` that raises the actor's own error (a ParameterError, a
    BackendUnavailable) rather than Ray's wrapper."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as exc:
        raise RayUnavailable(f"a Ray actor died while starting: {exc}") from exc
    except ray.exceptions.RayTaskError as exc:
        _raise_local(exc)


def _raise_local(exc: BaseException) -> None:
    error = _local_error(exc)
    if error is exc:
        raise exc
    raise error from exc


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable("the ray engine needs Ray: pip install 'spcache[ray]' "
                             f"({exc})") from exc
    return ray

