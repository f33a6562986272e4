"""Warm-up requests: validation, path safety, auth, limits, counting what is ready."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.helpers.recipes import BUILTINS, known_names
from tests.helpers.service import AUTH, Cache


def _warm(client: httpx.Client, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return client.post("/v1/warmup", json=body, headers=headers)


def _items(cache: Cache, n: int | None = None) -> list[dict]:
    ids = cache.ids if n is None else cache.ids[:n]
    return [{"id": sid, "path": str(cache.sources / f"{sid}.obj")} for sid in ids]


def test_ready_items_are_counted_not_queued(client: httpx.Client, cache: Cache) -> None:
    (cache.sources / "shapes" / "s1.obj").write_text("v 9 9 9\nv 1 0 0\nv 0 1 0\nf 1 2 3\n")
    new = cache.sources / "new.obj"
    new.write_text("v 0 0 0\nv 1 0 0\nv 0 1 0\nf 1 2 3\n")
    items = _items(cache) + [{"id": "new", "path": str(new)}]
    r = _warm(client, {"recipe": "spc", "params": {"level": 4}, "items": items, "priority": 3})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["fingerprint"] == cache.fingerprint
    assert body["already_ready"] == 4  # s1's source changed, so it is stale
    assert body["queued"] == 2
    job = client.get(f"/v1/jobs/{body['job_id']}").json()
    assert job["counts"] == {"pending": 2, "running": 0, "done": 4, "failed": 0, "cancelled": 0}
    assert job["status"] == "running" and job["priority"] == 3
    # progress: 4 of 6 settled; no worker has finished one, so no rate yet
    assert (job["total"], job["percent"], job["samples_per_s"], job["eta_s"]) == (
        6,
        66.67,
        None,
        None,
    )
    state = client.get(f"/v1/caches/{cache.fingerprint}/items/shapes/s1").json()
    assert state["state"] == "stale" and "changed" in state["reason"]
    ready = client.get(f"/v1/caches/{cache.fingerprint}/items/shapes/s0").json()
    assert ready["state"] == "ready"
    source = cache.sources / "shapes" / "s0.obj"
    assert ready["reason"] == (
        f"record present; source {source} unchanged since it was computed; "
        "recipe spc version 1 is the installed one"
    )
    assert client.get(f"/v1/caches/{cache.fingerprint}/items/new").json()["state"] == "queued"


def test_glob_warmup_uses_relative_paths_as_ids(client: httpx.Client, cache: Cache) -> None:
    r = _warm(
        client,
        {"recipe": "spc", "params": {"level": 5}, "root": str(cache.sources), "glob": "**/*.obj"},
    )
    assert r.status_code == 202, r.text
    job = client.get(f"/v1/jobs/{r.json()['job_id']}").json()
    assert job["counts"]["pending"] == len(cache.ids)  # another level: nothing ready


def test_mutating_routes_need_the_token(client: httpx.Client, cache: Cache) -> None:
    body = {"recipe": "spc", "items": _items(cache, 1)}
    assert _warm(client, body, headers=None).status_code == 401
    r = _warm(client, body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"] == "Unauthorized"
    assert r.headers["www-authenticate"] == "Bearer"
    job_id = _warm(client, body).json()["job_id"]
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 401
    r = client.delete(f"/v1/jobs/{job_id}", headers=AUTH)
    assert r.status_code == 200 and r.json()["status"] in ("cancelled", "done")
    assert client.get(f"/v1/jobs/{job_id}").status_code == 200  # reads need no token


def test_path_traversal_is_rejected_naming_the_path(
    client: httpx.Client, cache: Cache, tmp_path: Path
) -> None:
    outside = tmp_path / "secret.obj"
    outside.write_text("v 0 0 0\n")
    sneaky = f"{cache.sources}/shapes/../../secret.obj"
    r = _warm(client, {"recipe": "spc", "items": [{"id": "x", "path": sneaky}]})
    assert r.status_code == 422
    assert sneaky in r.json()["detail"] and "outside the allowed source roots" in r.json()["detail"]


def test_symlink_escape_is_rejected(client: httpx.Client, cache: Cache, tmp_path: Path) -> None:
    outside = tmp_path / "secret.obj"
    outside.write_text("v 0 0 0\n")
    link = cache.sources / "innocent.obj"
    os.symlink(outside, link)
    r = _warm(client, {"recipe": "spc", "items": [{"id": "x", "path": str(link)}]})
    assert r.status_code == 422 and str(link) in r.json()["detail"]
    os.symlink(tmp_path, cache.sources / "escape_dir")
    r = _warm(client, {"recipe": "spc", "root": str(cache.sources / "escape_dir"), "glob": "*.obj"})
    assert r.status_code == 422 and "outside" in r.json()["detail"]
    r = _warm(client, {"recipe": "spc", "root": str(cache.sources), "glob": "../*.obj"})
    assert r.status_code == 422


def test_missing_source_and_bad_ids_are_listed(client: httpx.Client, cache: Cache) -> None:
    items = [
        {"id": "../up", "path": str(cache.sources / "shapes/s0.obj")},
        {"id": "ok", "path": str(cache.sources / "absent.obj")},
        {"id": "shapes/s0", "path": str(cache.sources / "shapes/s0.obj")},
        {"id": "shapes/s0", "path": str(cache.sources / "shapes/s1.obj")},
    ]
    r = _warm(client, {"recipe": "spc", "items": items})
    assert r.status_code == 422
    problems = r.json()["problems"]
    assert problems[0].startswith("items[0]") and "'..'" in problems[0]
    assert problems[1].startswith("items[1]") and "does not exist" in problems[1]
    assert problems[2].startswith("items[3]") and "duplicate" in problems[2]


def test_bad_recipe_parameters_are_422_listing_each(client: httpx.Client, cache: Cache) -> None:
    r = _warm(
        client,
        {"recipe": "spc", "params": {"level": 99, "colour": "red"}, "items": _items(cache, 1)},
    )
    assert r.status_code == 422
    body = r.json()
    assert body["error"] == "ParameterError"
    assert any("level" in p and "maximum" in p for p in body["problems"])
    assert any("colour" in p and "unknown parameter" in p for p in body["problems"])
    r = _warm(client, {"recipe": "nope", "items": _items(cache, 1)})
    assert r.status_code == 422 and known_names(r.json()["detail"]) >= BUILTINS


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[]",
        b'{"recipe": "spc"}',
        b'{"recipe": "spc", "items": []}',
        b'{"recipe": "spc", "items": [{"id": "a", "path": "b"}], "root": "x", "glob": "*"}',
        b'{"recipe": "spc", "items": [{"id": "a", "path": "b"}], "surprise": 1}',
    ],
)
def test_malformed_requests_are_4xx_json(client: httpx.Client, body: bytes) -> None:
    r = client.post(
        "/v1/warmup", content=body, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert 400 <= r.status_code < 500
    assert set(r.json()) >= {"error", "detail"} and "Traceback" not in r.text


def test_oversize_bodies_are_413(client: httpx.Client) -> None:
    big = b'{"recipe": "spc", "items": [' + b'{"id": "a", "path": "b"},' * 5000 + b"]}"
    r = client.post("/v1/warmup", content=big, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "RequestTooLarge"

    def chunks():  # no Content-Length: the limit must hold on the streamed body too
        for _ in range(200):
            yield b" " * 1024

    r = client.post(
        "/v1/warmup", content=chunks(), headers={**AUTH, "Content-Type": "application/json"}
    )
    assert r.status_code == 413


def test_jobs_list_get_cancel_and_404(client: httpx.Client, cache: Cache) -> None:
    job_id = _warm(
        client, {"recipe": "spc", "params": {"level": 6}, "items": _items(cache)}
    ).json()["job_id"]
    listed = client.get("/v1/jobs").json()["jobs"]
    assert [j["id"] for j in listed] == [job_id]
    assert (listed[0]["total"], listed[0]["percent"], listed[0]["eta_s"]) == (
        len(cache.ids),
        0.0,
        None,
    )
    r = client.delete(f"/v1/jobs/{job_id}", headers=AUTH)
    assert r.json()["counts"]["cancelled"] == len(cache.ids) and r.json()["status"] == "cancelled"
    # nothing was computed: a cancelled job is not "100 %" done
    assert r.json()["percent"] == 0.0 and r.json()["eta_s"] == 0.0
    r = client.get("/v1/jobs/nope")
    assert r.status_code == 404 and r.json()["error"] == "JobNotFound"
    assert client.delete("/v1/jobs/nope", headers=AUTH).status_code == 404


def test_cache_lists_every_remembered_failure_and_its_created_time(
    client: httpx.Client, cache: Cache
) -> None:
    from cache_store.jobs.failures import FailureLog
    from cache_store.jobs.queue import JobQueue, NewItem

    # a precompute failure (the failure log) and a worker failure (the queue) alike
    FailureLog(cache.root).record(cache.fingerprint, "broken", "/data/broken.obj", "h", "no faces")
    queue = JobQueue(cache.root)
    queue.submit("spc", cache.params, cache.fingerprint, [NewItem("empty", "/data/empty.ply")])
    (claimed,) = queue.claim("w")
    queue.fail("w", claimed.item_id, "file is empty", permanent=True)
    queue.close()
    body = client.get(f"/v1/caches/{cache.fingerprint}").json()
    assert body["created"] and body["created"].startswith("20")
    failed = body["failed"]
    assert failed["count"] == 2 == body["counts"]["failed"]
    assert sorted((f["id"], f["path"], f["reason"]) for f in failed["items"]) == [
        ("broken", "/data/broken.obj", "no faces"),
        ("empty", "/data/empty.ply", "file is empty"),
    ]
    listed = client.get("/v1/caches").json()["caches"]
    assert [
        (c["failed"], bool(c["created"])) for c in listed if c["fingerprint"] == cache.fingerprint
    ] == [(2, True)]
    jobs = client.get("/v1/jobs").json()["jobs"]
    assert jobs[0]["status"] == "failed" and jobs[0]["errors"][0]["error"] == "file is empty"
