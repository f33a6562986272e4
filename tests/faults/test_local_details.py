"""Strangers do not learn the cache path, the source roots or
worker ``host:pid`` ids.

Unauthenticated answers named the absolute cache directory (record not found), the
source roots (a path outside them) and worker ids (``/metrics``). They are kept for
trusted callers (the right bearer token, or a loopback client whose Host passed the
check) and replaced by ``<cache>``, ``<source-root>``, ``<worker>`` for anyone else.
Checked through the ASGI app with a remote client address, and against a real uvicorn
bound to all addresses, reached through a non-loopback address of this machine.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import pytest

from cache_store.jobs.queue import JobQueue
from service.app import create_app
from service.settings import Settings
from tests.helpers.faults import report
from tests.helpers.service import TOKEN, build_cache, start_server, stop_server

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _probes(fp: str) -> list[tuple[str, str]]:
    return [
        ("GET", f"/v1/caches/{fp}/records/no/such/sample"),
        ("GET", f"/v1/caches/{fp}/items/shapes/s0?path=/etc/hostname"),
        ("GET", f"/v1/caches/{fp}/items/shapes/s0?path=../../outside.obj"),
        ("GET", "/metrics"),
    ]


def _leaks(text: str, secrets: list[str]) -> list[str]:
    return [s for s in secrets if s in text]


async def _ask(
    app: object, client: tuple[str, int], headers: dict[str, str], fp: str
) -> dict[str, str]:
    transport = httpx.ASGITransport(app=app, client=client)  # type: ignore[arg-type]
    out = {}
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
        for method, path in _probes(fp):
            r = await c.request(method, path, headers=headers)
            out[path] = r.text
    return out


def test_remote_callers_get_redacted_answers(tmp_path: Path) -> None:
    cache = build_cache(tmp_path)
    worker = f"{socket.gethostname()}:424242"
    JobQueue(cache.root).heartbeat(worker)
    settings = Settings(cache=cache.root, source_roots=[cache.sources], token=TOKEN, worker=False)
    app = create_app(settings)
    secrets = [str(cache.root), str(cache.sources), worker]
    remote = asyncio.run(_ask(app, ("203.0.113.9", 40000), {}, cache.fingerprint))
    wrong = asyncio.run(
        _ask(app, ("203.0.113.9", 40000), {"Authorization": "Bearer x"}, cache.fingerprint)
    )
    authed = asyncio.run(_ask(app, ("203.0.113.9", 40000), AUTH, cache.fingerprint))
    local = asyncio.run(_ask(app, ("127.0.0.1", 40000), {}, cache.fingerprint))
    report(
        "local_details",
        {
            "remote_leaks": {p: _leaks(t, secrets) for p, t in remote.items()},
            "trusted_mentions": {p: _leaks(t, secrets) for p, t in local.items()},
        },
    )
    for answers in (remote, wrong):
        for path, text in answers.items():
            assert not _leaks(text, secrets), (path, text)
    assert "<cache>" in remote[_probes(cache.fingerprint)[0][1]]
    assert "<source-root>" in remote[_probes(cache.fingerprint)[1][1]]
    assert "<worker>" in remote["/metrics"]
    # trusted callers keep the details (they need them to act)
    for answers in (authed, local):
        assert str(cache.root) in answers[_probes(cache.fingerprint)[0][1]]
        assert str(cache.sources) in answers[_probes(cache.fingerprint)[1][1]]
        assert worker in answers["/metrics"]


def _outward_address() -> str | None:
    for target in ("10.255.255.255", "192.0.2.1", "198.51.100.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((target, 9))  # UDP: no packet is sent, a route is chosen
                addr = s.getsockname()[0]
            except OSError:
                continue
        if not addr.startswith("127."):
            return addr
    return None


def test_real_server_reached_from_a_non_loopback_address(tmp_path: Path) -> None:
    addr = _outward_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    cache = build_cache(tmp_path)
    server = start_server(cache.root, cache.sources, "--no-worker", "--host", "0.0.0.0")
    try:
        port = int(server.url.rsplit(":", 1)[1])
        url = f"http://{addr}:{port}"
        probe = f"/v1/caches/{cache.fingerprint}/records/no/such/sample"
        outside = httpx.get(url + probe, timeout=10)
        inside = httpx.get(server.url + probe, timeout=10)
        authed = httpx.get(url + probe, headers=AUTH, timeout=10)
    finally:
        stop_server(server)
    assert outside.status_code == inside.status_code == 404
    assert str(cache.root) not in outside.text and "<cache>" in outside.text, outside.text
    assert str(cache.root) in inside.text
    assert str(cache.root) in authed.text
