"""Benchmark: precompute throughput (samples/s) and where the time goes.

Runs the ``spc_query`` recipe over the shared meshes (default: level 8, 32,768 queries:
16,384 uniform + 16,384 near the surface, 100,000 surface samples) into fresh caches:

- ``serial``: loading in the calling process (``loaders=0``), CPU device: the baseline;
- ``pipelined``: loading in a process pool ahead of the device (``loaders=N``), CPU device;
- ``cuda``: the pipelined run on the GPU, when CUDA works here.

Prints samples/s, the split between loading (summed over loader processes), device
compute and writing, and each run's speed as a ratio to the serial baseline measured in
the same invocation. Nothing here asserts a speed.

    python bench/precompute.py [--meshes DIR] [--level 8] [--queries 32768] [--loaders N]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from cache_store.stores.opener import open_store  # noqa: E402
from cache_store.sources.discover import discover_sources  # noqa: E402
from workers.engine import Engine  # noqa: E402


def run_once(
    items: list[tuple[str, str]], params: dict, *, device: str, backend: str, loaders: int
) -> dict:
    with tempfile.TemporaryDirectory(prefix="spcache-bench-") as tmp:
        store = open_store(Path(tmp) / "cache", readonly=False)
        try:
            engine = Engine(
                store, "spc_query", params, device=device, backend=backend, loaders=loaders
            )
            start = time.perf_counter()
            summary = engine.run(items)
            wall = time.perf_counter() - start
        finally:
            store.close()
    if summary.failed:
        raise SystemExit(f"benchmark samples failed: {summary.errors}")
    return {
        "device": summary.device,
        "backend": summary.backend,
        "loaders": loaders,
        "samples": summary.done,
        "wall_s": wall,
        "samples_per_s": summary.done / wall,
        "load_s": summary.load_s,
        "compute_s": summary.compute_s,
        "write_s": summary.write_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", type=Path, default=REPO.parent / "shared" / "data" / "meshes")
    parser.add_argument("--level", type=int, default=8)
    parser.add_argument("--queries", type=int, default=32_768)
    parser.add_argument("--surface-samples", type=int, default=100_000)
    parser.add_argument("--loaders", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    items = discover_sources([args.meshes])
    params = {
        "level": args.level,
        "surface_samples": args.surface_samples,
        "uniform_queries": args.queries // 2,
        "surface_queries": args.queries - args.queries // 2,
    }
    print(
        f"{len(items)} meshes from {args.meshes}; spc_query {params}; "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    # a warm-up run pays for imports and the loader pool's first start
    run_once(items[:2], params, device="cpu", backend=args.backend, loaders=args.loaders)
    configs = {"serial": ("cpu", 0), "pipelined": ("cpu", args.loaders)}
    if torch.cuda.is_available():
        run_once(items[:2], params, device="cuda", backend=args.backend, loaders=args.loaders)
        configs["cuda"] = ("cuda", args.loaders)
    # interleaved repeats, so machine load hits every configuration alike
    trials: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.repeat):
        for name, (device, loaders) in configs.items():
            trials[name].append(
                run_once(items, params, device=device, backend=args.backend, loaders=loaders)
            )
    runs = {
        name: min(t, key=lambda r: r["wall_s"])
        | {"median_wall_s": statistics.median(r["wall_s"] for r in t)}
        for name, t in trials.items()
    }
    base = runs["serial"]["samples_per_s"]
    print(f"best of {args.repeat} (median wall in the last column)")
    print(
        f"{'run':<10}{'device':<9}{'backend':<8}{'loaders':>8}{'samples/s':>11}{'x serial':>9}"
        f"{'load s':>9}{'device s':>10}{'write s':>9}{'wall s':>8}{'median':>8}"
    )
    for name, r in runs.items():
        r["ratio_to_serial"] = r["samples_per_s"] / base
        print(
            f"{name:<10}{r['device']:<9}{r['backend']:<8}{r['loaders']:>8}"
            f"{r['samples_per_s']:>11.2f}"
            f"{r['ratio_to_serial']:>9.2f}{r['load_s']:>9.2f}{r['compute_s']:>10.2f}"
            f"{r['write_s']:>9.2f}{r['wall_s']:>8.2f}{r['median_wall_s']:>8.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"params": params, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
