"""Read routes do not amplify memory.

One GET of a 1.3 GB record took the service from 247 MiB to 5.2 GB RSS, and a batch of
256 copies of one id hit ``MemoryError``; no token is needed for either. Against a real
``spcache serve`` subprocess with a 16 MiB response limit and a 48 MiB read budget
(scaled down from the 256 MiB / 1 GiB defaults), its anonymous RSS (less file-backed
pages, i.e. the LMDB map) sampled every 10 ms:

* a record over the response limit: 413 naming the sizes, before any copy;
* a batch of 256 copies of one 6 MiB id: the id is sent once;
* a batch whose distinct records pass the response limit: 413;
* ``CONCURRENT`` GETs of 6 MiB records at once: each answered 200 or 503 (budget), none
  fails otherwise, and the peak growth stays under ``RSS_BUDGET_MIB`` (the 48 MiB budget
  plus the copies a response makes on its way out);
* ``?path=`` item state for a source over the hash limit: 422.

Figures: answers by status and the service's peak RSS growth.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from cache_store.keys import record_key
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.wire import decode_batch
from tests.helpers.faults import env_int, report
from tests.helpers.service import build_cache, make_record, start_server, stop_server

MIB = 1 << 20
CONCURRENT = env_int("SPCACHE_FAULT_CONCURRENT_READS", 24)
RSS_BUDGET_MIB = 80


class _PeakRSS:
    """Peak anonymous RSS (RSS less file-backed pages: the LMDB map's pages read by the
    service are page cache, not memory the service holds)."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.base = self._anon()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _anon(self) -> int:
        info = self.proc.memory_info()
        return info.rss - info.shared

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._anon())
            time.sleep(0.01)

    def __enter__(self) -> _PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    @property
    def growth_mib(self) -> float:
        return round((self.peak - self.base) / MIB, 1)


def test_read_routes_stay_within_their_byte_budgets(tmp_path: Path) -> None:
    cache = build_cache(tmp_path)
    store = LMDBStore(cache.root, readonly=False)
    fp = cache.fingerprint
    big = {"big/b0": 40 * MIB}
    mid = {f"mid/m{i}": 6 * MIB for i in range(4)}
    for i, (sid, nbytes) in enumerate({**big, **mid}.items()):
        store.put_many([(record_key(fp, sid), make_record(fp, sid, "xxh3_128:0", nbytes, i))])
    store.close()
    (cache.sources / "huge.obj").write_bytes(b"v 0 0 0\n" * (2 * MIB // 8 + 1))
    server = start_server(
        cache.root,
        cache.sources,
        "--no-worker",
        env={
            "SPCACHE_MAX_RESPONSE_BYTES": str(16 * MIB),
            "SPCACHE_MAX_READ_BYTES_IN_FLIGHT": str(48 * MIB),
            "SPCACHE_MAX_HASH_BYTES": str(MIB),
        },
    )
    answers: dict[str, object] = {}
    try:
        with _PeakRSS(server.proc.pid) as rss, httpx.Client(base_url=server.url, timeout=60) as c:
            too_big = c.get(f"/v1/caches/{fp}/records/big/b0")
            answers["big record"] = too_big.status_code
            repeated = c.post(f"/v1/caches/{fp}/batch", json={"ids": ["mid/m0"] * 256})
            answers["256 copies"] = repeated.status_code
            found, missing = decode_batch(repeated.content, where="test")
            over = c.post(f"/v1/caches/{fp}/batch", json={"ids": sorted(mid)})
            answers["4 x 6 MiB batch"] = over.status_code
            hashed = c.get(f"/v1/caches/{fp}/items/shapes/s0", params={"path": "huge.obj"})
            answers["huge ?path="] = hashed.status_code

            def get(i: int) -> int:
                return c.get(f"/v1/caches/{fp}/records/mid/m{i % 4}").status_code

            with cf.ThreadPoolExecutor(CONCURRENT) as pool:
                concurrent = Counter(pool.map(get, range(CONCURRENT)))
            answers["concurrent"] = dict(concurrent)
            after = c.get(f"/v1/caches/{fp}/records/mid/m1")
            answers["after"] = after.status_code
        growth = rss.growth_mib
    finally:
        stop_server(server)
    report(
        "read_amplification",
        {"answers": answers, "peak_rss_growth_mib": growth, "rss_budget_mib": RSS_BUDGET_MIB},
    )
    assert too_big.status_code == 413, too_big.text
    assert "over the 16777216-byte response limit" in too_big.json()["detail"]
    assert repeated.status_code == 200 and list(found) == ["mid/m0"] and not missing
    assert over.status_code == 413 and "ask for fewer ids" in over.text, over.text
    assert hashed.status_code == 422 and "over the per-source limit" in hashed.text, hashed.text
    assert set(concurrent) <= {200, 503} and concurrent[200] >= 1, concurrent
    assert after.status_code == 200 and len(after.content) > 5 * MIB
    assert growth < RSS_BUDGET_MIB, growth


def test_reads_past_the_process_budget_are_answered_503(tmp_path: Path) -> None:
    from service.settings import Settings
    from tests.helpers.faults import served

    cache = build_cache(tmp_path)
    settings = Settings(
        cache=cache.root, source_roots=[cache.sources], worker=False, max_read_bytes_in_flight=MIB
    )
    with served(settings) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        budget = server.app.state.ctx.read_budget
        record = f"/v1/caches/{cache.fingerprint}/records/{cache.ids[0]}"
        batch = f"/v1/caches/{cache.fingerprint}/batch"
        release = budget.reserve(MIB - 1024, "held by the test")  # others' answers in flight
        busy = c.get(record)
        busy_batch = c.post(batch, json={"ids": cache.ids})
        release()
        ok = c.get(record)
        ok_batch = c.post(batch, json={"ids": cache.ids})
        deadline = time.monotonic() + 5  # released just after each answer's last byte
        while budget.used and time.monotonic() < deadline:
            time.sleep(0.01)
        left = budget.used
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
    assert "read budget" in busy.json()["detail"]
    assert busy_batch.status_code == 503, busy_batch.text
    assert ok.status_code == 200 and ok.content == cache.values[cache.ids[0]]
    assert ok_batch.status_code == 200
    assert left == 0  # every answer released what it reserved
