"""Benchmark: a first epoch over an empty cache with and without the sampler's read-ahead.

Both arms run in this invocation over the same sources (the shared meshes, copied
``--copies`` times under distinct ids) and parameters, each over a fresh empty cache
with its own ``spcache worker --device cpu`` (started and alive before the clock
starts), the arms alternated ``--repeat`` times:

- ``read-ahead``: ``spcache.DataLoader`` with ``Sampler(ds, read_ahead=R)``: the
  sampler queues each rank's next ``R`` samples in its shuffled order;
- ``no read-ahead``: the same with ``read_ahead=0``: a loader's miss queues its batch and
  the next ``warm_ahead=16`` uncached samples in *index* order (how read-through worked
  before the sampler).

Each batch is followed by ``--step-ms`` of sleep, a training step's stand-in. Also timed
once: ``spcache precompute`` of the same sources (what the worker's throughput allows).
Prints each arm's epoch time, how long the loop waited for data (in all, and after its
first batch, which waits for the worker's first claim either way), the ratios
no-read-ahead / read-ahead, and each epoch against precompute. Nothing here asserts a
speed.

    python bench/read_ahead.py [--meshes DIR] [--copies 6] [--level 7] [--read-ahead 64]
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import spcache  # noqa: E402
from cache_store.jobs.queue import JobQueue  # noqa: E402


def _worker(cache: Path, args: argparse.Namespace) -> subprocess.Popen:
    cache.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers", "worker", "--cache", str(cache)]
        + ["--device", "cpu", "--backend", "torch", "--loaders", "0", "--poll", "0.05"]
        + ["--batch", str(args.claim), "--log-level", "warning"],
        cwd=REPO,
    )
    queue = JobQueue(cache)
    while not queue.live_workers():
        if proc.poll() is not None:
            raise SystemExit("the worker exited at start")
        time.sleep(0.02)
    queue.close()
    return proc


def epoch(
    cache: Path, sources: Path, params: dict, read_ahead: int, args: argparse.Namespace
) -> tuple[float, float, float]:
    """(epoch seconds, seconds the loop waited for its first batch, for all batches)."""
    proc = _worker(cache, args)
    try:
        ds = spcache.CachedDataset(cache, "spc_query", sources=sources, **params)
        sampler = spcache.Sampler(ds, seed=1, read_ahead=read_ahead)
        loader = spcache.DataLoader(
            ds,
            batch_size=args.batch,
            sampler=sampler,
            num_workers=args.workers,
            collate_fn=spcache.collate_spc,
            multiprocessing_context="fork",
        )
        start = time.perf_counter()
        n, waited, first = 0, 0.0, None
        it = iter(loader)
        while True:
            asked = time.perf_counter()
            batch = next(it, None)
            waited += time.perf_counter() - asked
            first = waited if first is None else first
            if batch is None:
                break
            n += len(batch["sample_ids"])
            time.sleep(args.step_ms / 1000)
        took = time.perf_counter() - start
        assert n == len(ds), (n, len(ds))
        return took, first, waited
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def precompute(cache: Path, sources: Path, params: dict) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "workers", "precompute", str(sources), "--recipe", "spc_query"]
        + [a for k, v in params.items() for a in ("--param", f"{k}={v}")]
        + ["--cache", str(cache), "--device", "cpu", "--backend", "torch", "--loaders", "0"],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(prog="read_ahead.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--meshes",
        type=Path,
        default=REPO.parent.parent / "shared/data/meshes",
        help="source directory (default: ../shared/data/meshes)",
    )
    parser.add_argument("--copies", type=int, default=6, help="copies of the sources")
    parser.add_argument("--level", type=int, default=7)
    parser.add_argument("--queries", type=int, default=4096, help="half uniform, half surface")
    parser.add_argument("--read-ahead", type=int, default=64, help="the sampler's window")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--batch", type=int, default=4, help="DataLoader batch size")
    parser.add_argument("--step-ms", type=float, default=50.0, help="sleep per batch")
    parser.add_argument("--claim", type=int, default=4, help="items per worker claim")
    parser.add_argument("--repeat", type=int, default=2, help="alternated runs of each arm")
    args = parser.parse_args()
    params = {
        "level": args.level,
        "surface_samples": 20_000,
        "uniform_queries": args.queries // 2,
        "surface_queries": args.queries - args.queries // 2,
    }
    with tempfile.TemporaryDirectory(prefix="spcache-ra-") as tmp:
        sources = Path(tmp) / "sources"
        for c in range(args.copies):
            shutil.copytree(args.meshes, sources / f"c{c:02d}")
        n = len(spcache.CachedDataset(Path(tmp) / "x", "spc_query", sources=sources, **params))
        times: dict[str, list[tuple[float, float, float]]] = {"read-ahead": [], "no read-ahead": []}
        for r in range(args.repeat):
            for name, window in (("read-ahead", args.read_ahead), ("no read-ahead", 0)):
                took, first, waited = epoch(
                    Path(tmp) / f"{name}-{r}", sources, params, window, args
                )
                times[name].append((took, first, waited))
                print(
                    f"  {name} run {r + 1}: {took:.2f} s, first batch after {first:.2f} s, "
                    f"waited for data {waited:.2f} s in all, {waited - first:.2f} s after "
                    f"the first batch",
                    flush=True,
                )
        pre = precompute(Path(tmp) / "pre", sources, params)
    ahead, plain = (statistics.median(t[0] for t in times[k]) for k in times)
    wait_ahead, wait_plain = (statistics.median(t[2] for t in times[k]) for k in times)
    later_ahead, later_plain = (statistics.median(t[2] - t[1] for t in times[k]) for k in times)
    print(
        f"{n} samples, {params}, batch {args.batch}, {args.workers} loader workers, "
        f"step {args.step_ms:g} ms, read_ahead={args.read_ahead}"
    )
    print(f"precompute alone (the worker's throughput): {pre:8.2f} s")
    print(
        f"first epoch, read-ahead (median):           {ahead:8.2f} s ({ahead / pre:.2f}x precompute)"
    )
    print(
        f"first epoch, no read-ahead (median):        {plain:8.2f} s ({plain / pre:.2f}x precompute)"
    )
    print(
        f"waited for data (median): read-ahead {wait_ahead:.2f} s, no read-ahead {wait_plain:.2f} s"
    )
    print(
        f"waited after the first batch (median): read-ahead {later_ahead:.2f} s, "
        f"no read-ahead {later_plain:.2f} s"
    )
    print(
        f"ratio no read-ahead / read-ahead: epoch {plain / ahead:.2f}, wait {wait_plain / wait_ahead:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
