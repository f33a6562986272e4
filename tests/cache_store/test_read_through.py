"""Read-through: a DataLoader over an empty cache, a real ``spcache worker`` filling it.

Real LMDB, real SQLite queue, a real worker subprocess (torch backend on the CPU),
forked and spawned DataLoader workers; results compared with ``spcache precompute``.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from cache_store import CachedDataset
from cache_store.errors import NoWorkerAlive, ParameterError, SampleFailed
from cache_store.jobs.queue import JobQueue
from tests.helpers.read_through import (
    PARAMS,
    as_list,
    check_epochs_equal_precompute,
    loader_check,
    precompute_reference,
    queue_rows,
    start_worker,
    stop_worker,
    two_epochs,
)


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 4 on 2 cores
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_epoch_over_empty_cache_equals_precompute(
    tmp_path: Path, meshes: list[Path], context: str
) -> None:
    cache, reference = tmp_path / "rt", tmp_path / "pre"
    precompute_reference(reference, meshes)
    parent_had_ops = any(m.startswith("workers.ops") for m in sys.modules)
    proc = start_worker(cache)
    try:
        ds = CachedDataset(
            cache,
            "spc_query",
            sources=meshes,
            transform=functools.partial(loader_check, parent_had_ops),
            **PARAMS,
        )
        first, rows, second = two_epochs(ds, context, cache, len(meshes))
    finally:
        stop_worker(proc)
    check_epochs_equal_precompute(ds, meshes, cache, reference, rows, first, second)


def test_no_worker_fails_fast_naming_the_command(tmp_path: Path, corpus_meshes: list[Path]) -> None:
    cache = tmp_path / "rt"
    ds = CachedDataset(cache, "spc_query", sources=corpus_meshes[:3], **PARAMS)
    # at once: waiting for the record would end in MissTimeout (after miss_timeout), not this
    with pytest.raises(NoWorkerAlive, match=f"spcache worker --cache {cache}"):
        ds[0]
    # a worker that stopped cleanly is not taken for alive
    proc = start_worker(cache)
    stop_worker(proc)
    with pytest.raises(NoWorkerAlive):
        ds[1]
    assert JobQueue(cache).counts()["pending"] == 0  # nothing queued for nobody


def test_bad_mesh_fails_alone_and_the_epoch_goes_on(
    tmp_path: Path, corpus_meshes: list[Path], corpus_bad_inputs: list[Path]
) -> None:
    cache = tmp_path / "rt"
    bad = next(p for p in corpus_bad_inputs if p.name == "nan_vertices.obj")
    sources = [*corpus_meshes[:3], bad]
    proc = start_worker(cache)
    try:
        ds = CachedDataset(cache, "spc_query", sources=sources, **PARAMS)
        loader = DataLoader(
            ds, batch_size=1, num_workers=2, multiprocessing_context="fork", collate_fn=as_list
        )
        got, failures = [], []
        it = iter(loader)
        while True:  # the documented way: catch SampleFailed, go on with the next batch
            try:
                got.extend(next(it))
            except StopIteration:
                break
            except SampleFailed as exc:
                failures.append(str(exc))
        # in the main process, directly: the recorded reason, not a second computation
        with pytest.raises(SampleFailed, match="nan_vertices") as err:
            ds[3]
    finally:
        stop_worker(proc)
    assert len(got) == 3 and len(failures) == 1
    assert "nan_vertices" in failures[0] and str(bad) in failures[0]
    assert str(bad) in str(err.value) and err.value.reason
    rows = queue_rows(cache)
    assert sorted(s for _, s, _ in rows) == sorted(p.stem for p in sources)  # once each


def test_enqueue_once_reuses_live_and_failed_items(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    queue = JobQueue(tmp_path)
    a, b = (str(p) for p in corpus_meshes[:2])
    first = queue.enqueue_once("spc", {"level": 4}, "f" * 32, [("a", a), ("b", b)])
    assert [r.reused for r in first] == [False, False]
    again = queue.enqueue_once("spc", {"level": 4}, "f" * 32, [("b", b), ("a", a), ("a", a)])
    assert [(r.sample_id, r.item_id, r.reused) for r in again] == [
        ("b", first[1].item_id, True),
        ("a", first[0].item_id, True),
        ("a", first[0].item_id, True),
    ]
    claimed = queue.claim("w", limit=2)
    queue.fail("w", claimed[0].item_id, "broken", permanent=True)
    failed = queue.enqueue_once("spc", {"level": 4}, "f" * 32, [("a", a)])[0]
    assert failed.reused and failed.status == "failed" and failed.last_error == "broken"
    os.utime(a, (time.time() + 10, time.time() + 10))  # the source changed since: queue anew
    fresh = queue.enqueue_once("spc", {"level": 4}, "f" * 32, [("a", a)])[0]
    assert not fresh.reused and fresh.status == "pending"
    assert queue.counts()["pending"] == 1 and queue.counts()["failed"] == 1


def test_live_workers_ignores_dead_and_stopped(tmp_path: Path) -> None:
    now = [1000.0]
    queue = JobQueue(tmp_path, clock=lambda: now[0])
    queue.heartbeat("w1", {"heartbeat_s": 1.0})
    assert [w["worker_id"] for w in queue.live_workers(stale_s=5)] == ["w1"]
    now[0] += 6
    assert queue.live_workers(stale_s=5) == []
    queue.heartbeat("w1", {"stopped": True})
    assert queue.live_workers(stale_s=5) == []


def test_parameters_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ParameterError, match="needs sources"):
        CachedDataset(tmp_path, "spc_query", on_miss="compute")
    with pytest.raises(ParameterError, match="on_miss"):
        CachedDataset(tmp_path, "spc_query", sources=tmp_path, on_miss="skip")
    with pytest.raises(ParameterError, match="URL"):
        CachedDataset("s3://bucket/cache", "spc_query", sources=tmp_path)
    assert CachedDataset("http://127.0.0.1:1", "spc_query", sources=tmp_path).on_miss == "compute"
    assert CachedDataset(tmp_path, "spc_query").on_miss == "error"


def test_a_done_item_without_a_current_record_is_queued_again(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    from cache_store.readers.queue_read_through import QueueReadThrough

    reader = QueueReadThrough(tmp_path, "spc", {"level": 4}, "f" * 32)
    try:
        path = str(corpus_meshes[0])
        first = reader.queue.enqueue_once("spc", {"level": 4}, "f" * 32, [("a", path)])[0]
        claimed = reader.queue.claim("w", limit=1)
        assert reader.queue.complete("w", claimed[0].item_id)  # done, yet no current record
        waiting = {"a": first}
        reader._check_items(lambda key: False, waiting)
        assert waiting["a"].item_id != first.item_id and waiting["a"].status == "pending"
        assert not waiting["a"].reused and reader.queue.counts()["pending"] == 1
    finally:
        reader.close()
