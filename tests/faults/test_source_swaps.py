"""Sources that change between the service's check and the
worker's read.

The service checks a warm-up path when the job is submitted; the worker reads the file
later. Here the file is then replaced: by a FIFO (a read that would never end), and by a
symbolic link to a file outside the worker's source roots. Each such sample must fail
alone with a reason naming it, the run must not hang, the good samples are computed, and
nothing outside the roots is read into the cache.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cache_store.keys import compute_fingerprint, record_key
from cache_store.jobs.queue import JobQueue, NewItem
from cache_store.stores.lmdb import LMDBStore
from cache_store.recipes.registry import get_recipe_spec
from tests.helpers.faults import report
from workers.engine import Engine
from workers.worker_loop import WorkerLoop

PARAMS = {"level": 4, "surface_samples": 200}


def _cloud(path: Path, seed: int, points: int = 300) -> Path:
    np.save(path, np.random.default_rng(seed).uniform(-1, 1, size=(points, 3)))
    return path


@pytest.fixture()
def tree(tmp_path: Path) -> tuple[Path, Path]:
    sources, outside = tmp_path / "sources", tmp_path / "outside"
    sources.mkdir()
    outside.mkdir()
    for i in range(3):
        _cloud(sources / f"good{i}.npy", i)
    _cloud(sources / "fifo.npy", 10)
    _cloud(sources / "swapped.npy", 11)
    _cloud(outside / "secret.npy", 12, points=100)  # 2,528 bytes
    return sources, outside


def _swap(sources: Path, outside: Path) -> None:
    """What happens after the service checked the paths."""
    (sources / "fifo.npy").unlink()
    os.mkfifo(sources / "fifo.npy")
    (sources / "swapped.npy").unlink()
    (sources / "swapped.npy").symlink_to(outside / "secret.npy")


def test_the_worker_refuses_a_fifo_and_a_link_swapped_out_of_its_roots(tree) -> None:
    sources, outside = tree
    cache = sources.parent / "cache"
    spec = get_recipe_spec("spc")
    resolved = spec.resolve(PARAMS)
    fp = compute_fingerprint("spc", spec.version, resolved)
    queue = JobQueue(cache)
    names = ["good0", "fifo", "good1", "swapped", "good2"]
    job_id = queue.submit(
        "spc", resolved, fp, [NewItem(n, str(sources / f"{n}.npy")) for n in names]
    )
    _swap(sources, outside)
    loop = WorkerLoop(
        cache, device="cpu", backend="torch", loaders=1, drain=True, source_roots=[sources]
    )
    finished = threading.Event()
    start = time.monotonic()
    worker = threading.Thread(target=lambda: (loop.run(), finished.set()), daemon=True)
    worker.start()
    assert finished.wait(120), "the worker hung on a hostile source"
    seconds = time.monotonic() - start
    info = queue.job(job_id)
    errors = {e.sample_id: e.error for e in info.errors}
    assert info.counts["done"] == 3 and info.counts["failed"] == 2, (info.counts, errors)
    assert "not a regular file (it is a FIFO)" in errors["fifo"]
    assert "outside the allowed source roots" in errors["swapped"]
    store = LMDBStore(cache)
    try:
        stored = {key.rsplit("/", 1)[1] for key in store.keys(fp)}
        assert stored == {"good0", "good1", "good2"}
        assert not store.has(record_key(fp, "swapped"))
    finally:
        store.close()
    queue.close()
    report("source_swaps", {"items": len(names), "failed_alone": 2, "wall_s": round(seconds, 2)})


def test_the_engine_refuses_a_fifo_and_an_oversized_source_alone(tree) -> None:
    sources, outside = tree
    _swap(sources, outside)
    items = [(p.stem, str(p)) for p in sorted(sources.glob("*.npy"))]
    with LMDBStore(sources.parent / "cache", readonly=False) as store:
        # 300 float64 points are 7,328 bytes with the .npy header: 4 KiB is too small
        summary = Engine(
            store, "spc", PARAMS, device="cpu", backend="torch", loaders=0, max_source_bytes=4096
        ).run(items)
    reasons = {e.id: e.reason for e in summary.errors}
    assert "not a regular file (it is a FIFO)" in reasons["fifo"]
    assert all("over the per-source limit of 4096 bytes" in reasons[f"good{i}"] for i in range(3))
    # no roots given: the link is followed, and its small target is read
    assert summary.done == 1 and "swapped" not in reasons
