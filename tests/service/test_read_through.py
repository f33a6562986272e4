"""Read-through over the service URL: real uvicorn, real SQLite queue, a real worker.

``CachedDataset("http://...", recipe, sources=...)`` over an empty cache: the service
queues the misses (``POST /v1/warmup`` with ``dedupe``) and holds ``?wait=`` reads until
the worker's records land. Results are compared with ``spcache precompute``'s.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from cache_store import CachedDataset
from cache_store.errors import NoWorkerAlive, SampleFailed
from cache_store.keys import compute_fingerprint
from cache_store.jobs.queue import JobQueue
from cache_store.recipes.registry import get_recipe_spec
from cache_store.format.wire import decode_batch
from service.settings import Settings
from tests.helpers.read_through import (
    PARAMS,
    loader_check,
    precompute_reference,
    queue_rows,
    stop_worker,
    start_worker,
    check_epochs_equal_precompute,
    two_epochs,
)
from tests.helpers.service import AUTH, TOKEN, InProcessServer, start_server, stop_server


def _root(paths: list[Path]) -> Path:
    return Path(os.path.commonpath([str(p.parent) for p in paths]))


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 4 on 2 cores
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_http_epoch_over_empty_cache_equals_precompute(
    tmp_path: Path, corpus_meshes: list[Path], context: str
) -> None:
    meshes = corpus_meshes[:4]
    cache, reference = tmp_path / "rt", tmp_path / "pre"
    precompute_reference(reference, meshes)
    parent_had_ops = any(m.startswith("workers.ops") for m in sys.modules)
    server = start_server(cache, _root(meshes), "--no-worker")
    proc = start_worker(cache)
    try:
        ds = CachedDataset(
            server.url,
            "spc_query",
            sources=meshes,
            store_options={"token": TOKEN},
            transform=functools.partial(loader_check, parent_had_ops),
            **PARAMS,
        )
        first, rows, second = two_epochs(ds, context, cache, len(meshes))
    finally:
        ds.close()
        stop_worker(proc)
        stop_server(server)
    check_epochs_equal_precompute(ds, meshes, cache, reference, rows, first, second)


def test_http_no_worker_fails_fast_and_bad_mesh_fails_alone(
    tmp_path: Path, corpus_meshes: list[Path], corpus_bad_inputs: list[Path]
) -> None:
    cache = tmp_path / "rt"
    bad = next(p for p in corpus_bad_inputs if p.name == "nan_vertices.obj")
    sources = [corpus_meshes[0], bad]
    server = start_server(cache, _root(sources), "--no-worker")
    try:
        ds = CachedDataset(
            server.url,
            "spc_query",
            sources=sources,
            store_options={"token": TOKEN},
            warm_ahead=0,
            **PARAMS,
        )
        # at once: a wait for the record would end in MissTimeout, not this
        with pytest.raises(NoWorkerAlive, match=f"spcache worker --cache {cache}"):
            ds[0]
        assert JobQueue(cache).counts()["pending"] == 0  # nothing queued for nobody
        proc = start_worker(cache)
        try:
            assert set(ds[0]) >= {"octree", "point_hierarchy"}
            with pytest.raises(SampleFailed, match="nan_vertices") as err:
                ds[1]
            assert str(bad) in str(err.value) and err.value.reason
            assert err.value.reason != "failed"  # the worker's reason came across
            queued = ds.read_through_queued()
            with pytest.raises(SampleFailed, match="nan_vertices"):
                ds[1]  # the recorded failure, not a second computation
            assert ds.read_through_queued() == queued
        finally:
            stop_worker(proc)
    finally:
        ds.close()
        stop_server(server)
    rows = queue_rows(cache)
    assert sorted(s for _, s, _ in rows) == sorted(p.stem for p in sources)  # once each


def test_waiting_bound_dedupe_and_batch_wait(tmp_path: Path, corpus_meshes: list[Path]) -> None:
    mesh = corpus_meshes[0]
    cache = tmp_path / "cache"
    settings = Settings(
        cache=cache, source_roots=[mesh.parent], token=TOKEN, worker=False, max_waiting_requests=2
    )
    spec = get_recipe_spec("spc")
    fp = compute_fingerprint("spc", spec.version, spec.resolve({"level": 4}))
    with InProcessServer(settings) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        warm = {
            "recipe": "spc",
            "params": {"level": 4},
            "dedupe": True,
            "require_worker": True,
            "priority": 100,
            "items": [{"id": "m", "path": str(mesh)}],
        }
        refused = http.post("/v1/warmup", json=warm, headers=AUTH)
        assert refused.status_code == 503 and refused.json()["error"] == "NoWorkerAlive"
        assert "spcache worker --cache" in refused.json()["detail"]
        assert http.post("/v1/warmup", json=warm).status_code == 401  # token as for warm-up
        JobQueue(cache).heartbeat("fake-worker", {"heartbeat_s": 60})  # this process: alive
        first = http.post("/v1/warmup", json=warm, headers=AUTH).json()
        again = http.post("/v1/warmup", json=warm, headers=AUTH).json()
        assert (first["queued"], first["reused"]) == (1, 0)
        assert (again["queued"], again["reused"], again["job_id"]) == (0, 1, None)
        assert again["items"] == [{"id": "m", "status": "pending", "error": None, "reused": True}]
        assert JobQueue(cache).counts()["pending"] == 1

        ctx = server.app.state.ctx
        answers: list[httpx.Response] = []

        def wait_get() -> None:  # held long enough that the extra request finds them waiting
            answers.append(http.get(f"/v1/caches/{fp}/records/m", params={"wait": 20}))

        waiters = [threading.Thread(target=wait_get) for _ in range(2)]
        for t in waiters:
            t.start()
        deadline = time.monotonic() + 120
        while ctx.waits.taken < 2:
            assert time.monotonic() < deadline, "the waits did not start"
            time.sleep(0.01)
        # refused at once: had it waited, it would have answered 404 once its own wait ended
        extra = http.get(f"/v1/caches/{fp}/records/m", params={"wait": 2})
        assert extra.status_code == 503 and extra.headers["retry-after"]
        assert extra.json()["error"] == "WaitingFull"
        assert http.get("/healthz").status_code == 200  # the loop is not blocked
        for t in waiters:
            t.join(30)
        assert [a.status_code for a in answers] == [404, 404]
        assert all(a.headers["x-spcache-item-state"] == "queued" for a in answers)
        assert ctx.waits.taken == 0

        batch = http.post(
            f"/v1/caches/{fp}/batch", params={"wait": 0.3}, json={"ids": ["m", "never-queued"]}
        )
        found, missing = decode_batch(batch.content)
        assert not found and set(missing) == {"m", "never-queued"}
        assert "queued" in missing["m"] and "missing" in missing["never-queued"]
        # the item fails: a waiting read answers its state and the worker's reason
        queue = JobQueue(cache)
        item = queue.claim("fake-worker", limit=1)[0]
        queue.fail(
            "fake-worker", item.item_id, "degenerate mesh: all faces zero-area", permanent=True
        )
        failed = http.get(f"/v1/caches/{fp}/records/m", params={"wait": 5})
        assert failed.status_code == 404 and failed.headers["x-spcache-item-state"] == "failed"
        assert failed.json()["error"] == "SampleFailed"
        assert "zero-area" in failed.json()["detail"] and str(mesh) in failed.json()["detail"]
