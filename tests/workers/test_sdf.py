"""Signed distances (workers.sdf) and the spc_sdf recipe on generated and real meshes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trimesh
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from cache_store.errors import ParameterError, SourceError
from workers import sdf
from workers.ops import get_backend
from workers.recipe_run import RECIPES, make_generator, run_recipe
from cache_store.recipes.api import check_outputs
from workers.sampling import compute_normalization, normalize_points
from workers.source_load import load_source

RECIPE = RECIPES["spc_sdf"]
PARAMS = RECIPE.spec.resolve(
    {"level": 5, "surface_samples": 3000, "near_samples": 1500, "uniform_samples": 1500}
)


def _open_box() -> trimesh.Trimesh:
    box = trimesh.creation.box(extents=(1.0, 1.0, 1.0))
    top = box.triangles_center[:, 2] > 0.49
    return trimesh.Trimesh(box.vertices, box.faces[~top], process=False)


def _inverted_torus() -> trimesh.Trimesh:
    torus = trimesh.creation.torus(major_radius=0.7, minor_radius=0.25)
    return trimesh.Trimesh(
        torus.vertices, np.ascontiguousarray(torus.faces[:, ::-1]), process=False
    )


SHAPES = {
    "box": lambda: trimesh.creation.box(extents=(2.0, 1.2, 0.8)),
    "icosphere": lambda: trimesh.creation.icosphere(subdivisions=2),
    "capsule": lambda: trimesh.creation.capsule(height=1.0, radius=0.4),
    "inverted_torus": _inverted_torus,
    "open_box": _open_box,
}


def _points(count: int, mesh: trimesh.Trimesh, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    near = mesh.vertices[rng.integers(0, len(mesh.vertices), count)] + rng.normal(
        0, 0.02, (count, 3)
    )
    return np.concatenate([rng.uniform(-1.3, 1.3, (count, 3)), near, mesh.vertices[:50]])


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_libigl_path_equals_brute_force(name: str) -> None:
    mesh = SHAPES[name]()
    points = _points(600, mesh, 1)
    got, face = sdf.signed_distance(points, mesh.vertices, mesh.faces)
    assert got.dtype == np.float64 and face.dtype == np.int64 and got.shape == face.shape
    want, _ = sdf.brute_force_signed_distance(
        torch.from_numpy(points), torch.from_numpy(mesh.vertices), torch.from_numpy(mesh.faces)
    )
    want = want.numpy()
    np.testing.assert_allclose(np.abs(got), np.abs(want), rtol=0, atol=1e-12)
    far = np.abs(want) > 1e-4
    assert far.sum() > 1000 and np.array_equal(np.sign(got[far]), np.sign(want[far]))
    # the reported face is a closest one: each point's distance to that face alone
    own = np.array(
        [
            sdf.brute_force_distance(
                torch.from_numpy(points[i : i + 1]),
                torch.from_numpy(mesh.vertices),
                torch.from_numpy(mesh.faces[face[i] : face[i] + 1]),
            )[0].item()
            for i in range(0, len(points), 7)
        ]
    )
    np.testing.assert_allclose(own, np.abs(got[::7]), rtol=0, atol=1e-12)


def test_signs_follow_the_winding_number_on_open_and_inverted_meshes() -> None:
    centre_and_far = np.array([[0.0, 0.0, 0.0], [0.0, 0.0, -0.3], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    d, _ = sdf.signed_distance(centre_and_far, *_mesh_arrays(_open_box()))
    # inside the open box the missing lid subtends at most a sixth of the sphere: |w| > 1/2
    assert d[0] < 0 and d[1] < 0 and d[2] > 0 and d[3] > 0
    torus = _inverted_torus()
    d, _ = sdf.signed_distance(np.array([[0.7, 0.0, 0.0], [0.0, 0.0, 0.0]]), *_mesh_arrays(torus))
    assert d[0] == pytest.approx(-0.25, abs=0.01) and d[1] > 0  # in the tube; in the hole


def _mesh_arrays(mesh: trimesh.Trimesh) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(mesh.vertices, dtype=np.float64), np.asarray(mesh.faces, dtype=np.int64)


def test_a_triangle_with_two_equal_corners_is_its_edges_in_the_brute_force() -> None:
    """Hypothesis found it: corners b == c, so the cross product is rounding noise (a
    fused multiply-add leaves 1e-18, not 0); the brute force took that noise for a plane
    through the origin and said 0, where the nearest point is the corner (0.1875,)*3."""
    vertices = torch.tensor(
        [[0.0, 0.0, 0.9999999999999999], [0.1875] * 3, [0.1875] * 3], dtype=torch.float64
    )
    faces = torch.tensor([[0, 1, 2]])
    dist, _ = sdf.brute_force_distance(torch.zeros(1, 3, dtype=torch.float64), vertices, faces)
    assert dist.tolist() == pytest.approx([0.1875 * 3**0.5], abs=1e-12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrays(np.float64, (6, 3), elements=st.floats(-1, 1)),
    arrays(np.float64, (30, 3), elements=st.floats(-2, 2)),
    st.booleans(),
)
def test_distances_to_random_triangles_equal_brute_force(vertices, points, degenerate):
    faces = np.array([[0, 1, 2], [3, 4, 5], [0, 2, 4], [1, 3, 5]], dtype=np.int64)
    if degenerate:  # a sliver and a point-like triangle
        vertices[5] = vertices[3] + 0.5 * (vertices[4] - vertices[3])
        faces = np.concatenate([faces, [[0, 0, 0]]])
    got, _ = sdf.signed_distance(points, vertices, faces)
    want, _ = sdf.brute_force_distance(
        torch.from_numpy(points), torch.from_numpy(vertices), torch.from_numpy(faces)
    )
    np.testing.assert_allclose(np.abs(got), want.numpy(), rtol=0, atol=1e-9)


def test_brute_force_winding_number_of_a_closed_mesh() -> None:
    mesh = trimesh.creation.icosphere(subdivisions=1)
    points = torch.tensor([[0.0, 0.0, 0.0], [0.2, -0.3, 0.1], [2.0, 0.0, 0.0], [0.0, -1.5, 1.0]])
    w = sdf.brute_force_winding_number(
        points, torch.from_numpy(mesh.vertices), torch.from_numpy(mesh.faces)
    )
    np.testing.assert_allclose(w.numpy(), [1.0, 1.0, 0.0, 0.0], atol=1e-12)


def _record(tmp_path, mesh: trimesh.Trimesh, params=PARAMS, name: str = "shape.ply"):
    path = tmp_path / name
    mesh.export(path)
    source = load_source(path)
    out = run_recipe(
        RECIPE,
        source,
        params,
        generator=make_generator("f" * 32, name),
        device="cpu",
        ops=get_backend("torch", "cpu"),
    )
    check_outputs(RECIPE.spec, out, params)
    return source, out


def test_icosphere_distances_are_radial(tmp_path) -> None:
    params = RECIPE.spec.resolve(
        {"level": 6, "surface_samples": 20_000, "near_samples": 5000, "uniform_samples": 5000}
    )
    source, out = _record(tmp_path, trimesh.creation.icosphere(subdivisions=5), params)
    norm = compute_normalization(source.path, source.used_points())
    mesh = trimesh.Trimesh(normalize_points(source.vertices, norm), source.faces, process=False)
    p = out["sdf_points"].double()
    # a convex polytope around the origin: the ray along p leaves it through the nearest
    # supporting plane, so r_mesh(p) = min over faces facing p of (n . a) / (n . p/|p|)
    normals = torch.tensor(mesh.face_normals)
    offsets = (normals * torch.tensor(mesh.triangles[:, 0])).sum(1)
    direction = p / p.norm(dim=1, keepdim=True)
    cos = direction @ normals.T
    r_mesh = torch.where(cos > 0, offsets / cos, torch.full_like(cos, torch.inf)).min(dim=1).values
    expected = p.norm(dim=1) - r_mesh
    assert len(p) == 10_000
    np.testing.assert_allclose(out["sdf"].double().numpy(), expected.numpy(), rtol=0, atol=1e-3)
    clear = expected.abs() > 1e-3
    assert torch.equal(out["sdf"][clear] < 0, expected[clear] < 0)


def test_box_distances_are_exact(tmp_path) -> None:
    _, out = _record(tmp_path, trimesh.creation.box(extents=(2.0, 1.2, 0.8)))
    p = out["sdf_points"].double()
    q = p.abs() - torch.tensor([1.0, 0.6, 0.4], dtype=torch.float64)  # normalised: scale 1
    outside = q.clamp_min(0).norm(dim=1)
    inside = q.max(dim=1).values.clamp_max(0)
    expected = outside + inside
    assert bool((expected < 0).any()) and bool((expected > 0).any())
    np.testing.assert_allclose(out["sdf"].double().numpy(), expected.numpy(), rtol=0, atol=1e-6)


def test_record_fields_are_consistent(tmp_path) -> None:
    _, out = _record(tmp_path, trimesh.creation.capsule(height=1.0, radius=0.4))
    ops = get_backend("torch", "cpu")
    dual, pyramid_dual = ops.unbatched_make_dual(out["point_hierarchy"], out["pyramid"])
    assert torch.equal(dual, out["point_hierarchy_dual"]) and torch.equal(
        pyramid_dual, out["pyramid_dual"]
    )
    level = PARAMS["level"]
    pidx = ops.unbatched_query(out["octree"], out["exsum"], out["sdf_points"], level)
    assert torch.equal(pidx.to(torch.int32), out["sdf_pidx"])
    inside = out["sdf_pidx"] >= 0
    assert bool(inside.any()) and bool((~inside).any())
    # points in a leaf voxel are within a voxel diagonal of the surface samples' voxels
    assert float(out["sdf"][inside].abs().max()) <= 2 * 3**0.5 / 2**level + 0.05
    assert out["sdf_face"].min() >= 0
    assert len(out["sdf"]) == PARAMS["near_samples"] + PARAMS["uniform_samples"]


def test_records_are_identical_run_to_run(tmp_path) -> None:
    _, a = _record(tmp_path, trimesh.creation.torus(major_radius=0.7, minor_radius=0.25))
    _, b = _record(tmp_path, trimesh.creation.torus(major_radius=0.7, minor_radius=0.25))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_point_cloud_fails_with_its_reason(tmp_path) -> None:
    path = tmp_path / "cloud.npy"
    np.save(path, np.random.default_rng(0).normal(size=(500, 3)))
    with pytest.raises(SourceError, match="point cloud") as info:
        RECIPE.prepare(load_source(path), PARAMS, make_generator("f" * 32, "cloud"))
    assert str(path) in str(info.value)


def test_out_of_memory_backs_off_to_the_same_record(tmp_path) -> None:
    from cache_store.recipes.api import ChunkBudget

    mesh = trimesh.creation.capsule(height=1.0, radius=0.4)
    _, plain = _record(tmp_path, mesh)
    calls: list[int] = []

    def fault(size: int) -> None:
        calls.append(size)
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("simulated")

    budget = ChunkBudget(2048, minimum=256, before_query_chunk=fault)
    source = load_source(tmp_path / "shape.ply")
    out = run_recipe(
        RECIPE,
        source,
        PARAMS,
        generator=make_generator("f" * 32, "shape.ply"),
        device="cpu",
        ops=get_backend("torch", "cpu"),
        query_chunk=budget,
    )
    assert budget.backoffs == 1 and calls[0] == 2048 and calls[1] == 1024
    assert all(torch.equal(out[k], plain[k]) for k in plain)


def _sheet() -> trimesh.Trimesh:
    """An open, curved sheet: a quarter of a cylinder's side."""
    cylinder = trimesh.creation.cylinder(radius=0.8, height=1.2, sections=32)
    side = np.abs(cylinder.face_normals[:, 2]) < 0.5
    centres = cylinder.triangles_center
    keep = side & (centres[:, 0] > 0) & (centres[:, 1] > 0)
    return trimesh.Trimesh(cylinder.vertices, cylinder.faces[keep], process=False)


