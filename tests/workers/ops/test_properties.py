"""Property tests: the torch backend against the slow reference in reference.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import ops_reference as ref
from tests.helpers.strategies import point_sets
from workers.ops import torch_spc as ops

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _tensor(points) -> torch.Tensor:
    return torch.tensor(points, dtype=torch.int16).reshape(-1, 3)


def _build(points, level):
    octree = ops.unbatched_points_to_octree(_tensor(points), level)
    max_level, pyramids, exsum = ops.scan_octrees(octree, torch.tensor([len(octree)]))
    return octree, max_level, pyramids, exsum


@SETTINGS
@given(st.lists(st.tuples(*[st.integers(0, 2**15 - 1)] * 3), min_size=1, max_size=50))
def test_morton_round_trip(points):
    codes = ops.points_to_morton(_tensor(points))
    assert codes.tolist() == [ref.morton(p) for p in points]
    assert ops.morton_to_points(codes).tolist() == [list(p) for p in points]


@SETTINGS
@given(st.lists(st.integers(0, 2**45 - 1), min_size=1, max_size=50))
def test_points_of_morton_codes(codes):
    points = ops.morton_to_points(torch.tensor(codes, dtype=torch.int64))
    assert points.tolist() == [list(ref.unmorton(c)) for c in codes]
    assert ops.points_to_morton(points).tolist() == codes


@SETTINGS
@given(point_sets(), st.booleans())
def test_octree_scan_and_points_match_the_reference(case, presort):
    level, points = case
    tensor = _tensor(points)
    if presort:  # sorted=True input: Morton order, duplicates kept
        tensor = tensor[torch.argsort(ops.points_to_morton(tensor), stable=True)]
    octree = ops.unbatched_points_to_octree(tensor, level, sorted=presort)
    assert octree.dtype == torch.uint8
    assert octree.tolist() == ref.octree(points, level)
    max_level, pyramids, exsum = ops.scan_octrees(
        octree, torch.tensor([len(octree)], dtype=torch.int32)
    )
    assert max_level == level
    assert pyramids.tolist() == [ref.pyramid(points, level)]
    assert exsum.tolist() == ref.exsum(octree.tolist())
    hierarchy = ops.generate_points(octree, pyramids, exsum)
    assert hierarchy.tolist() == [list(p) for p in ref.point_hierarchy(points, level)]
    # the last level is the sorted unique input
    leaves = ops.unbatched_get_level_points(hierarchy, pyramids[0], level)
    unique = sorted(set(points), key=ref.morton)
    assert leaves.tolist() == [list(p) for p in unique]


@SETTINGS
@given(
    st.integers(1, 6).flatmap(
        lambda level: st.tuples(
            st.just(level),
            st.lists(
                point_sets(level, level, 40).map(lambda case: case[1]), min_size=1, max_size=4
            ),
        )
    )
)
def test_batched_octrees_of_several_shapes(case):
    level, point_lists = case
    octrees = [ops.unbatched_points_to_octree(_tensor(p), level) for p in point_lists]
    lengths = torch.tensor([len(o) for o in octrees], dtype=torch.int32)
    packed = torch.cat(octrees)
    max_level, pyramids, exsum = ops.scan_octrees(packed, lengths)
    assert max_level == level
    assert pyramids.shape == (len(point_lists), 2, level + 2)
    assert pyramids.tolist() == [ref.pyramid(p, level) for p in point_lists]
    assert exsum.tolist() == [e for o in octrees for e in ref.exsum(o.tolist())]
    hierarchies = ops.generate_points(packed, pyramids, exsum)
    expected = [list(q) for p in point_lists for q in ref.point_hierarchy(p, level)]
    assert hierarchies.tolist() == expected


@SETTINGS
@given(point_sets(max_points=60), st.data())
def test_query_every_input_point_and_absent_voxels(case, data):
    level, points = case
    octree, _, pyramids, exsum = _build(points, level)
    hierarchy = ops.generate_points(octree, pyramids, exsum)
    present = _tensor(points)
    idx = ops.unbatched_query(octree, exsum, present, level)
    assert (idx >= 0).all()
    assert torch.equal(hierarchy[idx], present)
    parents = ops.unbatched_query(octree, exsum, present, level, with_parents=True)
    assert torch.equal(parents[:, -1], idx)
    for lvl in range(level + 1):  # every ancestor is the point's voxel at that level
        assert torch.equal(hierarchy[parents[:, lvl]], present >> (level - lvl))
    coord = st.integers(0, 2**level - 1)
    others = data.draw(st.lists(st.tuples(coord, coord, coord), min_size=1, max_size=30))
    absent = [p for p in others if p not in set(points)]
    if absent:
        assert ops.unbatched_query(octree, exsum, _tensor(absent), level).eq(-1).all()


@SETTINGS
@given(
    point_sets(max_level=8, max_points=40),
    st.data(),
    st.booleans(),
    st.sampled_from([np.float16, np.float32, np.float64]),
)
def test_float_queries_match_the_reference(case, data, with_parents, dtype):
    depth, points = case
    level = data.draw(st.integers(0, depth))
    edge = [-1.0, 1.0, -1.0 - 2.0**-level, 1.0 - 2.0**-20, -1.0 + 2.0**-20]
    value = st.one_of(
        st.floats(-1.5, 1.5, width=16 if dtype is np.float16 else 32),
        st.sampled_from(edge + [float("nan"), float("inf"), -float("inf")]),
    )
    coords = data.draw(st.lists(st.tuples(value, value, value), min_size=1, max_size=30))
    tensor = torch.from_numpy(np.array(coords, dtype=dtype))
    octree, _, _, exsum = _build(points, depth)
    got = ops.unbatched_query(octree, exsum, tensor, level, with_parents=with_parents)
    as_given = [tuple(row) for row in tensor.tolist()]
    compute = np.float64 if dtype is np.float64 else np.float32
    assert got.tolist() == ref.query(points, depth, as_given, level, compute, with_parents)


@SETTINGS
@given(point_sets(max_level=8, max_points=40), st.data())
def test_integer_queries_match_their_float_form(case, data):
    depth, points = case
    level = data.draw(st.integers(0, depth))
    coord = st.integers(-3, 2**level + 2)
    coords = data.draw(st.lists(st.tuples(coord, coord, coord), min_size=1, max_size=30))
    octree, _, _, exsum = _build(points, depth)
    for dtype in (torch.int16, torch.int32, torch.int64):
        ints = torch.tensor(coords, dtype=dtype)
        as_float = (ints.float() / 2**level) * 2.0 - 1.0
        for parents in (False, True):
            assert torch.equal(
                ops.unbatched_query(octree, exsum, ints, level, parents),
                ops.unbatched_query(octree, exsum, as_float, level, parents),
            )
    expected = [ref.levels(points, depth)[level].count(c) for c in coords]
    hits = ops.unbatched_query(octree, exsum, torch.tensor(coords, dtype=torch.int16), level)
    assert (hits >= 0).long().tolist() == expected


@SETTINGS
@given(
    st.lists(st.tuples(*[st.floats(-2, 2, width=32)] * 3), min_size=1, max_size=50),
    st.integers(0, 15),
    st.sampled_from([torch.float16, torch.float32, torch.float64]),
)
def test_quantize_points_formula(coords, level, dtype):
    x = torch.tensor(coords, dtype=torch.float32).to(dtype)
    q = ops.quantize_points(x, level)
    res = 2**level
    expected = torch.floor(torch.clamp(res * (x + 1.0) / 2.0, 0, res - 1.0)).short()
    assert torch.equal(q, expected)
    if dtype != torch.float16:  # float16 cannot hold 2**15 - 1: Kaolin's wrap, kept
        assert ((q.int() >= 0) & (q.int() < res)).all()


@SETTINGS
@given(st.lists(st.tuples(*[st.integers(0, 2**15 - 2)] * 3), min_size=0, max_size=30))
def test_corners(points):
    corners = ops.points_to_corners(_tensor(points))
    expected = [
        [[x + (c >> 2 & 1), y + (c >> 1 & 1), z + (c & 1)] for c in range(8)] for x, y, z in points
    ]
    assert corners.shape == (len(points), 8, 3)
    assert corners.tolist() == expected


@pytest.mark.parametrize("level", [1, 5, 10, 11, 15])
def test_int32_and_int64_morton_paths_agree_at_the_switch(level):
    gen = torch.Generator().manual_seed(level)
    points = torch.randint(0, 2**level, (500, 3), generator=gen, dtype=torch.int16)
    octree = ops.unbatched_points_to_octree(points, level)
    plist = [tuple(p) for p in points.tolist()]
    assert octree.tolist() == ref.octree(plist, level)


@pytest.mark.parametrize("with_parents", [False, True])
def test_query_blocks_do_not_change_results(monkeypatch, with_parents):
    gen = torch.Generator().manual_seed(3)
    points = torch.randint(0, 64, (300, 3), generator=gen, dtype=torch.int16)
    octree, _, _, exsum = _build(points.tolist(), 6)
    queries = torch.rand(1001, 3, generator=gen) * 2.2 - 1.1
    whole = ops.unbatched_query(octree, exsum, queries, 6, with_parents)
    monkeypatch.setattr(ops, "_QUERY_BLOCK", 64)
    blocked = ops.unbatched_query(octree, exsum, queries, 6, with_parents)
    assert torch.equal(blocked, whole)
    assert (whole >= 0).any() and (whole < 0).any()
    expected = ref.query(
        [tuple(p) for p in points.tolist()], 6, queries.tolist(), 6, np.float32, with_parents
    )
    assert blocked.tolist() == expected
