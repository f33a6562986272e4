"""Benchmark: one epoch over an empty cache (read-through) against precompute + read.

Both arms run in this invocation over the same sources and parameters:

- ``read-through``: start ``spcache worker --cache EMPTY --device cpu`` (a subprocess),
  then iterate a DataLoader over ``CachedDataset(EMPTY, recipe, sources=...)``: every
  miss is queued for the worker and waited for. Timed from the worker's start to the
  epoch's last batch (the worker's start-up included);
- ``precompute + read``: ``spcache precompute`` (a subprocess, same device and loader
  count) into another empty cache, then the same DataLoader epoch over it.

Prints both times and the ratio read-through / (precompute + read). Nothing here asserts
a speed.

    python bench/read_through.py [--meshes DIR] [--level 8] [--workers 2] [--batch 4]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from torch.utils.data import DataLoader  # noqa: E402

from cache_store.readers.dataset import CachedDataset  # noqa: E402
from cache_store.jobs.queue import JobQueue  # noqa: E402


def _as_list(batch: list) -> list:
    return batch


def epoch(cache: Path, sources: Path, params: dict, workers: int, batch: int) -> int:
    ds = CachedDataset(cache, "spc_query", sources=sources, **params)
    loader = DataLoader(
        ds,
        batch_size=batch,
        num_workers=workers,
        collate_fn=_as_list,
        multiprocessing_context="fork",
    )
    return sum(len(b) for b in loader)


def read_through(
    cache: Path, sources: Path, params: dict, args: argparse.Namespace
) -> tuple[float, int]:
    start = time.perf_counter()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spcache",
            "worker",
            "--cache",
            str(cache),
            "--device",
            "cpu",
            "--backend",
            "torch",
            "--loaders",
            str(args.loaders),
            "--poll",
            "0.05",
            "--batch",
            str(args.claim),
            "--log-level",
            "warning",
        ],
        cwd=REPO,
    )
    try:
        queue = JobQueue(cache)
        while not queue.live_workers():
            time.sleep(0.02)
        queue.close()
        n = epoch(cache, sources, params, args.workers, args.batch)
        return time.perf_counter() - start, n
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def precompute_and_read(
    cache: Path, sources: Path, params: dict, args: argparse.Namespace
) -> tuple[float, float, int]:
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "spcache",
            "precompute",
            str(sources),
            "--recipe",
            "spc_query",
            *[a for k, v in params.items() for a in ("--param", f"{k}={v}")],
            "--cache",
            str(cache),
            "--device",
            "cpu",
            "--backend",
            "torch",
            "--loaders",
            str(args.loaders),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    computed = time.perf_counter()
    n = epoch(cache, sources, params, args.workers, args.batch)
    return computed - start, time.perf_counter() - computed, n


def main() -> int:
    parser = argparse.ArgumentParser(prog="read_through.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--meshes",
        type=Path,
        default=REPO.parent.parent / "shared/data/meshes",
        help="source directory (default: ../shared/data/meshes)",
    )
    parser.add_argument("--level", type=int, default=8)
    parser.add_argument("--surface-samples", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=32_768, help="half uniform, half surface")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--batch", type=int, default=4, help="DataLoader batch size")
    parser.add_argument(
        "--loaders", type=int, default=0, help="loader processes of worker/precompute"
    )
    parser.add_argument("--claim", type=int, default=4, help="items per worker claim")
    args = parser.parse_args()
    params = {
        "level": args.level,
        "surface_samples": args.surface_samples,
        "uniform_queries": args.queries // 2,
        "surface_queries": args.queries - args.queries // 2,
    }
    with tempfile.TemporaryDirectory(prefix="spcache-rt-") as tmp:
        rt, n_rt = read_through(Path(tmp) / "rt", args.meshes, params, args)
        pre, read, n_pre = precompute_and_read(Path(tmp) / "pre", args.meshes, params, args)
    assert n_rt == n_pre, (n_rt, n_pre)
    print(f"{n_rt} samples, {params}")
    print(f"read-through epoch on an empty cache: {rt:8.2f} s")
    print(f"precompute {pre:.2f} s + read {read:.2f} s: {pre + read:8.2f} s")
    print(f"ratio read-through / (precompute + read): {rt / (pre + read):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
