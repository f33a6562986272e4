"""A deleted, replaced or truncated ``jobs.sqlite`` is said loudly.

A live service (in-process uvicorn, no worker) has a queue with a job; then the file
is deleted, truncated, or replaced by another file. Wanted: ``/readyz`` answers 503
naming the queue and the reason, a warm-up answers 503 (``QueueDamaged``), a worker's
claim raises ``QueueDamaged``, and an ERROR is logged; nothing is silently recreated.
A job's own route (``GET /v1/jobs/{id}``) answers 503 ``QueueDamaged`` too, never the
job's last state from the unlinked file.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import httpx
import pytest

from cache_store.errors import QueueDamaged
from cache_store.jobs.queue import JOBS_FILENAME, JobQueue
from service.settings import Settings
from tests.helpers.faults import report
from tests.helpers.service import AUTH, TOKEN, InProcessServer, build_cache


def _lose(path: Path, how: str) -> None:
    if how == "deleted":
        path.unlink()
    elif how == "truncated":
        os.truncate(path, 0)
    else:  # replaced: an empty queue of another directory copied over it
        other = path.parent.parent / "other"
        JobQueue(other).counts()
        shutil.copy(other / JOBS_FILENAME, path.parent / "tmp.sqlite")
        os.replace(path.parent / "tmp.sqlite", path)


@pytest.mark.parametrize("how", ["deleted", "truncated", "replaced"])
def test_a_lost_queue_file_is_reported_and_refuses_work(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = build_cache(tmp_path, n=2)
    settings = Settings(cache=cache.root, source_roots=[cache.sources], token=TOKEN, worker=False)
    warmup = {
        "recipe": "spc",
        "params": {"level": 4},
        "items": [
            {"id": sid, "path": str(cache.sources / "shapes" / f"s{i}.obj")}
            for i, sid in enumerate(cache.ids)
        ],
    }
    worker_queue = JobQueue(cache.root)
    with InProcessServer(settings) as server, httpx.Client(base_url=server.url) as client:
        assert client.get("/readyz").status_code == 200
        answer = client.post("/v1/warmup", json=warmup, headers=AUTH)
        assert answer.status_code in (200, 202), answer.text
        assert worker_queue.counts()["pending"] >= 0  # the worker has the file open too
        _lose(cache.root / JOBS_FILENAME, how)
        with caplog.at_level(logging.ERROR, logger="cache_store.jobs.queue"):
            ready = client.get("/readyz")
            refused = client.post("/v1/warmup", json=warmup, headers=AUTH)
            with pytest.raises(QueueDamaged, match=how.rstrip("d")):
                worker_queue.claim("w1")
        assert ready.status_code == 503, ready.text
        assert "job queue damaged" in " ".join(ready.json()["problems"])
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"] == "QueueDamaged"
        assert how.rstrip("d") in refused.json()["detail"]
        assert any("job queue damaged" in r.getMessage() for r in caplog.records)
        if how == "deleted":  # nothing recreated it behind our back
            assert not (cache.root / JOBS_FILENAME).exists()
    worker_queue.close()
    report(
        "queue_file_lost",
        {
            "how": how,
            "readyz": ready.status_code,
            "warmup": refused.status_code,
            "claim": "QueueDamaged",
        },
    )


def test_a_job_is_not_answered_from_a_deleted_queue_file(tmp_path: Path) -> None:
    cache = build_cache(tmp_path)
    settings = Settings(cache=cache.root, source_roots=[cache.sources], token=TOKEN, worker=False)
    with InProcessServer(settings) as server, httpx.Client(base_url=server.url) as client:
        source = cache.sources / "shapes" / "new.obj"
        source.write_text("v 0 0 0\nv 1 0 0\nv 0 1 0\nf 1 2 3\n")
        r = client.post(
            "/v1/warmup",
            headers=AUTH,
            json={
                "recipe": "spc",
                "params": {"level": 5},
                "items": [{"id": "new", "path": str(source)}],
            },
        )
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "pending"
        (cache.root / JOBS_FILENAME).unlink()
        one, listed = client.get(f"/v1/jobs/{job_id}"), client.get("/v1/jobs")
    assert one.status_code == 503 and one.json()["error"] == "QueueDamaged", one.text
    assert listed.status_code == 503, listed.text
    report("job_after_queue_deleted", {"job": one.status_code, "jobs": listed.status_code})
