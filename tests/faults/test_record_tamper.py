"""Records over HTTP are bound to their key.

A tampering proxy (a real uvicorn serving a small ASGI app in front of a real service)
either *swaps* records (answers sample A with sample B's record, tag and all) or
*alters* them (changes a tensor and re-encodes: every checksum in the record is valid
again; it keeps the service's tag, having no secret to make a new one). Readers go
through ``HTTPStore`` single GETs (``get``, ``get_record``) and batches
(``get_records``). Wanted: every swap detected (key binding, always on), and with a
shared record key every alteration detected too: 0 undetected.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cache_store.errors import CorruptRecord
from cache_store.stores.http import HTTPStore
from cache_store.format.decode import decode_arrays
from cache_store.format.encode import encode_tensors
from cache_store.format.tag import TAG_HEADER
from cache_store.format.wire import decode_batch, encode_batch
from service.settings import Settings
from tests.helpers.faults import report
from tests.helpers.service import TOKEN, Cache, InProcessServer, build_cache

SECRET = "a-shared-record-key-0123456789"


def _alter(value: bytes) -> bytes:
    arrays, meta = decode_arrays(value)
    arrays["center"] = arrays["center"] + 1.0  # a plausible, wrong record
    for name in ("format_version", "field_checksums", "checksum"):  # recomputed
        meta.pop(name, None)
    # naming the same descriptor as the record it replaces: only its tensors differ
    return encode_tensors(arrays, meta, descriptor=meta.pop("descriptor"))


class TamperProxy:
    """ASGI app forwarding to ``upstream``; rewrites record answers per ``mode``."""

    def __init__(self, upstream: str, ids: list[str], fingerprint: str) -> None:
        self.upstream = upstream
        self.ids = ids
        self.fingerprint = fingerprint
        self.mode = "swap"

    def _other(self, sid: str) -> str:
        return self.ids[(self.ids.index(sid) + 1) % len(self.ids)]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        prefix = f"/v1/caches/{self.fingerprint}/records/"
        if path.startswith(prefix) and self.mode == "swap":
            path = prefix + self._other(path[len(prefix) :])
        query = scope["query_string"].decode()
        async with httpx.AsyncClient(base_url=self.upstream) as client:
            answer = await client.request(
                scope["method"],
                path + (f"?{query}" if query else ""),
                content=body,
                headers={
                    k.decode(): v.decode()
                    for k, v in scope["headers"]
                    if k not in (b"host", b"content-length")
                },
            )
        content, headers = answer.content, dict(answer.headers)
        if answer.status_code == 200 and path.startswith(prefix) and self.mode == "alter":
            content = _alter(content)
        if answer.status_code == 200 and path.endswith("/batch") and self.mode != "pass":
            tags: dict[str, str] = {}
            found, missing = decode_batch(content, tags=tags)
            order = list(found)
            if self.mode == "swap":  # each id gets the next one's record and tag
                pairs = [
                    (sid, bytes(found[order[(i + 1) % len(order)]])) for i, sid in enumerate(order)
                ]
                new_tags = [tags.get(order[(i + 1) % len(order)], "") for i in range(len(order))]
            else:
                pairs = [(sid, _alter(bytes(found[sid]))) for sid in order]
                new_tags = [tags.get(sid, "") for sid in order]
            content = encode_batch(
                pairs,
                [(k, *v.split(": ", 1)) for k, v in missing.items()],
                new_tags if tags else None,
            )
        headers.pop("content-length", None)
        headers.pop("content-encoding", None)
        await send(
            {
                "type": "http.response.start",
                "status": answer.status_code,
                "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
            }
        )
        await send({"type": "http.response.body", "body": content})


@pytest.fixture
def tampered(tmp_path: Path) -> Iterator[tuple[Cache, TamperProxy, str]]:
    cache = build_cache(tmp_path, n=8)
    settings = Settings(
        cache=cache.root, source_roots=[cache.sources], token=TOKEN, worker=False, record_key=SECRET
    )
    with InProcessServer(settings) as service:
        proxy = TamperProxy(service.url, cache.ids, cache.fingerprint)
        with InProcessServer(None, app=proxy) as front:
            yield cache, proxy, front.url


def _attempts(store: HTTPStore, cache: Cache) -> Iterator[tuple[str, Any]]:
    keys = [f"{cache.fingerprint}/{sid}" for sid in cache.ids]
    for key in keys:
        yield "get", lambda key=key: store.get(key)
        yield "get_record", lambda key=key: store.get_record(key)
        yield "get_record_fields", lambda key=key: store.get_record(key, ["center", "scale"])
    yield "get_records", lambda: store.get_records(keys)


def test_a_tampering_proxy_is_always_detected(tampered: tuple[Cache, TamperProxy, str]) -> None:
    cache, proxy, url = tampered
    figures: dict[str, Any] = {}
    keyed = HTTPStore(url, record_key=SECRET, retries=0)
    plain = HTTPStore(url, retries=0)
    # through the proxy, untouched: both readers read everything (no false alarms)
    proxy.mode = "pass"
    for _, attempt in _attempts(keyed, cache):
        attempt()
    first = f"{cache.fingerprint}/{cache.ids[0]}"
    assert keyed.get(first) == cache.values[cache.ids[0]]
    for mode, readers in (
        ("swap", (("plain", plain), ("keyed", keyed))),
        ("alter", (("keyed", keyed),)),
    ):
        proxy.mode = mode
        for name, store in readers:
            tried = undetected = 0
            for what, attempt in _attempts(store, cache):
                tried += 1
                try:
                    attempt()
                except CorruptRecord as exc:
                    assert cache.fingerprint in str(exc)
                else:
                    undetected += 1
            figures[f"{mode}_{name}_tried"] = tried
            figures[f"{mode}_{name}_undetected"] = undetected
    # without a key, an altered and re-checksummed record cannot be told apart (stated)
    proxy.mode = "alter"
    plain.get_record(first)
    # a keyed reader refuses answers without a tag (a service without the key)
    proxy.mode = "pass"
    response = httpx.get(f"{url}/v1/caches/{cache.fingerprint}/records/{cache.ids[0]}")
    assert len(response.headers[TAG_HEADER]) == 64
    keyed.close()
    plain.close()
    report("record_tamper", figures)
    assert figures["swap_plain_undetected"] == 0
    assert figures["swap_keyed_undetected"] == 0
    assert figures["alter_keyed_undetected"] == 0
    assert figures["alter_keyed_tried"] == figures["swap_keyed_tried"] > 20


def test_a_keyed_reader_refuses_an_untagged_record(tmp_path: Path) -> None:
    cache = build_cache(tmp_path, n=2)
    settings = Settings(cache=cache.root, source_roots=[cache.sources], token=TOKEN, worker=False)
    with InProcessServer(settings) as service:
        keyed = HTTPStore(service.url, record_key=SECRET, retries=0)
        with pytest.raises(CorruptRecord, match="no record tag"):
            keyed.get_record(f"{cache.fingerprint}/{cache.ids[0]}")
        with pytest.raises(CorruptRecord, match="no record tag"):
            keyed.get_records([f"{cache.fingerprint}/{i}" for i in cache.ids])
        keyed.close()
