"""Bad input gets a clear error naming the argument, the expected and the actual value."""

from __future__ import annotations

import pytest
import torch

from cache_store.errors import InvalidTensor, SpcacheError, TensorTypeError
from tests.helpers.kaolin_data import two_octrees


def _octree(ops, level=3):
    points = torch.tensor([[0, 0, 0], [1, 2, 3], [7, 7, 7]], dtype=torch.int16)
    octree = ops.unbatched_points_to_octree(points, level)
    _, pyramids, exsum = ops.scan_octrees(octree, torch.tensor([len(octree)]))
    return octree, pyramids, exsum


def test_errors_belong_to_the_project_root_and_the_builtin_meaning():
    assert issubclass(InvalidTensor, ValueError) and issubclass(InvalidTensor, SpcacheError)
    assert issubclass(TensorTypeError, TypeError) and issubclass(TensorTypeError, SpcacheError)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.uint8])
def test_points_must_be_int16(ops, dtype):
    with pytest.raises(TypeError, match=r"points: expected dtype torch.int16, got " + str(dtype)):
        ops.unbatched_points_to_octree(torch.zeros(4, 3, dtype=dtype), 3)
    with pytest.raises(TypeError, match="points"):
        ops.points_to_morton(torch.zeros(4, 3, dtype=dtype))


def test_points_must_be_a_tensor(ops):
    with pytest.raises(TypeError, match="points: expected a torch.Tensor, got list"):
        ops.unbatched_points_to_octree([[0, 0, 0]], 1)


@pytest.mark.parametrize("shape", [(4,), (4, 2), (2, 4, 3), (4, 4)])
def test_points_shape(ops, shape):
    with pytest.raises(ValueError, match=r"points: expected shape \(num_points, 3\), got"):
        ops.unbatched_points_to_octree(torch.zeros(shape, dtype=torch.int16), 3)


def test_empty_point_set(ops):
    with pytest.raises(ValueError, match="points: expected at least one point"):
        ops.unbatched_points_to_octree(torch.zeros(0, 3, dtype=torch.int16), 3)


@pytest.mark.parametrize("bad", [[8, 0, 0], [0, -1, 0], [0, 0, 100]])
def test_coordinates_outside_the_grid(ops, bad):
    points = torch.tensor([[0, 0, 0], bad], dtype=torch.int16)
    with pytest.raises(
        ValueError, match=r"points: coordinates must lie in \[0, 8\) for level 3.*row 1"
    ):
        ops.unbatched_points_to_octree(points, 3)


@pytest.mark.parametrize("level", [0, -1, 16, 40])
def test_octree_level_outside_int16(ops, level):
    with pytest.raises(ValueError, match=rf"level: expected an integer in \[1, 15\].*got {level}"):
        ops.unbatched_points_to_octree(torch.zeros(1, 3, dtype=torch.int16), level)


@pytest.mark.parametrize("level", [2.0, "3", True, None])
def test_level_must_be_an_int(ops, level):
    with pytest.raises(TypeError, match="level: expected an int"):
        ops.quantize_points(torch.zeros(1, 3), level)


def test_quantize_refuses_nan_integers_and_bad_levels(ops):
    with pytest.raises(ValueError, match="x: contains NaN"):
        ops.quantize_points(torch.tensor([[0.0, float("nan"), 0.0]]), 3)
    with pytest.raises(
        TypeError, match="x: expected dtype float16, float32 or float64, got torch.int64"
    ):
        ops.quantize_points(torch.zeros(2, 3, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="level"):
        ops.quantize_points(torch.zeros(2, 3), 16)
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., 3\)"):
        ops.quantize_points(torch.zeros(2, 2), 3)


def test_unsorted_points_with_sorted_true(ops):
    points = torch.tensor([[7, 7, 7], [0, 0, 0]], dtype=torch.int16)
    with pytest.raises(ValueError, match="sorted=True but the points are not in Morton order"):
        ops.unbatched_points_to_octree(points, 3, sorted=True)


def test_morton_codes_out_of_range(ops):
    with pytest.raises(TypeError, match="morton: expected dtype torch.int64, got torch.int32"):
        ops.morton_to_points(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"morton: Morton codes must lie in \[0, 2\*\*45\)"):
        ops.morton_to_points(torch.tensor([0, -5]))
    with pytest.raises(ValueError, match="Morton codes"):
        ops.morton_to_points(torch.tensor([1 << 45]))
    with pytest.raises(ValueError, match=r"points: coordinates must lie in \[0, 32768\)"):
        ops.points_to_morton(torch.tensor([[0, -1, 0]], dtype=torch.int16))


def test_octree_dtype_shape_and_emptiness(ops):
    with pytest.raises(TypeError, match="octrees: expected dtype torch.uint8, got torch.int32"):
        ops.scan_octrees(torch.ones(3, dtype=torch.int32), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"octrees: expected shape \(num_bytes,\)"):
        ops.scan_octrees(torch.ones(3, 1, dtype=torch.uint8), torch.tensor([3]))
    with pytest.raises(ValueError, match="octrees: expected at least one byte"):
        ops.scan_octrees(torch.ones(0, dtype=torch.uint8), torch.tensor([0]))


