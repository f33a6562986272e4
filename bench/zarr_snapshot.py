"""Zarr snapshot vs the LMDB cache it was exported from, in one run.

Workload: ``--samples`` spc_query-shaped records (``--unique`` of them computed with the
pure-PyTorch SPC ops, cycled: surface points of a randomly scaled sphere + torus,
quantised at ``--level``, octree, pyramid, exsum, point hierarchy; half uniform, half
near-surface queries with parent indices and occupancy), ingested into an LMDB cache as
the engine writes (timed), then exported with ``export_snapshot``.

Reported:

- size: the LMDB records' bytes (and the environment's used pages) vs the snapshot's
  bytes on disk, the compression ratio, for each codec the exporter offers;
- export time per codec (both passes, fsync and rename included), as MB/s of records and
  as a multiple of the LMDB ingest time of the same records;
- read throughput: samples/s of ``CachedDataset`` (when ``cache_store.readers.dataset`` is
  present; otherwise ``store.get_record``, which is what ``CachedDataset.__getitem__``
  calls) over the same records, on LMDB and on the snapshot, sequential and shuffled,
  measured interleaved so machine load hits both alike. The ratio snapshot/LMDB is the
  number to watch;
- the zstd snapshot read twice more ways, interleaved with the rest: through the
  hand-written chunk reader (``direct_reads=True``, the default for local snapshots) and
  through zarr's own codec pipeline (``direct_reads=False``); the ratio says which to keep.

    python bench/zarr_snapshot.py [--samples N] [--level L] [--points P] [--queries Q]
                                  [--repeats R] [--codecs zstd,lz4] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cache_store.snapshot.zarr.export import CODECS, export_snapshot
from cache_store.keys import compute_fingerprint
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.encode import encode_record
from cache_store.recipes.registry import get_recipe_spec
from cache_store.format.index import DatasetIndex
from cache_store.stores.opener import open_store
from workers.ops import get_backend


def shape_points(n: int, gen: torch.Generator) -> torch.Tensor:
    half = n // 2
    radius = 0.5 + 0.4 * torch.rand(1, generator=gen)
    sphere = torch.randn(half, 3, generator=gen)
    sphere = radius * sphere / sphere.norm(dim=1, keepdim=True)
    u, v = (2 * math.pi * torch.rand(2, n - half, generator=gen)).unbind(0)
    big, small = 0.4 + 0.3 * torch.rand(1, generator=gen), 0.1 + 0.1 * torch.rand(1, generator=gen)
    torus = torch.stack(
        [(big + small * v.cos()) * u.cos(), (big + small * v.cos()) * u.sin(), small * v.sin()],
        dim=1,
    )
    return torch.cat([sphere, torus]).clamp(-1, 1)


def make_fields(ops, level: int, points: int, queries: int, gen: torch.Generator) -> dict:
    surface = shape_points(points, gen)
    quantized = ops.quantize_points(surface, level)
    octree = ops.unbatched_points_to_octree(quantized, level)
    lengths = torch.tensor([octree.shape[0]], dtype=torch.int32)
    _, pyramids, exsum = ops.scan_octrees(octree, lengths)
    hierarchy = ops.generate_points(octree, pyramids, exsum)
    uniform = torch.rand(queries // 2, 3, generator=gen) * 2 - 1
    pick = torch.randint(0, points, (queries - queries // 2,), generator=gen)
    near = (surface[pick] + 0.01 * torch.randn(len(pick), 3, generator=gen)).clamp(-1, 1)
    qpts = torch.cat([uniform, near])
    pidx = ops.unbatched_query(octree, exsum, qpts, level, with_parents=True).to(torch.int32)
    return {
        "octree": octree,
        "pyramid": pyramids[0].to(torch.int32),
        "exsum": exsum.to(torch.int32),
        "point_hierarchy": hierarchy,
        "center": torch.zeros(3),
        "scale": torch.tensor(1.0),
        "query_points": qpts,
        "query_pidx": pidx,
        "occupancy": (pidx[:, -1] >= 0).to(torch.uint8),
    }


#: Records per write transaction of the timed ingest (the engine's default batch).
INGEST_BATCH = 32


def build_cache(
    path: Path, samples: int, level: int, points: int, queries: int, unique: int
) -> tuple:
    """The LMDB cache: ``unique`` records computed (slow at high levels), cycled to
    ``samples`` (each still its own record), then ingested as the engine's writer does
    (encode, ``put_many`` per :data:`INGEST_BATCH`, fsync'd commits); the ingest alone
    is timed, the baseline of the export times."""
    spec = get_recipe_spec("spc_query")
    params = spec.resolve(
        {
            "level": level,
            "surface_samples": points,
            "uniform_queries": queries // 2,
            "surface_queries": queries - queries // 2,
        }
    )
    fp = compute_fingerprint("spc_query", spec.version, params)
    ops = get_backend("torch")
    gen = torch.Generator().manual_seed(0)
    made = [make_fields(ops, level, points, queries, gen) for _ in range(min(unique, samples))]
    store = LMDBStore(path, readonly=False, map_size=1 << 28)
    ids = [f"shapes/s{i:05d}" for i in range(samples)]
    start = time.perf_counter()
    for lo in range(0, samples, INGEST_BATCH):
        batch = []
        for i in range(lo, min(lo + INGEST_BATCH, samples)):
            meta = {
                "recipe": "spc_query",
                "recipe_version": str(spec.version),
                "fingerprint": fp,
                "sample_id": ids[i],
                "source_hash": "0" * 16,
                "backend": ops.name,
                "device": "cpu",
            }
            batch.append((f"{fp}/{ids[i]}", encode_record(made[i % len(made)], meta)))
        store.put_many(batch)
    store.put_index(DatasetIndex(fp, "spc_query", spec.version, params, ids))
    return store, fp, ids, time.perf_counter() - start


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def reader(location: str, fp: str, **store_options):
    """A callable reading sample i (CachedDataset when present), and its name."""
    try:
        from cache_store.readers.dataset import CachedDataset
    except ImportError:
        store = open_store(location, **store_options)
        keys = store.get_index(fp).sample_ids.tolist()
        return (lambda i: store.get_record(f"{fp}/{keys[i]}").tensors), "store.get_record"
    dataset = CachedDataset(location, fp, store_options=store_options)
    return dataset.__getitem__, "CachedDataset"


def samples_per_s(read, order: list[int]) -> float:
    start = time.perf_counter()
    for i in order:
        read(i)
    return len(order) / (time.perf_counter() - start)


def run(
    samples: int,
    level: int,
    points: int,
    queries: int,
    repeats: int,
    codecs: tuple[str, ...] = CODECS,
    unique: int = 8,
) -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="spcache-bench-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        store, fp, _ids, ingest_s = build_cache(
            tmp / "cache", samples, level, points, queries, unique
        )
        build_s = time.perf_counter() - t0
        stats = store.stats()
        record_bytes = stats["bytes"]
        lmdb_used = stats["lmdb"]["used_bytes"]
        store.close()
        exports = {}
        for codec in codecs:
            t0 = time.perf_counter()
            summary = export_snapshot(tmp / "cache", fp, tmp / f"{codec}.zarr", codec=codec)
            exports[codec] = (time.perf_counter() - t0, dir_bytes(tmp / f"{codec}.zarr"))
        readers = {"lmdb": reader(str(tmp / "cache"), fp)}
        readers |= {codec: reader(str(tmp / f"{codec}.zarr"), fp) for codec in codecs}
        if "zstd" in codecs:  # the same snapshot through zarr's own codec pipeline
            readers["zstd_zarr_pipeline"] = reader(str(tmp / "zstd.zarr"), fp, direct_reads=False)
        for read, _ in readers.values():  # warm up: open, index, page cache
            for i in range(min(8, samples)):
                read(i)
        rates: dict[str, list[float]] = {
            f"{b}_{o}": [] for b in readers for o in ("seq", "shuffled")
        }
        rng = random.Random(0)
        for _ in range(repeats):
            shuffled = list(range(samples))
            rng.shuffle(shuffled)
            for name, (read, _) in readers.items():
                rates[f"{name}_seq"].append(samples_per_s(read, list(range(samples))))
                rates[f"{name}_shuffled"].append(samples_per_s(read, shuffled))
    result = {
        "samples": samples,
        "level": level,
        "points": points,
        "queries": queries,
        "repeats": repeats,
        "reader": readers["lmdb"][1],
        "cpus": os.cpu_count(),
        "build_s": build_s,
        "ingest_s": ingest_s,
        "record_bytes": record_bytes,
        "lmdb_used_bytes": lmdb_used,
        "exported": summary.samples,
        "codecs": list(codecs),
    }
    for codec, (seconds, size) in exports.items():
        result[f"{codec}_bytes"] = size
        result[f"{codec}_compression_ratio"] = record_bytes / size
        result[f"{codec}_export_s"] = seconds
        result[f"{codec}_export_mb_per_s"] = record_bytes / seconds / 1e6
        result[f"{codec}_export_vs_ingest"] = seconds / ingest_s
    for name, values in rates.items():
        result[f"{name}_per_s"] = statistics.median(values)
    for codec in codecs:
        for order in ("seq", "shuffled"):
            result[f"{codec}_ratio_{order}"] = (
                result[f"{codec}_{order}_per_s"] / result[f"lmdb_{order}_per_s"]
            )
    if "zstd" in codecs:
        for order in ("seq", "shuffled"):  # > 1: the hand-written reader is faster
            result[f"direct_vs_pipeline_{order}"] = (
                result[f"zstd_{order}_per_s"] / result[f"zstd_zarr_pipeline_{order}_per_s"]
            )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--level", type=int, default=8)
    parser.add_argument("--points", type=int, default=50_000)
    parser.add_argument("--queries", type=int, default=32_768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--unique", type=int, default=8, help="distinct records computed, cycled to --samples"
    )
    parser.add_argument(
        "--codecs", default=",".join(CODECS), help=f"comma-separated subset of {', '.join(CODECS)}"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    codecs = tuple(c for c in args.codecs.split(",") if c)
    if not codecs or not set(codecs) <= set(CODECS):
        parser.error(f"--codecs: choose from {', '.join(CODECS)}")
    r = run(args.samples, args.level, args.points, args.queries, args.repeats, codecs, args.unique)
    if args.json:
        print(json.dumps(r))
        return 0
    mb = 1e6
    print(
        f"{r['samples']} spc_query records (level {r['level']}, {r['points']:,} surface "
        f"points, {r['queries']:,} queries), {r['cpus']} CPUs, reader {r['reader']}, "
        f"{r['repeats']} interleaved repeats"
    )
    print(
        f"  LMDB records {r['record_bytes'] / mb:.1f} MB (env pages "
        f"{r['lmdb_used_bytes'] / mb:.1f} MB), ingested in {r['ingest_s']:.2f} s; "
        f"read LMDB seq {r['lmdb_seq_per_s']:.1f}, "
        f"shuffled {r['lmdb_shuffled_per_s']:.1f} samples/s"
    )
    for c in r["codecs"]:
        print(
            f"  {c:6s} snapshot {r[f'{c}_bytes'] / mb:7.1f} MB = "
            f"{r[f'{c}_compression_ratio']:.2f}x smaller; export {r[f'{c}_export_s']:.2f} s "
            f"({r[f'{c}_export_mb_per_s']:.1f} MB/s, {r[f'{c}_export_vs_ingest']:.2f}x the "
            f"ingest); read seq {r[f'{c}_seq_per_s']:.1f} "
            f"samples/s = {r[f'{c}_ratio_seq']:.2f}x LMDB, shuffled "
            f"{r[f'{c}_shuffled_per_s']:.1f} = {r[f'{c}_ratio_shuffled']:.2f}x LMDB"
        )
    if "direct_vs_pipeline_seq" in r:
        print(
            f"  zstd read through zarr's codec pipeline: seq "
            f"{r['zstd_zarr_pipeline_seq_per_s']:.1f}, shuffled "
            f"{r['zstd_zarr_pipeline_shuffled_per_s']:.1f} samples/s; hand-written chunk "
            f"reader = {r['direct_vs_pipeline_seq']:.2f}x (seq), "
            f"{r['direct_vs_pipeline_shuffled']:.2f}x (shuffled) of that"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