def _holed_sphere() -> trimesh.Trimesh:
    """A sphere with a cap cut away and a duplicated, flipped band: open and non-manifold."""
    sphere = trimesh.creation.icosphere(subdivisions=3)
    centres = sphere.triangles_center
    kept = sphere.faces[centres[:, 2] < 0.6]
    band = sphere.faces[np.abs(centres[:, 2]) < 0.1][:, ::-1]
    return trimesh.Trimesh(sphere.vertices, np.concatenate([kept, band]), process=False)


OPEN_SHAPES = {"open_box": _open_box, "sheet": _sheet, "holed_sphere": _holed_sphere}


@pytest.mark.parametrize("name", sorted(OPEN_SHAPES))
def test_sdf_signs_on_open_meshes_follow_the_winding_number_rule(tmp_path, name: str) -> None:
    """spc_sdf's sign is |generalised winding number| > 1/2 (computed in prepare, on the CPU,
    for every backend): checked against the exact winding number written from its
    definition, on meshes where ray parity (Kaolin's check_sign) gives other answers."""
    mesh = OPEN_SHAPES[name]()
    assert not mesh.is_watertight
    source, out = _record(tmp_path, mesh, name=f"{name}.ply")
    norm = compute_normalization(source.path, source.used_points())
    vertices = torch.from_numpy(normalize_points(source.vertices, norm))
    faces = torch.from_numpy(np.asarray(source.faces, dtype=np.int64))
    w = sdf.brute_force_winding_number(out["sdf_points"], vertices, faces, chunk=1024)
    clear = (w.abs() - 0.5).abs() > 1e-9  # rounding decides exactly at 1/2
    assert int(clear.sum()) >= len(w) - 2
    assert torch.equal((out["sdf"] < 0)[clear], (w.abs() > 0.5)[clear])
    if name != "sheet":  # a closed-ish shape: both signs occur
        assert bool((out["sdf"] < 0).any()) and bool((out["sdf"] > 0).any())
    # the prepared signs are the ones the record carries, on every path
    prepared = RECIPE.prepare(source, PARAMS, make_generator("f" * 32, f"{name}.ply"))
    assert prepared["sdf_inside"].dtype == np.bool_
    assert np.array_equal(prepared["sdf_inside"], (out["sdf"] < 0).numpy())