def test_lengths_must_add_up(ops):
    octrees, lengths = two_octrees()
    with pytest.raises(ValueError, match="lengths: octree lengths sum to 10 but octrees holds 11"):
        ops.scan_octrees(octrees, torch.tensor([6, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="lengths: every octree needs at least one byte"):
        ops.scan_octrees(octrees, torch.tensor([11, 0], dtype=torch.int32))
    with pytest.raises(TypeError, match="lengths: expected dtype"):
        ops.scan_octrees(octrees, torch.tensor([6.0, 5.0]))


def test_octree_bytes_that_do_not_add_up(ops):
    octrees, _ = two_octrees()
    # Split the 11 bytes wrongly: the first octree's level 2 has 3 points but only 2 bytes.
    with pytest.raises(ValueError, match="octree 0's bytes do not add up to its length 5"):
        ops.scan_octrees(octrees, torch.tensor([5, 6], dtype=torch.int32))
    # One octree whose bytes announce more levels than it has bytes for.
    with pytest.raises(ValueError, match="do not add up"):
        ops.scan_octrees(torch.tensor([255, 1], dtype=torch.uint8), torch.tensor([2]))


def test_zero_byte_levels_and_over_deep_octrees(ops):
    with pytest.raises(ValueError, match="has no points at level 1"):
        ops.scan_octrees(torch.tensor([0], dtype=torch.uint8), torch.tensor([1]))
    # A chain of single-child bytes 16 levels deep (Kaolin would overrun its pyramid).
    with pytest.raises(ValueError, match="deeper than 15 levels"):
        ops.scan_octrees(torch.ones(16, dtype=torch.uint8), torch.tensor([16]))
    max_level, _, _ = ops.scan_octrees(torch.ones(15, dtype=torch.uint8), torch.tensor([15]))
    assert max_level == 15


def test_mixed_depth_batches_are_refused(ops):
    shallow = torch.tensor([1], dtype=torch.uint8)
    deep = torch.tensor([1, 1], dtype=torch.uint8)
    with pytest.raises(
        ValueError, match="share one depth.*octree 0 has depth 1, octree 1 is deeper"
    ):
        ops.scan_octrees(torch.cat([shallow, deep]), torch.tensor([1, 2]))


def test_generate_points_checks_pyramids_and_exsum(ops):
    octrees, lengths = two_octrees()
    _, pyramids, exsum = ops.scan_octrees(octrees, lengths)
    bad_exsum = exsum.clone()
    bad_exsum[3] += 1
    with pytest.raises(ValueError, match="exsum: not the inclusive bit sums"):
        ops.generate_points(octrees, pyramids, bad_exsum)
    with pytest.raises(ValueError, match=r"exsum: expected shape \(11,\)"):
        ops.generate_points(octrees, pyramids, exsum[:-1])
    bad_pyramids = pyramids.clone()
    bad_pyramids[0, 0, 2] = 4
    with pytest.raises(ValueError, match="pyramids: not the pyramids of octrees"):
        ops.generate_points(octrees, bad_pyramids, exsum)
    with pytest.raises(ValueError, match="pyramids: they describe octrees of"):
        ops.generate_points(octrees[:-1], pyramids, exsum)
    with pytest.raises(TypeError, match="pyramids: expected dtype torch.int32, got torch.int64"):
        ops.generate_points(octrees, pyramids.long(), exsum)
    with pytest.raises(TypeError, match="exsum: expected dtype torch.int32"):
        ops.generate_points(octrees, pyramids, exsum.long())


def test_query_checks(ops):
    octree, _, exsum = _octree(ops)
    coords = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="level: the octree has depth 3, got level 4"):
        ops.unbatched_query(octree, exsum, coords, 4)
    with pytest.raises(ValueError, match=r"query_coords: expected shape \(num_query, 3\)"):
        ops.unbatched_query(octree, exsum, torch.zeros(4, 2), 3)
    with pytest.raises(TypeError, match="query_coords: expected a float16/32/64 or integer dtype"):
        ops.unbatched_query(octree, exsum, torch.zeros(4, 3, dtype=torch.bool), 3)
    with pytest.raises(ValueError, match="exsum: not the inclusive bit sums"):
        ops.unbatched_query(octree, exsum + 1, coords, 3)
    with pytest.raises(ValueError, match=r"exsum: expected shape"):
        ops.unbatched_query(octree, exsum[1:], coords, 3)
    empty = ops.unbatched_query(octree, exsum, torch.zeros(0, 3), 3, with_parents=True)
    assert empty.shape == (0, 4) and empty.dtype == torch.int64


def test_get_level_points_checks(ops):
    octree, pyramids, exsum = _octree(ops)
    points = ops.generate_points(octree, pyramids, exsum)
    with pytest.raises(ValueError, match=r"level: expected an integer in \[0, 3\]"):
        ops.unbatched_get_level_points(points, pyramids[0], 4)
    with pytest.raises(ValueError, match=r"pyramid: expected shape \(2, max_level \+ 2\)"):
        ops.unbatched_get_level_points(points, pyramids, 1)
    with pytest.raises(ValueError, match="but point_hierarchy has 3"):
        ops.unbatched_get_level_points(points[:3], pyramids[0], 3)


def test_corners_checks(ops):
    with pytest.raises(TypeError, match="points: expected dtype torch.int16"):
        ops.points_to_corners(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"points: expected shape \(num_points, 3\)"):
        ops.points_to_corners(torch.zeros(2, 2, 3, dtype=torch.int16))


def test_levels_may_be_numpy_or_tensor_integers(ops):
    import numpy as np

    x = torch.tensor([[0.3, -0.2, 0.9]])
    expected = ops.quantize_points(x, 4)
    assert torch.equal(ops.quantize_points(x, np.int64(4)), expected)
    assert torch.equal(ops.quantize_points(x, torch.tensor(4)), expected)
    with pytest.raises(TypeError, match="level: expected an int, got Tensor"):
        ops.quantize_points(x, torch.tensor([4]))
    with pytest.raises(TypeError, match="level: expected an int"):
        ops.quantize_points(x, torch.tensor(4.0))
