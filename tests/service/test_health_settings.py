"""Health, readiness, metrics, settings and the serve CLI's refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from cache_store.jobs.queue import JobQueue
from service.settings import Settings, is_loopback
from tests.helpers.procs import run
from tests.helpers.recipes import recipe_plugin_modules
from tests.helpers.service import AUTH, Cache


def test_health_and_readiness(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["store"] == "open"


def test_metrics_report_requests_bytes_queue_heartbeat_and_cache(
    client: httpx.Client, cache: Cache
) -> None:
    for sid in cache.ids:
        client.get(f"/v1/caches/{cache.fingerprint}/records/{sid}")
    client.post(
        "/v1/warmup",
        headers=AUTH,
        json={
            "recipe": "spc",
            "params": {"level": 7},
            "items": [{"id": "a", "path": str(cache.sources / "shapes/s0.obj")}],
        },
    )
    JobQueue(cache.root).heartbeat("gpu0", {"device": "cuda:0"})
    text = client.get("/metrics").text
    route = "/v1/caches/{fingerprint}/records/{sample_id:path}"
    assert f'spcache_http_requests_total{{method="GET",route="{route}",status="200"}} 5.0' in text
    served = sum(len(v) for v in cache.values.values())
    assert f'spcache_http_response_bytes_total{{route="{route}"}} {float(served)}' in text
    assert "spcache_records_served_total 5.0" in text
    assert 'spcache_queue_items{status="pending"} 1.0' in text
    assert 'spcache_worker_heartbeat_age_seconds{worker="gpu0"}' in text
    assert f'spcache_cache_records{{fingerprint="{cache.fingerprint}"}} 5.0' in text
    assert f'spcache_cache_bytes{{fingerprint="{cache.fingerprint}"}} {float(served)}' in text
    assert "# TYPE spcache_http_requests_total counter" in text


def test_unknown_route_is_json_404(client: httpx.Client) -> None:
    r = client.get("/nowhere")
    assert r.status_code == 404 and r.json()["error"] == "NotFound"


def test_non_loopback_bind_needs_a_token(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="without a token"):
        Settings(cache=tmp_path, host="0.0.0.0", token=None)
    assert Settings(cache=tmp_path, host="0.0.0.0", token="t").host == "0.0.0.0"
    assert is_loopback("127.0.0.2") and is_loopback("::1") and not is_loopback("10.0.0.1")


def test_source_roots_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv("SPCACHE_SOURCE_ROOTS", f"{a}:{b}")
    monkeypatch.setenv("SPCACHE_TOKEN", "secret")
    s = Settings(cache=tmp_path)
    assert s.source_roots == [a.resolve(), b.resolve()]
    assert s.token is not None and s.token.get_secret_value() == "secret"
    assert "secret" not in repr(s)


def test_serve_refuses_an_open_bind_at_start_up(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    r = run(
        [
            sys.executable,
            "-m",
            "spcache",
            "serve",
            "--cache",
            tmp_path,
            "--host",
            "0.0.0.0",
            "--no-worker",
        ],
        env=env,
        inherit_env=False,
    )
    assert r.returncode == 2 and "without a token" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


_SERVE_ONE = """
import json, socket, sys, threading, time, httpx, uvicorn
from service.app import create_app
from service.settings import Settings
cache, fp, sid = sys.argv[1:4]
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
port = sock.getsockname()[1]
server = uvicorn.Server(uvicorn.Config(create_app(Settings(cache=cache)), host="127.0.0.1",
                                       port=port, log_config=None, log_level="warning"))
thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
thread.start()
while not server.started:
    time.sleep(0.01)
base = f"http://127.0.0.1:{port}/v1/caches/{fp}"
codes = [httpx.get(f"{base}/records/{sid}").status_code,
         httpx.get(f"{base}/records/{sid}", params={"fields": "octree"}).status_code,
         httpx.post(f"{base}/batch", json={"ids": [sid]}).status_code,
         httpx.get(f"{base}/items/{sid}").status_code, httpx.get(base).status_code]
server.should_exit = True
thread.join()
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "workers", "kaolin"))
print(json.dumps([codes, heavy]))
"""


def test_serving_imports_no_torch_and_no_workers_code(cache: Cache) -> None:
    """Serving records, fields, a batch, an item's state and a listing loads neither torch
    nor any module of workers but the recipe classes the registry reads schemas from."""
    out = run([sys.executable, "-c", _SERVE_ONE, cache.root, cache.fingerprint, cache.ids[0]])
    assert out.returncode == 0, out.stderr[-3000:]
    codes, heavy = json.loads(out.stdout)
    assert codes == [200, 200, 200, 200, 200]
    assert set(heavy) - recipe_plugin_modules() == set(), heavy


def test_readers_full_is_503_with_retry_after_and_bugs_are_500_json(settings: Settings) -> None:
    import lmdb

    from cache_store.errors import StoreBusy
    from tests.helpers.service import InProcessServer

    server = InProcessServer(settings)

    @server.app.get("/test/readers-full")
    def readers_full() -> None:
        try:
            raise lmdb.ReadersFullError("MDB_READERS_FULL")
        except lmdb.ReadersFullError as exc:  # wrapped the way LMDBStore wraps it
            raise StoreBusy("reader table full") from exc

    @server.app.get("/test/bug")
    def bug() -> None:
        raise RuntimeError("secret internals")

    with server, httpx.Client(base_url=server.url) as http:
        r = http.get("/test/readers-full")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json() == {
            "error": "StoreBusy",
            "detail": "too many concurrent readers of the cache; retry shortly",
        }
        r = http.get("/test/bug")
        assert r.status_code == 500 and r.json()["error"] == "InternalError"
        assert "secret" not in r.text and "Traceback" not in r.text


def test_metrics_snapshot_reads_the_counters() -> None:
    from service.metrics import Metrics

    metrics = Metrics()
    for status, size in ((200, 10), (200, 5), (404, 1)):
        metrics.observe("GET", "/r", status, size)
    metrics.add_records(3)
    assert metrics.snapshot() == ({("GET", "/r", "200"): 2, ("GET", "/r", "404"): 1}, {"/r": 16}, 3)
    assert Metrics().snapshot() == ({}, {}, 0)  # each app has its own registry
