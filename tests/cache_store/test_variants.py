"""Variants at rest and in the reader: record keys, the index's counts, the per-epoch
pick, the augmentation rule and its parameters (no engine here: tests/workers/
test_variants.py computes records; tests/spcache/test_variants_training.py runs what
users run)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from cache_store.errors import InvalidSampleId, ParameterError
from cache_store.format.index import DatasetIndex, decode_index, encode_index
from cache_store.keys import (
    MAX_VARIANTS,
    compute_fingerprint,
    record_key,
    split_key,
    split_record_id,
    validate_record_id,
    validate_sample_id,
    validate_variant_count,
    variant_counts,
)
from cache_store.readers.variants import EpochIndex, epoch_of, pick_variant, variant_problems
from cache_store.recipes.augment import augment_points, decompose_augmentation
from cache_store.recipes.registry import get_recipe_spec

FP = "0" * 32


def test_a_variant_has_its_own_key_and_variant_0_keeps_the_sample_key() -> None:
    assert record_key(FP, "chairs/a1") == f"{FP}/chairs/a1"
    assert record_key(FP, "chairs/a1", 0) == f"{FP}/chairs/a1"
    assert record_key(FP, "chairs/a1", 3) == f"{FP}/chairs/a1#v3"
    assert split_key(f"{FP}/chairs/a1#v3") == (FP, "chairs/a1#v3")
    assert split_record_id("chairs/a1#v3") == ("chairs/a1", 3)
    assert split_record_id("chairs/a1#v03") == ("chairs/a1#v03", 0)  # one spelling only
    assert split_record_id("a#vx") == ("a#vx", 0)
    assert validate_record_id("a1#v7") == "a1#v7"
    with pytest.raises(ParameterError, match="variant"):
        record_key(FP, "a1", MAX_VARIANTS)


def test_a_sample_id_that_ends_like_a_variant_is_refused_with_its_reason() -> None:
    with pytest.raises(InvalidSampleId, match="#v<number>"):
        validate_sample_id("chairs/a1#v2")
    assert validate_sample_id("chairs/a1#v") == "chairs/a1#v"
    assert validate_sample_id("a#v2b") == "a#v2b"


@pytest.mark.parametrize("bad", [0, -1, MAX_VARIANTS + 1, 2.0, True, "4", None])
def test_a_variant_count_is_an_int_in_range(bad: object) -> None:
    with pytest.raises(ParameterError, match=r"variants: expected an integer from 1 to 1024"):
        validate_variant_count(bad)
    assert validate_variant_count(MAX_VARIANTS) == MAX_VARIANTS


def test_variant_counts_count_the_unbroken_run_from_variant_0() -> None:
    ids = ["b", "a#v1", "a", "a#v3", "b#v1", "b#v2", "c#v1"]
    assert variant_counts(ids) == {"b": 3, "a": 2}  # c has no variant 0: not a sample


def test_the_index_stores_counts_only_where_a_sample_has_variants() -> None:
    params = {"level": 5}
    fp = compute_fingerprint("spc", 1, params)
    ids = np.array(["a", "b"])
    plain = DatasetIndex(fp, "spc", 1, params, ids, created="t")
    ones = DatasetIndex(fp, "spc", 1, params, ids, created="t", variants=np.ones(2, np.uint16))
    assert encode_index(ones) == encode_index(plain)  # stored as before variants existed
    assert decode_index(encode_index(plain)).variants is None
    many = DatasetIndex(fp, "spc", 1, params, ids, created="t", variants=np.array([4, 6]))
    back = decode_index(encode_index(many))
    assert back.variant_counts().tolist() == [4, 6]
    assert back.describe()["variants"] == 4 and back.describe()["variants_max"] == 6
    with pytest.raises(ParameterError, match="counts from 1"):
        DatasetIndex(fp, "spc", 1, params, ids, variants=np.array([0, 2]))


def test_the_pick_is_a_pure_function_of_seed_epoch_and_id() -> None:
    ids = [f"s{i}" for i in range(200)]
    epoch0 = [pick_variant(0, 0, sid, 4) for sid in ids]
    assert epoch0 == [pick_variant(0, 0, sid, 4) for sid in ids]  # every process alike
    assert set(epoch0) == {0, 1, 2, 3}
    assert epoch0 != [pick_variant(0, 1, sid, 4) for sid in ids]  # a fresh draw per epoch
    assert epoch0 != [pick_variant(1, 0, sid, 4) for sid in ids]  # and per seed
    assert {pick_variant(5, e, "x", 1) for e in range(20)} == {0}


def test_an_epoch_index_is_an_int_that_carries_its_epoch_through_pickle() -> None:
    index = EpochIndex(7, epoch=3)
    assert index == 7 and [10, 11, 12, 13, 14, 15, 16, 17][index] == 17
    back = pickle.loads(pickle.dumps([index]))[0]
    assert type(back) is EpochIndex and back.epoch == 3 and int(back) == 7
    assert epoch_of(back, 0) == 3 and epoch_of(7, 5) == 5


def test_reader_variant_arguments_are_checked() -> None:
    assert variant_problems(None, None, 0) == []
    assert variant_problems(2, 4, 1) == []
    assert variant_problems(4, 4, 0) == ["variant: 4 is not one of the 4 variants (0 .. 3)"]
    assert variant_problems(-1, None, "x")[1] == "variant_seed: expected an integer, got 'x'"


def _points(n: int = 500) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.uniform(-0.7, 0.7, size=(n, 3))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_variant_0_is_untouched_and_draws_nothing() -> None:
    pts = _points()
    gen = _gen(1)
    out = augment_points(pts, {"rotation": "so3", "jitter": 0.05}, gen, 0)
    assert np.array_equal(out.points, pts) and np.array_equal(out.matrix, np.eye(4))
    assert torch.equal(gen.get_state(), _gen(1).get_state())


def test_so3_scale_and_jitter_are_seeded_and_the_matrix_maps_the_points() -> None:
    pts = _points()
    params = {"rotation": "so3", "scale_min": 0.8, "scale_max": 1.3}
    a = augment_points(pts, params, _gen(5), 2)
    b = augment_points(pts, params, _gen(5), 2)
    assert np.array_equal(a.points, b.points) and np.array_equal(a.matrix, b.matrix)
    assert not np.allclose(a.points, augment_points(pts, params, _gen(6), 2).points)
    # no jitter: the matrix is exactly what was applied, and its inverse undoes it
    homogeneous = np.c_[pts, np.ones(len(pts))]
    assert np.allclose((homogeneous @ a.matrix.T)[:, :3], a.points)
    assert np.allclose((np.c_[a.points, np.ones(len(pts))] @ np.linalg.inv(a.matrix).T)[:, :3], pts)
    assert np.abs(a.points).max() <= 1.0  # fitted into the cube
    rotation_only = augment_points(pts, {"rotation": "so3"}, _gen(5), 1).matrix[:3, :3]
    fit = np.cbrt(np.linalg.det(rotation_only))  # a uniform shrink, where a corner left
    assert np.allclose(rotation_only @ rotation_only.T / fit**2, np.eye(3))
    jittered = augment_points(pts, {"jitter": 0.01}, _gen(5), 1)
    assert np.allclose(jittered.matrix, np.eye(4)) and 0 < np.abs(jittered.points - pts).max() < 0.1


def test_z_rotation_keeps_z() -> None:
    pts = _points()
    out = augment_points(pts, {"rotation": "z"}, _gen(3), 1)
    assert np.allclose(out.points[:, 2], pts[:, 2])
    assert not np.allclose(out.points[:, :2], pts[:, :2])


def _axis_angle(axis: list[float], degrees: float) -> np.ndarray:
    a = np.asarray(axis, dtype=np.float64) / np.linalg.norm(axis)
    k = np.array([[0, -a[2], a[1]], [a[2], 0, -a[0]], [-a[1], a[0], 0]])
    t = np.radians(degrees)
    return np.eye(3) + np.sin(t) * k + (1 - np.cos(t)) * k @ k


@pytest.mark.parametrize("degrees", [0.0, 37.0, 120.0, 180.0])
def test_an_augmentation_matrix_comes_apart_into_its_rotation_and_scale(degrees: float) -> None:
    axis, scale = [0.3, -0.5, 0.81], np.array([0.7, 1.2, 0.95])
    matrix = np.eye(4)
    matrix[:3, :3] = 0.8 * np.diag(scale) @ _axis_angle(axis, degrees)  # fit * S @ R
    parts = decompose_augmentation(matrix.astype(np.float32))
    assert parts.angle_deg == pytest.approx(degrees, abs=1e-3)
    assert np.allclose(parts.scale, 0.8 * scale, atol=1e-5)
    if degrees == 0.0:
        assert np.array_equal(parts.axis, np.zeros(3))
    else:  # the axis, up to its sign at a half turn
        want = np.asarray(axis) / np.linalg.norm(axis)
        assert np.allclose(
            parts.axis, want if degrees < 180 else np.sign(parts.axis @ want) * want, atol=1e-4
        )
    assert np.allclose(parts.rotation, _axis_angle(axis, degrees), atol=1e-5)


def test_a_z_variant_turns_about_z_by_the_angle_it_moved_the_points() -> None:
    pts = _points()
    out = augment_points(pts, {"rotation": "z"}, _gen(3), 1)
    parts = decompose_augmentation(out.matrix)
    assert np.allclose(np.abs(parts.axis), [0, 0, 1])
    moved = np.degrees(
        np.arctan2(out.points[:, 1], out.points[:, 0]) - np.arctan2(pts[:, 1], pts[:, 0])
    )
    turn = np.mod(moved * parts.axis[2], 360.0)[np.hypot(pts[:, 0], pts[:, 1]) > 0.1]
    assert np.allclose(turn, parts.angle_deg, atol=1e-3)


@pytest.mark.parametrize(
    "bad",
    [
        np.eye(3),
        np.full((4, 4), np.nan),
        np.diag([0.0, 1, 1, 1]),
        np.array([[1, 1, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]),
    ],
    ids=["3x3", "nan", "zero-row", "shear"],
)
def test_a_matrix_that_is_no_augmentation_is_refused(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="augmentation"):
        decompose_augmentation(bad)


def test_augmentation_parameters_leave_default_fingerprints_and_records_alone() -> None:
    spec = get_recipe_spec("spc")
    assert spec.resolve({}) == {"level": 8, "surface_samples": 100_000}
    assert spec.resolve({"rotation": "none", "jitter": 0.0}) == spec.resolve({})
    assert "augmentation" not in spec.fields_for(spec.resolve({}))
    augmented = spec.resolve({"rotation": "so3"})
    assert augmented["rotation"] == "so3" and "augmentation" in spec.fields_for(augmented)
    # the seeds ignore augmentation: variant 0 of an augmented run is the plain record
    assert spec.seed_params(augmented) == spec.resolve({})
    with pytest.raises(ParameterError, match="rotation: 'x' is not one of 'none', 'z', 'so3'"):
        spec.resolve({"rotation": "x"})
    with pytest.raises(ParameterError, match="scale_min: 1.5 is above scale_max 1.2"):
        spec.resolve({"scale_min": 1.5, "scale_max": 1.2})
