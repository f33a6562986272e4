"""Case 3: more concurrent readers than LMDB's reader table holds.

LMDB sizes the reader table by the largest ``max_readers`` any process asked for since
the lock file was created (a later opener asking for more grows it; the file outlives
the processes), so the test starts from a fresh lock file, every process here asks for
the same small table, and a helper process holds slots. Then:

* every slot held: every route that reads the store answers 503 with ``Retry-After``
  (never 500, never a hang), and forked DataLoader workers reading the cache directly
  fail at once with an error that names the reader table and what to do;
* the helper SIGKILLed (its slots now belong to a dead process): the next reader that
  finds the table full frees dead readers' slots itself, and the same requests and
  DataLoader answer again without any writer coming by;
* a small table under a storm of concurrent requests (more client threads than slots):
  only 200 or 503, and a retrying client (``HTTPStore``) gets every record byte-identical.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
import concurrent.futures as cf
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from cache_store.readers.dataset import CachedDataset
from cache_store.stores.http import HTTPStore
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.decode import decode_record
from service.settings import Settings
from tests.helpers.faults import Child, env_int, report, served
from tests.helpers.service import TOKEN, Cache, build_cache

SLOTS = 6
STORM_THREADS = env_int("SPCACHE_FAULT_READER_STORM_THREADS", 24)
STORM_REQUESTS = env_int("SPCACHE_FAULT_READER_STORM_REQUESTS", 400)


def _reads(cache: Cache) -> list[tuple[str, str, dict | None]]:
    fp, sid = cache.fingerprint, cache.ids[0]
    return [
        ("GET", f"/v1/caches/{fp}/records/{sid}", None),
        ("HEAD", f"/v1/caches/{fp}/records/{sid}", None),
        ("GET", f"/v1/caches/{fp}/records/{sid}?fields=octree", None),
        ("POST", f"/v1/caches/{fp}/batch", {"ids": cache.ids}),
        ("GET", f"/v1/caches/{fp}", None),
        ("GET", "/v1/caches", None),
        ("GET", f"/v1/caches/{fp}/items/{sid}", None),
        ("GET", "/metrics", None),
    ]


def _server(cache: Cache) -> Any:
    return served(
        Settings(
            cache=cache.root, source_roots=[cache.sources], token=TOKEN, worker=False, stats_ttl_s=0
        )
    )


def _load_all(dataset: CachedDataset) -> int:
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=2,
        num_workers=2,
        multiprocessing_context="fork",
        timeout=60,
        collate_fn=lambda batch: batch,
    )
    return sum(len(batch) for batch in loader)


@pytest.mark.slow
def test_a_full_reader_table_is_a_503_or_a_clear_error_never_a_500_or_a_hang(
    tmp_path: Path, children: list[Child]
) -> None:
    cache = build_cache(tmp_path, n=6)
    (cache.root / "records" / "lock.mdb").unlink()  # nobody has it open: a fresh table
    small = {"max_readers": SLOTS}
    # The service's store shares this process's environment: open it with the small table.
    pin = LMDBStore(cache.root, readonly=True, **small).open()
    holder = Child("hold-readers", str(cache.root), str(SLOTS), "--max-readers", str(SLOTS))
    children.append(holder)
    holder.expect("holding")

    full: dict[str, int] = {}
    with _server(cache) as server, httpx.Client(base_url=server.url, timeout=20) as client:
        for method, path, body in _reads(cache):
            response = client.request(method, path, json=body)
            full[f"{method} {path}"] = response.status_code
            if path == "/metrics":  # may leave the store's figures out rather than fail
                assert response.status_code in (200, 503), response.text
                continue
            assert response.status_code == 503, (method, path, response.text)
            assert response.headers["retry-after"] == "1"
            if method != "HEAD":
                assert "too many concurrent readers" in response.json()["detail"]
        holder.kill()  # its slots now belong to a dead process
        after = {f"{m} {p}": client.request(m, p, json=b).status_code for m, p, b in _reads(cache)}
    pin.close()

    dataset = CachedDataset(cache.root, cache.fingerprint, store_options=small)
    assert len(dataset) == len(cache.ids)  # index loaded before the table fills
    holder = Child("hold-readers", str(cache.root), str(SLOTS), "--max-readers", str(SLOTS))
    children.append(holder)
    holder.expect("holding")
    started = time.monotonic()
    with pytest.raises(Exception, match="reader table full") as excinfo:
        _load_all(dataset)
    failed_after_s = time.monotonic() - started
    holder.kill()
    with LMDBStore(cache.root, readonly=False, **small).open():  # a writer opening checks
        pass
    loaded = _load_all(dataset)
    report(
        "3a reader table full",
        {
            "slots": SLOTS,
            "routes": len(full),
            "statuses_while_full": dict(Counter(full.values())),
            "statuses_after_holder_killed": dict(Counter(after.values())),
            "dataloader_error": str(excinfo.value).splitlines()[-1][:200],
            "dataloader_failed_after_s": round(failed_after_s, 2),
            "loaded_after": loaded,
        },
    )
    assert set(after.values()) == {200}, after
    assert loaded == len(cache.ids)


@pytest.mark.slow
def test_more_concurrent_readers_than_slots_get_back_pressure(
    tmp_path: Path, children: list[Child]
) -> None:
    cache = build_cache(tmp_path, n=8)
    (cache.root / "records" / "lock.mdb").unlink()
    # Three slots, two of them held: concurrent reads contend for the last one.
    keeper = Child("hold-readers", str(cache.root), "2", "--max-readers", "3")
    children.append(keeper)
    keeper.expect("holding")
    statuses: Counter[int] = Counter()
    pin = LMDBStore(cache.root, readonly=True, max_readers=3).open()
    with _server(cache) as server:
        reads = _reads(cache)

        local = threading.local()

        def hammer(i: int) -> int:
            method, path, body = reads[i % 4]  # the record routes: the hot ones
            if not hasattr(local, "client"):
                local.client = httpx.Client(base_url=server.url, timeout=30)
                opened.append(local.client)
            return local.client.request(method, path, json=body).status_code

        opened: list[httpx.Client] = []
        with cf.ThreadPoolExecutor(STORM_THREADS) as pool:
            statuses.update(pool.map(hammer, range(STORM_REQUESTS)))
        for c in opened:
            c.close()
        client = HTTPStore(server.url, retries=20, backoff_s=0.05)
        keys = [f"{cache.fingerprint}/{sid}" for sid in cache.ids]
        with cf.ThreadPoolExecutor(STORM_THREADS) as pool:
            records = list(pool.map(lambda k: client.get_record(k), keys * 8))
        client.close()
    pin.close()
    report(
        "3b reader storm",
        {
            "slots": 3,
            "client_threads": STORM_THREADS,
            "requests": STORM_REQUESTS,
            "statuses": dict(statuses),
            "retrying_client_records_ok": len(records),
        },
    )
    assert set(statuses) <= {200, 503} and statuses[200], statuses
    for key, record in zip(keys * 8, records, strict=True):
        sid = key.split("/", 1)[1]
        expected = decode_record(cache.values[sid], key=key)
        assert all(torch.equal(record.tensors[n], t) for n, t in expected.tensors.items())
