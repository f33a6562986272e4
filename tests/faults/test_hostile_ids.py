"""Case 8: hostile sample ids in every route and CLI argument that takes one.

Ids: ``../x``, ``a/../../x``, ``/etc/passwd``, ``..\\x``, NUL, 600 bytes, Unicode dot and
slash look-alikes (ONE/TWO DOT LEADER, FULLWIDTH FULL STOP and SOLIDUS), bidi and
zero-width characters, an NFD id that NFKC folds into dots. In URL paths each is sent
raw (where HTTP allows the bytes at all), percent-encoded, and with its dots and slashes
as ``%2e``/``%2f`` (the server decodes a path once; ``%252e`` arrives as a literal
``%2e``, an ordinary character in an id).

Routes: record GET/HEAD (also with ``?fields=``), item state, batch, warm-up, and the
fingerprint segment of each. The service's store is wrapped in a spy that records every
call: a hostile id must be answered 4xx with no store call naming it (the batch route
answers per sample: the id is listed as ``InvalidSampleId`` and never looked up). CLI:
``spcache precompute`` over a JSON-lines manifest and a directory of look-alike file
names: each hostile id fails alone, the good sample is computed. Afterwards no file
exists outside the cache that was not there before.
"""

from __future__ import annotations

import json
import socket
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from cache_store.format.wire import decode_batch
from cache_store.stores.base import Store
from service.settings import Settings
from tests.conftest import REPO_ROOT
from tests.helpers.faults import report, served
from tests.helpers.procs import run_spcache
from tests.helpers.service import AUTH, TOKEN, build_cache

HOSTILE_IDS = [
    "../x",
    "a/../../x",
    "..",
    ".",
    "/etc/passwd",
    "..\\x",
    "a\\..\\..\\x",
    "x\x00y",
    "\x00",
    "a" * 600,
    "a/" * 300 + "b",
    "\u2024\u2024/x",
    "\u2025/x",
    "\uff0e\uff0e/x",
    "a\uff0fb/../x",
    "x/\u2024\u2024",
    "\u2024\u2025",
    "a/\u202eevil",
    "a\u200bb/../c",
    "x\n/../y",
    " ../x",
    "a//b",
    "a/",
    "",
    "\ud800",
    "a/\u0085b",
]


def _encodings(sample_id: str) -> list[tuple[str, bytes]]:
    """(how, path segment bytes) for a raw HTTP request line."""
    out = [("percent", quote(sample_id, safe="/", errors="surrogatepass").encode())]
    dots = sample_id.replace(".", "%2e").replace("/", "%2f").replace("\\", "%5c")
    out.append(("%2e%2f", quote(dots, safe="%", errors="surrogatepass").encode()))
    raw = sample_id.encode("utf-8", "surrogatepass")
    if all(0x21 <= b < 0x7F for b in raw):  # bytes HTTP allows in a request target
        out.append(("raw", raw))
    return out


def _raw_request(
    port: int, method: str, target: bytes, body: bytes = b"", headers: dict[str, str] | None = None
) -> int:
    """Send the request line exactly as given (clients would normalise ``..``)."""
    lines = [
        method.encode() + b" " + target + b" HTTP/1.1",
        b"Host: 127.0.0.1",
        b"Connection: close",
        f"Content-Length: {len(body)}".encode(),
    ]
    lines += [f"{k}: {v}".encode() for k, v in (headers or {}).items()]
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1])


