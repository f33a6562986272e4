"""`spcache serve` for real: uvicorn + its worker child, warm-up of every mesh of a corpus,
then every record read over HTTP is the one in LMDB and parses with safetensors."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import safetensors.numpy

from cache_store.keys import record_key
from cache_store.jobs.queue import JobQueue
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.header import record_checksum
from tests.helpers.service import AUTH, start_server, stop_server


@pytest.mark.slow
def test_warmup_of_meshes_served_byte_identical(tmp_path: Path, meshes: list[Path]) -> None:
    cache = tmp_path / "cache"
    root = meshes[0].parent
    server = start_server(cache, root, "--device", "cpu", "--backend", "torch")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            items = [{"id": p.stem, "path": str(p)} for p in meshes]
            body = {
                "recipe": "spc",
                "params": {"level": 5, "surface_samples": 4000},
                "items": items,
            }
            r = http.post("/v1/warmup", json=body, headers=AUTH)
            assert r.status_code == 202, r.text
            job_id, fp = r.json()["job_id"], r.json()["fingerprint"]
            deadline = time.monotonic() + 300
            while (job := http.get(f"/v1/jobs/{job_id}").json())["status"] in (
                "pending",
                "running",
            ):
                assert time.monotonic() < deadline, job
                time.sleep(0.2)
            assert job["status"] == "done" and job["counts"]["done"] == len(items), job
            store = LMDBStore(cache)
            for item in items:
                r = http.get(f"/v1/caches/{fp}/records/{item['id']}")
                assert r.status_code == 200
                stored = store.get(record_key(fp, item["id"]))
                assert r.content == stored
                assert r.headers["etag"] == f'"{record_checksum(stored)}"'
                arrays = safetensors.numpy.load(r.content)
                assert arrays["octree"].dtype.name == "uint8" and arrays["octree"].size > 0
            store.close()
            # The same warm-up again: everything is ready, nothing is queued.
            again = http.post("/v1/warmup", json=body, headers=AUTH).json()
            assert again["already_ready"] == len(items) and again["queued"] == 0
            assert http.get("/readyz").json()["worker_heartbeat_age_s"] is not None
            worker_pids = {b["pid"] for b in JobQueue(cache).heartbeats()}
    finally:
        stop_server(server)
    assert server.proc.returncode == -signal.SIGTERM  # uvicorn's convention after a clean stop
    for pid in worker_pids:  # the worker child went with it
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
