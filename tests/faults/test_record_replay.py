"""A replayed record is refused by a reader holding the record key.

With ``SPCACHE_RECORD_KEY`` each record comes with a keyed tag binding it to its key and
checksum, so an older valid record of the same id, replayed with its own tag after the
record was recomputed, passed. Now a reader holding the key also asks the service for
the checksums of the records it holds now, signed together with a fresh nonce, and
refuses a record that is not one of them; a reader without the key in front of a keyed
service is told the records are signed.

A real service (in-process uvicorn) with a record key, behind a real replaying proxy
that answers the GET of one record with a response captured before that record was
recomputed (tag and all) and forwards everything else:

* the keyed reader refuses the replayed record, naming its key, and reads the others;
* once the proxy stops replaying, the same reader reads the new record;
* a reader without the key logs that the service signs its records.
"""

from __future__ import annotations

import http.server
import logging
import threading
from pathlib import Path

import httpx
import pytest

from cache_store.errors import CorruptRecord
from cache_store.format.tag import TAG_HEADER
from cache_store.keys import record_key
from cache_store.sources.files import hash_source_file
from cache_store.stores.http import HTTPStore
from cache_store.stores.lmdb import LMDBStore
from service.settings import Settings
from tests.helpers.faults import report
from tests.helpers.service import TOKEN, InProcessServer, build_cache, make_record

SECRET = "replay-test-key-0123456789abcdef"


class _ReplayingProxy:
    """Forwards to ``upstream``; answers a GET of ``path`` with a captured response."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.replay: dict[str, tuple[bytes, dict[str, str]]] = {}
        self.replayed = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _forward(self, method: str) -> None:
                if method == "GET" and self.path in proxy.replay:
                    body, headers = proxy.replay[self.path]
                    proxy.replayed += 1
                    self._answer(200, body, headers)
                    return
                length = int(self.headers.get("content-length") or 0)
                data = self.rfile.read(length) if length else None
                r = httpx.request(
                    method,
                    proxy.upstream + self.path,
                    content=data,
                    headers={
                        k: v
                        for k, v in self.headers.items()
                        if k.lower() not in ("host", "content-length")
                    },
                    timeout=30,
                )
                self._answer(r.status_code, r.content, dict(r.headers))

            def _answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    if name.lower() not in (
                        "content-length",
                        "transfer-encoding",
                        "connection",
                        "date",
                        "server",
                    ):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

            def do_HEAD(self) -> None:
                self._forward("HEAD")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _ReplayingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_replayed_record_with_its_valid_tag_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = build_cache(tmp_path)
    fp, target = cache.fingerprint, cache.ids[0]
    key = record_key(fp, target)
    path = f"/v1/caches/{fp}/records/{target}"
    settings = Settings(
        cache=cache.root, source_roots=[cache.sources], token=TOKEN, worker=False, record_key=SECRET
    )
    with InProcessServer(settings) as server, _ReplayingProxy(server.url) as proxy:
        old = httpx.get(server.url + path, timeout=30)
        assert old.status_code == 200 and old.headers.get(TAG_HEADER)
        source = cache.sources / "shapes" / "s0.obj"
        with LMDBStore(cache.root, readonly=False) as store:  # recomputed: a new record
            store.put_many([(key, make_record(fp, target, hash_source_file(source), seed=99))])
        proxy.replay[path] = (
            old.content,
            {"content-type": old.headers["content-type"], TAG_HEADER: old.headers[TAG_HEADER]},
        )

        keyed = HTTPStore(proxy.url, record_key=SECRET)
        with pytest.raises(CorruptRecord, match="replayed or stale") as info:
            keyed.get(key)
        assert key in str(info.value)
        others = [keyed.get(record_key(fp, sid)) for sid in cache.ids[1:]]
        assert len(others) == len(cache.ids) - 1
        proxy.replay.clear()
        fresh = keyed.get(key)
        assert fresh != old.content
        keyed.close()

        with caplog.at_level(logging.WARNING, logger="cache_store.stores.http"):
            keyless = HTTPStore(server.url)
            keyless.get(key)
            keyless.close()
        assert any("signs its records" in r.getMessage() for r in caplog.records)
    report(
        "record_replay",
        {
            "replayed": proxy.replayed,
            "refused": 1,
            "others_read": len(others),
            "keyless_told": True,
        },
    )
