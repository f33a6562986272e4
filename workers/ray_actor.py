"""The Ray actor side: :class:`ShardWorker` runs the local engine on shards of items and
streams the encoded records back in batches; :class:`ShardBuffer` is the in-memory store
(:class:`~cache_store.stores.memory.MemoryStore`) its engine writes into.

Only plain values cross the wire: lists, dicts, strings, numbers and the records'
safetensors bytes. Ray is imported inside the actor's methods only.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import replace
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from cache_store.engine_options import EngineOptions, auto_loaders
from cache_store.errors import RecordNotFound, SpcacheError
from cache_store.log_setup import configure_logging
from cache_store.format.index import DatasetIndex
from cache_store.stores.base import Store
from cache_store.stores.memory import MemoryStore
from workers.engine import Engine, resolve_device
from workers.ray_common import RemoteError
from workers.run_ledger import ItemResult, Summary
from workers.time_limits import own_the_process

__all__ = ["ShardBuffer", "ShardWorker"]


class ShardBuffer(MemoryStore):
    """The in-memory store the actor's engine writes into (a :class:`MemoryStore`).

    It is empty when a shard starts and hands each record back once (:meth:`pop`), with
    the descriptors they name (:meth:`descriptor_texts`). What the driver's store holds
    it knows only as source hashes (:meth:`expect`, answered by :meth:`source_hash_of`
    as a sharded snapshot answers from its manifests): the engine then computes just the
    variants of a sample whose record is not current there, by the local engine's own
    rule, and reports the others skipped. The index the engine writes at the end of a
    shard is dropped: the driver writes the real one. Closing it forgets what it held.
    """

    def __init__(self) -> None:
        super().__init__("memory://shard")
        self._stored: dict[str, str] = {}

    def expect(self, stored: Mapping[str, str]) -> None:
        """The source hash of each record the driver's store holds for this shard (by
        key): what :meth:`source_hash_of` answers until the shard ends."""
        self._stored = dict(stored)

    def source_hash_of(self, key: str) -> str | None:
        """The source hash of the driver's record under ``key`` (None: none there)."""
        return self._stored.get(key)

    def descriptor_texts(self) -> list[list[str]]:
        """``[fingerprint, digest, text]`` of every descriptor written here (a run's one
        or few): sent with the records, plain values."""
        with self.data.lock:
            return [[fp, digest, text] for (fp, digest), text in self.data.descriptors.items()]

    def pop(self, key: str) -> bytes:
        """The record under ``key``, removed from the buffer."""
        with self.data.lock:
            value = self.data.records.pop(key, None)
        if value is None:
            raise RecordNotFound(key, self.location)
        return value

    def close(self) -> None:
        with self.data.lock:
            self.data.records.clear()
            self.data.descriptors.clear()
        self._stored = {}

    def put_index(self, index: DatasetIndex) -> None:
        """Dropped (see the class doc)."""


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
        options: the actor engine's options as plain values
            (:meth:`cache_store.engine_options.EngineOptions.as_json`). ``write_batch``
            is also the number of results per streamed batch. ``loaders=None`` picks loader
            processes from the node: 0 on a CPU actor, else
            :func:`~cache_store.engine_options.auto_loaders` of the node's CPUs per GPU.
        log_level: level for this process's ``workers`` loggers.
        actor_fault: test hook called with every sample id the engine reports (tests
            make it end the actor's process).
    """

    def __init__(
        self,
        recipe: str,
        params: Mapping[str, Any],
        options: Mapping[str, Any],
        log_level: int = logging.WARNING,
        actor_fault: Callable[[str], None] | None = None,
        sink: Mapping[str, Any] | None = None,
    ) -> None:
        self.recipe = recipe
        self.params = dict(params)
        self.options = EngineOptions.from_json(options)
        self.log_level = log_level
        self.actor_fault = actor_fault
        self.sink = dict(sink) if sink is not None else None
        self._buffer: ShardBuffer | None = None
        self._parts: Any = None  # the sharded snapshot this actor writes into, with a sink
        self._engine: Engine | None = None

    def _configure(self) -> Engine:
        if self._engine is not None:
            return self._engine
        configure_logging(self.log_level)
        # the actor's process is spcache's: a sample that cannot be stopped at its time
        # limit may end it (the driver then fails the actor's samples)
        own_the_process()
        # The driver reports every failed sample; the actor's copy of that warning would
        # print each one twice. Errors (with tracebacks) still come through.
        if self.log_level > logging.DEBUG:
            logging.getLogger("workers.run_ledger").setLevel(max(self.log_level, logging.ERROR))
        if self.options.loaders is None:
            self.options = replace(self.options, loaders=_auto_loaders(self.options.device))
        self._buffer = ShardBuffer()
        target: Store = self._buffer
        if self.sink is not None:
            # Records go straight to the snapshot, one committed part per write batch;
            # only results travel back to the driver.
            from cache_store.snapshot.sharded import ShardedSnapshot

            self._parts = ShardedSnapshot(
                self.sink["location"],
                readonly=False,
                storage_options=self.sink.get("storage_options"),
            )
            target = self._parts
        engine = Engine(target, self.recipe, self.params, options=self.options, progress=False)
        self._engine = engine.open()  # the loader pool starts now, once
        return self._engine

    def describe(self) -> dict[str, Any]:
        """Where this actor runs; resolves its device and ops backend (errors surface here)."""
        try:
            return self._describe()
        except SpcacheError as exc:
            raise RemoteError.of(exc) from None

    def _describe(self) -> dict[str, Any]:
        import ray
        import torch

        from workers.ops import get_backend  # the ops package imports Kaolin if present

        self._configure()
        # The mesh loader's first import (trimesh, networkx: about half a second) is paid
        # here, while the actor starts, rather than by the first sample of the first shard.
        import trimesh  # noqa: F401

        device = resolve_device(self.options.device)
        ops = get_backend(self.options.backend, device)
        return {
            "node": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "device": str(device),
            "backend": str(ops.name),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "loaders": self.options.loaders,
            "threads": torch.get_num_threads(),
        }

    def run_shard(
        self, items: Sequence[Sequence[Any]], label: str | None = None, variants: int = 1
    ) -> Iterator[dict[str, Any]]:
        """Run the engine over ``[sample_id, path, stored]`` items, ``variants`` records
        of each (``stored``: the source hash of each variant's record in the driver's
        store, None where none is; may be left out); yield batches as they commit.

        Each yielded value is ``{"results": [[id, path, status, key, reason, source_hash,
        variant], ...], "records": [[key, bytes], ...], "descriptors": [[fingerprint,
        digest, text], ...]}`` with at most ``write_batch`` results, and
        the last is ``{"summary": {...}}`` (the shard's engine timings). An error that stops
        the engine (not one sample's failure) is raised from here. With a sink the records
        are already committed to it (parts named after ``label``: shard and attempt) and
        ``records`` is empty.
        """
        try:
            engine = self._configure()
        except SpcacheError as exc:
            raise RemoteError.of(exc) from None
        buffer, batch = self._buffer, engine.write_batch
        assert buffer is not None
        buffer.close()  # nothing is left over from a shard that stopped early
        buffer.expect(
            {
                engine.key(item[0], v): digest
                for item in items
                if len(item) > 2
                for v, digest in enumerate(item[2])
                if digest is not None
            }
        )
        if self._parts is not None:
            self._parts.start_writer(label or "s-unknown")
        # Bounded: when Ray holds the stream back, the engine waits here, not in memory.
        events: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=2 * batch)

        def on_result(result: ItemResult) -> None:
            if self.actor_fault is not None:
                self.actor_fault(result.sample_id)
            record = (
                buffer.pop(result.key) if result.status == "done" and self._parts is None else None
            )
            events.put(("result", (result, record)))

        def work() -> None:
            try:
                work = [(item[0], item[1]) for item in items]
                events.put(("summary", engine.run(work, on_result, variants=variants)))
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
                    yield _batch_message(pending, buffer.descriptor_texts())
                    pending = []
                continue
            thread.join()
            if pending:
                yield _batch_message(pending, buffer.descriptor_texts())
            if kind == "error":
                raise RemoteError.of(value) if isinstance(value, SpcacheError) else value
            yield {"summary": _summary_message(value)}
            return


def _batch_message(
    pending: list[tuple[ItemResult, bytes | None]], descriptors: list[list[str]]
) -> dict[str, Any]:
    records = [[r.key, record] for r, record in pending if record is not None]
    return {
        "results": [
            [r.sample_id, r.path, r.status, r.key, r.reason, r.source_hash, r.variant]
            for r, _ in pending
        ],
        "records": records,
        # the descriptors the records name ([fingerprint, digest, text]; none with a sink)
        "descriptors": descriptors if records else [],
    }


def _summary_message(summary: Summary) -> dict[str, Any]:
    return {
        "device": summary.device,
        "backend": summary.backend,
        "load_s": summary.load_s,
        "compute_s": summary.compute_s,
        "encode_s": summary.write_s,
        "oom_backoffs": summary.oom_backoffs,
    }


def _auto_loaders(device: str) -> int:
    """Loader processes for one actor with ``loaders=None``: none on a CPU actor (the
    node's cores are shared out between its actors), else
    :func:`~cache_store.engine_options.auto_loaders` of the node's CPUs per GPU."""
    if device == "cpu":
        return 0
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            cpus = float(node["Resources"].get("CPU", 1))
            gpus = max(1.0, float(node["Resources"].get("GPU", 1)))
            return auto_loaders(cpus // gpus)
    return 1
