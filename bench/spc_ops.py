"""Benchmark the pure-PyTorch SPC ops against one torch.sort, on one CPU thread.

Workload: 1,000,000 points sampled on a surface (a sphere of radius 0.9 and a
torus, half each, in [-1, 1]^3), quantized at level 10;

- build: ``unbatched_points_to_octree`` + ``scan_octrees`` + ``generate_points``;
- query: ``unbatched_query(..., with_parents=True)`` of 1,000,000 points, half uniform in
  the cube and half jittered around the surface (sigma 0.01), as the spc_query recipe does.

Baseline: one ``torch.sort`` of 1,000,000 int64 keys drawn uniformly from [0, 2**30) (the
range of level-10 Morton codes), measured in the same run, interleaved with the ops, so
machine load hits both alike. Goals: build <= 4x the sort, query <= 6x.

    python bench/spc_ops.py [--points N] [--level L] [--repeats R] [--threads T] [--device D]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.ops import get_backend

GOALS = {"build": 4.0, "query": 6.0}


def surface_points(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` float32 points on a sphere (r=0.9) and a torus (R=0.6, r=0.2) in [-1, 1]^3."""
    half = n // 2
    sphere = torch.randn(half, 3, generator=generator)
    sphere = 0.9 * sphere / sphere.norm(dim=1, keepdim=True)
    u, v = (2 * math.pi * torch.rand(2, n - half, generator=generator)).unbind(0)
    torus = torch.stack(
        [(0.6 + 0.2 * v.cos()) * u.cos(), (0.6 + 0.2 * v.cos()) * u.sin(), 0.2 * v.sin()], dim=1
    )
    return torch.cat([sphere, torus])


def query_points(surface: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    n = surface.shape[0]
    uniform = torch.rand(n // 2, 3, generator=generator) * 2 - 1
    near = surface[n // 2 :] + 0.01 * torch.randn(n - n // 2, 3, generator=generator)
    return torch.cat([uniform, near])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def run(
    points: int, level: int, repeats: int, threads: int, device: str, backend: str, seed: int = 0
) -> dict:
    torch.set_num_threads(threads)
    dev = torch.device(device)
    ops = get_backend(backend, device=dev)
    gen = torch.Generator().manual_seed(seed)
    surface = surface_points(points, gen)
    quantized = ops.quantize_points(surface.to(dev), level)
    queries = query_points(surface, gen).to(dev)
    keys = torch.randint(0, 2**30, (points,), generator=gen, dtype=torch.int64).to(dev)
    state: dict = {}

    def build() -> None:
        octree = ops.unbatched_points_to_octree(quantized, level)
        lengths = torch.tensor([octree.shape[0]], dtype=torch.int32)
        _, pyramids, exsum = ops.scan_octrees(octree, lengths)
        state["spc"] = (octree, exsum, ops.generate_points(octree, pyramids, exsum))

    def query() -> None:
        octree, exsum, _ = state["spc"]
        state["pidx"] = ops.unbatched_query(octree, exsum, queries, level, with_parents=True)

    build()  # warm up (allocator, lazy init)
    query()
    times: dict[str, list[float]] = {"sort": [], "build": [], "query": []}
    for _ in range(repeats):
        times["sort"].append(_timed(lambda: torch.sort(keys), dev))
        times["build"].append(_timed(build, dev))
        times["query"].append(_timed(query, dev))
    octree, _, hierarchy = state["spc"]
    result = {
        "backend": ops.name,
        "device": str(dev),
        "threads": threads,
        "points": points,
        "level": level,
        "repeats": repeats,
        "torch": torch.__version__,
        "unique_voxels": int(hierarchy.shape[0] - octree.shape[0]),
        "octree_bytes": int(octree.shape[0]),
        "query_hits": float((state["pidx"][:, -1] >= 0).float().mean()),
    }
    for name, samples in times.items():
        result[f"{name}_median_s"] = statistics.median(samples)
        result[f"{name}_min_s"] = min(samples)
    for name in GOALS:
        result[f"{name}_ratio_median"] = result[f"{name}_median_s"] / result["sort_median_s"]
        result[f"{name}_ratio_min"] = result[f"{name}_min_s"] / result["sort_min_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=1_000_000)
    parser.add_argument("--level", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    r = run(args.points, args.level, args.repeats, args.threads, args.device, args.backend)
    if args.json:
        print(json.dumps(r))
        return 0
    print(
        f"backend={r['backend']} device={r['device']} threads={r['threads']} "
        f"torch={r['torch']} points={r['points']:,} level={r['level']} "
        f"(unique voxels {r['unique_voxels']:,}, octree {r['octree_bytes']:,} bytes, "
        f"query hits {r['query_hits']:.1%}), {r['repeats']} interleaved repeats"
    )
    print(
        f"  torch.sort of {r['points']:,} int64 keys: median {r['sort_median_s'] * 1e3:7.1f} ms"
        f"  min {r['sort_min_s'] * 1e3:7.1f} ms"
    )
    for name, label in (
        ("build", "build (points_to_octree + scan + generate)"),
        ("query", "query (with_parents=True)"),
    ):
        ok = "ok" if r[f"{name}_ratio_median"] <= GOALS[name] else "OVER GOAL"
        print(
            f"  {label}: median {r[f'{name}_median_s'] * 1e3:7.1f} ms "
            f"= {r[f'{name}_ratio_median']:.2f}x sort (min {r[f'{name}_min_s'] * 1e3:.1f} ms "
            f"= {r[f'{name}_ratio_min']:.2f}x); goal <= {GOALS[name]:g}x: {ok}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
