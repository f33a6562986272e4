"""Case 6: thousands of items enqueued per second while a worker claims.

Two submitter processes (the service's warm-up path: ``JobQueue.submit``) each enqueue
``RATE`` items per second in jobs of 100, while a claimer process does what the worker
loop does with the queue (claim 8 under a lease, complete each) until the queue is
drained. This process samples the WAL file's size meanwhile.

Figures: items submitted and the rate reached, "database is locked" errors surfaced
(must be 0: every write is ``BEGIN IMMEDIATE`` under a busy timeout), p50/p99/max claim
latency, the largest WAL size, and every item done.

A ``dedupe`` warm-up of 24k items through a live service queues every item as a plain
one does (it took 26.5 s against 3.5 s when ``JobQueue.enqueue_once`` compared each new
item with every one queued before it); figures: seconds for each, the ratio measured by
``bench/responsiveness.py --part dedupe``, not asserted here.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from cache_store.jobs.queue import JobQueue
from tests.helpers.faults import Child, env_float, env_int, report
from tests.helpers.service import AUTH, start_server, stop_server

RATE = env_int("SPCACHE_FAULT_QUEUE_RATE", 1500)  # per submitter; two submitters
SECONDS = env_float("SPCACHE_FAULT_QUEUE_SECONDS", 5.0)


@pytest.mark.slow
def test_enqueue_storm_while_claiming_never_surfaces_database_locked(
    tmp_path: Path, children: list[Child]
) -> None:
    cache = tmp_path / "cache"
    queue = JobQueue(cache)
    queue.counts()  # creates the schema before the storm
    wal = cache / "jobs.sqlite-wal"
    largest = [0]
    stop = threading.Event()

    def sample_wal() -> None:
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError):
                largest[0] = max(largest[0], wal.stat().st_size)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample_wal, daemon=True)
    sampler.start()
    claimer = Child("queue-claim", str(cache), str(SECONDS))
    submitters = [
        Child("queue-submit", str(cache), str(SECONDS), str(RATE), "100") for _ in range(2)
    ]
    children.extend([claimer, *submitters])
    subs = [json.loads(s.expect("{", timeout=SECONDS + 120)) for s in submitters]
    claim = json.loads(claimer.expect("{", timeout=SECONDS + 300))
    stop.set()
    sampler.join(5)
    counts = queue.counts()
    queue.close()
    submitted = sum(s["submitted"] for s in subs)
    figures = {
        "submitters": 2,
        "items_submitted": submitted,
        "submit_rate_items_per_s": round(sum(s["rate"] for s in subs)),
        "p99_submit_s": round(max(s["p99_submit_s"] for s in subs), 4),
        "claims": claim["claims"],
        "completed": claim["completed"],
        "database_locked_surfaced": sum(s["locked"] for s in subs) + claim["locked"],
        "p50_claim_s": round(claim["p50_claim_s"], 4),
        "p99_claim_s": round(claim["p99_claim_s"], 4),
        "max_claim_s": round(claim["max_claim_s"], 4),
        "largest_wal_bytes": largest[0],
        "done": counts["done"],
    }
    report("6 queue load", figures)
    assert figures["database_locked_surfaced"] == 0
    assert figures["submit_rate_items_per_s"] >= 1000  # thousands per second, really
    assert counts["done"] == submitted == claim["completed"]
    assert counts["pending"] == counts["running"] == 0
    assert largest[0] < 256 * 1024 * 1024


DEDUPE_ITEMS = 24_000


def test_a_dedupe_warm_up_of_many_items_queues_them_as_a_plain_one_does(tmp_path: Path) -> None:
    sources = tmp_path / "sources"
    sources.mkdir()
    for i in range(DEDUPE_ITEMS):
        (sources / f"s{i:05d}.xyz").write_bytes(b"0 0 0\n1 1 1\n")
    items = [
        {"id": f"s{i:05d}", "path": str(sources / f"s{i:05d}.xyz")} for i in range(DEDUPE_ITEMS)
    ]
    server = start_server(
        tmp_path / "cache", sources, "--no-worker", env={"SPCACHE_MAX_BODY_BYTES": str(16 << 20)}
    )
    try:
        seconds = {}
        for name, level in (("plain", 4), ("dedupe", 5)):  # two fingerprints: no reuse
            body = {
                "recipe": "spc",
                "params": {"level": level},
                "items": items,
                "dedupe": name == "dedupe",
            }
            start = time.perf_counter()
            r = httpx.post(f"{server.url}/v1/warmup", headers=AUTH, json=body, timeout=300)
            seconds[name] = time.perf_counter() - start
            assert r.status_code == 202, r.text[:300]
            assert r.json()["queued"] == DEDUPE_ITEMS
    finally:
        stop_server(server)
    report(
        "dedupe_warmup",
        {"items": DEDUPE_ITEMS, **{f"{k}_s": round(v, 2) for k, v in seconds.items()}},
    )


def _open_fresh_queue(cache: str, barrier: Any, errors: Any) -> None:
    barrier.wait(30)
    queue = JobQueue(cache)
    try:
        queue.live_workers()
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        errors.put(f"{type(exc).__name__}: {exc}")
    finally:
        queue.close()


def test_processes_opening_a_new_cache_at_once_never_see_database_locked(
    tmp_path: Path,
) -> None:
    """``spcache serve`` on a new cache: the service and its worker child open the job
    queue's fresh file at the same moment. Switching a fresh file to WAL needs it alone,
    and SQLite answered the loser "database is locked" at once, busy timeout or not (one
    pair in six; the CI run of stop 39 lost its supervisor thread to it). Forty pairs of
    real processes, released together by a barrier, each on a new cache."""
    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    for i in range(40):
        cache = tmp_path / f"cache{i}"
        barrier = ctx.Barrier(2)
        procs = [
            ctx.Process(target=_open_fresh_queue, args=(str(cache), barrier, errors))
            for _ in range(2)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(120)
            assert proc.exitcode == 0, f"pair {i}: a process ended with {proc.exitcode}"
    seen = []
    while not errors.empty():
        seen.append(errors.get(timeout=5))
    assert seen == [], f"{len(seen)} of 80 opens failed: {seen[:3]}"