def test_the_kaolin_path_takes_its_signs_from_the_rule(monkeypatch) -> None:
    """signed_distance_kaolin signs by the inside mask it is given (Kaolin's distance
    kernel stood in for by the exact one, so this runs on the CPU)."""
    mesh = _open_box()
    points = torch.from_numpy(_points(300, mesh, 4))
    vertices = torch.from_numpy(mesh.vertices)
    faces = torch.from_numpy(mesh.faces)

    def fake_point_to_mesh_distance(p, face_vertices):  # Kaolin's signature and outputs
        dist, face = sdf.brute_force_distance(p[0], vertices, faces)
        return (dist**2).unsqueeze(0), face.unsqueeze(0), torch.zeros_like(face).unsqueeze(0)

    monkeypatch.setattr(sdf, "_kaolin_point_to_mesh_distance", lambda: fake_point_to_mesh_distance)
    inside = torch.from_numpy(sdf.winding_inside(points.numpy(), mesh.vertices, mesh.faces))
    got, face = sdf.signed_distance_kaolin(points, vertices, faces, inside)
    want, want_face = sdf.signed_distance(points.numpy(), mesh.vertices, mesh.faces)
    assert torch.equal(got < 0, torch.from_numpy(want < 0))
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)
    assert face.dtype == torch.int64


