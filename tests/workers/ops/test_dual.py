"""unbatched_make_dual / unbatched_make_trinkets: Kaolin 0.18's published example, its
TestTrinkets properties, and random octrees against a plain reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from cache_store.errors import InvalidTensor, TensorTypeError
from tests.helpers import ops_reference as ref
from tests.helpers.strategies import point_sets
from workers.ops import torch_spc as ops

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _hierarchy(points, level):
    octree = ops.unbatched_points_to_octree(
        torch.tensor(points, dtype=torch.int16).reshape(-1, 3), level
    )
    _, pyramids, exsum = ops.scan_octrees(octree, torch.tensor([len(octree)], dtype=torch.int32))
    return ops.generate_points(octree, pyramids, exsum), pyramids[0]


def test_make_dual_of_kaolins_docstring_example():
    hierarchy, pyramid = _hierarchy([[0, 0, 0], [0, 0, 1], [0, 1, 0]], 1)
    dual, pyramid_dual = ops.unbatched_make_dual(hierarchy, pyramid)
    assert dual.dtype == torch.int16 and pyramid_dual.dtype == torch.int32
    unit = [[(c >> 2) & 1, (c >> 1) & 1, c & 1] for c in range(8)]
    assert ops.unbatched_get_level_points(dual, pyramid_dual, 0).tolist() == unit
    assert ops.unbatched_get_level_points(dual, pyramid_dual, 1).tolist() == unit + [
        [0, 0, 2],
        [0, 1, 2],
        [1, 0, 2],
        [1, 1, 2],
        [0, 2, 0],
        [0, 2, 1],
        [1, 2, 0],
        [1, 2, 1],
    ]
    assert pyramid_dual.tolist() == [[8, 16, 0], [0, 8, 24]]


def _check_trinkets(hierarchy, pyramid, dual, pyramid_dual, trinkets, parents):
    """Kaolin's TestTrinkets: trinkets pick each voxel's corners; parents halve voxels."""
    max_level = pyramid.shape[1] - 2
    for level in range(max_level + 1):
        index = pyramid_dual[1, level] + ops.unbatched_get_level_points(trinkets, pyramid, level)
        picked = dual.index_select(0, index.reshape(-1).long()).view(-1, 8, 3)
        corners = ops.points_to_corners(ops.unbatched_get_level_points(hierarchy, pyramid, level))
        assert torch.equal(picked, corners)
    assert parents[0] == -1
    for level in range(1, max_level + 1):
        parent = hierarchy.index_select(
            0, ops.unbatched_get_level_points(parents, pyramid, level).long()
        )
        expected = torch.div(
            ops.unbatched_get_level_points(hierarchy, pyramid, level), 2, rounding_mode="trunc"
        )
        assert torch.equal(parent, expected)


def test_trinkets_of_the_docstring_example():
    hierarchy, pyramid = _hierarchy([[0, 0, 0], [0, 0, 1], [0, 1, 0]], 1)
    dual, pyramid_dual = ops.unbatched_make_dual(hierarchy, pyramid)
    trinkets, parents = ops.unbatched_make_trinkets(hierarchy, pyramid, dual, pyramid_dual)
    assert trinkets.dtype == torch.int32 and parents.dtype == torch.int32
    assert trinkets.shape == (4, 8) and parents.tolist() == [-1, 0, 0, 0]
    assert trinkets[0].tolist() == list(range(8))
    # voxel (0, 0, 1) at level 1: corners (0,0,1), (0,0,2), (0,1,1), (0,1,2), (1,0,1), ...
    assert trinkets[2].tolist() == [1, 8, 3, 9, 5, 10, 7, 11]
    _check_trinkets(hierarchy, pyramid, dual, pyramid_dual, trinkets, parents)


def _reference_dual(points, level):
    """Per level, the corners of its voxels as a Morton-sorted list without duplicates."""
    out = []
    for voxels in ref.levels(points, level):
        corners = {
            (x + (c >> 2 & 1), y + (c >> 1 & 1), z + (c & 1))
            for x, y, z in voxels
            for c in range(8)
        }
        out.append(sorted(corners, key=ref.morton))
    return out


@SETTINGS
@given(point_sets(min_level=1, max_level=8, max_points=60))
def test_dual_and_trinkets_of_random_octrees_match_the_reference(case):
    level, points = case
    hierarchy, pyramid = _hierarchy(points, level)
    dual, pyramid_dual = ops.unbatched_make_dual(hierarchy, pyramid)
    expected = _reference_dual(points, level)
    assert dual.tolist() == [list(p) for lvl in expected for p in lvl]
    counts = [len(lvl) for lvl in expected]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    assert pyramid_dual.tolist() == [counts + [0], starts + [sum(counts)]]
    trinkets, parents = ops.unbatched_make_trinkets(hierarchy, pyramid, dual, pyramid_dual)
    voxels = ref.levels(points, level)
    want_trinkets, want_parents = [], []
    for lvl, level_voxels in enumerate(voxels):
        where = {p: i for i, p in enumerate(expected[lvl])}
        above = (
            {p: i + sum(len(v) for v in voxels[: lvl - 1]) for i, p in enumerate(voxels[lvl - 1])}
            if lvl
            else {}
        )
        for x, y, z in level_voxels:
            want_trinkets.append(
                [where[(x + (c >> 2 & 1), y + (c >> 1 & 1), z + (c & 1))] for c in range(8)]
            )
            want_parents.append(above[(x >> 1, y >> 1, z >> 1)] if lvl else -1)
    assert trinkets.tolist() == want_trinkets
    assert parents.tolist() == want_parents
    _check_trinkets(hierarchy, pyramid, dual, pyramid_dual, trinkets, parents)


def test_bad_input_is_refused_with_the_argument_named():
    hierarchy, pyramid = _hierarchy([[0, 0, 0], [3, 1, 2]], 2)
    dual, pyramid_dual = ops.unbatched_make_dual(hierarchy, pyramid)
    with pytest.raises(TensorTypeError, match="point_hierarchy"):
        ops.unbatched_make_dual(hierarchy.int(), pyramid)
    with pytest.raises(InvalidTensor, match="pyramid"):
        ops.unbatched_make_dual(hierarchy[:-1], pyramid)
    with pytest.raises(InvalidTensor, match="outside its level"):
        ops.unbatched_make_dual(hierarchy * 4, pyramid)
    with pytest.raises(InvalidTensor, match="point_hierarchy_dual"):  # a corner missing
        ops.unbatched_make_trinkets(hierarchy, pyramid, dual.flip(0), pyramid_dual)
    with pytest.raises(InvalidTensor, match="pyramid_dual"):
        ops.unbatched_make_trinkets(hierarchy, pyramid, dual, pyramid)
    orphan = hierarchy.clone()
    orphan[-1] = torch.tensor([2, 2, 2], dtype=torch.int16)  # its parent (1, 1, 1) is absent
    with pytest.raises(InvalidTensor, match="no parent"):
        ops.unbatched_make_trinkets(orphan, pyramid, *ops.unbatched_make_dual(orphan, pyramid))


def test_level_15_corners_beyond_int16_are_refused():
    hierarchy, pyramid = _hierarchy([[2**15 - 1, 0, 0]], 15)
    with pytest.raises(InvalidTensor, match="2\\*\\*15"):
        ops.unbatched_make_dual(hierarchy, pyramid)
    inner, pyramid = _hierarchy([[2**15 - 2, 5, 7]], 15)
    dual, pyramid_dual = ops.unbatched_make_dual(inner, pyramid)
    assert dual[-1].tolist() == [2**15 - 1, 6, 8]
