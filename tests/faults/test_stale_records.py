"""A read-through dataset never serves a record of other bytes than its source holds.

``CachedDataset(cache, recipe, sources=...)`` returned whatever record was stored under a
sample id: edit a source between epochs and epoch 2 trained on the old octree (nothing
queued); point a second source directory whose ids collide at the same cache and it read
the first directory's records. Now every read compares the record's stored stat
signature with its source (hashing only when that differs) and a stale record is a miss.

Against a real ``spcache worker`` subprocess and a persistent, forked DataLoader:

* epoch 1 computes every sample; one source is rewritten between epochs; epoch 2 answers
  the new source's record (it was queued again and recomputed), the others unchanged;
* a second directory whose ids collide gets its own files' records, and the first
  directory, read again, gets its own again;
* ``on_stale="error"`` raises ``StaleRecord`` naming the source; ``"serve"`` returns the
  stored record unchecked.

Figures: seconds for the stale sample's recompute, and the per-read cost of the check
(one ``open`` + ``fstat``) against ``on_stale="serve"``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cache_store import CachedDataset
from cache_store.errors import SpcacheError
from cache_store.format.header import read_metadata
from cache_store.keys import compute_fingerprint, record_key
from cache_store.recipes.registry import get_recipe_spec
from cache_store.sources.files import hash_source_file
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.faults import report
from tests.helpers.read_through import start_worker, stop_worker

PARAMS = {"level": 4, "surface_samples": 200}
IDS = ["a", "b", "c"]


def _cloud(path: Path, seed: int) -> None:
    np.save(path, np.random.default_rng(seed).uniform(-1, 1, size=(300, 3)))
    past = time.time() - 3600  # old enough for the stat signature to be trusted
    os.utime(path, (past + seed, past + seed))


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


def _epoch(loader: DataLoader) -> list[dict[str, torch.Tensor]]:
    return [sample for batch in loader for sample in batch]


def _stored_hash(cache: Path, sample_id: str) -> str:
    fp = compute_fingerprint(
        "spc", get_recipe_spec("spc").version, get_recipe_spec("spc").resolve(PARAMS)
    )
    store = LMDBStore(cache, readonly=True)
    try:
        key = record_key(fp, sample_id)
        return read_metadata(store.get(key), key=key)["source_hash"]
    finally:
        store.close()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_an_edited_or_colliding_source_is_recomputed_never_served_stale(tmp_path: Path) -> None:
    first, second, cache = tmp_path / "first", tmp_path / "second", tmp_path / "cache"
    first.mkdir()
    second.mkdir()
    for n, sid in enumerate(IDS):
        _cloud(first / f"{sid}.npy", n)
        _cloud(second / f"{sid}.npy", 100 + n)  # same ids, other shapes
    worker = start_worker(cache)
    try:
        ds = CachedDataset(cache, "spc", sources=first, miss_timeout=120, **PARAMS)
        loader = DataLoader(
            ds,
            batch_size=3,
            num_workers=2,
            persistent_workers=True,
            multiprocessing_context="fork",
            collate_fn=_as_list,
        )
        epoch1 = _epoch(loader)
        _cloud(first / "b.npy", 7)  # edited between epochs
        start = time.perf_counter()
        epoch2 = _epoch(loader)
        recompute_s = time.perf_counter() - start
        del loader
        assert _stored_hash(cache, "b") == hash_source_file(first / "b.npy"), (
            "epoch 2 did not recompute the edited source"
        )
        assert not _same(epoch1[1], epoch2[1]), "epoch 2 trained on the old octree"
        assert _same(epoch1[0], epoch2[0]) and _same(epoch1[2], epoch2[2])

        other = CachedDataset(cache, "spc", sources=second, miss_timeout=120, **PARAMS)
        from_second = [other[i] for i in range(len(IDS))]
        for sid in IDS:
            assert _stored_hash(cache, sid) == hash_source_file(second / f"{sid}.npy"), (
                f"{sid}: the second directory read the first directory's record"
            )
        again = CachedDataset(cache, "spc", sources=first, miss_timeout=120, **PARAMS)
        assert _same(again[1], epoch2[1]) and not _same(again[1], from_second[1])

        strict = CachedDataset(
            cache, "spc", sources=second, on_miss="error", on_stale="error", **PARAMS
        )
        with pytest.raises(SpcacheError, match="is stale") as info:
            strict[1]  # "b" holds the first directory's record again
        assert str(second / "b.npy") in str(info.value)
        lax = CachedDataset(
            cache, "spc", sources=second, on_miss="error", on_stale="serve", **PARAMS
        )
        assert _same(lax[1], again[1])  # served as stored, unchecked

        assert [_same(again[i], epoch2[i]) for i in range(len(IDS))] == [True] * len(IDS)
        checked = CachedDataset(cache, "spc", sources=first, on_miss="error", **PARAMS)
        reads = 1000
        timings = {}
        for name, ds_ in (
            (
                "serve",
                again.__class__(
                    cache, "spc", sources=first, on_miss="error", on_stale="serve", **PARAMS
                ),
            ),
            ("checked", checked),
        ):
            ds_[0]
            start = time.perf_counter()
            for n in range(reads):
                ds_[n % len(IDS)]
            timings[name] = (time.perf_counter() - start) / reads * 1e6
    finally:
        stop_worker(worker)
    report(
        "stale_records",
        {
            "recompute_epoch_s": round(recompute_s, 2),
            "read_us_serve": round(timings["serve"], 1),
            "read_us_checked": round(timings["checked"], 1),
        },
    )
