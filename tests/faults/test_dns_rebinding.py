"""DNS rebinding against a token-less service on loopback.

A page on ``attacker.example`` that re-resolves its name to 127.0.0.1 makes the browser
send ``Host: attacker.example:PORT``; such a warm-up was accepted (202). Against a real
uvicorn on loopback without a token: every route answers 400 with the JSON error body
for a foreign Host (and nothing is queued), the default names still work, and
``SPCACHE_ALLOWED_HOSTS`` replaces the list. Figures: answers by Host.
"""

from __future__ import annotations

import socket
from pathlib import Path

import httpx

from service.settings import Settings
from tests.helpers.faults import report, served
from tests.helpers.service import build_cache

FOREIGN = [
    "attacker.example",
    "attacker.example:8000",
    "127.0.0.1.attacker.example",
    "localhost.attacker.example",
    "[::2]",
    "evil",
    "",
]


def _raw_get(port: int, host: str | None, path: str = "/v1/jobs") -> tuple[int, bytes]:
    """One request with exactly this Host header (None: no Host header at all)."""
    head = f"GET {path} HTTP/1.1\r\n" + (f"Host: {host}\r\n" if host is not None else "")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall((head + "Connection: close\r\n\r\n").encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


def test_foreign_host_is_refused_without_a_token(tmp_path: Path) -> None:
    cache = build_cache(tmp_path)
    settings = Settings(cache=cache.root, source_roots=[cache.sources], token=None, worker=False)
    answers: dict[str, int] = {}
    with served(settings) as server:
        port = server.port
        warm = {
            "recipe": "spc",
            "items": [{"id": "shapes/s0", "path": "shapes/s0.obj"}],
            "params": {"level": 5},
        }
        for host in FOREIGN:
            r = httpx.post(f"{server.url}/v1/warmup", json=warm, headers={"Host": host}, timeout=10)
            answers[f"warmup {host!r}"] = r.status_code
            assert r.status_code == 400, (host, r.status_code, r.text)
            assert r.json()["error"] == "BadHost"
            status, body = _raw_get(port, host)
            answers[f"jobs {host!r}"] = status
            assert status == 400 and b"BadHost" in body
        jobs = httpx.get(f"{server.url}/v1/jobs", timeout=10).json()["jobs"]
        assert jobs == [], "a refused warm-up queued a job"
        for host in (
            "127.0.0.1",
            f"127.0.0.1:{port}",
            f"localhost:{port}",
            "LOCALHOST",
            f"[::1]:{port}",
        ):
            status, _ = _raw_get(port, host)
            answers[f"jobs {host!r}"] = status
            assert status == 200, host
        ok = httpx.post(f"{server.url}/v1/warmup", json=warm, timeout=10)
        assert ok.status_code == 202, ok.text
    report("dns_rebinding", {"answers": answers})


def test_allowed_hosts_setting_replaces_the_default(tmp_path: Path, monkeypatch) -> None:
    cache = build_cache(tmp_path)
    monkeypatch.setenv("SPCACHE_ALLOWED_HOSTS", "cache.internal, 127.0.0.1")
    settings = Settings(cache=cache.root, source_roots=[cache.sources], worker=False)
    assert settings.allowed_hosts == ["cache.internal", "127.0.0.1"]
    with served(settings) as server:
        assert _raw_get(server.port, f"cache.internal:{server.port}")[0] == 200
        assert _raw_get(server.port, "127.0.0.1")[0] == 200
        assert _raw_get(server.port, "localhost")[0] == 400  # no longer in the list
        assert _raw_get(server.port, None)[0] in (400,)
