"""A generated test corpus: good shapes in every supported format, and hostile files.

The suite must pass on a bare clone, without the real-mesh corpus that CI keeps in
``../shared/data``. This module writes a small stand-in for it from ``trimesh.creation``
shapes and seeded NumPy arrays, in the layout the shared corpus has::

    DEST/meshes/       good meshes: OBJ (triangles, quads, materials), ASCII and binary
                       PLY and STL, OFF, GLB (one mesh; a multi-part scene), NPZ with faces;
                       closed, open and multi-part shapes
    DEST/points/       good point clouds: NPY, NPZ, XYZ, PTS, PLY without faces
    DEST/bad_inputs/   hostile files, each with its expected outcome in HOSTILE

Run it by hand with ``python -m tests.data.corpus DEST``. The tests call :func:`ensure`,
which builds the corpus once into ``tests/data/.generated/<key>/`` (git-ignored) and
reuses it; the key holds :data:`VERSION` and a digest of this file and of the trimesh and
NumPy versions, so any change to the builder builds a fresh copy. Every byte is
deterministic (fixed seeds, fixed formatting), and concurrent builders are safe: each
builds into its own temporary directory and renames it into place; the first rename wins.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import shutil
import struct
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

# Bump when the corpus's meaning changes; any edit of this file also changes the key.
VERSION = 1
DEFAULT_ROOT = Path(__file__).resolve().parent / ".generated"
# The file types workers.source_load reads (kept here so conftest need not import torch);
# tests/test_corpus.py checks the two agree.
SOURCE_SUFFIXES = frozenset(
    {".obj", ".ply", ".stl", ".off", ".glb", ".npy", ".npz", ".xyz", ".pts"}
)

# --- writers (own formatting, so the bytes depend on this file only) -------------------------


def _fmt(values: np.ndarray) -> str:
    return " ".join(f"{float(x):.9g}" for x in values)


def write_obj(
    path: Path,
    vertices: np.ndarray,
    faces: list[list[int]] | np.ndarray,
    *,
    header: str = "",
    groups: list[tuple[str, int]] | None = None,
) -> None:
    """OBJ with 1-based faces of any arity; ``groups``: (material, first face index) pairs."""
    starts = {start: name for name, start in (groups or [])}
    lines = [header] if header else []
    lines += [f"v {_fmt(v)}" for v in vertices]
    for i, face in enumerate(faces):
        if i in starts:
            lines.append(f"usemtl {starts[i]}")
        lines.append("f " + " ".join(str(int(k) + 1) for k in face))
    path.write_text("\n".join(lines) + "\n")


def write_off(
    path: Path, vertices: np.ndarray, faces: np.ndarray, counts: tuple[int, int] | None = None
) -> None:
    nv, nf = counts if counts else (len(vertices), len(faces))
    lines = ["OFF", "# written by tests/data/corpus.py", f"{nv} {nf} 0"]
    lines += [_fmt(v) for v in vertices]
    lines += [f"{len(f)} " + " ".join(str(int(k)) for k in f) for f in faces]
    path.write_text("\n".join(lines) + "\n")


def ply_bytes(
    vertices: np.ndarray,
    faces: np.ndarray | None,
    *,
    binary: str | None = None,
    extra_uchar: np.ndarray | None = None,
    declare: tuple[int, int] | None = None,
) -> bytes:
    """PLY: ASCII, or ``binary`` "<" / ">" endianness; ``extra_uchar`` [N, 3] vertex colours."""
    nv = len(vertices) if declare is None else declare[0]
    fmt = (
        "ascii"
        if binary is None
        else ("binary_little_endian" if binary == "<" else "binary_big_endian")
    )
    head = [
        "ply",
        f"format {fmt} 1.0",
        "comment tests/data/corpus.py",
        f"element vertex {nv}",
        "property float x",
        "property float y",
        "property float z",
    ]
    if extra_uchar is not None:
        head += ["property uchar red", "property uchar green", "property uchar blue"]
    if faces is not None:
        nf = len(faces) if declare is None else declare[1]
        head += [f"element face {nf}", "property list uchar int vertex_indices"]
    out = ("\n".join(head) + "\nend_header\n").encode("ascii")
    v32 = np.asarray(vertices, dtype=np.float32)
    if binary is None:
        rows = []
        for i, v in enumerate(v32):
            row = _fmt(v)
            if extra_uchar is not None:
                row += " " + " ".join(str(int(c)) for c in extra_uchar[i])
            rows.append(row)
        rows += [
            f"{len(f)} " + " ".join(str(int(k)) for k in f)
            for f in (faces if faces is not None else [])
        ]
        return out + ("\n".join(rows) + "\n").encode("ascii")
    fields = [("xyz", f"{binary}f4", (3,))]
    if extra_uchar is not None:
        fields.append(("rgb", "u1", (3,)))
    packed = np.zeros(len(v32), dtype=fields)
    packed["xyz"] = v32
    if extra_uchar is not None:
        packed["rgb"] = extra_uchar
    out += packed.tobytes()
    if faces is not None:
        tri = np.zeros(len(faces), dtype=[("n", "u1"), ("i", f"{binary}i4", (3,))])
        tri["n"], tri["i"] = 3, np.asarray(faces)
        out += tri.tobytes()
    return out


def npz_bytes(**arrays: np.ndarray) -> bytes:
    """An uncompressed .npz archive with fixed timestamps (np.savez stamps the clock)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            member = io.BytesIO()
            np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)
            archive.writestr(
                zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), member.getvalue()
            )
    return buffer.getvalue()


