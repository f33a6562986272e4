"""Variants through the service: a warm-up asking for them (a real ``spcache serve`` with
a real ``spcache worker``), a variant's record by its record id, and read-through over
HTTP reading the variant each epoch picks."""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import torch

from cache_store import CachedDataset
from cache_store.format.decode import decode_record
from cache_store.keys import record_key
from cache_store.readers.variants import pick_variant
from cache_store.stores.lmdb.store import LMDBStore
from tests.helpers.read_through import start_worker, stop_worker
from tests.helpers.service import AUTH, TOKEN, start_server, stop_server

PARAMS = {"level": 5, "surface_samples": 4000, "rotation": "z", "jitter": 0.002}


@pytest.mark.slow
def test_a_warm_up_of_variants_then_read_through_over_http(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    meshes = []
    for mesh in sorted(corpus_meshes)[:3]:
        meshes.append(shapes / mesh.name)
        meshes[-1].write_bytes(mesh.read_bytes())
    cache = tmp_path / "cache"
    server = start_server(cache, shapes, "--no-worker")
    worker = start_worker(cache)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            first = meshes[0]
            body = {
                "recipe": "spc",
                "params": PARAMS,
                "items": [{"id": first.stem, "path": str(first)}],
                "variants": 3,
            }
            bad = client.post("/v1/warmup", json={**body, "variants": 0}, headers=AUTH)
            assert bad.status_code == 422
            r = client.post("/v1/warmup", json=body, headers=AUTH)
            assert r.status_code == 202, r.text
            job = r.json()
            assert job["variants"] == 3 and job["queued"] == 1
            deadline = time.monotonic() + 120
            while client.get(f"/v1/jobs/{job['job_id']}").json()["status"] != "done":
                assert time.monotonic() < deadline, "the warm-up did not finish"
                time.sleep(0.2)
            fp = job["fingerprint"]
            got = client.get(f"/v1/caches/{fp}/records/{quote(first.stem + '#v2', safe='')}")
            assert got.status_code == 200, got.text
            record = decode_record(got.content, key=record_key(fp, first.stem, 2))
            assert record.metadata["variant"] == "2"
            assert not torch.allclose(record["augmentation"], torch.eye(4))
            previews = [
                client.get(f"/v1/caches/{fp}/previews/{quote(first.stem + tail, safe='')}")
                for tail in ("", "#v1", "#v2")
            ]  # each variant of a sample has its own picture
            assert [p.status_code for p in previews] == [200, 200, 200]
            assert len({p.content for p in previews}) == 3
            again = client.post("/v1/warmup", json=body, headers=AUTH).json()
            assert again["already_ready"] == 1 and again["queued"] == 0  # stored once
        ds = CachedDataset(
            server.url,
            "spc",
            sources=meshes,
            variants=3,
            store_options={"token": TOKEN},
            miss_timeout=120,
            **PARAMS,
        )
        read = {}
        for epoch in (0, 1, 2):
            ds.set_epoch(epoch)
            for i in range(len(ds)):
                k = pick_variant(0, epoch, ds.sample_id(i), 3)
                read[(ds.sample_id(i), k)] = ds[i]["octree"]
        ds.close()
    finally:
        stop_worker(worker)
        stop_server(server)
    with LMDBStore(cache) as store:
        assert store.get_index(fp).variant_counts().tolist() == [3, 3, 3]
        assert len(list(store.keys(fp))) == 9  # each variant computed once
        for (sid, k), octree in read.items():
            assert torch.equal(store.get_record(record_key(fp, sid, k))["octree"], octree)
    assert len({k for _, k in read}) > 1  # the epochs read more than one variant
