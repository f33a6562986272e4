"""Child processes the fault suite starts, kills and watches.

Run as ``python -m tests.helpers.fault_children COMMAND ...`` from the repository root. Each
command is a small, real client of the project's code (``LMDBStore``, ``JobQueue``,
``WorkerLoop``); it reports on stdout, one line per event, flushed, so the test knows
what had happened when it sent SIGKILL. Nothing here imports torch unless asked to.

Commands:

``writer CACHE --batches B --size N --record-bytes K``
    Writes batches ``0..B-1`` of ``N`` records each, one ``put_many`` per batch, skipping
    batches already stored (the resume). Prints ``begin b`` right before a batch's
    ``put_many`` and ``committed b`` right after it returned.
``hold-readers CACHE N``
    Opens the cache read-only, begins ``N`` read transactions, prints ``holding N`` and
    sleeps until killed.
``read-loop CACHE SECONDS SEED``
    Reads and decodes random stored records until ``SECONDS`` pass; prints one JSON line
    ``{"reads": .., "errors": [..], "map_sizes": [..]}``.
``hold-view CACHE KEY SECONDS``
    Takes ``LMDBStore.read_view(KEY)`` and prints ``holding SHA256`` (of the viewed
    bytes); after a line on stdin (the test compacted or grew the cache meanwhile) reads
    the cache's other records for ``SECONDS``, prints ``retired-maps N`` (deleted LMDB data
    files it still maps), then ``view SHA256 reads N`` (the same bytes hashed again
    through the view), releases it and prints ``released retired-maps N``.
``worker-zygote CACHE LEASE BATCH [--max-attempts N]``
    Imports the worker stack once, then forks a real :class:`WorkerLoop` per ``spawn ID``
    line read from stdin and prints ``pid PID``; reaps children as they die.
``queue-submit CACHE SECONDS RATE PER_JOB``
    Submits ``RATE`` items per second in jobs of ``PER_JOB`` items; prints a JSON summary.
``queue-claim CACHE SECONDS``
    Claims (limit 8) and completes items until ``SECONDS`` pass and the queue is empty;
    prints a JSON summary with every claim's latency.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sqlite3
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cache_store.log_setup import configure_logging
from cache_store.keys import compute_fingerprint
from cache_store.recipes.registry import get_recipe_spec

__all__ = ["FAULT_CHILD", "FAULT_FINGERPRINT", "batch_key", "make_small_record", "main"]

log = logging.getLogger(__name__)

#: the command line that runs this module (give it to ``tests.helpers.procs.start``)
FAULT_CHILD = [sys.executable, "-m", "tests.helpers.fault_children"]

SPEC = get_recipe_spec("spc")
#: The fingerprint synthetic records are stored under (recipe ``spc``, level 3).
FAULT_FINGERPRINT = compute_fingerprint("spc", SPEC.version, SPEC.resolve({"level": 3}))


def batch_key(batch: int, i: int) -> str:
    return f"{FAULT_FINGERPRINT}/b{batch:04d}/r{i:05d}"


def make_small_record(key: str, nbytes: int, seed: int) -> bytes:
    """A valid record of about ``nbytes`` under ``key`` (NumPy only, deterministic)."""
    from cache_store.format.encode import encode_record

    fingerprint, sample_id = key.split("/", 1)
    rng = np.random.default_rng(seed)
    n = max(nbytes // 2, 8)
    return encode_record(
        {
            "octree": rng.integers(0, 255, n, dtype=np.uint8),
            "point_hierarchy": rng.integers(-8, 8, (max(n // 6, 1), 3), dtype=np.int16),
            "center": np.zeros(3, dtype=np.float32),
            "scale": np.ones((), dtype=np.float32),
        },
        {
            "recipe": "spc",
            "recipe_version": str(SPEC.version),
            "fingerprint": fingerprint,
            "sample_id": sample_id,
            "source_hash": f"xxh3_128:{seed:032x}",
            "backend": "torch",
            "device": "cpu",
            "created": "2026-01-01T00:00:00+00:00",
            "spcache_version": "0",
        },
    )


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- commands


def _writer(args: argparse.Namespace) -> int:
    from cache_store.stores.lmdb import LMDBStore

    store = LMDBStore(args.cache, readonly=False, map_size=args.map_size)
    for b in range(args.batches):
        if store.has(batch_key(b, 0)) and store.has(batch_key(b, args.size - 1)):
            continue  # committed by an earlier run: resume after it
        items = [
            (
                batch_key(b, i),
                make_small_record(batch_key(b, i), args.record_bytes, b * 100_000 + i),
            )
            for i in range(args.size)
        ]
        _say(f"begin {b}")
        store.put_many(items)
        _say(f"committed {b}")
    store.close()
    _say("finished")
    return 0


def _hold_readers(args: argparse.Namespace) -> int:
    from cache_store.stores.lmdb import LMDBStore

    store = LMDBStore(args.cache, readonly=True, max_readers=args.max_readers)
    env, _ = store.handle.environment()
    txns = [env.begin() for _ in range(args.n)]
    _say(f"holding {len(txns)}")
    while True:
        time.sleep(3600)


def _retired_maps() -> int:
    """Deleted LMDB data files this process still maps (generations a compaction swapped
    out and removed)."""
    with open("/proc/self/maps", encoding="utf-8") as fh:
        return len({line.split(None, 5)[-1] for line in fh if "data.mdb (deleted)" in line})


def _hold_view(args: argparse.Namespace) -> int:
    import hashlib

    from cache_store.stores.lmdb import LMDBStore, environment

    # Before issue 34 a swapped-out map was closed RETIRED_GRACE_S (60 s) after the swap
    # whether or not a view into it was in use. Zero makes any such rule fire within this
    # run; the view must stay readable for as long as it is held, whatever the clock says.
    environment.RETIRED_GRACE_S = 0.0  # (the constant is gone from the module now)
    store = LMDBStore(args.cache)
    held = store.read_view(args.key)
    value = held.__enter__()
    _say(f"holding {hashlib.sha256(value).hexdigest()}")
    sys.stdin.readline()
    reads = 0
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        for key in store.keys(args.key.split("/")[0] + "/"):
            if key != args.key:
                store.get(key)
                reads += 1
        time.sleep(0.05)
    _say(f"retired-maps {_retired_maps()}")
    _say(f"view {hashlib.sha256(value).hexdigest()} reads {reads}")
    held.__exit__(None, None, None)
    _say(f"released retired-maps {_retired_maps()}")
    return 0


def _read_loop(args: argparse.Namespace) -> int:
    from cache_store.errors import RecordNotFound
    from cache_store.stores.lmdb import LMDBStore
    from cache_store.format.decode import decode_arrays

    rng = random.Random(args.seed)
    store = LMDBStore(args.cache, readonly=True)
    reads, errors, sizes = 0, [], set()
    keys: list[str] = []
    _say("ready")
    deadline = time.monotonic() + args.seconds
    refreshed = 0.0
    while time.monotonic() < deadline:
        try:
            if time.monotonic() - refreshed > 0.5 or not keys:
                keys = list(store.keys(FAULT_FINGERPRINT + "/"))
                refreshed = time.monotonic()
                env, _ = store.handle.environment()
                sizes.add(env.info()["map_size"])
            if not keys:
                time.sleep(0.01)
                continue
            key = rng.choice(keys)
            arrays, meta = decode_arrays(store.get(key), key=key)
            if meta["sample_id"] != key.split("/", 1)[1] or arrays["octree"].size == 0:
                errors.append(f"{key}: wrong content")
            reads += 1
        except RecordNotFound as exc:  # keys only ever get added here: this is a failure
            errors.append(f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
            errors.append(f"{type(exc).__name__}: {exc}")
    _say(
        json.dumps(
            {
                "reads": reads,
                "errors": errors[:20],
                "error_count": len(errors),
                "map_sizes": sorted(sizes),
            }
        )
    )
    return 0


def _worker_zygote(args: argparse.Namespace) -> int:
    import torch

    import workers.engine  # noqa: F401 - imported once here, inherited by every fork
    from workers.worker_loop import WorkerLoop

    torch.set_num_threads(1)
    children: set[int] = set()
    _say("ready")
    for line in sys.stdin:
        for pid in list(children):  # reap the killed ones
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "quit":
            break
        worker_id = parts[1]
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                sys.stdin.close()
                loop = WorkerLoop(
                    args.cache,
                    device="cpu",
                    backend="torch",
                    batch=args.batch,
                    lease_s=args.lease,
                    poll_s=0.05,
                    loaders=0,
                    max_attempts=args.max_attempts,
                    worker_id=worker_id,
                )
                code = loop.run()
            finally:
                os._exit(code)
        children.add(pid)
        _say(f"pid {pid}")
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        except ProcessLookupError:
            pass
    return 0


def _queue_submit(args: argparse.Namespace) -> int:
    from cache_store.jobs.queue import JobQueue, NewItem

    queue = JobQueue(args.cache)
    params = SPEC.resolve({"level": 3})
    start = time.monotonic()
    submitted, locked, jobs = 0, 0, 0
    latencies = []
    while time.monotonic() - start < args.seconds:
        due = int((time.monotonic() - start) * args.rate)
        if submitted >= due:
            time.sleep(0.002)
            continue
        items = [
            NewItem(f"j{jobs:05d}/s{i:04d}", f"/nonexistent/{jobs}/{i}.obj")
            for i in range(args.per_job)
        ]
        t0 = time.perf_counter()
        try:
            queue.submit("spc", params, FAULT_FINGERPRINT, items)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc):
                locked += 1
                continue
            raise
        latencies.append(time.perf_counter() - t0)
        submitted += args.per_job
        jobs += 1
    elapsed = time.monotonic() - start
    _say(
        json.dumps(
            {
                "submitted": submitted,
                "jobs": jobs,
                "locked": locked,
                "seconds": elapsed,
                "rate": submitted / elapsed,
                "p99_submit_s": float(np.percentile(latencies, 99)) if latencies else 0.0,
            }
        )
    )
    return 0


def _queue_claim(args: argparse.Namespace) -> int:
    from cache_store.jobs.queue import JobQueue

    queue = JobQueue(args.cache)
    start = time.monotonic()
    latencies, completed, locked, empty_after = [], 0, 0, None
    worker = f"claimer:{os.getpid()}"
    while True:
        t0 = time.perf_counter()
        try:
            claimed = queue.claim(worker, limit=8, lease_s=60)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc):
                locked += 1
                continue
            raise
        latencies.append(time.perf_counter() - t0)
        for item in claimed:
            queue.complete(worker, item.item_id)
            completed += 1
        if not claimed:
            if time.monotonic() - start > args.seconds:
                if empty_after is None:
                    empty_after = time.monotonic()
                elif time.monotonic() - empty_after > 0.5:
                    break
            time.sleep(0.001)
        else:
            empty_after = None
    _say(
        json.dumps(
            {
                "claims": len(latencies),
                "completed": completed,
                "locked": locked,
                "p50_claim_s": float(np.percentile(latencies, 50)),
                "p99_claim_s": float(np.percentile(latencies, 99)),
                "max_claim_s": float(max(latencies)),
            }
        )
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.fault_children")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("writer")
    p.add_argument("cache", type=Path)
    p.add_argument("--batches", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--record-bytes", type=int, default=1024)
    p.add_argument("--map-size", type=int, default=1 << 26)
    p.set_defaults(func=_writer)
    p = sub.add_parser("hold-readers")
    p.add_argument("cache", type=Path)
    p.add_argument("n", type=int)
    p.add_argument("--max-readers", type=int, default=1024)
    p.set_defaults(func=_hold_readers)
    p = sub.add_parser("read-loop")
    p.add_argument("cache", type=Path)
    p.add_argument("seconds", type=float)
    p.add_argument("seed", type=int)
    p.set_defaults(func=_read_loop)
    p = sub.add_parser("hold-view")
    p.add_argument("cache", type=Path)
    p.add_argument("key")
    p.add_argument("seconds", type=float)
    p.set_defaults(func=_hold_view)
    p = sub.add_parser("worker-zygote")
    p.add_argument("cache", type=Path)
    p.add_argument("lease", type=float)
    p.add_argument("batch", type=int)
    p.add_argument("--max-attempts", type=int, default=3)
    p.set_defaults(func=_worker_zygote)
    p = sub.add_parser("queue-submit")
    p.add_argument("cache", type=Path)
    p.add_argument("seconds", type=float)
    p.add_argument("rate", type=float)
    p.add_argument("per_job", type=int)
    p.set_defaults(func=_queue_submit)
    p = sub.add_parser("queue-claim")
    p.add_argument("cache", type=Path)
    p.add_argument("seconds", type=float)
    p.set_defaults(func=_queue_claim)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging(logging.WARNING)  # spcache's own set-up and line format
    args = _parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