def npy_bytes(array: np.ndarray, allow_pickle: bool = False) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, np.asanyarray(array), allow_pickle=allow_pickle)
    return buffer.getvalue()


def _triangles(vertices: np.ndarray, faces: np.ndarray) -> np.ndarray:
    return np.asarray(vertices, dtype=np.float64)[np.asarray(faces)]


def write_stl_ascii(path: Path, vertices: np.ndarray, faces: np.ndarray, name: str) -> None:
    lines = [f"solid {name}"]
    for tri in _triangles(vertices, faces):
        normal = np.cross(tri[1] - tri[0], tri[2] - tri[0])
        length = np.linalg.norm(normal)
        normal = normal / length if length > 0 else normal
        lines += [f"  facet normal {_fmt(normal)}", "    outer loop"]
        lines += [f"      vertex {_fmt(v)}" for v in tri]
        lines += ["    endloop", "  endfacet"]
    lines.append(f"endsolid {name}")
    path.write_text("\n".join(lines) + "\n")


def stl_binary_bytes(vertices: np.ndarray, faces: np.ndarray, declare: int | None = None) -> bytes:
    tris = _triangles(vertices, faces)
    rec = np.zeros(len(tris), dtype=[("n", "<f4", (3,)), ("v", "<f4", (3, 3)), ("a", "<u2")])
    rec["v"] = tris
    header = b"binary STL written by tests/data/corpus.py".ljust(80, b" ")
    return header + struct.pack("<I", len(tris) if declare is None else declare) + rec.tobytes()


def _scene_glb(parts: list[tuple[object, np.ndarray]]) -> bytes:
    import trimesh

    scene = trimesh.Scene()
    for i, (mesh, transform) in enumerate(parts):
        scene.add_geometry(mesh, node_name=f"part{i}", geom_name=f"geom{i}", transform=transform)
    return scene.export(file_type="glb")


# --- good shapes ------------------------------------------------------------------------------


