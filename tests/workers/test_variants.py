"""Variants computed by the engine and read back: through spcache.precompute into a cache
directory, a sharded snapshot and an exported Zarr snapshot, and through the worker on a
read-through miss; and recipes made from functions (``spcache.recipe``)."""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import logging
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import spcache
from cache_store.errors import ParameterError, UsageError
from cache_store.jobs.queue import JobQueue
from cache_store.readers.variants import pick_variant
from cache_store.snapshot.importer import import_snapshot
from cache_store.snapshot.zarr.export import export_snapshot
from cache_store.stores.lmdb.store import LMDBStore
from spcache.recipes import Field, Param
from tests.conftest import REPO_ROOT
from tests.helpers.procs import run
from tests.helpers.read_through import start_worker, stop_worker

RUN = {"device": "cpu", "backend": "torch", "loaders": 0, "progress": False}
SHAPE = {"level": 5, "surface_samples": 4000}
AUGMENT = {"rotation": "so3", "scale_min": 0.8, "scale_max": 1.2, "jitter": 0.005}
TENSORS = ("octree", "point_hierarchy", "pyramid", "exsum", "center", "scale")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory, corpus_meshes: list[Path]) -> Path:
    """Three meshes in a directory of their own."""
    root = tmp_path_factory.mktemp("variant_shapes")
    for mesh in sorted(corpus_meshes)[:3]:
        (root / mesh.name).write_bytes(mesh.read_bytes())
    return root


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory, shapes: Path) -> tuple[Path, Any]:
    """A cache directory holding 4 augmented variants of each shape."""
    cache = tmp_path_factory.mktemp("four") / "cache"
    result = spcache.precompute(shapes, "spc", cache, variants=4, **RUN, **SHAPE, **AUGMENT)
    assert (result.done, result.skipped, result.failed) == (12, 0, 0), result.errors
    return cache, result


def _pinned(cache: Path | str, fingerprint: str, variant: int) -> list[dict[str, Any]]:
    ds = spcache.CachedDataset(cache, fingerprint, variant=variant)
    return [ds[i] for i in range(len(ds))]


def test_variants_are_distinct_and_variant_0_is_the_record_of_a_plain_run(
    tmp_path: Path, shapes: Path, four: tuple[Path, Any]
) -> None:
    cache, result = four
    plain = spcache.precompute(shapes, "spc", tmp_path / "plain", **RUN, **SHAPE)
    base = _pinned(tmp_path / "plain", plain.fingerprint, 0)
    by_variant = [_pinned(cache, result.fingerprint, k) for k in range(4)]
    assert len(base) == 3 and all(len(v) == 3 for v in by_variant)
    for i, record in enumerate(base):
        assert "augmentation" not in record  # a plain run's records are as they were
        assert all(torch.equal(record[f], by_variant[0][i][f]) for f in TENSORS)
        assert torch.equal(by_variant[0][i]["augmentation"], torch.eye(4))
        octrees = [by_variant[k][i]["octree"] for k in range(4)]
        for a, b in itertools.combinations(octrees, 2):
            assert not torch.equal(a, b)  # four distinct octrees of the shape
        for k in range(1, 4):
            matrix = by_variant[k][i]["augmentation"]
            assert matrix.dtype == torch.float32 and matrix.shape == (4, 4)
            assert not torch.allclose(matrix, torch.eye(4))


def test_variants_are_reproducible_and_a_larger_k_computes_only_the_new_ones(
    tmp_path: Path, shapes: Path, four: tuple[Path, Any]
) -> None:
    cache, result = four
    again = spcache.precompute(
        shapes, "spc", tmp_path / "again", variants=4, **RUN, **SHAPE, **AUGMENT
    )
    assert again.fingerprint == result.fingerprint  # K is not part of the fingerprint
    for k in range(4):
        for mine, theirs in zip(
            _pinned(cache, result.fingerprint, k),
            _pinned(tmp_path / "again", again.fingerprint, k),
            strict=True,
        ):
            assert all(torch.equal(mine[f], theirs[f]) for f in (*TENSORS, "augmentation"))
    with LMDBStore(tmp_path / "again") as store:
        created = {
            k: store.get_record(k).metadata["created"] for k in store.keys(again.fingerprint)
        }
    six = spcache.precompute(
        shapes, "spc", tmp_path / "again", variants=6, **RUN, **SHAPE, **AUGMENT
    )
    assert (six.done, six.skipped, six.failed, six.variants) == (6, 12, 0, 6)
    with LMDBStore(tmp_path / "again") as store:
        index = store.get_index(six.fingerprint)
        assert index.variant_counts().tolist() == [6, 6, 6]
        keys = list(store.keys(six.fingerprint))
        assert len(keys) == 18
        # the four variants computed before are the same records, not computed again
        assert all(store.get_record(k).metadata["created"] == c for k, c in created.items())
        assert (
            store.get_record(f"{six.fingerprint}/{index.sample_ids[0]}#v5").metadata["variant"]
            == "5"
        )
    back = spcache.precompute(
        shapes, "spc", tmp_path / "again", variants=2, **RUN, **SHAPE, **AUGMENT
    )
    assert (back.done, back.skipped) == (0, 6)  # fewer asked: what is stored stays
    (report,) = spcache.rm(tmp_path / "again", [six.fingerprint])
    assert report["records"] == 18  # a sample's variants are removed together
    with LMDBStore(tmp_path / "again") as store:
        assert list(store.keys(six.fingerprint)) == []


