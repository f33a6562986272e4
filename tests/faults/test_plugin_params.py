"""Issue 34, case 3: a recipe that changes its parameters, and "done" before the index.

* A plugin whose ``compute`` does ``params["level"] += 1`` changed the engine's own
  parameters: under the level=3 fingerprint the records were computed at levels 3, 4,
  5, ... and later runs skipped them as current. Recipes now get the parameters
  read-only (``ReadOnlyParams``): the attempt is that sample's failure, naming the
  recipe; nothing is stored under the fingerprint. Run through ``spcache precompute``
  and through a live ``spcache serve`` (its worker child), the plugin installed from a
  module on ``PYTHONPATH`` named in ``SPCACHE_RECIPES``.
* The worker completed the items a run reported done in a ``finally``, so a run whose
  index write then failed left its job reading "done 3/3" with the ids missing from the
  index. An item is now done only when its record and the index are committed; the
  failed run's items are an attempt, and the next attempt (their records skipped as
  current) writes the index and completes them. Real ``WorkerLoop``, LMDB and SQLite in
  this process, the index write failing twice.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import lmdb
import numpy as np
import pytest

from cache_store.errors import FingerprintLookupError
from cache_store.format.decode import decode_record
from cache_store.jobs.queue import JobQueue, NewItem
from cache_store.keys import compute_fingerprint
from cache_store.recipes.registry import get_recipe_spec
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.faults import report
from tests.helpers.plugins import install, use_here
from tests.helpers.procs import run_spcache, wait_for
from tests.helpers.service import AUTH, start_server, stop_server
from workers.worker_loop import WorkerLoop

IDS = ["c0", "c1", "c2"]


def _clouds(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    past = time.time() - 3600
    paths = []
    for n, sid in enumerate(IDS):
        path = folder / f"{sid}.npy"
        np.save(path, np.random.default_rng(n).uniform(-1, 1, size=(100 + n, 3)))
        os.utime(path, (past, past))
        paths.append(path)
    return paths


def _levels_stored(cache: Path, fp: str) -> dict[str, int]:
    store = LMDBStore(cache, readonly=True)
    try:
        out = {}
        for key in store.keys(fp + "/"):
            out[key.split("/", 1)[1]] = int(decode_record(store.get(key)).tensors["level"][0])
        return out
    finally:
        store.close()


@pytest.mark.slow
def test_a_recipe_cannot_change_the_parameters_of_its_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = tmp_path / "sources"
    paths = _clouds(sources)
    env = install(tmp_path / "plugins", "mutates")
    use_here(env, monkeypatch)
    spec = get_recipe_spec("mutates")
    fp = compute_fingerprint("mutates", spec.version, spec.resolve({"level": 3}))

    cli_cache = tmp_path / "cli-cache"
    ran = run_spcache(
        "precompute", sources, "--recipe", "mutates", "--param", "level=3",
        "--cache", cli_cache, "--device", "cpu", "--backend", "torch", "--loaders", "0",
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert ran.returncode == 1, ran.stderr
    assert _levels_stored(cli_cache, fp) == {}, "records stored under the level=3 fingerprint"
    failures = [line for line in ran.stderr.splitlines() if "compute() raised" in line]
    assert len(failures) == len(IDS), ran.stderr
    assert all("recipe 'mutates'" in f and "read-only" in f for f in failures), ran.stderr

    cache = tmp_path / "cache"
    server = start_server(cache, sources, "--device", "cpu", "--backend", "torch", env=env)
    jobs = []
    try:
        for _ in range(2):  # the second job runs on the worker's engine the first one used
            warm = httpx.post(
                f"{server.url}/v1/warmup",
                json={
                    "recipe": "mutates",
                    "params": {"level": 3},
                    "items": [{"id": p.stem, "path": str(p)} for p in paths],
                },
                headers=AUTH,
                timeout=60,
            )
            assert warm.status_code == 202, warm.text
            job = warm.json()["job_id"]

            def finished(job: str = job) -> dict | None:
                info = httpx.get(f"{server.url}/v1/jobs/{job}", timeout=30).json()
                return info if info["status"] in ("done", "failed", "done_with_errors") else None

            jobs.append(wait_for(finished, 180, f"job {job}", proc=server.proc))
    finally:
        stop_server(server)
    stored = _levels_stored(cache, fp)
    assert stored == {}, f"records computed at other levels under level=3: {stored}"
    for info in jobs:
        assert info["counts"]["failed"] == len(IDS), info
        reasons = [e["error"] for e in info["errors"]]
        assert all("recipe 'mutates'" in r and "read-only" in r for r in reasons), reasons
    report(
        "34.3 params mutated",
        {
            "precompute_records_under_fp": 0,
            "precompute_failed": len(IDS),
            "worker_jobs": len(jobs),
            "worker_failed_per_job": [info["counts"]["failed"] for info in jobs],
            "worker_records_under_fp": len(stored),
        },
    )


def test_an_item_is_done_only_once_its_index_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources, cache = tmp_path / "sources", tmp_path / "cache"
    paths = _clouds(sources)
    spec = get_recipe_spec("spc")
    params = spec.resolve({"level": 3, "surface_samples": 100})
    fp = compute_fingerprint("spc", spec.version, params)
    queue = JobQueue(cache, max_attempts=3)
    job = queue.submit("spc", params, fp, [NewItem(p.stem, str(p)) for p in paths])
    real_put_index = LMDBStore.put_index
    calls = {"n": 0}
    seen_done_without_index: list[str] = []

    def put_index(self: LMDBStore, index: object) -> None:
        calls["n"] += 1
        done = {r["sample_id"] for r in queue.items(job, status="done")}
        try:
            indexed = set(self.get_index(fp).sample_ids.tolist())
        except FingerprintLookupError:
            indexed = set()
        seen_done_without_index.extend(sorted(done - indexed))  # "done", not indexed: the bug
        if calls["n"] <= 2:
            raise lmdb.Error("mdb_put: simulated failure of the index write")
        real_put_index(self, index)

    monkeypatch.setattr(LMDBStore, "put_index", put_index)
    loop = WorkerLoop(cache, device="cpu", backend="torch", loaders=0, drain=True, batch=8)
    assert loop.run() == 0
    info = queue.job(job)
    rows = queue.items(job)
    store = LMDBStore(cache, readonly=True)
    try:
        indexed = set(store.get_index(fp).sample_ids.tolist())
    except FingerprintLookupError:
        indexed = set()
    finally:
        store.close()
    assert not seen_done_without_index, f"done before the index: {seen_done_without_index}"
    assert info.counts["done"] == len(IDS) and indexed == set(IDS), (info.counts, indexed)
    assert max(r["attempts"] for r in rows) >= 2  # a failed index write spent an attempt
    queue.close()
    report(
        "34.3 done only when indexed",
        {"index_write_failures": 2, "done": info.counts["done"], "indexed": len(indexed)},
    )
