"""``--engine ray`` into a sharded snapshot: every actor writes its own committed parts to
a local directory or to S3 (moto's real S3 HTTP API on 127.0.0.1); the driver writes no
record bytes, only the merged index.

One Ray instance and one S3 server for the module; small runs (two CPU actors).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cache_store import CachedDataset
from cache_store.snapshot.sharded import ShardedSnapshot, merge
from cache_store.stores.opener import open_store
from tests.helpers.ray_cluster import local_ray
from tests.helpers.ray_faults import CrashOnce
from tests.helpers.s3 import S3Server, moto_s3
from workers.engine import Engine
from workers.ray_engine import RayEngine

PARAMS = {"level": 5, "surface_samples": 2000, "uniform_queries": 500, "surface_queries": 500}
RAY_OPTIONS = dict(device="cpu", backend="torch", loaders=0, actors=2)


def _items(paths: list[Path]) -> list[tuple[str, str]]:
    return [(p.stem, str(p)) for p in paths]


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with moto_s3() as server:
        yield server


@pytest.fixture(scope="module")
def ray_local(s3: S3Server) -> Iterator[Any]:  # after the S3 server: actors inherit its env
    with local_ray() as ray:
        yield ray


@pytest.fixture(scope="module")
def sources(corpus_meshes: list[Path], corpus_bad_inputs: list[Path]) -> list[Path]:
    return corpus_meshes[:6] + corpus_bad_inputs[:2]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, sources: list[Path]):
    """The same sources through the local engine into an LMDB cache."""
    cache = tmp_path_factory.mktemp("local") / "cache"
    with open_store(cache, readonly=False) as store:
        summary = Engine(store, "spc_query", PARAMS, device="cpu", backend="torch", loaders=0).run(
            _items(sources)
        )
    return cache, summary


def _options(s3: S3Server) -> dict[str, Any]:
    return {"endpoint_url": s3.endpoint, "key": "testing", "secret": "testing"}


def _dest(kind: str, tmp_path: Path, s3: S3Server) -> tuple[str, dict[str, Any]]:
    if kind == "local":
        return str(tmp_path / "snap.zarr"), {}
    return f"s3://{s3.new_bucket()}/runs/snap.zarr", _options(s3)


def _samples(location: str, fingerprint: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    ds = CachedDataset(
        location,
        fingerprint,
        store_options={"storage_options": storage_options} if storage_options else None,
    )
    return {ds.sample_id(i): ds[i] for i in range(len(ds))}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _manifest_counts(store: ShardedSnapshot, fingerprint: str) -> Counter[str]:
    """How many committed manifests list each sample id (duplicates included)."""
    counts: Counter[str] = Counter()
    for part in store.commit_names(fingerprint):  # test reads the raw layout
        raw = store.fs.cat_file(f"{store.root}/{fingerprint}/commits/{part}.json")
        counts.update(row[0] for row in json.loads(raw)["records"])
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_two_actors_write_their_own_parts_and_readers_get_the_local_engines_tensors(
    ray_local, s3: S3Server, tmp_path: Path, sources: list[Path], reference, kind: str
) -> None:
    location, storage_options = _dest(kind, tmp_path, s3)
    with ShardedSnapshot(location, readonly=False, storage_options=storage_options) as store:
        engine = RayEngine(store, "spc_query", PARAMS, shard_size=2, write_batch=2, **RAY_OPTIONS)
        summary = engine.run(_items(sources))
    ref_cache, ref_summary = reference
    fp = summary.fingerprint
    assert fp == ref_summary.fingerprint
    assert (summary.done, summary.failed) == (ref_summary.done, ref_summary.failed)
    assert summary.write_s == 0  # the driver wrote no record
    with open_store(location, storage_options=storage_options) as snap:
        assert isinstance(snap, ShardedSnapshot)
        report = snap.verify()
        assert report.ok and report.checked == ref_summary.done, report.as_json()
        labels = {part.split("-p")[0] for part in snap.commit_names(fp)}
        assert len(labels) >= 2  # parts of several shards (two actors at work)
        assert snap.fs.exists(f"{snap.root}/{fp}/index.json")  # merged at the end
    got = _samples(location, fp, storage_options)
    expected = _samples(str(ref_cache), fp, {})
    assert got.keys() == expected.keys() and len(got) == ref_summary.done
    for sample_id, tensors in expected.items():
        assert _same(got[sample_id], tensors), sample_id

    # Resumable: the same run again computes nothing (source hashes from the manifests).
    with ShardedSnapshot(location, readonly=False, storage_options=storage_options) as store:
        again = RayEngine(store, "spc_query", PARAMS, shard_size=2, **RAY_OPTIONS).run(
            _items(sources)
        )
    assert (again.done, again.skipped) == (0, ref_summary.done)


@pytest.mark.slow
def test_a_dead_actors_committed_parts_are_neither_lost_nor_computed_again(
    ray_local, tmp_path: Path, sources: list[Path]
) -> None:
    """The actor dies right after committing the part that holds ``victim`` and before
    reporting it. Its shard goes to the other actor, whose engine finds the committed
    records in the snapshot (source hashes from the manifests) and skips them: each
    sample is committed once, nothing committed is lost, nothing is computed twice."""
    location = str(tmp_path / "snap.zarr")
    victim = sources[1].stem
    crash = CrashOnce(victim, str(tmp_path / "crashed"))
    with ShardedSnapshot(location, readonly=False) as store:
        summary = RayEngine(
            store,
            "spc_query",
            PARAMS,
            shard_size=3,
            write_batch=1,
            actor_fault=crash,
            **RAY_OPTIONS,
        ).run(_items(sources))
    assert (tmp_path / "crashed").exists()
    assert summary.shard_retries >= 1 and summary.skipped >= 1
    with ShardedSnapshot(location) as snap:
        counts = _manifest_counts(snap, summary.fingerprint)
        assert counts[victim] == 1 and set(counts.values()) == {1}, counts
        keys = list(snap.keys())
        assert len(keys) == summary.done + summary.skipped == len(sources) - summary.failed
        assert snap.verify().ok
    assert merge(location) == {summary.fingerprint: len(keys)}


VARIANT_PARAMS = {"level": 5, "surface_samples": 2000, "rotation": "so3", "scale_min": 0.8}


@pytest.mark.slow
def test_variants_on_ray_into_a_snapshot_read_back_as_the_local_engines(
    ray_local, tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    """``variants`` on Ray with the actors writing their own parts: 2, then 3 (only the
    new one computed); a reader pinned to each variant gets the local engine's tensors."""
    paths = corpus_meshes[:3]
    location = str(tmp_path / "snap.zarr")
    with ShardedSnapshot(location, readonly=False) as store:
        engine = RayEngine(store, "spc", VARIANT_PARAMS, shard_size=2, write_batch=2, **RAY_OPTIONS)
        first = engine.run(_items(paths), variants=2)
        more = engine.run(_items(paths), variants=3)
    assert (first.done, first.skipped, first.failed) == (6, 0, 0), first.errors
    assert (more.done, more.skipped, more.failed) == (3, 6, 0), more.errors
    fp = first.fingerprint
    with open_store(location) as snap:
        assert isinstance(snap, ShardedSnapshot)
        assert len(list(snap.keys(fp))) == 9 and snap.verify().ok
        assert set(_manifest_counts(snap, fp).values()) == {1}  # each record committed once
        assert snap.get_index(fp).variant_counts().tolist() == [3, 3, 3]
    reference = tmp_path / "local"
    with open_store(reference, readonly=False) as store:
        local = Engine(store, "spc", VARIANT_PARAMS, device="cpu", backend="torch", loaders=0)
        assert local.run(_items(paths), variants=3).done == 9
    for k in range(3):
        got = CachedDataset(location, fp, variant=k)
        want = CachedDataset(str(reference), fp, variant=k)
        assert [got.sample_id(i) for i in range(3)] == [want.sample_id(i) for i in range(3)]
        for i in range(3):
            assert _same(got[i], want[i]), (k, got.sample_id(i))
        assert not torch.equal(got[0]["augmentation"], torch.eye(4)) or k == 0
        got.close()
        want.close()
