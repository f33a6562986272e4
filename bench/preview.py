"""Preview rendering: a 512x512 picture of a level-8 record, against baselines run here.

Computes one real ``spc`` record at level 8 (the shared bunny when ``../shared`` is
there, else a trimesh icosphere; torch backend on the CPU), then times, median of
``--repeat`` runs each:

* ``decode``: ``decode_arrays`` of the fields a preview reads (the floor: every render
  pays it);
* ``render``: :func:`service.preview.render_record` -> PNG bytes (what the route does);
* ``naive``: the same splats with the obvious NumPy z-buffer (sort every splat by pixel
  and depth with ``np.unique``) instead of ``minimum.at`` on packed keys.

Prints JSON with the medians, ``render / decode`` and ``naive / render``, and whether
the render meets the 200 ms goal.

    python bench/preview.py [--level 8] [--size 512] [--view iso] [--repeat 10] [--mesh PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

GOAL_MS = 200.0


def make_record(mesh: Path | None, level: int) -> tuple[bytes, str]:
    from cache_store.keys import compute_fingerprint
    from cache_store.recipes.registry import get_recipe_spec
    from cache_store.format.encode import encode_record
    from workers.ops import get_backend
    from workers.recipe_run import get_recipe, make_generator, run_recipe
    from workers.source_load import load_source

    if mesh is None:
        shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "meshes" / "bunny.ply"
        if shared.is_file():
            mesh = shared
        else:
            import trimesh

            mesh = Path(tempfile.mkdtemp()) / "sphere.obj"
            trimesh.creation.icosphere(subdivisions=4).export(mesh)
    spec = get_recipe_spec("spc")
    params = spec.resolve({"level": level, "surface_samples": 400_000})
    fp = compute_fingerprint("spc", spec.version, params)
    source = load_source(mesh)
    tensors = run_recipe(
        get_recipe("spc"),
        source,
        params,
        generator=make_generator(fp, mesh.stem),
        device="cpu",
        ops=get_backend("torch", "cpu"),
    )
    value = encode_record(
        tensors,
        {
            "recipe": "spc",
            "recipe_version": str(spec.version),
            "fingerprint": fp,
            "sample_id": mesh.stem,
            "source_hash": source.source_hash,
            "backend": "torch",
            "device": "cpu",
        },
    )
    return value, str(mesh)


def naive_render(voxels: np.ndarray, level: int, view: str, size: int) -> np.ndarray:
    """The same picture with an np.unique z-buffer over every (pixel, depth) splat."""
    from service import preview as p

    rotation = p.VIEWS[view]
    scale = (size / 2) * 0.94 / p.half_extent(rotation)
    half = 1.0 / (1 << level)
    dx, dy, shade = p.splat_template(rotation, half, scale)
    centres = (voxels.astype(np.float64) + 0.5) * (2 * half) - 1.0
    xyz = centres @ rotation.T
    order = np.argsort(-xyz[:, 2], kind="stable")
    xyz = xyz[order]
    cx = np.rint(size / 2 + scale * xyz[:, 0]).astype(np.int64)
    cy = np.rint(size / 2 - scale * xyz[:, 1]).astype(np.int64)
    px, py = (cx[:, None] + dx).ravel(), (cy[:, None] + dy).ravel()
    keep = (px >= 0) & (px < size) & (py >= 0) & (py < size)
    pixels, first = np.unique((py * size + px)[keep], return_index=True)
    chosen = np.flatnonzero(keep)[first]
    image = np.empty((size * size, 3), np.uint8)
    image[:] = p.BACKGROUND
    light = shade[chosen % len(dx)]
    image[pixels] = np.clip(light[:, None] * p.BASE_COLOUR * 255, 0, 255).astype(np.uint8)
    return image.reshape(size, size, 3)


def median_ms(fn, repeat: int) -> tuple[float, float]:
    """(median, fastest) of ``repeat`` timed calls after one warm-up, in ms."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000, min(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--level", type=int, default=8)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--view", default="iso")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--mesh", type=Path, default=None)
    args = parser.parse_args()

    from cache_store.format.decode import decode_arrays
    from service.preview import PreviewRequest, level_voxels, render_record

    value, mesh = make_record(args.mesh, args.level)
    fields = ["point_hierarchy", "pyramid"]
    arrays, _ = decode_arrays(value, fields=fields)
    voxels = level_voxels(arrays["point_hierarchy"], arrays["pyramid"], args.level)
    request = PreviewRequest(level=args.level, view=args.view, size=args.size)
    decode = median_ms(lambda: decode_arrays(value, fields=fields), args.repeat)
    render = median_ms(lambda: render_record(value, request), args.repeat)
    naive = median_ms(lambda: naive_render(voxels, args.level, args.view, args.size), args.repeat)
    print(
        json.dumps(
            {
                "mesh": mesh,
                "level": args.level,
                "voxels": len(voxels),
                "size": args.size,
                "view": args.view,
                "record_bytes": len(value),
                "repeat": args.repeat,
                "median_ms": {
                    "decode": round(decode[0], 2),
                    "render_png": round(render[0], 1),
                    "naive_zbuffer": round(naive[0], 1),
                },
                "fastest_ms": {
                    "decode": round(decode[1], 2),
                    "render_png": round(render[1], 1),
                    "naive_zbuffer": round(naive[1], 1),
                },
                "render_over_decode": round(render[0] / decode[0], 1),
                "naive_over_render": round(naive[0] / render[0], 2),
                "goal_ms": GOAL_MS,
                "meets_goal": render[0] < GOAL_MS,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
