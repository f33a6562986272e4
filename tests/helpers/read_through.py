"""Read-through under test: a real ``spcache worker`` subprocess over a cache, the
reference records ``spcache precompute`` writes, and two DataLoader epochs compared
with them (shared by the queue and the HTTP read-through tests)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from cache_store import CachedDataset
from cache_store.format.decode import decode_record
from cache_store.jobs.queue import JobQueue
from cache_store.sources.discover import discover_sources
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.procs import Proc, run_spcache, start_spcache, wait_for

# level 8, the level training uses; fewer samples and queries than the defaults keep the
# CPU-only worker quick on a shared 2-core machine.
PARAMS = {"level": 8, "surface_samples": 20_000, "uniform_queries": 1024, "surface_queries": 1024}
CLI_PARAMS = [arg for k, v in PARAMS.items() for arg in ("--param", f"{k}={v}")]


def start_worker(cache: Path, *extra: str) -> Proc:
    """``spcache worker`` on ``cache`` (CPU, torch, no loaders, polling fast), once its
    heartbeat is in the queue."""
    cache.mkdir(parents=True, exist_ok=True)  # a worker drains an existing cache only
    proc = start_spcache(
        "worker",
        "--cache",
        cache,
        "--device",
        "cpu",
        "--backend",
        "torch",
        "--loaders",
        "0",
        "--poll",
        "0.05",
        "--batch",
        "4",
        "--log-level",
        "warning",
        *extra,
    )
    queue = JobQueue(cache)
    try:
        wait_for(queue.live_workers, what="the worker's heartbeat", proc=proc)
    finally:
        queue.close()
    return proc


def stop_worker(proc: Proc) -> None:
    assert proc.stop(signal.SIGTERM) == 0, proc.output()[-3000:]


def precompute_reference(cache: Path, sources: list[Path]) -> None:
    done = run_spcache(
        "precompute",
        *sources,
        "--recipe",
        "spc_query",
        *CLI_PARAMS,
        "--cache",
        cache,
        "--device",
        "cpu",
        "--backend",
        "torch",
        "--loaders",
        "0",
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: a hostile source failed


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def loader_check(parent_had_ops: bool, sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Transform run in each loader process: it reads, it never computes."""
    if not parent_had_ops:
        assert not any(m.startswith("workers.ops") for m in sys.modules), "loader imported ops"
    assert "workers.engine" not in sys.modules or parent_had_ops
    assert not torch.cuda.is_initialized(), "a loader process initialised CUDA"
    return sample


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def queue_rows(cache: Path) -> list[tuple[str, str, str]]:
    queue = JobQueue(cache)
    rows = [
        (r["fingerprint"], r["sample_id"], r["status"])
        for j in queue.jobs(limit=10_000)
        for r in queue.items(j.id)
    ]
    queue.close()
    return rows


def epoch(ds: CachedDataset, context: str) -> list[Any]:
    loader = DataLoader(
        ds, batch_size=2, num_workers=4, multiprocessing_context=context, collate_fn=as_list
    )
    return [sample for batch in loader for sample in batch]


def two_epochs(
    ds: CachedDataset, context: str, cache: Path, count: int
) -> tuple[list[Any], list[tuple[str, str, str]], list[Any]]:
    """Two DataLoader epochs over a read-through dataset of ``count`` sources: the samples
    of each, and the queue rows after the first (the second must queue nothing)."""
    assert ds.on_miss == "compute" and len(ds) == count
    first = epoch(ds, context)
    rows = queue_rows(cache)
    second = epoch(ds, context)
    assert queue_rows(cache) == rows  # second epoch: nothing queued
    return first, rows, second


def check_epochs_equal_precompute(
    ds: CachedDataset,
    meshes: list[Path],
    cache: Path,
    reference: Path,
    rows: list[tuple[str, str, str]],
    first: list[Any],
    second: list[Any],
) -> None:
    """Read-through's promise: the samples are the sources as precompute discovers them,
    each queued exactly once and done, one record each, and both epochs equal (torch.equal,
    every field) to the records ``spcache precompute`` wrote into ``reference``."""
    fp = ds.fingerprint
    ids = [ds.sample_id(i) for i in range(len(ds))]
    assert [sid for sid, _ in discover_sources(meshes)] == ids
    assert sorted((f, s) for f, s, _ in rows) == sorted((fp, sid) for sid in ids)
    assert {status for _, _, status in rows} == {"done"}
    store, ref = LMDBStore(cache), LMDBStore(reference)
    try:
        assert sorted(store.keys(prefix=f"{fp}/")) == sorted(f"{fp}/{sid}" for sid in ids)
        for sid, a, b in zip(ids, first, second, strict=True):
            expected = decode_record(ref.get(f"{fp}/{sid}")).tensors
            assert same_tensors(a, expected), sid
            assert same_tensors(b, expected), sid
    finally:
        store.close()
        ref.close()
