"""The roots a job was accepted under bind whichever worker reads it.

A standalone ``spcache worker`` without ``--source-root`` (what ``docker-compose.yml``
ran) read and served a file swapped for a symbolic link out of the service's roots after
the warm-up was accepted. The roots now travel with the job in the queue.

A real ``spcache serve --no-worker`` accepts a warm-up of three files inside its source
root; one is then swapped for a link to a file outside; a worker with no roots of its
own drains the queue. The swapped sample fails alone, naming the roots, and nothing of
the outside file is stored. A worker whose own roots share no directory with the job's
fails its items with that reason.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import numpy as np

from cache_store.jobs.queue import JobQueue
from cache_store.keys import record_key
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.faults import report
from tests.helpers.service import AUTH, start_server, stop_server
from workers.worker_loop import WorkerLoop

PARAMS = {"level": 4, "surface_samples": 200}


def _cloud(path: Path, seed: int) -> None:
    np.save(path, np.random.default_rng(seed).uniform(-1, 1, size=(300, 3)))


def _drain(cache: Path, roots: list[Path] | None) -> float:
    loop = WorkerLoop(
        cache, device="cpu", backend="torch", loaders=0, drain=True, source_roots=roots
    )
    finished = threading.Event()
    start = time.monotonic()
    threading.Thread(target=lambda: (loop.run(), finished.set()), daemon=True).start()
    assert finished.wait(120), "the worker did not drain the queue"
    return time.monotonic() - start


def _warmup(url: str, sources: Path, names: list[str]) -> tuple[str, str]:
    r = httpx.post(
        f"{url}/v1/warmup",
        headers=AUTH,
        timeout=30,
        json={
            "recipe": "spc",
            "params": PARAMS,
            "items": [{"id": n, "path": str(sources / f"{n}.npy")} for n in names],
        },
    )
    assert r.status_code == 202, r.text
    return r.json()["job_id"], r.json()["fingerprint"]


def test_a_worker_without_roots_enforces_the_roots_the_job_was_accepted_under(
    tmp_path: Path,
) -> None:
    sources, outside, other = tmp_path / "sources", tmp_path / "outside", tmp_path / "other"
    cache = tmp_path / "cache"
    for d in (sources, outside, other):
        d.mkdir()
    for n in ("good0", "swapped", "good1"):
        _cloud(sources / f"{n}.npy", len(n))
    _cloud(outside / "secret.npy", 99)
    server = start_server(cache, sources, "--no-worker")
    try:
        job_id, fp = _warmup(server.url, sources, ["good0", "swapped", "good1"])
        (sources / "swapped.npy").unlink()  # after the service checked it
        (sources / "swapped.npy").symlink_to(outside / "secret.npy")
        seconds = _drain(cache, None)  # no --source-root, as compose ran it
        job = httpx.get(f"{server.url}/v1/jobs/{job_id}", timeout=30).json()
        errors = {e["sample_id"]: e["error"] for e in job["errors"]}
        assert job["counts"]["done"] == 2 and job["counts"]["failed"] == 1, job
        assert "outside the allowed source roots" in errors["swapped"], errors
        with LMDBStore(cache) as store:
            assert not store.has(record_key(fp, "swapped")), "the outside file was served"
            assert store.has(record_key(fp, "good0")) and store.has(record_key(fp, "good1"))

        _cloud(sources / "late.npy", 5)
        job_id, _ = _warmup(server.url, sources, ["late"])
        _drain(cache, [other])  # this worker's roots and the job's share nothing
        queue = JobQueue(cache)
        info = queue.job(job_id)
        queue.close()
        assert info.counts["failed"] == 1, info.counts
        assert "share no directory" in info.errors[0].error
    finally:
        stop_server(server)
    report("worker_roots", {"items": 3, "failed_alone": 1, "wall_s": round(seconds, 2)})
