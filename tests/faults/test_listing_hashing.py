"""Listing samples must not hash every source in full.

``GET /v1/caches/{fp}/samples`` (no token; the status page polls it) must not hash the
whole source of every listed sample (with 512 MB sources: 10 GB read per request). A
record carries its source's stat signature and the listing compares that first; only a
source whose signature changed is hashed, within ``max_listing_hash_bytes`` per request
(the rest are listed ``unchecked``).

Against a real ``spcache serve`` subprocess over ``SAMPLES`` records whose sources are
``SOURCE_MIB`` MiB each, the bytes the service process reads (``/proc/<pid>/io``
``rchar``: every ``read()``, page cache included) per listing request:

* nothing changed: under 1 MiB (the queue's SQLite pages; no source byte);
* ``CHANGED`` sources rewritten with the listing budget at two sources' worth: exactly
  two are hashed (``stale``), the others ``unchecked``, and the request reads at most
  the budget plus 1 MiB.

Figures: bytes read per request in both cases, and its time.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from cache_store.jobs.queue import JobQueue, NewItem
from cache_store.keys import compute_fingerprint, record_key
from cache_store.recipes.registry import get_recipe_spec
from cache_store.sources.files import hash_source_file, signature_of
from cache_store.format.encode import encode_record
from cache_store.format.index import DatasetIndex
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.faults import env_int, report
from tests.helpers.service import start_server, stop_server

MIB = 1 << 20
SAMPLES = env_int("SPCACHE_FAULT_LISTING_SAMPLES", 12)
SOURCE_MIB = env_int("SPCACHE_FAULT_LISTING_SOURCE_MIB", 8)
CHANGED = 4


def _signature(path: Path) -> str:
    """What the worker stores as ``source_stat`` (the gate's one rule)."""
    return signature_of(os.stat(path))


def _record(fp: str, sid: str, path: Path) -> bytes:
    import torch

    return encode_record(
        {"octree": torch.zeros(64, dtype=torch.uint8)},
        {
            "recipe": "spc",
            "recipe_version": "1",
            "fingerprint": fp,
            "sample_id": sid,
            "source_hash": hash_source_file(path),
            "source_stat": _signature(path),
            "backend": "torch",
            "device": "cpu",
        },
    )


def _read_chars(pid: int) -> int:
    return psutil.Process(pid).io_counters().read_chars


def test_listing_compares_signatures_and_hashes_within_a_budget(tmp_path: Path) -> None:
    sources, cache = tmp_path / "sources", tmp_path / "cache"
    sources.mkdir()
    spec = get_recipe_spec("spc")
    params = spec.resolve({"level": 4})
    fp = compute_fingerprint("spc", spec.version, params)
    rng = np.random.default_rng(0)
    paths = {}
    past = time.time() - 3600  # older than the racy window: signatures are trusted
    for i in range(SAMPLES):
        path = sources / f"s{i:02d}.obj"
        path.write_bytes(rng.bytes(SOURCE_MIB * MIB))
        os.utime(path, (past, past))
        paths[f"s{i:02d}"] = path
    store = LMDBStore(cache, readonly=False)
    store.put_many([(record_key(fp, sid), _record(fp, sid, p)) for sid, p in paths.items()])
    store.put_index(DatasetIndex(fp, "spc", spec.version, params, np.array(list(paths))))
    store.close()
    queue = JobQueue(cache)
    queue.submit("spc", params, fp, [], ready=[NewItem(s, str(p)) for s, p in paths.items()])
    queue.close()

    budget = 2 * SOURCE_MIB * MIB
    server = start_server(
        cache, sources, "--no-worker", env={"SPCACHE_MAX_LISTING_HASH_BYTES": str(budget)}
    )
    try:
        url = f"{server.url}/v1/caches/{fp}/samples"

        def listing() -> tuple[dict[str, str], int, float]:
            before = _read_chars(server.proc.pid)
            start = time.perf_counter()
            r = httpx.get(url, params={"limit": 500}, timeout=120)
            took = time.perf_counter() - start
            assert r.status_code == 200, r.text
            return (
                {s["sample_id"]: s["state"] for s in r.json()["samples"]},
                _read_chars(server.proc.pid) - before,
                took,
            )

        listing()  # the first request warms up imports and connections
        states, unchanged_read, unchanged_s = listing()
        assert set(states.values()) == {"ready"}, states
        assert unchanged_read < MIB, f"an unchanged listing read {unchanged_read} bytes"

        for sid in list(paths)[:CHANGED]:
            paths[sid].write_bytes(rng.bytes(SOURCE_MIB * MIB))
            os.utime(paths[sid], (past + 60, past + 60))
        states, changed_read, changed_s = listing()
        changed = [states[s] for s in list(paths)[:CHANGED]]
        assert sorted(changed) == ["stale", "stale", "unchecked", "unchecked"], states
        assert all(states[s] == "ready" for s in list(paths)[CHANGED:]), states
        assert changed_read <= budget + MIB, f"a listing read {changed_read} bytes"
    finally:
        stop_server(server)
    report(
        "listing_hashing",
        {
            "samples": SAMPLES,
            "source_mib": SOURCE_MIB,
            "unchanged_bytes_read": unchanged_read,
            "unchanged_s": round(unchanged_s, 3),
            "changed": CHANGED,
            "budget_bytes": budget,
            "changed_bytes_read": changed_read,
            "changed_s": round(changed_s, 3),
            "before_fix_bytes_per_listing": SAMPLES * SOURCE_MIB * MIB,
        },
    )