def _good_meshes(out: Path) -> None:
    from trimesh import creation, transformations as tf

    rng = np.random.default_rng(17)
    ico = creation.icosphere(subdivisions=3)
    write_obj(out / "icosphere.obj", ico.vertices, ico.faces, header="# closed icosphere")

    # A box of six quads: the loader triangulates polygons.
    corners = np.array([[x, y, z] for x in (0, 2) for y in (0, 1) for z in (0, 3)], dtype=float)
    quads = [[0, 1, 3, 2], [4, 6, 7, 5], [0, 4, 5, 1], [2, 3, 7, 6], [0, 2, 6, 4], [1, 5, 7, 3]]
    write_obj(out / "box_quads.obj", corners, quads, header="# six quad faces")

    # A torus in two materials, with its .mtl beside it (geometry loaders skip materials).
    torus = creation.torus(major_radius=1.0, minor_radius=0.3)
    (out / "torus_materials.mtl").write_text(
        "newmtl red\nKd 1 0 0\nmap_Kd missing_texture.png\n\nnewmtl blue\nKd 0 0 1\n"
    )
    write_obj(
        out / "torus_materials.obj",
        torus.vertices,
        torus.faces,
        header="mtllib torus_materials.mtl",
        groups=[("red", 0), ("blue", len(torus.faces) // 2)],
    )

    # An open mesh: the upper half of a UV sphere (faces with all vertices at z >= 0).
    sphere = creation.uv_sphere(count=[16, 16])
    keep = (sphere.vertices[sphere.faces][:, :, 2] >= -1e-9).all(axis=1)
    write_obj(
        out / "hemisphere_open.obj", sphere.vertices, sphere.faces[keep], header="# open: no bottom"
    )

    # A triangle soup: 200 disconnected triangles (a multi-part mesh with nothing shared).
    soup = rng.uniform(-1, 1, size=(200, 1, 3)) + rng.normal(scale=0.1, size=(200, 3, 3))
    write_obj(
        out / "triangle_soup.obj",
        soup.reshape(-1, 3),
        np.arange(600).reshape(-1, 3),
        header="# 200 loose triangles",
    )

    capsule = creation.capsule(height=1.5, radius=0.4, count=[16, 16])
    (out / "capsule_ascii.ply").write_bytes(ply_bytes(capsule.vertices, capsule.faces))

    cylinder = creation.cylinder(radius=0.5, height=2.0, sections=24)
    colours = (np.arange(len(cylinder.vertices) * 3).reshape(-1, 3) % 256).astype(np.uint8)
    (out / "cylinder_binary.ply").write_bytes(
        ply_bytes(cylinder.vertices, cylinder.faces, binary="<", extra_uchar=colours)
    )

    # Two spheres in one mesh (two components), big-endian binary PLY.
    a = creation.icosphere(subdivisions=2)
    b = creation.icosphere(subdivisions=1)
    both_v = np.concatenate([a.vertices, b.vertices * 0.5 + [2.5, 0, 0]])
    both_f = np.concatenate([a.faces, b.faces + len(a.vertices)])
    (out / "two_spheres.ply").write_bytes(ply_bytes(both_v, both_f, binary=">"))

    cone = creation.cone(radius=1.0, height=2.0, sections=24)
    write_stl_ascii(out / "cone_ascii.stl", cone.vertices, cone.faces, "cone")

    box = creation.box(extents=[1.0, 2.0, 0.5], transform=tf.rotation_matrix(0.6, [1, 1, 0]))
    (out / "box_binary.stl").write_bytes(stl_binary_bytes(box.vertices, box.faces))

    # An open wavy sheet (a height field): binary STL.
    g = np.linspace(-1, 1, 21)
    gx, gy = np.meshgrid(g, g, indexing="ij")
    sheet_v = np.stack([gx, gy, 0.2 * np.sin(3 * gx) * np.cos(2 * gy)], axis=-1).reshape(-1, 3)
    idx = np.arange(21 * 21).reshape(21, 21)
    q = np.stack([idx[:-1, :-1], idx[1:, :-1], idx[1:, 1:], idx[:-1, 1:]], axis=-1).reshape(-1, 4)
    sheet_f = np.concatenate([q[:, [0, 1, 2]], q[:, [0, 2, 3]]])
    (out / "wavy_sheet_open.stl").write_bytes(stl_binary_bytes(sheet_v, sheet_f))

    annulus = creation.annulus(r_min=0.5, r_max=1.0, height=0.3, sections=32)
    write_off(out / "annulus.off", annulus.vertices, annulus.faces)

    thin = creation.torus(major_radius=2.0, minor_radius=0.1, major_sections=48, minor_sections=12)
    write_off(out / "thin_torus.off", thin.vertices, thin.faces)

    # A box far from the origin (normalisation must bring it home).
    far = creation.box(extents=[3.0, 1.0, 2.0])
    (out / "far_box.ply").write_bytes(ply_bytes(far.vertices + [1.0e4, -2.5e3, 7.0e2], far.faces))

    (out / "icosphere_single.glb").write_bytes(
        _scene_glb([(creation.icosphere(subdivisions=2), np.eye(4))])
    )
    # A multi-part scene whose node transforms place the parts.
    (out / "scene_parts.glb").write_bytes(
        _scene_glb(
            [
                (creation.box(extents=[1, 1, 1]), tf.translation_matrix([-2, 0, 0])),
                (creation.icosphere(subdivisions=2), np.eye(4)),
                (
                    creation.torus(major_radius=0.8, minor_radius=0.2),
                    tf.translation_matrix([2, 0, 0]) @ tf.rotation_matrix(np.pi / 2, [1, 0, 0]),
                ),
            ]
        )
    )

    # A mesh as NumPy arrays (vertices + faces): an anisotropically stretched icosahedron.
    icosa = creation.icosahedron()
    (out / "icosahedron_mesh.npz").write_bytes(
        npz_bytes(vertices=icosa.vertices * [1.0, 0.5, 2.0], faces=icosa.faces.astype(np.int32))
    )


def _good_points(out: Path) -> None:
    rng = np.random.default_rng(23)
    on_sphere = rng.normal(size=(2000, 3))
    on_sphere /= np.linalg.norm(on_sphere, axis=1, keepdims=True)
    (out / "sphere_points.npy").write_bytes(npy_bytes(on_sphere.astype(np.float32)))
    grid = np.stack(np.meshgrid(*[np.arange(-5, 6)] * 3, indexing="ij"), axis=-1).reshape(-1, 3)
    (out / "grid_points_int.npy").write_bytes(npy_bytes(grid.astype(np.int32)))
    (out / "cube_points.npz").write_bytes(
        npz_bytes(
            points=rng.uniform(-1, 1, size=(1500, 3)), colours=rng.integers(0, 255, size=(1500, 3))
        )
    )
    (out / "only_array.npz").write_bytes(
        npz_bytes(arr_0=rng.normal(size=(800, 3)) * [2.0, 1.0, 0.5])
    )
    t = np.linspace(0, 6 * np.pi, 600)
    helix = np.stack([np.cos(t), np.sin(t), t / (6 * np.pi)], axis=1)
    (out / "helix.xyz").write_text(
        "# helix: x y z intensity\n"
        + "\n".join(f"{_fmt(p)} {i % 7}" for i, p in enumerate(helix))
        + "\n"
    )
    scan = rng.uniform(0, 10, size=(500, 3))
    (out / "scan_count_header.pts").write_text(
        f"{len(scan)}\n" + "\n".join(",".join(f"{float(x):.6f}" for x in p) for p in scan) + "\n"
    )
    (out / "vertex_only.ply").write_bytes(ply_bytes(rng.normal(size=(700, 3)), None, binary="<"))


# --- hostile files: name -> (builder, expected outcome) ----------------------------------------
# Expected outcome: a substring of the SourceError reason, or None for "a valid record".
# Names shared with ../shared/data/bad_inputs mean the same thing there. Stems are unique:
# a stem is the sample id.


def _first_third_of_ply(binary: str | None) -> bytes:
    """An icosphere PLY cut after a third of its bytes (as truncated_bunny.ply is)."""
    from trimesh import creation

    ico = creation.icosphere(subdivisions=3)
    whole = ply_bytes(ico.vertices, ico.faces, binary=binary)
    return whole[: len(whole) // 3]


def _hostile() -> dict[str, tuple[Callable[[], bytes], str | None]]:
    rng = np.random.default_rng(29)
    cube = np.array([[x, y, z] for x in (0, 1) for y in (0, 1) for z in (0, 1)], dtype=float)
    cube_faces = np.array(
        [
            [0, 1, 3],
            [0, 3, 2],
            [4, 6, 7],
            [4, 7, 5],
            [0, 4, 5],
            [0, 5, 1],
            [2, 3, 7],
            [2, 7, 6],
            [0, 2, 6],
            [0, 6, 4],
            [1, 5, 7],
            [1, 7, 3],
        ]
    )

    npy = npy_bytes

    def object_array() -> bytes:
        # Test-data generation only: writing an object array needs allow_pickle=True at save
        # time. The loader under test must refuse it (it never passes allow_pickle at read).
        values = np.empty(3, dtype=object)
        values[:] = [[0, 0, 0], [1, 2, 3], [4, 5, 6]]
        return npy(values, allow_pickle=True)

    def no_point_array() -> bytes:
        return npz_bytes(first=np.zeros((4, 3)), second=np.ones((4, 3)))

    def huge() -> np.ndarray:
        return rng.uniform(-1.0, 1.0, size=(1000, 3)) * 1.0e30 + 3.0e30

    return {
        # zero bytes
        "empty.obj": (lambda: b"", "file is empty"),
        # binary PLY cut at a third: the parser sees the body is short
        "truncated_binary.ply": (lambda: _first_third_of_ply("<"), "cannot parse as PLY"),
        # ASCII PLY cut at a third: fewer vertices than the header declares
        "truncated_ascii.ply": (lambda: _first_third_of_ply(None), "truncated"),
        # header promises 50 vertices and 12 faces; the body holds 8 and 12
        "lying_header.ply": (lambda: ply_bytes(cube, cube_faces, declare=(50, 12)), "truncated"),
        # binary STL whose count field says 1000 triangles where 12 follow: nothing is read
        "lying_count.stl": (
            lambda: stl_binary_bytes(cube, cube_faces, declare=1000),
            "no geometry",
        ),
        # NaN and inf coordinates
        "nan_vertices.obj": (
            lambda: b"v 0 0 0\nv nan 1 0\nv 0 1 0\nv 1 0 inf\nf 1 2 3\nf 1 3 4\n",
            "non-finite",
        ),
        # a face names vertex 9 of 3 (OBJ, then OFF)
        "faces_out_of_range.obj": (
            lambda: b"v 0 0 0\nv 1 0 0\nv 0 1 0\nf 1 2 3\nf 1 2 9\n",
            "out of bounds",
        ),
        "faces_out_of_range_off.off": (
            lambda: b"OFF\n3 1 0\n0 0 0\n1 0 0\n0 1 0\n3 0 1 7\n",
            "cannot parse as OFF",
        ),
        # one vertex, no faces: a one-point cloud that cannot be normalised
        "single_vertex.obj": (lambda: b"v 0.5 0.5 0.5\n", "coincide"),
        # prose with a .ply name
        "text_not_mesh.ply": (lambda: b"this is not a ply file\n" * 20, "not a PLY"),
        # seeded random bytes with mesh names
        "garbage.stl": (
            lambda: rng.integers(0, 256, size=4096, dtype=np.uint8).tobytes(),
            "no geometry",
        ),
        "garbage_scene.glb": (
            lambda: rng.integers(0, 256, size=2048, dtype=np.uint8).tobytes(),
            "cannot parse",
        ),
        # 1000 identical points
        "degenerate_points.npy": (lambda: npy(np.full((1000, 3), 0.25)), "coincide"),
        # coordinates near 1e30: still finite in float32, so a valid record
        "huge_coords_points.npy": (lambda: npy(huge()), None),
        # a pickled object array: refused, never unpickled
        "int_object_points.npy": (object_array, "pickle"),
        # [100, 4] instead of [N, 3]
        "wrong_shape_points.npy": (lambda: npy(rng.normal(size=(100, 4))), "shape (100, 4)"),
        # an archive of two arrays, neither named as points
        "no_point_array.npz": (no_point_array, "no point array"),
        # vertices and an empty face list: a point cloud, so a valid record
        "points_emptyface.ply": (
            lambda: ply_bytes(rng.normal(size=(1024, 3)) * 40.0, np.zeros((0, 3), dtype=np.int64)),
            None,
        ),
    }


def hostile_expectations() -> dict[str, str | None]:
    """Hostile file name -> a substring of its SourceError reason, or None: a valid record."""
    return {name: expect for name, (_, expect) in _hostile().items()}


# --- build, cache ------------------------------------------------------------------------------


def build(dest: str | os.PathLike[str]) -> Path:
    """Write the corpus into ``dest`` (created; must not hold files already). Returns it."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise FileExistsError(f"{dest} is not empty; the corpus is built into an empty directory")
    for sub in ("meshes", "points", "bad_inputs"):
        (dest / sub).mkdir()
    _good_meshes(dest / "meshes")
    _good_points(dest / "points")
    expectations = {}
    for name, (make, expect) in _hostile().items():
        (dest / "bad_inputs" / name).write_bytes(make())
        expectations[name] = "valid record" if expect is None else f"error mentioning {expect!r}"
    (dest / "EXPECTED.json").write_text(json.dumps(expectations, indent=1, sort_keys=True) + "\n")
    return dest


def cache_key() -> str:
    """``v<VERSION>-<digest>`` of this file and the trimesh and NumPy versions."""
    import trimesh

    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(f"trimesh {trimesh.__version__} numpy {np.__version__}".encode())
    return f"v{VERSION}-{digest.hexdigest()[:12]}"


def ensure(root: str | os.PathLike[str] | None = None) -> Path:
    """The corpus under ``root`` (default ``tests/data/.generated``), built there if missing.

    Safe when several processes call it at once: each builds into a private temporary
    directory and renames it to the final name; a loser of that race removes its copy.
    """
    root = Path(root) if root is not None else DEFAULT_ROOT
    final = root / cache_key()
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
            logger.info("built the test corpus at %s", final)
        except OSError:
            if not final.is_dir():
                raise
            logger.info("another process built the test corpus at %s first", final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.data.corpus", description="Write the generated test corpus into DEST."
    )
    parser.add_argument("dest", type=Path, help="an empty or missing directory")
    args = parser.parse_args(argv)
    try:
        dest = build(args.dest)
    except FileExistsError as exc:
        parser.error(str(exc))
    counts = {sub: len(list((dest / sub).iterdir())) for sub in ("meshes", "points", "bad_inputs")}
    sys.stdout.write(f"wrote {dest}: {json.dumps(counts)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