def test_each_epoch_reads_the_picked_variant_and_set_epoch_changes_it(
    four: tuple[Path, Any],
) -> None:
    cache, result = four
    ds = spcache.CachedDataset(cache, result.fingerprint)
    pinned = [_pinned(cache, result.fingerprint, k) for k in range(4)]
    seen = set()
    for epoch in range(6):
        ds.set_epoch(epoch)
        for i in range(len(ds)):
            k = pick_variant(0, epoch, ds.sample_id(i), 4)
            assert ds.variant_at(i) == k
            assert torch.equal(ds[i]["octree"], pinned[k][i]["octree"])
            seen.add(k)
    assert seen == {0, 1, 2, 3}
    bounded = spcache.CachedDataset(cache, result.fingerprint, variants=2, variant_seed=9)
    assert {bounded.variant_at(i) for i in range(3)} <= {0, 1}


def test_a_sharded_snapshot_and_an_export_hold_the_same_variants(
    tmp_path: Path, shapes: Path, four: tuple[Path, Any]
) -> None:
    cache, result = four
    snap = tmp_path / "snap.zarr"
    sharded = spcache.precompute(shapes, "spc", snap, variants=4, **RUN, **SHAPE, **AUGMENT)
    assert (sharded.done, sharded.failed) == (12, 0)
    export_snapshot(LMDBStore(cache), result.fingerprint, tmp_path / "export.zarr", progress=False)
    for where in (snap, tmp_path / "export.zarr"):
        ds = spcache.CachedDataset(where, result.fingerprint)
        assert len(ds) == 3
        for k in range(4):
            for mine, theirs in zip(
                _pinned(cache, result.fingerprint, k),
                _pinned(where, result.fingerprint, k),
                strict=True,
            ):
                assert torch.equal(mine["octree"], theirs["octree"])
                assert torch.equal(mine["augmentation"], theirs["augmentation"])
        ds.set_epoch(3)
        assert [ds.variant_at(i) for i in range(3)] == [
            pick_variant(0, 3, ds.sample_id(i), 4) for i in range(3)
        ]
    # imported back into a cache directory: every variant's record and the counts
    report = import_snapshot(tmp_path / "export.zarr", tmp_path / "imported")
    assert report[result.fingerprint]["copied"] == 12 and not report[result.fingerprint]["bad"]
    with LMDBStore(tmp_path / "imported") as store:
        assert store.get_index(result.fingerprint).variant_counts().tolist() == [4, 4, 4]
    for mine, theirs in zip(
        _pinned(cache, result.fingerprint, 3),
        _pinned(tmp_path / "imported", result.fingerprint, 3),
        strict=True,
    ):
        assert torch.equal(mine["octree"], theirs["octree"])