def _kaolin_or_skip() -> None:
    """Skip unless Kaolin's backend can run (no importorskip: on a broken install it warns,
    an error under filterwarnings = error)."""
    from cache_store.errors import BackendUnavailable
    from workers.ops import kaolin_spc

    try:
        kaolin_spc.ensure_available()
    except BackendUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name", ["box", "icosphere", "capsule", "inverted_torus", "open_box", "sheet", "holed_sphere"]
)
def test_kaolin_path_agrees_with_the_cpu_path(name: str) -> None:
    _kaolin_or_skip()
    mesh = {**SHAPES, **OPEN_SHAPES}[name]()
    points = _points(3000, mesh, 2)
    cpu, cpu_face = sdf.signed_distance(points, mesh.vertices, mesh.faces)
    inside = torch.from_numpy(sdf.winding_inside(points, mesh.vertices, mesh.faces))
    gpu, gpu_face = sdf.signed_distance_kaolin(
        torch.from_numpy(points).cuda(),
        torch.from_numpy(mesh.vertices).cuda(),
        torch.from_numpy(mesh.faces).cuda(),
        inside,
    )
    gpu = gpu.cpu().numpy()
    # Kaolin computes squared distances in float32
    np.testing.assert_allclose(np.abs(gpu), np.abs(cpu), rtol=1e-5, atol=1e-6)
    assert np.array_equal(np.signbit(gpu), np.signbit(cpu))  # one sign rule: identical
    assert gpu_face.dtype == torch.int64 and gpu_face.shape == cpu_face.shape
    # Kaolin's face is a nearest one (ties: the lowest index)
    for i, f in list(enumerate(gpu_face.cpu().numpy()))[::97]:
        d, _ = sdf.brute_force_distance(
            torch.from_numpy(points[i : i + 1]),
            torch.from_numpy(mesh.vertices),
            torch.from_numpy(mesh.faces[f : f + 1]),
        )
        assert abs(float(d) - abs(cpu[i])) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["capsule", "open_box", "holed_sphere"])
