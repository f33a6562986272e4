"""``workers.sdf.mesh_is_closed``, the ``closed`` field of ``spc_sdf`` records: whether
the mesh is watertight, edge-manifold and consistently oriented (so the sign is exact)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trimesh
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.sdf import mesh_is_closed
from workers.source_load import load_source

CLOSED = {
    "box": lambda: trimesh.creation.box(extents=(2.0, 1.2, 0.8)),
    "icosphere": lambda: trimesh.creation.icosphere(subdivisions=2),
    "torus": lambda: trimesh.creation.torus(major_radius=0.7, minor_radius=0.25),
    "cylinder": lambda: trimesh.creation.cylinder(radius=0.5, height=1.0, sections=12),
}


def _parts(name: str) -> tuple[np.ndarray, np.ndarray]:
    mesh = CLOSED[name]()
    return np.asarray(mesh.vertices, dtype=np.float64), np.asarray(mesh.faces, dtype=np.int64)


def _unwelded(vertices: np.ndarray, faces: np.ndarray, jitter: float) -> tuple:
    """STL's layout: three vertices of its own per face, copies off by up to ``jitter``."""
    rng = np.random.default_rng(0)
    copies = vertices[faces.reshape(-1)] + rng.uniform(-jitter, jitter, (faces.size, 3))
    return copies, np.arange(faces.size).reshape(-1, 3)


@pytest.mark.parametrize("name", sorted(CLOSED))
def test_closed_shapes_are_closed_also_flipped_and_unwelded(name: str) -> None:
    vertices, faces = _parts(name)
    assert mesh_is_closed(vertices, faces)
    assert mesh_is_closed(vertices, faces[:, ::-1])  # every face flipped: still closed
    assert mesh_is_closed(*_unwelded(vertices, faces, jitter=1e-13))
    degenerate = np.concatenate([faces, [[0, 0, 1], [2, 2, 2]]])
    assert mesh_is_closed(vertices, degenerate)  # faces that bound nothing are dropped


@pytest.mark.parametrize("name", sorted(CLOSED))
def test_a_hole_a_flipped_face_a_doubled_face_or_a_gap_is_not_closed(name: str) -> None:
    vertices, faces = _parts(name)
    assert not mesh_is_closed(vertices, faces[1:])  # a hole
    flipped = faces.copy()
    flipped[3] = flipped[3][::-1]
    assert not mesh_is_closed(vertices, flipped)
    back_to_back = np.concatenate([faces, faces[:1, ::-1]])  # an edge with four faces
    assert not mesh_is_closed(vertices, back_to_back)
    # copies a visible distance apart are not welded: a cracked surface
    assert not mesh_is_closed(*_unwelded(vertices, faces, jitter=1e-4))


def test_two_closed_parts_are_closed_and_touching_parts_are_not() -> None:
    vertices, faces = _parts("box")
    apart = np.concatenate([vertices, vertices + [5.0, 0, 0]])
    assert mesh_is_closed(apart, np.concatenate([faces, faces + len(vertices)]))
    # a second box sharing one edge of the first: four faces along that edge
    extent = vertices.max(axis=0) - vertices.min(axis=0)
    touching = np.concatenate([vertices, vertices + extent * [1, 1, 0]])
    assert not mesh_is_closed(touching, np.concatenate([faces, faces + len(vertices)]))


def test_nothing_to_bound_is_not_closed() -> None:
    vertices, _ = _parts("box")
    assert not mesh_is_closed(vertices, np.zeros((0, 3), dtype=np.int64))
    assert not mesh_is_closed(vertices, np.array([[0, 0, 1], [3, 3, 3]]))
    assert not mesh_is_closed(np.zeros((3, 3)), np.array([[0, 1, 2], [0, 2, 1]]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(CLOSED)), seed=st.integers(0, 2**32 - 1))
def test_renumbering_keeps_closed_and_any_one_defect_breaks_it(name: str, seed: int) -> None:
    vertices, faces = _parts(name)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(vertices))  # renumber the vertices ...
    faces = np.argsort(order)[faces]
    vertices = vertices[order]
    faces = faces[rng.permutation(len(faces))]  # ... reorder the faces ...
    turns = rng.integers(0, 3, len(faces))  # ... and start each face at another corner
    faces = np.stack([np.roll(f, t) for f, t in zip(faces, turns, strict=True)])
    assert mesh_is_closed(vertices, faces)
    k = int(rng.integers(len(faces)))
    assert not mesh_is_closed(vertices, np.delete(faces, k, axis=0))
    flipped = faces.copy()
    flipped[k] = flipped[k][::-1]
    assert not mesh_is_closed(vertices, flipped)


def _trimesh_says_closed(vertices: np.ndarray, faces: np.ndarray) -> bool:
    """The oracle: trimesh merges the vertices, and without its degenerate faces the mesh
    is watertight with consistent winding."""
    mesh = trimesh.Trimesh(vertices, faces)
    mesh.update_faces(mesh.nondegenerate_faces())
    return bool(len(mesh.faces) and mesh.is_watertight and mesh.is_winding_consistent)


def test_real_meshes_agree_with_trimesh(meshes: list[Path]) -> None:
    seen = {True: 0, False: 0}
    for path in meshes:
        source = load_source(str(path))
        if source.faces is None:
            continue
        ours = mesh_is_closed(source.vertices, source.faces)
        assert ours == _trimesh_says_closed(source.vertices, source.faces), path.name
        seen[ours] += 1
    assert seen[True] and seen[False]  # the corpus has both kinds