@pytest.mark.parametrize("bad", [0, 1025, True, 2.0])
def test_the_ray_engine_checks_the_variant_count_before_ray_starts(bad: object) -> None:
    from workers.builtin_recipes import Spc
    from workers.ray_engine import RayEngine

    engine = RayEngine.__new__(RayEngine)  # no Ray started: only the check runs
    engine.recipe_spec = Spc.schema()
    with pytest.raises(ParameterError, match="variants: expected an integer from 1 to 1024"):
        engine.run([], variants=bad)  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_worker_computes_a_missing_variant_on_read_through(
    tmp_path: Path, shapes: Path, four: tuple[Path, Any]
) -> None:
    """A read-through dataset asking for 3 variants, with a real ``spcache worker``: each
    miss queues the sample's 3 variants, the worker computes them, the read gets the
    variant the epoch picked, equal to what spcache.precompute computes."""
    cache, result = four
    live = tmp_path / "live"
    worker = start_worker(live)
    try:
        ds = spcache.CachedDataset(
            live, "spc", sources=str(shapes), variants=3, miss_timeout=120, **SHAPE, **AUGMENT
        )
        pinned = [_pinned(cache, result.fingerprint, k) for k in range(3)]
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            for i in range(len(ds)):
                k = pick_variant(0, epoch, ds.sample_id(i), 3)
                row = pinned[k][[s.stem for s in sorted(shapes.iterdir())].index(ds.sample_id(i))]
                assert torch.equal(ds[i]["octree"], row["octree"])
        jobs = JobQueue(live).jobs()
        assert jobs and all(job.variants == 3 for job in jobs)
    finally:
        stop_worker(worker)
    with LMDBStore(live) as store:
        assert len(list(store.keys(result.fingerprint))) == 9  # each variant computed once
        assert store.get_index(result.fingerprint).variant_counts().tolist() == [3, 3, 3]


# -- a recipe from a function -------------------------------------------------------------


def _extent_fn(source: Any, params: Any, generator: Any) -> dict[str, np.ndarray]:
    """Bounding box size."""
    v = source.vertices
    return {"extent": (v.max(0) - v.min(0) + 2 * params["margin"]).astype(np.float32)}


def test_a_function_recipe_runs_in_process_and_reads_back(
    tmp_path: Path, shapes: Path, caplog: pytest.LogCaptureFixture
) -> None:
    extent = spcache.recipe(
        _extent_fn,
        name="extent_probe",
        fields={"extent": Field("float32", "[3]", "bounding box size")},
        params={"margin": Param(float, 0.0, 0.0, 1.0, "added to each side")},
    )
    with caplog.at_level(logging.WARNING):
        result = spcache.precompute(
            shapes, extent, tmp_path / "cache", margin=0.25, device="cpu", loaders=2, progress=False
        )
    assert (result.done, result.failed) == (3, 0), result.errors
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # no loader trouble
    ds = spcache.CachedDataset(tmp_path / "cache", extent, margin=0.25)
    assert ds.fingerprint == result.fingerprint
    expected = hashlib.blake2b(
        inspect.getsource(_extent_fn).encode() + b"\0", digest_size=8
    ).hexdigest()
    with LMDBStore(tmp_path / "cache") as store:
        key = next(iter(store.keys(result.fingerprint)))
        assert store.get_record(key).metadata["code_digest"] == expected
    assert all(float(ds[i]["extent"].min()) >= 0.5 for i in range(len(ds)))
    again = spcache.precompute(shapes, extent, tmp_path / "cache", margin=0.25, **RUN)
    assert (again.done, again.skipped) == (0, 3)
    with pytest.raises(UsageError, match="install it instead"):
        spcache.CachedDataset(tmp_path / "cache", extent, sources=str(shapes), margin=0.25)
    with pytest.raises(spcache.ParameterError, match="name of an installed recipe"):
        spcache.recipe(_extent_fn, name="spc", fields={"extent": Field("float32", "[3]", "x")})


def test_a_function_recipe_from_a_notebook_like_session(tmp_path: Path, shapes: Path) -> None:
    """``python -`` (no file behind the function, as in a notebook cell): the recipe is
    made, computed (loaders asked for), read back, and a second run skips it all."""
    code = textwrap.dedent(
        f"""
        import json
        import numpy as np
        import spcache
        from spcache.recipes import Field

        @spcache.recipe(fields={{"extent": Field("float32", "[3]", "bounding box size")}})
        def extent(source, params, generator):
            v = source.vertices
            return {{"extent": (v.max(0) - v.min(0)).astype(np.float32)}}

        first = spcache.precompute({str(shapes)!r}, extent, "cache", loaders=2, progress=False)
        second = spcache.precompute({str(shapes)!r}, extent, "cache", loaders=2, progress=False)
        ds = spcache.CachedDataset("cache", extent)
        print(json.dumps([first.done, second.skipped, len(ds), ds[0]["extent"].tolist()]))
        """
    )
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = run([sys.executable, "-"], cwd=tmp_path, input=code, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    done, skipped, n, first = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (done, skipped, n) == (3, 3, 3) and min(first) > 0
    assert os.path.isdir(tmp_path / "cache" / "records")