def test_kaolin_records_agree_with_cpu_records(tmp_path, name: str) -> None:
    _kaolin_or_skip()
    kaolin_ops = get_backend("kaolin", "cuda")
    path = tmp_path / f"{name}.ply"
    {**SHAPES, **OPEN_SHAPES}[name]().export(path)
    source = load_source(path)
    records = [
        run_recipe(
            RECIPE, source, PARAMS, generator=make_generator("f" * 32, "c"), device=device, ops=ops
        )
        for device, ops in (
            ("cpu", get_backend("torch", "cpu")),
            ("cuda", kaolin_ops),
            ("cuda", get_backend("torch", "cuda")),
        )
    ]
    cpu, gpu, torch_cuda = records
    for name_ in cpu:
        if name_ not in ("sdf", "sdf_face"):
            assert torch.equal(cpu[name_], gpu[name_]), name_
    assert all(torch.equal(cpu[k], torch_cuda[k]) for k in cpu)  # torch on CUDA: the CPU path
    diff = (cpu["sdf"].double() - gpu["sdf"].double()).abs()
    assert float((diff / cpu["sdf"].double().abs().clamp_min(1e-1)).max()) <= 1e-5
    assert torch.equal(torch.signbit(cpu["sdf"]), torch.signbit(gpu["sdf"]))


def test_the_stated_size_bound_holds_at_the_parameter_bounds() -> None:
    """The arithmetic behind the doc: num_points <= sum_l min(8^l, S), each point
    47 bytes (hierarchy, trinkets, parent, octree byte + exsum), at most 8 dual points of
    6 bytes per point, 24 bytes per SDF sample."""
    params = RECIPE.spec.params
    level = int(params["level"].maximum)
    samples = int(params["surface_samples"].maximum)
    m = int(params["near_samples"].maximum) + int(params["uniform_samples"].maximum)
    points = sum(min(8**lvl, samples) for lvl in range(level + 1))
    per_sample = sum(
        np.dtype(f.dtype).itemsize * (3 if f.shape.endswith(", 3]") else 1)
        for name, f in RECIPE.spec.fields.items()
        if name.startswith("sdf")
    )
    assert per_sample == 24
    assert points * 47 + 8 * points * 6 + m * per_sample < 400e6
    # the schema's own worst case covers that estimate and is enforced at the record limit
    from cache_store.recipes.specs import MAX_RECORD_BYTES

    worst = RECIPE.spec.worst_case_record_bytes(
        {
            "level": level,
            "surface_samples": samples,
            "near_samples": m // 2,
            "uniform_samples": m // 2,
        }
    )
    assert worst >= points * 47 + m * per_sample
    if worst > MAX_RECORD_BYTES:
        with pytest.raises(ParameterError, match="record limit"):
            RECIPE.spec.resolve({"level": level, "surface_samples": samples})
    assert RECIPE.spec.worst_case_record_bytes() < MAX_RECORD_BYTES  # the defaults pass
