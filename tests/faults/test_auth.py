"""Case 9: every mutating route refuses requests without the right bearer token.

The mutating routes are found from the app's OpenAPI schema (every POST/PUT/PATCH/DELETE
except the batch read, which is a POST only to carry its id list), so a route added later
is covered or fails this test. Each gets: no header, the wrong token, a prefix and an
extension of the token, the wrong scheme (Basic, Token, none), an empty token, the token
in a query parameter or a cookie instead, and two Authorization headers with the wrong
one first; with a valid body and with a body that would not validate (auth comes first:
no schema details leak). Figures: attempts and how many were answered 401/403 (must be
all), and that nothing was queued or cancelled meanwhile; the right token then works.
"""

from __future__ import annotations

import base64
import json
import socket
from dataclasses import dataclass
from collections import Counter
from pathlib import Path

import httpx
import pytest

from service.settings import Settings
from tests.helpers.faults import report, served
from tests.helpers.service import TOKEN, build_cache

# POSTs that read: a batch of records, the signed checksums of records a reader holds
READ_ONLY_POSTS = {"/v1/caches/{fingerprint}/batch", "/v1/caches/{fingerprint}/checksums"}


def _variants() -> list[tuple[str, list[tuple[str, str]], dict[str, str]]]:
    """(name, headers as a list (duplicates allowed), query params)."""
    basic = base64.b64encode(f"user:{TOKEN}".encode()).decode()
    return [
        ("no header", [], {}),
        ("wrong token", [("Authorization", "Bearer not-the-token")], {}),
        ("token prefix", [("Authorization", f"Bearer {TOKEN[:-1]}")], {}),
        ("token extended", [("Authorization", f"Bearer {TOKEN}x")], {}),
        ("basic scheme", [("Authorization", f"Basic {basic}")], {}),
        ("token scheme", [("Authorization", f"Token {TOKEN}")], {}),
        ("no scheme", [("Authorization", TOKEN)], {}),
        ("scheme glued", [("Authorization", f"Bearer{TOKEN}")], {}),
        ("empty token", [("Authorization", "Bearer ")], {}),
        ("bare scheme", [("Authorization", "Bearer")], {}),
        ("empty header", [("Authorization", "")], {}),
        ("token in query", [], {"token": TOKEN, "access_token": TOKEN}),
        ("token in cookie", [("Cookie", f"token={TOKEN}; access_token={TOKEN}")], {}),
        ("other header", [("X-Api-Key", TOKEN), ("X-Token", TOKEN)], {}),
        (
            "wrong first of two",
            [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {TOKEN}")],
            {},
        ),
    ]


@dataclass
class _Answer:
    status_code: int
    headers: dict[str, str]
    body: bytes


def _raw(
    port: int, method: str, target: str, headers: list[tuple[str, str]], body: bytes
) -> _Answer:
    """One request written byte for byte (duplicate and odd headers included)."""
    lines = [
        f"{method} {target} HTTP/1.1",
        "Host: 127.0.0.1",
        "Connection: close",
        f"Content-Length: {len(body)}",
    ]
    if body:
        lines.append("Content-Type: application/json")
    lines += [f"{k}: {v}" for k, v in headers]
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall("\r\n".join(lines).encode() + b"\r\n\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parsed = {}
    for line in header_lines:
        key, _, value = line.partition(":")
        parsed[key.strip().lower()] = value.strip()
    return _Answer(int(status_line.split()[1]), parsed, rest)


@pytest.mark.slow
def test_every_mutating_route_needs_the_token(tmp_path: Path) -> None:
    cache = build_cache(tmp_path, n=2)
    settings = Settings(cache=cache.root, source_roots=[cache.sources], token=TOKEN, worker=False)
    valid_warmup = {
        "recipe": "spc",
        "params": {"level": 4},
        "items": [{"id": "shapes/new", "path": "shapes/s0.obj"}],
    }
    with served(settings) as server, httpx.Client(base_url=server.url, timeout=20) as client:
        app, ctx = server.app, server.app.state.ctx
        job_id = ctx.queue.submit("spc", cache.params, cache.fingerprint, [("shapes/x", "/x.obj")])
        mutating = sorted(
            (method.upper(), path)
            for path, ops in app.openapi()["paths"].items()
            for method in ops
            if method in {"post", "put", "patch", "delete"} and path not in READ_ONLY_POSTS
        )
        assert ("POST", "/v1/warmup") in mutating and ("DELETE", "/v1/jobs/{job_id}") in mutating
        targets = {
            ("POST", "/v1/warmup"): [valid_warmup, {"recipe": 5, "nonsense": True}],
            ("DELETE", "/v1/jobs/{job_id}"): [None],
            ("DELETE", "/v1/caches/{fingerprint}"): [None],
        }
        unknown = set(mutating) - set(targets)
        assert not unknown, f"mutating routes this test does not know how to call: {unknown}"
        counts_before = ctx.queue.counts()
        statuses: Counter[int] = Counter()
        leaks: list[str] = []
        for (method, path), bodies in targets.items():
            url = path.replace("{job_id}", job_id).replace("{fingerprint}", cache.fingerprint)
            for body in bodies:
                for name, headers, params in _variants():
                    query = "&".join(f"{k}={v}" for k, v in params.items())
                    response = _raw(
                        server.port,
                        method,
                        url + ("?" + query if query else ""),
                        headers,
                        b"" if body is None else json.dumps(body).encode(),
                    )
                    statuses[response.status_code] += 1
                    if response.status_code not in (401, 403):
                        leaks.append(
                            f"{method} {url} {name} body={body}: "
                            f"{response.status_code} {response.body[:200]!r}"
                        )
                    elif response.status_code == 401:
                        assert response.headers.get("www-authenticate") == "Bearer"
        counts_after = ctx.queue.counts()
        still_there = client.get(f"/v1/caches/{cache.fingerprint}").status_code
        cancelled = ctx.queue.job(job_id).cancelled
        ok_warmup = client.post(
            "/v1/warmup", json=valid_warmup, headers={"Authorization": f"Bearer {TOKEN}"}
        ).status_code
        ok_cancel = client.delete(
            f"/v1/jobs/{job_id}", headers={"Authorization": f"bearer {TOKEN}"}
        ).status_code
    attempts = sum(statuses.values())
    report(
        "9 auth",
        {
            "mutating_routes": [" ".join(r) for r in mutating],
            "variants": len(_variants()),
            "attempts": attempts,
            "statuses": dict(statuses),
            "refused": statuses[401] + statuses[403],
            "queue_changed": counts_after != counts_before,
            "job_cancelled": cancelled,
            "with_token": {"warmup": ok_warmup, "cancel": ok_cancel},
        },
    )
    assert not leaks, "\n".join(leaks)
    assert counts_after == counts_before and not cancelled and still_there == 200
    assert ok_warmup == 202 and ok_cancel == 200
