"""Sources: every supported format loads, bad files fail alone with a clear reason,
normalisation lands in [-1, 1] and sampling is seeded and area-weighted."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from cache_store.errors import SourceError
from tests.data.corpus import hostile_expectations
from cache_store.sources.files import hash_source_file
from workers.sampling import (
    compute_normalization,
    face_areas,
    normalize_points,
    sample_surface,
    shape_points,
)
from workers.source_load import SUPPORTED_EXTENSIONS, hash_bytes, load_source

TETRA_V = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], dtype=np.float64)
TETRA_F = np.array([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]], dtype=np.int64)


def test_every_mesh_loads_as_a_valid_mesh(meshes: list[Path]) -> None:
    assert meshes
    for path in meshes:
        src = load_source(path)
        assert src.kind == "mesh", path
        assert src.vertices.dtype == np.float64 and src.vertices.shape[1] == 3
        assert np.isfinite(src.vertices).all()
        assert src.faces.min() >= 0 and src.faces.max() < len(src.vertices)
        assert src.source_hash == hash_source_file(path)
        area = face_areas(torch.from_numpy(src.vertices), torch.from_numpy(src.faces)).sum()
        assert float(area) > 0


def test_every_corpus_point_cloud_loads_as_points(corpus_points: list[Path]) -> None:
    assert {p.suffix for p in corpus_points} == {".npy", ".npz", ".xyz", ".pts", ".ply"}
    for path in corpus_points:
        src = load_source(path)
        assert src.kind == "points" and src.faces is None, path
        assert src.vertices.dtype == np.float64 and src.vertices.shape[1] == 3
        assert len(src.vertices) >= 500 and np.isfinite(src.vertices).all()
        assert src.source_hash == hash_source_file(path)


# ../shared/data/bad_inputs by name; the generated corpus's files by their documented outcome
# (None: must load). Names the two share mean the same thing in both.
EXPECTED_BAD = {
    "degenerate_points.npy": "coincide",
    "empty.obj": "empty",
    "faces_out_of_range.obj": "out of bounds",
    "garbage.stl": "no geometry",
    "int_object_points.npy": "pickle",
    "nan_vertices.obj": "non-finite",
    "single_vertex.obj": "coincide",
    "text_not_mesh.ply": "not a PLY",
    "truncated_bunny.ply": "truncated",
    "wrong_shape_points.npy": "shape (100, 4)",
}
CORPUS_EXPECTED = hostile_expectations()


def test_bad_inputs_fail_with_file_and_reason_or_load(bad_inputs: list[Path]) -> None:
    assert bad_inputs
    for path in bad_inputs:
        try:
            src = load_source(path)
            norm = compute_normalization(path, src.used_points())
        except SourceError as exc:
            assert exc.path == str(path)
            assert str(path) in str(exc) and exc.reason
            expected = EXPECTED_BAD.get(path.name) or CORPUS_EXPECTED.get(path.name)
            if expected:
                assert expected in exc.reason, (path.name, exc.reason)
            assert path.name not in CORPUS_EXPECTED or CORPUS_EXPECTED[path.name], (
                f"{path.name} should have loaded, failed with {exc.reason}"
            )
            continue
        assert path.name not in EXPECTED_BAD, f"{path.name} should have failed"
        assert CORPUS_EXPECTED.get(path.name) is None, f"{path.name} should have failed"
        normalised = normalize_points(src.used_points(), norm)
        assert np.isfinite(normalised).all()
        assert np.abs(normalised).max() <= 1.0


def test_huge_coordinates_normalise_without_overflow(bad_inputs: list[Path]) -> None:
    path = next(p for p in bad_inputs if p.name == "huge_coords_points.npy")
    src = load_source(path)
    norm = compute_normalization(path, src.used_points())
    out = normalize_points(src.vertices, norm)
    assert np.isfinite(out).all() and np.isfinite(norm.center).all() and math.isfinite(norm.scale)
    assert out.max() == pytest.approx(1.0, abs=1e-6) or out.min() == pytest.approx(-1.0, abs=1e-6)


def test_normalisation_definition() -> None:
    pts = np.array([[1.0, 2.0, 3.0], [3.0, 2.5, 4.0], [2.0, 6.0, 3.5]])
    norm = compute_normalization("x", pts)
    np.testing.assert_array_equal(norm.center, [2.0, 4.0, 3.5])
    assert norm.scale == 2.0  # half of the largest extent (y: 2 .. 6)
    out = normalize_points(pts, norm)
    assert out[:, 1].min() == -1.0 and out[:, 1].max() == 1.0
    # stored as float32: exact values, so (source - center) / scale reproduces the record
    assert np.float32(norm.scale) == norm.scale
    assert (norm.center.astype(np.float32).astype(np.float64) == norm.center).all()


def test_normalisation_covers_points_when_center_rounds() -> None:
    pts = np.array([[1e3 + 0.01, 0, 0], [1e3 + 0.02, 1e-3, 0]])  # midpoint not a float32
    norm = compute_normalization("x", pts)
    assert norm.center[0] != 1e3 + 0.015
    assert np.abs((pts - norm.center) / norm.scale).max() <= 1.0
    # far from the origin and tiny: float32 cannot place the center on the shape
    with pytest.raises(SourceError, match="too small for its distance"):
        compute_normalization("x", np.array([[1e6 + 0.01, 0, 0], [1e6 + 0.02, 1e-3, 0]]))


def test_beyond_float32_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "big.npy"
    np.save(path, np.array([[1e39, 0, 0], [-1e39, 1, 1]]))
    src = load_source(path)
    with pytest.raises(SourceError, match="float32"):
        compute_normalization(path, src.vertices)


def test_point_cloud_formats(tmp_path: Path) -> None:
    pts = np.random.default_rng(0).normal(size=(50, 3))
    np.save(tmp_path / "a.npy", pts.astype(np.float32))
    np.savez(tmp_path / "b.npz", points=pts)
    np.savez(tmp_path / "c.npz", whatever=pts.astype(np.int32))
    np.savez(tmp_path / "m.npz", vertices=TETRA_V, faces=TETRA_F)
    (tmp_path / "d.xyz").write_text(
        "# comment\n" + "\n".join(f"{x} {y} {z} 0.5" for x, y, z in pts)
    )
    (tmp_path / "e.pts").write_text(f"{len(pts)}\n" + "\n".join(f"{x},{y},{z}" for x, y, z in pts))
    for name, exact in [("a.npy", False), ("b.npz", True), ("d.xyz", True), ("e.pts", True)]:
        src = load_source(tmp_path / name)
        assert src.kind == "points" and src.vertices.shape == (50, 3)
        np.testing.assert_allclose(
            src.vertices, pts, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6
        )
    assert load_source(tmp_path / "c.npz").kind == "points"
    mesh = load_source(tmp_path / "m.npz")
    assert mesh.kind == "mesh" and mesh.faces.shape == (4, 3)


def test_mesh_formats_through_trimesh(tmp_path: Path) -> None:
    import trimesh

    mesh = trimesh.Trimesh(TETRA_V, TETRA_F, process=False)
    for ext in ("obj", "ply", "stl", "off", "glb"):
        path = tmp_path / f"t.{ext}"
        mesh.export(path)
        src = load_source(path)
        assert src.kind == "mesh", ext
        area = float(face_areas(torch.from_numpy(src.vertices), torch.from_numpy(src.faces)).sum())
        assert area == pytest.approx(1.5 + math.sqrt(3) / 2, rel=1e-6), ext
    cloud = trimesh.PointCloud(TETRA_V)
    cloud.export(tmp_path / "p.ply")
    assert load_source(tmp_path / "p.ply").kind == "points"


def test_scene_transforms_are_applied(tmp_path: Path) -> None:
    import trimesh

    scene = trimesh.Scene()
    scene.add_geometry(
        trimesh.Trimesh(TETRA_V, TETRA_F, process=False),
        transform=trimesh.transformations.translation_matrix([10, 0, 0]),
    )
    scene.add_geometry(trimesh.Trimesh(TETRA_V, TETRA_F, process=False))
    scene.export(tmp_path / "s.glb")
    src = load_source(tmp_path / "s.glb")
    assert src.faces.shape == (8, 3)
    assert src.vertices[:, 0].max() == pytest.approx(11.0)
    assert src.vertices[:, 0].min() == pytest.approx(0.0)


@pytest.mark.parametrize(
    "name,content,reason",
    [
        ("x.foo", b"1 2 3", "unsupported file type"),
        ("x.xyz", b"1 2\n", "expected at least 3 numbers"),
        ("x.xyz", b"1 2 a\n", "not a number"),
        ("x.xyz", b"\xff\xfe\x00", "not a text point file"),
        ("x.npz", b"PK-not-really", "not a valid .npz"),
        ("x.npy", b"\x93NUMPY garbage", "not a valid .npy"),
        ("x.obj", b"v 0 0 0\nv 1 0 0\nv 2 0 0\nf 1 2 3\n", "zero surface area"),
    ],
)
def test_hostile_small_files(tmp_path: Path, name: str, content: bytes, reason: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(SourceError, match=reason) as info:
        src = load_source(path)
        norm = compute_normalization(path, src.used_points())
        shape_points(src, norm, 10, torch.Generator().manual_seed(0))
    assert info.value.path == str(path)


def test_missing_file_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="cannot read"):
        load_source(tmp_path / "nope.obj")
    with pytest.raises(SourceError, match="cannot read"):
        hash_source_file(tmp_path / "nope.obj")


def test_hash_is_of_the_bytes(tmp_path: Path) -> None:
    path = tmp_path / "a.xyz"
    path.write_bytes(b"0 0 0\n1 1 1\n")
    assert hash_source_file(path) == hash_bytes(b"0 0 0\n1 1 1\n") == load_source(path).source_hash
    path.write_bytes(b"0 0 0\n1 1 2\n")
    assert hash_source_file(path) != hash_bytes(b"0 0 0\n1 1 1\n")


def test_supported_extensions_are_the_issue_list() -> None:
    assert {
        ".npy",
        ".npz",
        ".ply",
        ".xyz",
        ".pts",
        ".obj",
        ".stl",
        ".off",
        ".glb",
    } == SUPPORTED_EXTENSIONS


def test_sampling_is_seeded_on_surface_and_area_weighted() -> None:
    # two triangles in the z=0 plane, the second with 3x the area of the first
    v = torch.tensor(
        [[0, 0, 0], [1, 0, 0], [0, 1, 0], [2, 0, 0], [5, 0, 0], [2, 2, 0], [9, 9, 9]],
        dtype=torch.float64,
    )  # last vertex unused
    f = torch.tensor([[0, 1, 2], [3, 4, 5]])
    a = sample_surface(v, f, 20_000, torch.Generator().manual_seed(7))
    b = sample_surface(v, f, 20_000, torch.Generator().manual_seed(7))
    c = sample_surface(v, f, 20_000, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.dtype == torch.float64 and a.shape == (20_000, 3)
    assert (a[:, 2] == 0).all()
    first = (a[:, 0] <= 1) & (a[:, 0] + a[:, 1] <= 1 + 1e-12)
    second = (a[:, 0] >= 2) & (a[:, 1] >= 0) & (a[:, 1] <= (5 - a[:, 0]) * 2 / 3 + 1e-9)
    assert bool((first | second).all())
    frac = first.double().mean().item()
    assert abs(frac - 0.5 / 3.5) < 0.01  # areas 0.5 and 3


def test_shape_points_of_clouds_and_meshes(tmp_path: Path) -> None:
    np.save(tmp_path / "c.npy", TETRA_V * 4 + 1)
    np.savez(tmp_path / "m.npz", vertices=TETRA_V * 4 + 1, faces=TETRA_F)
    cloud, mesh = load_source(tmp_path / "c.npy"), load_source(tmp_path / "m.npz")
    norm = compute_normalization("x", cloud.used_points())
    gen = torch.Generator().manual_seed(3)
    pts = shape_points(cloud, norm, 99, gen)
    assert pts.shape == (4, 3) and gen.initial_seed() == 3
    assert torch.equal(pts, torch.from_numpy(normalize_points(cloud.vertices, norm)))
    surf = shape_points(mesh, norm, 1000, gen)
    assert surf.shape == (1000, 3) and surf.abs().max() <= 1.0
    # every sample lies on one of the four faces of the normalised tetrahedron (x+y+z<=1 corner)
    unit = (surf + 1) / 2  # back to the unit tetrahedron
    on_face = ((unit.abs() < 1e-9).any(dim=1)) | ((unit.sum(dim=1) - 1).abs() < 1e-9)
    assert bool(on_face.all())


_coords = st.floats(min_value=-1e30, max_value=1e30, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(arrays(np.float64, st.tuples(st.integers(2, 40), st.just(3)), elements=_coords))
def test_normalisation_property(points: np.ndarray) -> None:
    try:
        norm = compute_normalization("p", points)
    except SourceError as exc:
        if "coincide" in exc.reason:
            assert (points == points[0]).all()
        else:
            assert "too small for its distance" in exc.reason or "below float32" in exc.reason
        return
    assert np.float32(norm.scale) == norm.scale and norm.scale > 0
    assert (norm.center.astype(np.float32).astype(np.float64) == norm.center).all()
    exact = (points - norm.center) / norm.scale  # no clipping: the definition itself holds
    assert np.isfinite(exact).all() and np.abs(exact).max() <= 1.0
    assert np.abs(exact).max() >= 0.5  # the shape fills the cube (up to float32 rounding)
