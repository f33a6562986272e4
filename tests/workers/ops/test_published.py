"""Kaolin 0.18's published expectations (docs/SPC_SEMANTICS.md and Kaolin's own tests)."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.kaolin_data import (
    TWO_OCTREES_EXSUM,
    TWO_OCTREES_POINTS,
    TWO_OCTREES_PYRAMIDS,
    two_octrees,
)

QUERY_POINTS = [[3, 2, 0], [3, 1, 1], [0, 0, 0], [3, 3, 3]]


def _spc(ops, points, level):
    octree = ops.unbatched_points_to_octree(torch.tensor(points, dtype=torch.int16), level)
    max_level, pyramids, exsum = ops.scan_octrees(
        octree, torch.tensor([len(octree)], dtype=torch.int32)
    )
    return octree, pyramids, exsum


def test_morton_codes_of_the_documented_points(ops):
    points = torch.tensor(
        [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 3], [0, 1, 0]], dtype=torch.int16
    )
    morton = ops.points_to_morton(points)
    assert morton.dtype == torch.int64
    assert morton.tolist() == [0, 1, 8, 9, 2]
    back = ops.morton_to_points(morton)
    assert back.dtype == torch.int16 and torch.equal(back, points)


def test_scan_octrees_of_two_packed_octrees(ops):
    octrees, lengths = two_octrees()
    assert octrees[0].item() == 0b10001  # bits 0 and 4: children (0,0,0) and (1,0,0)
    max_level, pyramids, exsum = ops.scan_octrees(octrees, lengths)
    assert max_level == 3
    assert pyramids.dtype == torch.int32 and pyramids.device.type == "cpu"
    assert pyramids.tolist() == TWO_OCTREES_PYRAMIDS
    assert exsum.dtype == torch.int32 and exsum.tolist() == TWO_OCTREES_EXSUM


def test_generate_points_of_two_packed_octrees(ops):
    octrees, lengths = two_octrees()
    _, pyramids, exsum = ops.scan_octrees(octrees, lengths)
    points = ops.generate_points(octrees, pyramids, exsum)
    assert points.dtype == torch.int16
    assert points.tolist() == TWO_OCTREES_POINTS


def test_query_with_integer_and_float_coordinates(ops):
    octree, pyramids, exsum = _spc(ops, QUERY_POINTS, 2)
    queries = torch.tensor(QUERY_POINTS + [[2, 2, 2], [1, 1, 1]], dtype=torch.int16)
    as_float = 2.0 * (queries.float() / 4) - 1.0
    expected = [7, 6, 5, 8, -1, -1]
    for coords in (queries, as_float, as_float.double(), as_float.half()):
        result = ops.unbatched_query(octree, exsum, coords, 2)
        assert result.dtype == torch.int64 and result.tolist() == expected
    hierarchy = ops.generate_points(octree, pyramids, exsum)
    assert torch.equal(hierarchy[torch.tensor(expected[:4])], queries[:4])


def test_query_floor_edge(ops):
    octree, _, exsum = _spc(ops, [[0, 0, 0]], 1)
    coords = torch.tensor([-3.0, -2.5, 2.5, 3.0, 0.0, 0.5]).unsqueeze(1).repeat(1, 3)
    assert ops.unbatched_query(octree, exsum, coords, 0).tolist() == [-1, -1, -1, -1, 0, 0]


def test_docstring_example_with_and_without_parents(ops):
    octree, _, exsum = _spc(ops, [[3, 2, 0], [3, 1, 1], [3, 3, 3]], 2)
    query = torch.tensor([[3, 2, 0]], dtype=torch.int16)
    assert ops.unbatched_query(octree, exsum, query, 2).tolist() == [5]
    assert ops.unbatched_query(octree, exsum, query, 2, with_parents=True).tolist() == [[0, 2, 5]]


def test_with_parents_columns_are_the_single_level_queries(ops):
    level = 3
    octree, _, exsum = _spc(ops, QUERY_POINTS, level)
    queries = torch.tensor(
        QUERY_POINTS + [[0, 4, 4], [2, 2, 2], [1, 1, 1], [16, 16, 16]], dtype=torch.int16
    )
    as_float = 2.0 * (queries.float() / 2**level) - 1.0
    every = ops.unbatched_query(octree, exsum, as_float, level, with_parents=True)
    shallower = ops.unbatched_query(octree, exsum, as_float, level - 1, with_parents=True)
    assert every.shape == (8, level + 1) and every.dtype == torch.int64
    for lvl in range(level + 1):
        single = ops.unbatched_query(octree, exsum, as_float, lvl)
        assert torch.equal(every[:, lvl], single)
        if lvl < level:
            assert torch.equal(shallower[:, lvl], single)
    assert torch.equal(
        ops.unbatched_query(octree, exsum, queries, level, with_parents=True)[:, 3],
        ops.unbatched_query(octree, exsum, queries, level),
    )
    assert every[-1].tolist() == [-1] * (level + 1)  # (16,16,16) lies outside the grid
    found = every[:, -1] >= 0
    assert (every[found] >= 0).all()  # present leaves have every ancestor


def test_with_parents_truncates_where_the_single_query_floors(ops):
    octree, _, exsum = _spc(ops, [[0, 0, 0]], 1)
    below = torch.full((1, 3), -1.0 - 1e-3)
    assert ops.unbatched_query(octree, exsum, below, 1).tolist() == [-1]
    assert ops.unbatched_query(octree, exsum, below, 1, with_parents=True).tolist() == [[0, 1]]
    far_below = torch.full((1, 3), -2.5)
    assert ops.unbatched_query(octree, exsum, far_below, 1, with_parents=True).tolist() == [
        [-1, -1]
    ]


def test_undefined_queries_give_minus_one(ops):
    octree, _, exsum = _spc(ops, [[0, 0, 0], [32767, 32767, 32767]], 15)
    coords = torch.tensor(
        [
            [float("nan"), 0.0, 0.0],
            [5.0, 5.0, 5.0],
            [-5.0, -5.0, -5.0],
            [float("inf"), 1.0, 1.0],
            [-1.0, -1.0, -1.0],
            [0.99999, 0.99999, 0.99999],
        ]
    )
    expected_leaf = [-1, -1, -1, -1, 29, 30]  # two points per level
    assert ops.unbatched_query(octree, exsum, coords, 15).tolist() == expected_leaf
    parents = ops.unbatched_query(octree, exsum, coords, 15, with_parents=True)
    assert parents[:4].eq(-1).all()
    assert parents[4:, -1].tolist() == [29, 30]


def test_quantize_points(ops):
    x = torch.tensor(
        [
            [-1.1] * 3,
            [-1.0] * 3,
            [0.0] * 3,
            [0.1, 0.3, 0.6],
            [0.1, -1.1, 1.1],
            [0.1, -1.0, 1.0],
            [1.0] * 3,
            [1.1] * 3,
        ]
    )
    expected = [
        [0, 0, 0],
        [0, 0, 0],
        [4, 4, 4],
        [4, 5, 6],
        [4, 0, 7],
        [4, 0, 7],
        [7, 7, 7],
        [7, 7, 7],
    ]
    for dtype in (torch.float16, torch.float32, torch.float64):
        q = ops.quantize_points(x.to(dtype), 3)
        assert q.dtype == torch.int16 and q.tolist() == expected


def test_points_to_corners(ops):
    corners = ops.points_to_corners(torch.tensor([[0, 0, 0], [0, 2, 0]], dtype=torch.int16))
    assert corners.dtype == torch.int16 and corners.shape == (2, 8, 3)
    assert corners[1].tolist() == [
        [0, 2, 0],
        [0, 2, 1],
        [0, 3, 0],
        [0, 3, 1],
        [1, 2, 0],
        [1, 2, 1],
        [1, 3, 0],
        [1, 3, 1],
    ]
    assert torch.equal(corners[0], corners[1] - torch.tensor([0, 2, 0], dtype=torch.int16))


def test_get_level_points(ops):
    octrees, lengths = two_octrees()
    _, pyramids, exsum = ops.scan_octrees(octrees, lengths)
    points = ops.generate_points(octrees, pyramids, exsum)
    first = points[: pyramids[0, 1, -1]]
    assert ops.unbatched_get_level_points(first, pyramids[0], 0).tolist() == [[0, 0, 0]]
    assert ops.unbatched_get_level_points(first, pyramids[0], 2).tolist() == TWO_OCTREES_POINTS[3:6]
    assert ops.unbatched_get_level_points(first, pyramids[0], 3).tolist() == TWO_OCTREES_POINTS[6:9]


def test_octree_bytes_of_a_small_point_set(ops):
    # (0,0,0) and (3,3,3) at level 2: root has children 0 and 7; each has one child.
    octree = ops.unbatched_points_to_octree(
        torch.tensor([[3, 3, 3], [0, 0, 0], [3, 3, 3]], dtype=torch.int16), 2
    )
    assert octree.dtype == torch.uint8
    assert octree.tolist() == [0b10000001, 0b1, 0b10000000]
    sorted_octree = ops.unbatched_points_to_octree(
        torch.tensor([[0, 0, 0], [0, 0, 0], [3, 3, 3]], dtype=torch.int16), 2, sorted=True
    )
    assert torch.equal(sorted_octree, octree)


def test_legacy_exsum_is_accepted_with_a_warning(ops):
    octrees, lengths = two_octrees()
    with pytest.warns(DeprecationWarning):
        _, pyramids, legacy = ops.scan_octrees(octrees, lengths, legacy_exsum=True)
    assert legacy.tolist() == [0] + TWO_OCTREES_EXSUM[:6] + [0] + TWO_OCTREES_EXSUM[6:]
    with pytest.warns(DeprecationWarning):
        points = ops.generate_points(octrees, pyramids, legacy)
    assert points.tolist() == TWO_OCTREES_POINTS
    octree, _, exsum = _spc(ops, QUERY_POINTS, 2)
    with pytest.warns(DeprecationWarning):
        result = ops.unbatched_query(
            octree,
            torch.cat([exsum.new_zeros(1), exsum]),
            torch.tensor(QUERY_POINTS, dtype=torch.int16),
            2,
        )
    assert result.tolist() == [7, 6, 5, 8]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.unbatched_query(octree, exsum, torch.tensor(QUERY_POINTS, dtype=torch.int16), 2)
