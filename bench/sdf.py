"""Benchmark the CPU signed-distance path of the spc_sdf recipe against brute force.

Workload: for each mesh (the shared meshes, or generated shapes when the path
is absent or holds none), M sample points (default 100,000) drawn as the recipe draws
them (half uniform in [-1, 1]^3, half surface samples jittered with sigma 0.01) in the
normalised frame, then:

- sdf: :func:`workers.sdf.signed_distance` (libigl exact distance + winding-number sign)
  on all M points: points/s;
- recipe: the whole ``spc_sdf`` record at level 8 (octree, dual, trinkets, queries and
  distances) with M SDF points: samples/s;
- baseline: :func:`workers.sdf.brute_force_signed_distance` (every point against every
  face, torch float64) on a subset of ``--subset`` points, timed in the same run and
  extrapolated linearly to M (it is linear in the points). The subset also checks the
  fast path: largest distance difference, and sign disagreements farther than 1e-4 from
  the surface.

``--compare`` also times other libraries that are installed (libigl's own signed
modes, point-cloud-utils, trimesh on a subset) and prints their error against brute force.
Goal: 100,000 signed distances on the bunny in under 2 s.

    python bench/sdf.py [PATH] [--points M] [--subset S] [--threads T] [--compare] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers import sdf
from workers.ops import get_backend
from workers.recipe_run import RECIPES, make_generator, run_recipe
from workers.sampling import compute_normalization, normalize_points
from workers.source_load import load_source

GOAL_S = 2.0  # 100,000 signed distances on the bunny


def generated_meshes(directory: Path) -> list[Path]:
    import trimesh

    directory.mkdir(parents=True, exist_ok=True)
    shapes = {
        "icosphere5": trimesh.creation.icosphere(subdivisions=5),
        "torus": trimesh.creation.torus(major_radius=0.7, minor_radius=0.25),
        "capsule": trimesh.creation.capsule(height=1.0, radius=0.4, count=[64, 64]),
    }
    paths = []
    for name, mesh in shapes.items():
        paths.append(directory / f"{name}.ply")
        mesh.export(paths[-1])
    return paths


def sample_points(vertices: np.ndarray, faces: np.ndarray, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tri = vertices[faces]
    area = np.linalg.norm(np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]), axis=1)
    pick = rng.choice(len(faces), count - count // 2, p=area / area.sum())
    uv = rng.random((len(pick), 2))
    flip = uv.sum(1) > 1
    uv[flip] = 1 - uv[flip]
    t = tri[pick]
    near = t[:, 0] + uv[:, :1] * (t[:, 1] - t[:, 0]) + uv[:, 1:] * (t[:, 2] - t[:, 0])
    near += rng.normal(0, 0.01, near.shape)
    return np.concatenate([rng.uniform(-1, 1, (count // 2, 3)), near]).astype(np.float32)


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def compare_libraries(
    points: np.ndarray, v: np.ndarray, f: np.ndarray, reference: np.ndarray, subset: int
) -> dict:
    """Seconds for all points and largest |distance| error on the subset, per library."""
    out = {}
    p = points.astype(np.float64)
    try:
        import igl

        for name, kind in (
            ("igl_winding", igl.SIGNED_DISTANCE_TYPE_WINDING_NUMBER),
            ("igl_fast_winding", igl.SIGNED_DISTANCE_TYPE_FAST_WINDING_NUMBER),
            ("igl_pseudonormal", igl.SIGNED_DISTANCE_TYPE_PSEUDONORMAL),
            ("igl_unsigned", igl.SIGNED_DISTANCE_TYPE_UNSIGNED),
        ):
            (s, *_), t = _timed(lambda kind=kind: igl.signed_distance(p, v, f, sign_type=kind))
            out[name] = {
                "s": t,
                "max_err": float(np.abs(np.abs(s[:subset]) - np.abs(reference)).max()),
            }
    except ImportError:
        pass
    try:
        import point_cloud_utils as pcu

        (s, *_), t = _timed(lambda: pcu.signed_distance_to_mesh(p, v, f.astype(np.int32)))
        out["point_cloud_utils"] = {
            "s": t,
            "max_err": float(np.abs(np.abs(s[:subset]) - np.abs(reference)).max()),
        }
    except ImportError:
        pass
    try:
        import trimesh

        mesh = trimesh.Trimesh(v, f, process=False)
        (_, d, _), t = _timed(lambda: trimesh.proximity.closest_point(mesh, p[:subset]))
        out["trimesh_unsigned(extrapolated)"] = {
            "s": t * len(p) / subset,
            "max_err": float(np.abs(d - np.abs(reference)).max()),
        }
    except ImportError:
        pass
    return out


def bench_mesh(path: Path, count: int, subset: int, compare: bool) -> dict:
    source = load_source(path)
    if source.faces is None:
        return {"mesh": path.name, "skipped": "point cloud"}
    norm = compute_normalization(path, source.used_points())
    v = normalize_points(source.vertices, norm)
    f = np.ascontiguousarray(source.faces, dtype=np.int64)
    points = sample_points(v, f, count, seed=0)
    # brute force last: torch's OpenMP threads keep spinning a while after a parallel
    # region and would slow libigl's own threads if it ran first
    (fast, _), fast_s = _timed(lambda: sdf.signed_distance(points, v, f))
    recipe = RECIPES["spc_sdf"]
    params = recipe.spec.resolve(
        {"level": 8, "near_samples": count - count // 2, "uniform_samples": count // 2}
    )
    ops = get_backend("torch", "cpu")
    _, recipe_s = _timed(
        lambda: run_recipe(
            recipe,
            source,
            params,
            generator=make_generator("0" * 32, path.name),
            device="cpu",
            ops=ops,
        )
    )
    sub = torch.from_numpy(points[:subset])
    (brute, _), brute_s = _timed(
        lambda: sdf.brute_force_signed_distance(sub, torch.from_numpy(v), torch.from_numpy(f))
    )
    brute = brute.numpy()
    brute_full_s = brute_s * count / subset
    time.sleep(0.5)  # let the OpenMP threads go idle before --compare times libigl again
    far = np.abs(brute) > 1e-4
    row = {
        "mesh": path.name,
        "faces": len(f),
        "points": count,
        "sdf_s": fast_s,
        "points_per_s": count / fast_s,
        "record_s": recipe_s,
        "samples_per_s": 1 / recipe_s,
        "brute_subset": subset,
        "brute_s_extrapolated": brute_full_s,
        "speedup": brute_full_s / fast_s,
        "max_abs_err": float(np.abs(fast[:subset] - brute)[far].max(initial=0.0)),
        "max_dist_err": float(np.abs(np.abs(fast[:subset]) - np.abs(brute)).max()),
        "sign_mismatches_far": int((np.sign(fast[:subset]) != np.sign(brute))[far].sum()),
    }
    if compare:
        row["libraries"] = compare_libraries(points, v, f, brute, subset)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "path",
        nargs="?",
        default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "meshes"),
        help="a mesh file or a directory of meshes (default: ../shared/data/meshes; "
        "generated shapes when absent)",
    )
    parser.add_argument("--points", type=int, default=100_000, help="M, SDF points per mesh")
    parser.add_argument("--subset", type=int, default=500, help="points given to brute force")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--compare", action="store_true", help="also time other libraries")
    parser.add_argument("--json", action="store_true", help="print one JSON line per mesh")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.path)
    paths = (
        [root]
        if root.is_file()
        else sorted(p for p in root.glob("*") if p.is_file())
        if root.is_dir()
        else []
    )
    if not paths:
        import tempfile

        print(f"{root} holds no meshes: using generated shapes", file=sys.stderr)
        paths = generated_meshes(Path(tempfile.mkdtemp(prefix="spcache-sdf-bench-")))
    for path in paths:
        row = bench_mesh(path, args.points, min(args.subset, args.points), args.compare)
        if args.json:
            print(json.dumps(row), flush=True)
        elif "skipped" in row:
            print(f"{row['mesh']:24s} skipped ({row['skipped']})", flush=True)
        else:
            line = (
                f"{row['mesh']:24s} F={row['faces']:6d}  sdf {row['sdf_s']:.2f}s "
                f"({row['points_per_s'] / 1e3:.0f}k points/s)  record {row['record_s']:.2f}s  "
                f"brute~{row['brute_s_extrapolated']:.0f}s ({row['speedup']:.0f}x)  "
                f"err {row['max_dist_err']:.1e} signs {row['sign_mismatches_far']}"
            )
            if path.stem == "bunny":
                line += f"  goal <{GOAL_S:.0f}s: {'met' if row['sdf_s'] < GOAL_S else 'MISSED'}"
            print(line, flush=True)
            for name, lib in row.get("libraries", {}).items():
                print(
                    f"    {name:32s} {lib['s']:.2f}s  max distance error {lib['max_err']:.1e}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
