"""The example recipe, used as a user would: installed, found by spcache, precomputed
with ``spcache.precompute`` and read back with ``spcache.CachedDataset``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trimesh

import spcache
from spcache.recipes import installed_recipes


@pytest.fixture
def sphere(tmp_path: Path) -> Path:
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    trimesh.creation.icosphere(subdivisions=3, radius=0.9).export(shapes / "sphere.obj")
    return shapes


def test_spcache_finds_the_installed_recipe() -> None:
    entry = installed_recipes().get("voxel_normals")
    assert entry.origin["package"] == "spcache-voxel-normals"
    assert entry.origin["entry"] == "voxel_normals = spcache_voxel_normals.recipe:VoxelNormals"
    assert set(entry.spec.fields) >= {"octree", "pyramid", "normals", "counts"}


def test_a_sphere_has_outward_unit_normals_in_every_leaf(sphere: Path, tmp_path: Path) -> None:
    level = 4
    result = spcache.precompute(
        sphere,
        "voxel_normals",
        tmp_path / "cache",
        device="cpu",
        backend="torch",
        loaders=0,
        progress=False,
        level=level,
        samples=20_000,
    )
    assert result.done == 1, result.errors
    t = spcache.CachedDataset(tmp_path / "cache", "voxel_normals", level=level, samples=20_000)[0]
    first, leaves = int(t["pyramid"][1, level]), int(t["pyramid"][0, level])
    assert t["normals"].shape == (leaves, 3) and int(t["counts"].sum()) == 20_000
    assert (t["counts"] > 0).all()  # every leaf holds a sample: that is how it got there
    centres = (t["point_hierarchy"][first : first + leaves].double() + 0.5) / 2**level * 2 - 1
    outward = (centres / centres.norm(dim=1, keepdim=True) * t["normals"].double()).sum(dim=1)
    assert float(outward.min()) > 0.8
    np.testing.assert_allclose(t["normals"].norm(dim=1).numpy(), 1.0, atol=1e-5)


def test_a_point_cloud_fails_with_its_reason(tmp_path: Path) -> None:
    cloud = tmp_path / "clouds" / "cloud.xyz"
    cloud.parent.mkdir()
    cloud.write_text("0 0 0\n1 0 0\n0 1 0\n0 0 1\n")
    result = spcache.precompute(
        cloud.parent,
        "voxel_normals",
        tmp_path / "cache",
        device="cpu",
        backend="torch",
        loaders=0,
        progress=False,
    )
    assert result.failed == 1 and "needs a triangle mesh" in result.errors[0].reason


def test_records_are_the_same_with_and_without_loader_processes(
    sphere: Path, tmp_path: Path
) -> None:
    tensors = []
    for loaders in (0, 2):
        cache = tmp_path / f"cache{loaders}"
        result = spcache.precompute(
            sphere,
            "voxel_normals",
            cache,
            device="cpu",
            backend="torch",
            loaders=loaders,
            progress=False,
            level=5,
            samples=5000,
        )
        assert result.done == 1, result.errors
        tensors.append(spcache.CachedDataset(cache, result.fingerprint)[0])
    for name in tensors[0]:
        if name != "sample_id":
            assert np.array_equal(np.asarray(tensors[0][name]), np.asarray(tensors[1][name])), name
