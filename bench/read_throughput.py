"""Read throughput: CachedDataset over LMDB vs Kaolin-style per-field torch.save files.

Writes N records of about 0.6 MB (octree, point hierarchy, exsum, query points, labels)
twice, once into an LMDB cache through ``LMDBStore`` and once the way Kaolin's
``CachedDataset`` keeps a cache on disk (one ``torch.save`` file per field per sample,
read back with ``torch.load``), then reads every sample through a DataLoader in a fixed
shuffled order with ``num_workers`` 0 and 4, and prints samples/s and the ratio against
the baseline measured in the same run. A second part decodes 1 MB records in one
process and compares the decoded GB/s with a plain memory copy measured in the same run.

Both caches are read warm (just written, in the page cache): this compares the reading
code paths, not disks.

    python bench/read_throughput.py [--records 2000] [--workers 0 4] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from cache_store import CachedDataset, collate_spc
from cache_store.keys import compute_fingerprint
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.encode import encode_record
from cache_store.format.index import DatasetIndex

log = logging.getLogger("bench.read_throughput")
FIELDS = ("octree", "point_hierarchy", "exsum", "query_points", "labels")


def make_fields(rng: np.random.Generator, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """About 0.6 MB at scale 1: sizes vary +-10% per sample like real octrees do."""
    nbytes = int(40_000 * scale * rng.uniform(0.9, 1.1))
    npoints = int(50_000 * scale * rng.uniform(0.9, 1.1))
    nquery = int(8_192 * scale)
    octree = rng.integers(1, 256, nbytes, dtype=np.uint8)
    return {
        "octree": torch.from_numpy(octree),
        "point_hierarchy": torch.from_numpy(rng.integers(0, 256, (npoints, 3), dtype=np.int16)),
        "exsum": torch.from_numpy(
            np.cumsum(np.unpackbits(octree[:, None], axis=1).sum(1), dtype=np.int32)
        ),
        "query_points": torch.from_numpy(rng.uniform(-1, 1, (nquery, 3)).astype(np.float32)),
        "labels": torch.from_numpy(rng.integers(0, 2, nquery, dtype=np.uint8)),
    }


def write_caches(root: Path, n: int, scale: float) -> tuple[str, float]:
    params = {"level": 8, "surface_samples": 100_000}
    fp = compute_fingerprint("spc", 1, params)
    store = LMDBStore(root / "lmdb", readonly=False, map_size=1 << 30)
    rng = np.random.default_rng(0)
    ids, batch, total = [], [], 0
    for i in range(n):
        sid = f"shape{i:06d}"
        fields = make_fields(rng, scale)
        meta = {
            "recipe": "spc",
            "recipe_version": "1",
            "fingerprint": fp,
            "sample_id": sid,
            "source_hash": "0" * 16,
            "backend": "torch",
            "device": "cpu",
        }
        value = encode_record(fields, meta)
        total += len(value)
        batch.append((f"{fp}/{sid}", value))
        sample_dir = root / "torchsave" / sid
        sample_dir.mkdir(parents=True)
        for name, tensor in fields.items():
            torch.save(tensor, sample_dir / f"{name}.pt")
        ids.append(sid)
        if len(batch) == 64:
            store.put_many(batch)
            batch = []
    store.put_many(batch)
    store.put_index(DatasetIndex(fp, "spc", 1, params, np.array(ids)))
    store.close()
    return fp, total / n


class TorchSaveDataset(Dataset):
    """The baseline: Kaolin-style cache, one torch.save file per field per sample."""

    def __init__(self, root: Path, n: int) -> None:
        self.root = str(root)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        base = os.path.join(self.root, f"shape{i:06d}")
        return {name: torch.load(os.path.join(base, f"{name}.pt")) for name in FIELDS}


def identity(sample: object) -> object:
    return sample


def time_loader(
    dataset: Dataset, workers: int, order: list[int], batch_size: int = 0
) -> tuple[float, float]:
    """Samples/s reading ``order`` (batch_size 0: one sample at a time, no collate), by
    wall clock and by this process's CPU time (the second is the rate one uncontended
    core would give; it means something only with ``workers == 0``)."""
    batched = batch_size > 0
    loader = DataLoader(
        dataset,
        batch_size=batch_size if batched else None,
        sampler=order,
        num_workers=workers,
        collate_fn=collate_spc if batched else identity,
        prefetch_factor=(2 if batched else 8) if workers else None,
        multiprocessing_context="fork" if workers else None,
    )
    start, cpu = time.perf_counter(), time.process_time()
    count = sum(len(b["lengths"]) if batched else 1 for b in loader)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert count == len(order)
    return count / elapsed, count / max(cpu, 1e-9)


def decode_gbps(root: Path, n: int, rounds: int = 7) -> dict[str, float]:
    """Decoded GB/s for ~1 MB records in one process, next to memcpy of the same bytes."""
    params = {"level": 9, "surface_samples": 100_000}
    fp = compute_fingerprint("spc", 1, params)
    store = LMDBStore(root / "lmdb1mb", readonly=False, map_size=1 << 30)
    rng = np.random.default_rng(1)
    items = []
    for i in range(n):
        sid = f"big{i:05d}"
        meta = {
            "recipe": "spc",
            "recipe_version": "1",
            "fingerprint": fp,
            "sample_id": sid,
            "source_hash": "0" * 16,
            "backend": "torch",
            "device": "cpu",
        }
        items.append((f"{fp}/{sid}", encode_record(make_fields(rng, 1.65), meta)))
    store.put_many(items)
    store.put_index(
        DatasetIndex(fp, "spc", 1, params, np.array([k.split("/")[1] for k, _ in items]))
    )
    store.close()
    record_bytes = sum(len(v) for _, v in items)
    ds = CachedDataset(root / "lmdb1mb", fp)
    src = np.frombuffer(b"".join(v for _, v in items), dtype=np.uint8)
    dst = np.empty_like(src)
    decode, decode_cpu, copy, copy_cpu = [], [], [], []
    ds[0]  # open the store outside the timed passes
    for _ in range(rounds):  # interleaved: load swings hit both alike
        start, cpu = time.perf_counter(), time.process_time()
        decoded = sum(sum(t.nbytes for t in ds[i].values()) for i in range(n))
        decode.append(decoded / (time.perf_counter() - start))
        decode_cpu.append(decoded / max(time.process_time() - cpu, 1e-9))
        start, cpu = time.perf_counter(), time.process_time()
        np.copyto(dst, src)
        copy.append(src.nbytes / (time.perf_counter() - start))
        copy_cpu.append(src.nbytes / max(time.process_time() - cpu, 1e-9))
    ds.close()
    best, med, copy_best = max(decode), float(np.median(decode)), max(copy)
    return {
        "record_mb": record_bytes / n / 1e6,
        "decode_gb_s": best / 1e9,
        "decode_gb_s_median": med / 1e9,
        "decode_gb_s_cpu_median": float(np.median(decode_cpu)) / 1e9,
        "memcpy_gb_s": copy_best / 1e9,
        "memcpy_gb_s_median": float(np.median(copy)) / 1e9,
        "memcpy_gb_s_cpu_median": float(np.median(copy_cpu)) / 1e9,
        "decode_over_memcpy": best / copy_best,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 4])
    parser.add_argument(
        "--batch-size",
        type=int,
        default=0,
        help="0: per-sample reads (default); N: batches of N through collate_spc",
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed passes per loader (median)")
    parser.add_argument("--decode-records", type=int, default=500)
    parser.add_argument("--decode-rounds", type=int, default=7)
    parser.add_argument("--dir", type=Path, default=None, help="scratch dir (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON line at the end")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = Path(tempfile.mkdtemp(prefix="spcache-bench-", dir=args.dir))
    try:
        start = time.perf_counter()
        fp, mean_bytes = write_caches(root, args.records, 1.0)
        log.info(
            "wrote %d records of %.2f MB twice in %.1fs",
            args.records,
            mean_bytes / 1e6,
            time.perf_counter() - start,
        )
        os.sync()  # no writeback of what was just written competes with the timed reads
        order = np.random.default_rng(2).permutation(args.records).tolist()
        ours = CachedDataset(root / "lmdb", fp)
        base = TorchSaveDataset(root / "torchsave", args.records)
        results = {
            "records": args.records,
            "record_mb": mean_bytes / 1e6,
            "cpus": os.cpu_count(),
            "batch_size": args.batch_size,
            "loadavg_start": os.getloadavg(),
        }
        for workers in args.workers:
            time_loader(ours, workers, order[:100], args.batch_size)  # warm both paths
            time_loader(base, workers, order[:100], args.batch_size)
            ours_runs, base_runs = [], []
            for _ in range(args.rounds):  # alternate, so load swings hit both alike
                ours_runs.append(time_loader(ours, workers, order, args.batch_size))
                base_runs.append(time_loader(base, workers, order, args.batch_size))
            a, b = (float(np.median([r[0] for r in runs])) for runs in (ours_runs, base_runs))
            row = {
                "cached_dataset_sps": a,
                "torch_save_sps": b,
                "ratio": a / b,
                "cached_dataset_gb_s": a * mean_bytes / 1e9,
                "ratios_per_round": [
                    o[0] / t[0] for o, t in zip(ours_runs, base_runs, strict=True)
                ],
            }
            if workers == 0:
                ca, cb = (float(np.median([r[1] for r in runs])) for runs in (ours_runs, base_runs))
                row.update(cached_dataset_cpu_sps=ca, torch_save_cpu_sps=cb, cpu_ratio=ca / cb)
                log.info(
                    "  by CPU time of the reading process: %.0f vs %.0f samples/s: %.1fx",
                    ca,
                    cb,
                    ca / cb,
                )
            results[f"workers{workers}"] = row
            log.info(
                "num_workers=%d batch_size=%d: CachedDataset %.0f samples/s (%.2f GB/s), "
                "torch.save files %.0f samples/s: %.1fx (rounds: %s)",
                workers,
                args.batch_size,
                a,
                a * mean_bytes / 1e9,
                b,
                a / b,
                " ".join(f"{r:.1f}x" for r in row["ratios_per_round"]),
            )
        dec = decode_gbps(root, args.decode_records, args.decode_rounds)
        results["decode_1mb"] = dec
        log.info(
            "decode %.2f MB records in one process: best %.2f GB/s, median %.2f GB/s "
            "(by CPU time %.2f); memcpy best %.2f, median %.2f GB/s (by CPU time %.2f)",
            dec["record_mb"],
            dec["decode_gb_s"],
            dec["decode_gb_s_median"],
            dec["decode_gb_s_cpu_median"],
            dec["memcpy_gb_s"],
            dec["memcpy_gb_s_median"],
            dec["memcpy_gb_s_cpu_median"],
        )
        results["loadavg_end"] = os.getloadavg()
        if args.json:
            print(json.dumps(results))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
