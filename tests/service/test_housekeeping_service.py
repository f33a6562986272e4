"""A running `spcache serve` that keeps its cache under --max-size, and removes a
fingerprint on DELETE /v1/caches/{fingerprint}."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pytest

from cache_store import housekeeping as hk
from cache_store.errors import CacheNotFound, FingerprintLookupError, StoreBusy, error_values
from tests.helpers.housekeeping import add_fingerprint
from tests.helpers.procs import run_spcache
from tests.helpers.service import AUTH, start_server, stop_server

# four fingerprints of about the same size: the same recipe, a different query count
QUERIES = (1000, 1001, 1002, 1003)


def _params(queries: int) -> dict[str, int]:
    return {"level": 5, "surface_samples": 4000, "uniform_queries": queries, "surface_queries": 500}


def _warm(http: httpx.Client, items: list[dict[str, str]], queries: int) -> str:
    r = http.post(
        "/v1/warmup",
        headers=AUTH,
        json={"recipe": "spc_query", "params": _params(queries), "items": items},
    )
    assert r.status_code == 202, r.text
    job_id, fp = r.json()["job_id"], r.json()["fingerprint"]
    deadline = time.monotonic() + 300
    while (job := http.get(f"/v1/jobs/{job_id}").json())["status"] in ("pending", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    assert job["counts"]["done"] == len(items), job
    return fp


@pytest.mark.slow
def test_max_size_keeps_a_running_service_under_its_limit(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    meshes = corpus_meshes[:6]
    root = meshes[0].parent
    items = [{"id": p.stem, "path": str(p)} for p in meshes]
    # the size of one fingerprint, measured with a service without a limit
    probe = tmp_path / "probe"
    server = start_server(probe, root, "--device", "cpu", "--backend", "torch")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            _warm(http, items, 999)
    finally:
        stop_server(server)
    one = hk.ls(probe)[0]["bytes"]
    per_record = max(r["bytes"] / r["records"] for r in hk.ls(probe))
    limit = int(2.5 * one)  # room for two fingerprints and a half

    cache = tmp_path / "cache"
    server = start_server(
        cache, root, "--device", "cpu", "--backend", "torch", "--max-size", str(limit)
    )
    seen: list[list[str]] = []
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            fps = []
            for queries in QUERIES:
                fps.append(_warm(http, items, queries))
                # the worker evicts after the batch it reported done: watch it settle
                deadline = time.monotonic() + 60
                while True:
                    rows = hk.ls(cache)
                    total = sum(r["bytes"] for r in rows)
                    # under the limit, plus at most one batch (8 records) of the one written
                    assert total <= limit + 8 * per_record, (total, limit, rows)
                    written = {r["fingerprint"]: r for r in rows}[fps[-1]]
                    assert written["state"] == "complete"  # the one written is never evicted
                    if total <= limit and all(r["state"] != "removing" for r in rows):
                        break
                    assert time.monotonic() < deadline, rows
                    time.sleep(0.2)
                seen.append([r["fingerprint"] for r in rows])
            r = http.get(f"/v1/caches/{fps[0]}/records/{items[0]['id']}")
            assert r.status_code == 404 and "was removed" in r.text, r.text
    finally:
        stop_server(server)
    assert seen[-1][-1] == fps[-1] and fps[0] not in seen[-1]  # least recently used went first
    assert len(seen[-1]) == 2

    # a limit smaller than a fingerprint already stored is refused at start
    refused = run_spcache("serve", "--cache", cache, "--port", "0", "--max-size", str(one // 2))
    assert refused.returncode == 2
    assert "--max-size" in refused.stderr and "is smaller than fingerprint" in refused.stderr


def test_delete_route_removes_a_fingerprint(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    keep = add_fingerprint(cache, 3, n=20, nbytes=1024)
    gone = add_fingerprint(cache, 4, n=30, nbytes=1024)
    server = start_server(cache, tmp_path, "--no-worker")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get(f"/v1/caches/{gone}/records/s000001").status_code == 200
            assert http.delete(f"/v1/caches/{gone}").status_code == 401
            r = http.delete(f"/v1/caches/{gone}", headers=AUTH)
            assert r.status_code == 200, r.text
            assert r.json()["records"] == 30 and r.json()["fingerprint"] == gone
            r = http.get(f"/v1/caches/{gone}/records/s000001")
            assert r.status_code == 404 and "FingerprintRemoved" in r.text, r.text
            assert http.get(f"/v1/caches/{keep}/records/s000001").status_code == 200
            listed = [c["fingerprint"] for c in http.get("/v1/caches").json()["caches"]]
            assert listed == [keep]
            r = http.delete(f"/v1/caches/{'0' * 32}", headers=AUTH)
            assert r.status_code == 404, r.text
    finally:
        stop_server(server)


def test_delete_cancels_a_fingerprint_that_is_only_queued(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    """No worker: the warm-up stays queued, nothing is stored; DELETE still finds the
    fingerprint and cancels its items. Removed once, a second DELETE is a 404."""
    root = corpus_meshes[0].parent
    items = [{"id": p.stem, "path": str(p)} for p in corpus_meshes[:3]]
    server = start_server(tmp_path / "cache", root, "--no-worker")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            r = http.post(
                "/v1/warmup",
                headers=AUTH,
                json={"recipe": "spc", "params": {"level": 4}, "items": items},
            )
            assert r.status_code == 202, r.text
            job_id, fp = r.json()["job_id"], r.json()["fingerprint"]
            r = http.delete(f"/v1/caches/{fp}", headers=AUTH)
            assert r.status_code == 200, r.text
            assert r.json()["cancelled"] == 3 and r.json()["records"] == 0
            job = http.get(f"/v1/jobs/{job_id}").json()
            assert job["counts"]["pending"] == 0 and job["counts"]["cancelled"] == 3, job
            r = http.delete(f"/v1/caches/{fp}", headers=AUTH)
            assert r.status_code == 404 and "no such fingerprint" in r.text, r.text
    finally:
        stop_server(server)


@pytest.mark.slow
def test_rm_while_the_worker_computes_it_stops_its_writes(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    """DELETE while the worker is in the middle of the fingerprint's job: its queued items
    are cancelled, the batch in flight is not written, and nothing brings it back."""
    root = corpus_meshes[0].parent
    items = [
        {"id": f"m{i:03d}", "path": str(corpus_meshes[i % len(corpus_meshes)])} for i in range(400)
    ]
    cache = tmp_path / "cache"
    server = start_server(cache, root, "--device", "cpu", "--backend", "torch")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            r = http.post(
                "/v1/warmup",
                headers=AUTH,
                json={
                    "recipe": "spc",
                    "params": {"level": 5, "surface_samples": 4000},
                    "items": items,
                },
            )
            assert r.status_code == 202, r.text
            job_id, fp = r.json()["job_id"], r.json()["fingerprint"]
            deadline = time.monotonic() + 300
            while http.get(f"/v1/jobs/{job_id}").json()["counts"]["done"] < 8:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            r = http.delete(f"/v1/caches/{fp}", headers=AUTH)
            assert r.status_code == 200, r.text
            assert r.json()["cancelled"] > 0
            while (job := http.get(f"/v1/jobs/{job_id}").json())["counts"]["running"]:
                assert time.monotonic() < deadline, job
                time.sleep(0.2)
            time.sleep(2)  # a batch in flight would have committed by now
            assert job["counts"]["pending"] == 0 and job["counts"]["cancelled"] > 0, job
            r = http.get(f"/v1/caches/{fp}/records/{items[0]['id']}")
            assert r.status_code == 404 and "FingerprintRemoved" in r.text
            assert fp not in {row["fingerprint"] for row in hk.ls(cache)}  # no record, no index
            # asked for again: computed again
            r = http.post(
                "/v1/warmup",
                headers=AUTH,
                json={
                    "recipe": "spc",
                    "params": {"level": 5, "surface_samples": 4000},
                    "items": items[:4],
                },
            )
            assert r.status_code == 202 and r.json()["fingerprint"] == fp, r.text
            again = r.json()["job_id"]
            while (job := http.get(f"/v1/jobs/{again}").json())["status"] in ("pending", "running"):
                assert time.monotonic() < deadline, job
                time.sleep(0.2)
            assert job["counts"]["done"] == 4, job
            assert http.get(f"/v1/caches/{fp}/records/{items[0]['id']}").status_code == 200
    finally:
        stop_server(server)
    (row,) = [r for r in hk.ls(cache) if r["fingerprint"] == fp]
    assert row["records"] == 4 and row["state"] == "complete"


def _answer(error: BaseException) -> str:
    return json.dumps(error_values(error))


@pytest.mark.parametrize(
    "stdout,stderr,code,status",
    [
        (_answer(StoreBusy("/c: the cache is being compacted; writes waited 600s")), "", 0, 503),
        ("", "Traceback (most recent call last):\nRuntimeError: boom", 1, 500),
        (
            _answer(FingerprintLookupError("'abc': fingerprint abc was already removed")),
            "",
            0,
            404,
        ),
        (_answer(CacheNotFound("/c", "no cache here")), "", 0, 404),
        ("", "", -6, 503),  # LMDB aborted the child: the cache is damaged
    ],
)
def test_delete_maps_what_the_rm_child_answered_to_a_status(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stdout: str,
    stderr: str,
    code: int,
    status: int,
) -> None:
    """The route runs ``rm`` in a child (the housekeeping children's one protocol): its
    error comes back as its own class, so a store busy being compacted is a 503 to
    retry, a crash a 500, an unknown or removed fingerprint (or no cache at all) a 404,
    a child LMDB aborted a 503. The child here is a real process that answers as the
    real one does in each case."""
    from service.errors import status_for
    from service.routes_caches import remove_in_child

    child = tmp_path / "rm-child"
    (tmp_path / "out.txt").write_text(stdout)
    (tmp_path / "err.txt").write_text(stderr + "\n")
    end = "kill -ABRT $$" if code < 0 else f"exit {code}"
    child.write_text(
        f"#!/bin/sh\ncat {tmp_path / 'out.txt'}\ncat {tmp_path / 'err.txt'} >&2\n{end}\n"
    )
    child.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(child))
    with pytest.raises(Exception) as caught:
        remove_in_child(tmp_path, "0" * 32)
    assert status_for(caught.value) == status, caught.value
