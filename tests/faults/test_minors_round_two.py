"""Issue 26, break 6 (minors): a FIFO as the TLS certificate, the dedupe warm-up's cost,
the docs' CSP and ``nosniff``, and a job answered from a deleted queue file.

* ``spcache serve --tls-certfile FIFO`` hung silently at start; now it exits 2 at once
  naming the file and why (regular files only, as sources are checked).
* A 24k-item ``dedupe`` warm-up took 26.5 s against 3.5 s without dedupe:
  ``JobQueue.enqueue_once`` compared each new item with every one queued before it.
  Both are accepted with every item queued (figures: seconds for each); the ratio is
  measured by ``bench/responsiveness.py --part dedupe``, not asserted here.
* ``/docs`` ran under a CSP allowing ``'unsafe-inline'`` scripts and styles; no answer
  carried ``X-Content-Type-Options: nosniff``. Now no docs page allows inline scripts,
  ``/docs`` allows no inline style either, and every answer (pages, JSON, records,
  errors, a refused Host) says ``nosniff``.
* ``GET /v1/jobs/{id}`` after ``jobs.sqlite`` was deleted answered the job's last state
  from the unlinked file; now 503 ``QueueDamaged`` like every other queue route.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import httpx

from cache_store.jobs.queue import JOBS_FILENAME
from service.settings import Settings
from tests.helpers.faults import report
from tests.helpers.procs import run_spcache
from tests.helpers.service import (
    AUTH,
    TOKEN,
    InProcessServer,
    build_cache,
    start_server,
    stop_server,
)

ITEMS = 24_000


def test_a_fifo_as_the_tls_certificate_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "cert.pem"
    os.mkfifo(fifo)
    (tmp_path / "cache").mkdir()
    start = time.monotonic()
    done = run_spcache(  # a hang on the FIFO fails here, after the bound
        "serve",
        "--cache",
        tmp_path / "cache",
        "--port",
        "0",
        "--no-worker",
        "--source-root",
        tmp_path,
        "--tls-certfile",
        fifo,
        "--tls-keyfile",
        fifo,
        env={"SPCACHE_TOKEN": TOKEN},
        timeout=120,
    )
    seconds = time.monotonic() - start
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "not a regular file (it is a FIFO)" in done.stderr and str(fifo) in done.stderr
    report("tls_fifo", {"exit": done.returncode, "seconds": round(seconds, 2)})


def test_a_dedupe_warm_up_of_many_items_queues_them_as_a_plain_one_does(tmp_path: Path) -> None:
    sources = tmp_path / "sources"
    sources.mkdir()
    for i in range(ITEMS):
        (sources / f"s{i:05d}.xyz").write_bytes(b"0 0 0\n1 1 1\n")
    items = [{"id": f"s{i:05d}", "path": str(sources / f"s{i:05d}.xyz")} for i in range(ITEMS)]
    server = start_server(
        tmp_path / "cache", sources, "--no-worker", env={"SPCACHE_MAX_BODY_BYTES": str(16 << 20)}
    )
    try:
        seconds = {}
        for name, level in (("plain", 4), ("dedupe", 5)):  # two fingerprints: no reuse
            body = {
                "recipe": "spc",
                "params": {"level": level},
                "items": items,
                "dedupe": name == "dedupe",
            }
            start = time.perf_counter()
            r = httpx.post(f"{server.url}/v1/warmup", headers=AUTH, json=body, timeout=300)
            seconds[name] = time.perf_counter() - start
            assert r.status_code == 202, r.text[:300]
            assert r.json()["queued"] == ITEMS
    finally:
        stop_server(server)
    report("dedupe_warmup", {"items": ITEMS, **{f"{k}_s": round(v, 2) for k, v in seconds.items()}})


def test_no_inline_script_on_the_docs_and_nosniff_on_every_answer(tmp_path: Path) -> None:
    cache = build_cache(tmp_path)
    settings = Settings(cache=cache.root, source_roots=[cache.sources], token=TOKEN, worker=False)
    with InProcessServer(settings) as server, httpx.Client(base_url=server.url) as client:
        docs = client.get("/docs")
        redoc = client.get("/redoc")
        for page in (docs, redoc):
            policy = page.headers["content-security-policy"]
            script = re.search(r"script-src ([^;]*)", policy).group(1)
            assert "'unsafe-inline'" not in script, policy
            assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", page.text), page.text
        assert "'unsafe-inline'" not in docs.headers["content-security-policy"]
        init = re.findall(r'<script src="([^"]+)"', docs.text)
        assert all(client.get(src).status_code == 200 for src in init), init
        fp = cache.fingerprint
        answers = {
            "page": client.get("/"),
            "docs": docs,
            "redoc": redoc,
            "script": client.get("/ui/page.js"),
            "health": client.get("/healthz"),
            "json": client.get("/v1/caches"),
            "record": client.get(f"/v1/caches/{fp}/records/{cache.ids[0]}"),
            "missing": client.get(f"/v1/caches/{fp}/records/nope"),
            "bad host": client.get("/healthz", headers={"Host": "evil.example"}),
        }
    without = {
        name: r.status_code
        for name, r in answers.items()
        if r.headers.get("x-content-type-options") != "nosniff"
    }
    assert without == {}, f"answers without nosniff: {without}"
    report("docs_csp_nosniff", {"answers_checked": len(answers), "without_nosniff": 0})


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