class SpyStore(Store):
    """Forwards to a real store and records every call with its arguments."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner.location, readonly=True)
        self.inner = inner
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def _log(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))

    def get(self, key: str) -> bytes:
        self._log("get", key)
        return self.inner.get(key)

    def has(self, key: str) -> bool:
        self._log("has", key)
        return self.inner.has(key)

    def keys(self, prefix: str = "") -> Any:
        self._log("keys", prefix)
        return self.inner.keys(prefix)

    def put_many(self, items: Any) -> int:
        self._log("put_many")
        return self.inner.put_many(items)

    def put_index(self, index: Any) -> None:
        self._log("put_index")
        self.inner.put_index(index)

    def get_index(self, fingerprint: str) -> Any:
        self._log("get_index", fingerprint)
        return self.inner.get_index(fingerprint)

    def fingerprints(self) -> list[str]:
        self._log("fingerprints")
        return self.inner.fingerprints()

    def close(self) -> None:
        self.inner.close()


def _files(root: Path, skip: Path) -> set[Path]:
    return {p for p in root.rglob("*") if not p.is_relative_to(skip)}


@pytest.mark.slow
def test_hostile_ids_are_refused_before_any_store_call(tmp_path: Path) -> None:
    cache = build_cache(tmp_path, n=3)
    fp = cache.fingerprint
    before = _files(tmp_path, cache.root)
    repo_before = set(REPO_ROOT.iterdir())
    settings = Settings(cache=cache.root, source_roots=[cache.sources], token=TOKEN, worker=False)
    outcomes: Counter[str] = Counter()
    bad: list[str] = []
    with served(settings) as server, httpx.Client(base_url=server.url, timeout=20) as client:
        ctx = server.app.state.ctx
        spy = SpyStore(ctx.store())
        ctx._store = spy
        jobs_before = ctx.queue.counts()

        def check(what: str, status: int) -> None:
            looked_up = [c for c in spy.calls if c[0] in ("get", "has")]
            ok = 400 <= status < 500 and not looked_up
            if status == 307 and not looked_up and what.startswith("GET b'/v1/caches/"):
                # "/v1/caches/<id ending in '/'>": the framework redirects to the route
                # without the slash; nothing was read. Counted apart, not as a refusal.
                outcomes["fingerprint route: 307 to the slash-less route, no store call"] += 1
                spy.calls.clear()
                return
            outcomes["refused 4xx, no store call" if ok else f"FAILED {status}"] += 1
            if not ok:
                bad.append(f"{what}: {status} {looked_up[:2]}")
            spy.calls.clear()

        for sid in HOSTILE_IDS:
            for how, segment in _encodings(sid):
                for method, target in (
                    ("GET", b"/v1/caches/%s/records/%s" % (fp.encode(), segment)),
                    ("HEAD", b"/v1/caches/%s/records/%s" % (fp.encode(), segment)),
                    ("GET", b"/v1/caches/%s/records/%s?fields=octree" % (fp.encode(), segment)),
                    ("GET", b"/v1/caches/%s/items/%s" % (fp.encode(), segment)),
                    ("GET", b"/v1/caches/%s/records/%s" % (segment, cache.ids[0].encode())),
                    ("GET", b"/v1/caches/%s" % segment),
                ):
                    check(
                        f"{method} {target[:90]!r} ({how})",
                        _raw_request(server.port, method, target),
                    )
            # JSON bodies carry the id itself (as the decoded path would); json.dumps
            # escapes a lone surrogate as \ud800, which JSON allows.
            json_headers = {**AUTH, "Content-Type": "application/json"}
            response = client.post(
                "/v1/warmup",
                headers=json_headers,
                content=json.dumps(
                    {
                        "recipe": "spc",
                        "params": {"level": 4},
                        "items": [{"id": sid, "path": "shapes/s0.obj"}],
                    }
                ),
            )
            check(f"warmup {sid[:40]!r}", response.status_code)
            response = client.post(
                f"/v1/caches/{fp}/batch",
                headers=json_headers,
                content=json.dumps({"ids": [sid, cache.ids[0]]}),
            )
            found, missing = (
                decode_batch(response.content) if response.status_code == 200 else ({}, {})
            )
            looked_up = [
                c for c in spy.calls if c[0] in ("get", "has") and c[1][0] != f"{fp}/{cache.ids[0]}"
            ]
            listed = [
                why
                for got, why in missing.items()
                if got.encode("utf-8", "surrogatepass") == sid.encode("utf-8", "surrogatepass")
            ]
            ok = (
                response.status_code == 200
                and listed
                and "InvalidSampleId" in listed[0]
                and list(found) == [cache.ids[0]]
                and not looked_up
            ) or (400 <= response.status_code < 500 and not looked_up)
            outcomes["batch: refused per sample, no store call" if ok else "batch FAILED"] += 1
            if not ok:
                bad.append(f"batch {sid[:40]!r}: {response.status_code} {missing}")
            spy.calls.clear()
        jobs_after = ctx.queue.counts()
        ctx._store = spy.inner

    after = _files(tmp_path, cache.root)
    report(
        "8 hostile ids (service)",
        {
            "ids": len(HOSTILE_IDS),
            "requests": sum(outcomes.values()),
            "outcomes": dict(outcomes),
            "files_created_outside_cache": len(after - before),
        },
    )
    assert not bad, "\n".join(bad)
    assert jobs_after == jobs_before  # nothing was queued
    assert after == before and set(REPO_ROOT.iterdir()) == repo_before


@pytest.mark.slow
def test_hostile_ids_in_cli_manifests_fail_alone(tmp_path: Path) -> None:
    sources = tmp_path / "sources"
    sources.mkdir()
    good = sources / "good.obj"
    good.write_text("v 0 0 0\nv 1 0 0\nv 0 1 0\nv 0 0 1\nf 1 2 3\nf 1 2 4\nf 1 3 4\nf 2 3 4\n")
    usable = [s for s in HOSTILE_IDS if s and "\ud800" not in s]
    manifest = tmp_path / "items.jsonl"
    manifest.write_text(
        "".join(json.dumps({"id": s, "path": "sources/good.obj"}) + "\n" for s in usable)
        + json.dumps({"id": "fine/good", "path": "sources/good.obj"})
        + "\n"
    )
    looks = tmp_path / "looks"  # file names that are themselves look-alike ids
    looks.mkdir()
    for name in ("\u2024\u2024", "\uff0e\uff0e", "\u2025", "a\u200bb"):
        (looks / f"{name}.obj").write_text(good.read_text())
    cache = tmp_path / "cache"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    before = _files(tmp_path, cache)
    result = run_spcache(
        "precompute",
        manifest,
        looks,
        "--recipe",
        "spc",
        "--param",
        "level=3",
        "--param",
        "surface_samples=100",
        "--cache",
        cache,
        "--device",
        "cpu",
        "--backend",
        "torch",
        "--loaders",
        "0",
        "--json",
        cwd=workdir,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        inherit_env=False,
    )
    summary = json.loads(result.stdout)
    from cache_store.stores.lmdb import LMDBStore

    with LMDBStore(cache) as store:
        keys = list(store.keys())
    after = _files(tmp_path, cache)
    reasons = Counter("invalid sample id" in e["reason"] for e in summary["errors"])
    report(
        "8 hostile ids (CLI)",
        {
            "manifest_ids": len(usable) + 1,
            "look_alike_files": 4,
            "failed": summary["failed"],
            "done": summary["done"],
            "failed_as_invalid_sample_id": reasons[True],
            "records": len(keys),
            "files_created_outside_cache": len(after - before),
        },
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert summary["done"] == 1 and [k.split("/", 1)[1] for k in keys] == ["fine/good"]
    assert summary["failed"] == len(usable) + 4 == reasons[True]
    assert after == before and not any(workdir.iterdir())
