"""spc_sdf through the engines and the read side: real LMDB, loader processes, Zarr
export, CachedDataset with a forked DataLoader, and (slow) Ray."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import trimesh

from cache_store import CachedDataset, collate_spc
from cache_store.snapshot.zarr.export import export_snapshot
from cache_store.format.decode import decode_record
from cache_store.format.header import read_header
from cache_store.stores.opener import open_store
from tests.conftest import SHARED_DATA
from workers import sdf
from workers.engine import Engine
from workers.recipe_run import RECIPES
from cache_store.recipes.api import check_outputs
from workers.sampling import compute_normalization, normalize_points
from workers.source_load import load_source

PARAMS = {"level": 5, "surface_samples": 3000, "near_samples": 1000, "uniform_samples": 1000}
SPEC = RECIPES["spc_sdf"].spec


def _items(paths: list[Path]) -> list[tuple[str, str]]:
    return [(p.stem, str(p)) for p in paths]


def _data_section(value: bytes) -> bytes:
    return bytes(value[read_header(value).data_start :])


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """trimesh.creation shapes (closed, open, inverted) written as mesh files."""
    root = tmp_path_factory.mktemp("shapes")
    box = trimesh.creation.box(extents=(1.0, 0.6, 0.4))
    shapes = {
        "box": box,
        "icosphere": trimesh.creation.icosphere(subdivisions=3),
        "capsule": trimesh.creation.capsule(height=1.0, radius=0.3),
        "torus": trimesh.creation.torus(major_radius=0.7, minor_radius=0.2),
        "cylinder": trimesh.creation.cylinder(radius=0.5, height=1.5),
        "open_box": trimesh.Trimesh(
            box.vertices, box.faces[box.triangles_center[:, 2] < 0.19], process=False
        ),
    }
    paths = []
    for name, mesh in shapes.items():
        paths.append(root / f"{name}.obj")
        mesh.export(paths[-1])
    return paths


@pytest.fixture(scope="module")
def shared_or_skip() -> Path:
    if not (SHARED_DATA / "meshes").is_dir():
        pytest.skip(
            f"shared meshes not found at {SHARED_DATA} (set SPCACHE_SHARED_DATA); the "
            "generated-shape tests cover the same code"
        )
    return SHARED_DATA


def _run(cache: Path, paths: list[Path], loaders: int = 2) -> tuple[Engine, object, dict, dict]:
    with open_store(cache, readonly=False) as store:
        engine = Engine(store, "spc_sdf", PARAMS, device="cpu", backend="torch", loaders=loaders)
        summary = engine.run(_items(paths))
        values = {k: store.get(k) for k in store.keys()}
        metadata = {k: store.record_metadata(k) for k in values}
    return engine, summary, values, metadata


def test_a_record_for_every_generated_shape(tmp_path: Path, generated: list[Path]) -> None:
    engine, summary, values, metadata = _run(tmp_path / "cache", generated)
    assert summary.failed == 0, summary.errors
    assert summary.done == len(generated)
    resolved = SPEC.resolve(PARAMS)
    for path in generated:
        record = decode_record(values[engine.key(path.stem)])
        check_outputs(SPEC, record.tensors, resolved)
        sdf = record.tensors["sdf"]
        assert bool((sdf < 0).any()) and bool((sdf > 0).any()), path.stem
        # what a record of format 2 shares with its fingerprint (the recipe) is in its
        # descriptor; the store's metadata of a record is both, merged
        meta = metadata[engine.key(path.stem)]
        assert meta["recipe"] == "spc_sdf" and meta["backend"] == "torch"


@pytest.mark.slow
def test_a_record_for_every_shared_mesh(tmp_path: Path, shared_or_skip: Path) -> None:
    meshes = sorted(p for p in (shared_or_skip / "meshes").iterdir() if p.is_file())
    assert len(meshes) == 21
    engine, summary, values, _ = _run(tmp_path / "cache", meshes)
    assert summary.failed == 0, summary.errors
    assert summary.done == len(meshes)
    resolved = SPEC.resolve(PARAMS)
    for path in meshes:
        tensors = decode_record(values[engine.key(path.stem)]).tensors
        check_outputs(SPEC, tensors, resolved)
        assert bool(torch.isfinite(tensors["sdf"]).all())
        # open or closed, the sign is the winding-number rule: check some points, both
        # uniform and near ones, against brute force
        source = load_source(path)
        norm = compute_normalization(path, source.used_points())
        pick = torch.cat([torch.arange(0, 60), torch.arange(1000, 1060)])
        want, _ = sdf.brute_force_signed_distance(
            tensors["sdf_points"][pick],
            torch.from_numpy(normalize_points(source.vertices, norm)),
            torch.from_numpy(source.faces),
        )
        got = tensors["sdf"][pick].double()
        assert float((got.abs() - want.abs()).abs().max()) <= 1e-6, path.stem
        clear = want.abs() > 1e-4
        assert torch.equal(got[clear] < 0, want[clear] < 0), path.stem


def test_bad_inputs_and_point_clouds_fail_alone(tmp_path: Path, generated: list[Path]) -> None:
    cloud = tmp_path / "cloud.npy"
    np.save(cloud, np.random.default_rng(0).normal(size=(300, 3)))
    bad = [cloud]
    if (SHARED_DATA / "bad_inputs").is_dir():
        bad += sorted(p for p in (SHARED_DATA / "bad_inputs").iterdir() if p.is_file())
    items = _items(bad) + _items(generated[:2])
    with open_store(tmp_path / "cache", readonly=False) as store:
        engine = Engine(store, "spc_sdf", PARAMS, device="cpu", backend="torch", loaders=2)
        summary = engine.run(items)
        errors = {e.id: e.reason for e in summary.errors}
        assert "point cloud" in errors["cloud"]
        for path in bad:  # every hostile file is a failure with a reason, or a valid mesh record
            if path.stem in errors:
                assert errors[path.stem]
            else:
                check_outputs(SPEC, store.get_record(engine.key(path.stem)).tensors, engine.params)
        for path in generated[:2]:
            assert store.has(engine.key(path.stem))
        assert summary.done + summary.failed == len(items)
        assert store.verify().ok


def test_records_are_identical_across_runs_and_loader_modes(
    tmp_path: Path, generated: list[Path]
) -> None:
    runs = [
        _run(tmp_path / name, generated[:3], jobs)[2]
        for name, jobs in (("a", 0), ("b", 2), ("c", 2))
    ]
    assert len(runs[0]) == 3
    for other in runs[1:]:
        assert other.keys() == runs[0].keys()
        for key in runs[0]:
            assert _data_section(other[key]) == _data_section(runs[0][key])


def test_lmdb_to_zarr_to_dataloader(tmp_path: Path, generated: list[Path]) -> None:
    engine, summary, _, _ = _run(tmp_path / "cache", generated[:4])
    assert summary.done == 4
    resolved = SPEC.resolve(PARAMS)
    export_snapshot(tmp_path / "cache", engine.fingerprint, tmp_path / "snap.zarr")
    lmdb_ds = CachedDataset(tmp_path / "cache", "spc_sdf", **PARAMS)
    zarr_ds = CachedDataset(tmp_path / "snap.zarr", engine.fingerprint)
    assert len(zarr_ds) == len(lmdb_ds) == 4
    for i in range(4):
        a, b = lmdb_ds[i], zarr_ds[i]
        assert a.keys() == b.keys() and set(SPEC.fields_for(resolved)) <= set(a)
        assert all(torch.equal(a[k], b[k]) for k in a)
    loader = torch.utils.data.DataLoader(
        zarr_ds, batch_size=2, num_workers=2, collate_fn=collate_spc, multiprocessing_context="fork"
    )
    batches = list(loader)
    assert len(batches) == 2
    batch = batches[0]
    samples = [zarr_ds[0], zarr_ds[1]]
    assert batch["pyramid_dual"].shape == (2, 2, PARAMS["level"] + 2)
    assert torch.equal(
        batch["point_hierarchy_dual"], torch.cat([s["point_hierarchy_dual"] for s in samples])
    )
    assert batch["trinkets"].shape == (sum(len(s["trinkets"]) for s in samples), 8)
    assert batch["sdf"].shape == (2, PARAMS["near_samples"] + PARAMS["uniform_samples"])
    assert batch["sdf_points"].shape == (2, PARAMS["near_samples"] + PARAMS["uniform_samples"], 3)
    # each sample's slice of the packed dual is given by its dual pyramid
    sizes = batch["pyramid_dual"][:, 1, -1].tolist()
    assert sizes == [len(s["point_hierarchy_dual"]) for s in samples]
    assert "point_hierarchy_dual_lengths" not in batch and "trinkets_lengths" not in batch


def test_collate_concatenates_dual_fields_even_when_sizes_agree(
    tmp_path: Path, generated: list[Path]
) -> None:
    engine, _, _, _ = _run(tmp_path / "cache", generated[:1], loaders=0)
    sample = CachedDataset(tmp_path / "cache", engine.fingerprint)[0]
    batch = collate_spc([sample, sample])  # same sizes: still Kaolin's packed layout
    assert batch["trinkets"].shape == (2 * len(sample["trinkets"]), 8)
    assert batch["trinket_parents"].shape == (2 * len(sample["trinket_parents"]),)
    assert batch["point_hierarchy_dual"].shape == (2 * len(sample["point_hierarchy_dual"]), 3)


@pytest.mark.slow
def test_ray_engine_writes_the_same_records(tmp_path: Path, generated: list[Path]) -> None:
    ray = pytest.importorskip("ray")
    import logging
    import signal

    from workers.ray_engine import RayEngine

    _, _, local, _ = _run(tmp_path / "local", generated[:2], loaders=0)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ray.init(
        num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False
    )
    try:
        with open_store(tmp_path / "ray", readonly=False) as store:
            summary = RayEngine(
                store,
                "spc_sdf",
                PARAMS,
                device="cpu",
                backend="torch",
                loaders=0,
                actors=2,
                shard_size=1,
            ).run(_items(generated[:2]))
            remote = {k: store.get(k) for k in store.keys()}
    finally:
        ray.shutdown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert summary.done == 2 and remote.keys() == local.keys()
    for key in local:
        assert _data_section(remote[key]) == _data_section(local[key])


def test_the_readme_indexing_finds_each_points_voxel_corners(
    tmp_path: Path, generated: list[Path]
) -> None:
    from workers.ops import torch_spc

    engine, _, _, _ = _run(tmp_path / "cache", generated[:3], loaders=0)
    level = PARAMS["level"]
    ds = CachedDataset(tmp_path / "cache", "spc_sdf", **PARAMS)
    batch = collate_spc([ds[i] for i in range(3)])
    points, pidx = batch["sdf_points"], batch["sdf_pidx"]
    point_offset = dual_offset = 0
    for b in range(len(points)):
        pyramid, pyramid_dual = batch["pyramid"][b], batch["pyramid_dual"][b]
        n_points = int(pyramid[1, -1])
        hierarchy = batch["point_hierarchy"][point_offset : point_offset + n_points]
        trinkets = batch["trinkets"][point_offset : point_offset + n_points]
        hit = pidx[b] >= 0
        corners = dual_offset + pyramid_dual[1, level] + trinkets[pidx[b][hit].long()]
        voxels = hierarchy[pidx[b][hit].long()]
        assert bool(hit.any())
        assert torch.equal(
            batch["point_hierarchy_dual"][corners.long()], torch_spc.points_to_corners(voxels)
        )
        # and the voxel really holds the point
        cell = torch.floor((points[b][hit].double() + 1) * 2 ** (level - 1)).to(torch.int16)
        assert torch.equal(cell, voxels)
        point_offset += n_points
        dual_offset += int(pyramid_dual[1, -1])


def test_the_service_serves_the_new_fields(tmp_path: Path, generated: list[Path]) -> None:
    import httpx

    from cache_store.format.decode import decode_record as decode
    from service.settings import Settings
    from tests.helpers.service import InProcessServer

    engine, summary, values, _ = _run(tmp_path / "cache", generated[:2], loaders=0)
    assert summary.done == 2
    settings = Settings(
        cache=tmp_path / "cache", source_roots=[tmp_path], token="t" * 32, worker=False
    )
    local = CachedDataset(tmp_path / "cache", engine.fingerprint)
    with InProcessServer(settings) as server:
        remote = CachedDataset(server.url, "spc_sdf", **PARAMS)
        try:
            assert remote.fingerprint == engine.fingerprint and len(remote) == 2
            for i in range(2):
                a, b = local[i], remote[i]
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        finally:
            remote.close()
            local.close()
        sample_id = generated[0].stem
        with httpx.Client(base_url=server.url) as client:
            reply = client.get(
                f"/v1/caches/{engine.fingerprint}/records/{sample_id}",
                params={"fields": "sdf,trinkets"},
            )
        assert reply.status_code == 200
        subset = decode(reply.content)
        full = decode(values[engine.key(sample_id)])
        assert set(subset.tensors) == {"sdf", "trinkets"}
        assert torch.equal(subset.tensors["sdf"], full.tensors["sdf"])
        assert torch.equal(subset.tensors["trinkets"], full.tensors["trinkets"])
