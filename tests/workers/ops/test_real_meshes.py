"""The torch backend on points sampled from real surfaces (the generated corpus's, and
../shared's real meshes where present), against the reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import trimesh

from tests.conftest import shared_corpus
from tests.helpers import ops_reference as ref
from workers.ops import torch_spc as ops

LEVEL = 7
MESHES = [
    ("corpus", name)
    for name in ("torus_materials.obj", "two_spheres.ply", "wavy_sheet_open.stl", "scene_parts.glb")
]
MESHES += [
    pytest.param("shared", name, marks=shared_corpus)
    for name in ("bunny.ply", "fandisk.obj", "teapot.stl", "torus.STL")
]


def _surface_points(path: Path, n: int = 4000) -> torch.Tensor:
    mesh = trimesh.load(path, force="mesh")
    points, _ = trimesh.sample.sample_surface(mesh, n, seed=7)
    points = np.asarray(points, dtype=np.float64)
    center = (points.max(0) + points.min(0)) / 2
    scale = 1.01 * np.abs(points - center).max()  # inside (-1, 1): queries at +1 are outside
    return torch.from_numpy((points - center) / scale).float()


@pytest.mark.parametrize("corpus,mesh", MESHES)
def test_octree_and_queries_of_a_real_surface(request, corpus, mesh):
    x = _surface_points(request.getfixturevalue(f"{corpus}_data") / "meshes" / mesh)
    points = ops.quantize_points(x, LEVEL)
    plist = [tuple(p) for p in points.tolist()]
    octree = ops.unbatched_points_to_octree(points, LEVEL)
    assert octree.tolist() == ref.octree(plist, LEVEL)
    max_level, pyramids, exsum = ops.scan_octrees(
        octree, torch.tensor([len(octree)], dtype=torch.int32)
    )
    assert max_level == LEVEL and pyramids.tolist() == [ref.pyramid(plist, LEVEL)]
    hierarchy = ops.generate_points(octree, pyramids, exsum)
    assert hierarchy.tolist() == [list(p) for p in ref.point_hierarchy(plist, LEVEL)]
    # the surface samples themselves, as floats, land in their own voxels (quantize_points
    # floors in float32, the query truncates in float64; they agree away from voxel faces)
    parents = ops.unbatched_query(octree, exsum, x, LEVEL, with_parents=True)
    assert (parents >= 0).all()
    assert torch.equal(hierarchy[parents[:, -1]], points)
    gen = torch.Generator().manual_seed(1)
    queries = torch.cat(
        [
            torch.rand(2000, 3, generator=gen) * 2.2 - 1.1,
            x[:2000] + 0.02 * torch.randn(2000, 3, generator=gen),
        ]
    )
    for with_parents in (False, True):
        got = ops.unbatched_query(octree, exsum, queries, LEVEL, with_parents)
        assert got.tolist() == ref.query(
            plist, LEVEL, queries.tolist(), LEVEL, np.float32, with_parents
        )
