"""Worker memory: summed PSS growth of forked DataLoader workers over two epochs.

Builds an LMDB cache of N small SPC records, then reads it twice with 8 forked,
persistent workers through

* ``CachedDataset`` (what workers inherit: two NumPy arrays of packed sample ids), and
* a baseline dataset that keeps a Python list of per-sample dicts (id, key, recipe,
  params: the usual pattern) and reads the same records through the same store.

Each worker's PSS comes from ``/proc/<pid>/smaps_rollup``; the script prints the summed
growth between the first batches of epoch 1 and the end of the last epoch, per worker,
for both. PSS divides shared pages among the processes that map them, so pages a worker
copies on read (refcount updates on inherited objects) show up as growth.

    python bench/worker_memory.py [--records 100000] [--workers 8] [--epochs 2]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cache_store import CachedDataset
from cache_store.keys import compute_fingerprint
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.encode import encode_record
from cache_store.format.index import DatasetIndex

log = logging.getLogger("bench.worker_memory")
PARAMS = {"level": 3, "surface_samples": 1000}


def build_cache(root: Path, n: int) -> tuple[str, list[str]]:
    fp = compute_fingerprint("spc", 1, PARAMS)
    store = LMDBStore(root, readonly=False, map_size=1 << 28)
    rng = np.random.default_rng(0)
    ids, batch = [], []
    for i in range(n):
        sid = f"category{i % 55:02d}/shape_{i:07d}"
        k = int(rng.integers(8, 24))
        fields = {
            "octree": torch.from_numpy(rng.integers(1, 256, k, dtype=np.uint8)),
            "exsum": torch.arange(1, k + 1, dtype=torch.int32),
            "point_hierarchy": torch.from_numpy(rng.integers(0, 8, (k + 1, 3), dtype=np.int16)),
            "pyramid": torch.zeros(2, 5, dtype=torch.int32),
            "center": torch.zeros(3),
            "scale": torch.ones(()),
        }
        meta = {
            "recipe": "spc",
            "recipe_version": "1",
            "fingerprint": fp,
            "sample_id": sid,
            "source_hash": f"{i:016x}",
            "backend": "torch",
            "device": "cpu",
        }
        batch.append((f"{fp}/{sid}", encode_record(fields, meta)))
        ids.append(sid)
        if len(batch) == 5000:
            store.put_many(batch)
            batch = []
    store.put_many(batch)
    store.put_index(DatasetIndex(fp, "spc", 1, PARAMS, np.array(ids)))
    store.close()
    return fp, ids


class ListOfDictsDataset(Dataset):
    """Baseline: a Python list of per-sample dicts, inherited by every forked worker."""

    def __init__(self, cache: Path, fp: str, ids: list[str]) -> None:
        self.cache = cache
        self.samples = [
            {
                "sample_id": sid,
                "key": f"{fp}/{sid}",
                "index": i,
                "recipe": "spc",
                "params": dict(PARAMS),
            }
            for i, sid in enumerate(ids)
        ]
        self._store: LMDBStore | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self._store is None:
            self._store = LMDBStore(self.cache)
        return self._store.get_record(self.samples[i]["key"]).tensors


def summarise(batch: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """collate_fn: touch every sample, send back only (pid, samples, octree bytes)."""
    return torch.tensor([os.getpid(), len(batch), sum(int(s["octree"].numel()) for s in batch)])


PSS_KINDS = ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")


def pss_kib(pid: int) -> dict[str, int]:
    """PSS of a process in KiB: total, anonymous (heap: copy-on-read shows here), file
    (mapped files: LMDB's map, shared libraries), shmem."""
    found = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in PSS_KINDS:
                found[name] = int(rest.split()[0])
    if "Pss" not in found:
        raise RuntimeError(f"no Pss line for {pid}")
    return found


def measure(dataset: Dataset, workers: int, epochs: int) -> dict[str, Any]:
    gc.collect()
    loader = DataLoader(
        dataset,
        batch_size=64,
        shuffle=True,
        num_workers=workers,
        multiprocessing_context="fork",
        persistent_workers=True,
        collate_fn=summarise,
        generator=torch.Generator().manual_seed(0),
    )
    pids: set[int] = set()
    start_pss: dict[int, dict[str, int]] = {}
    samples = 0
    began = time.perf_counter()
    for epoch in range(epochs):
        for batch in loader:
            pid, count, _ = batch.tolist()
            samples += count
            if pid not in pids:
                pids.add(pid)
                start_pss[pid] = pss_kib(pid)  # right after this worker's first batch
        log.info("  epoch %d done (%d workers seen)", epoch + 1, len(pids))
    end_pss = {pid: pss_kib(pid) for pid in pids}
    elapsed = time.perf_counter() - began
    del loader
    out: dict[str, Any] = {"workers": len(pids), "samples": samples, "seconds": elapsed}
    for kind in PSS_KINDS:
        if all(kind in start_pss[p] and kind in end_pss[p] for p in pids):
            start = sum(start_pss[p][kind] for p in pids) / 1024
            end = sum(end_pss[p][kind] for p in pids) / 1024
            out[kind] = {
                "start_mib": start,
                "end_mib": end,
                "growth_mib": end - start,
                "growth_per_worker_mib": (end - start) / len(pids),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = Path(tempfile.mkdtemp(prefix="spcache-mem-", dir=args.dir))
    try:
        began = time.perf_counter()
        fp, ids = build_cache(root, args.records)
        log.info("cache of %d records built in %.1fs", args.records, time.perf_counter() - began)
        results = {}
        cached = CachedDataset(root, fp)
        len(cached)  # the index is loaded in the parent, as a DataLoader would
        log.info("CachedDataset:")
        results["cached_dataset"] = measure(cached, args.workers, args.epochs)
        del cached
        baseline = ListOfDictsDataset(root, fp, ids)
        del ids
        log.info("list of per-sample dicts:")
        results["list_of_dicts"] = measure(baseline, args.workers, args.epochs)
        for name, r in results.items():
            log.info(
                "%-15s %d workers, %d samples in %.1fs",
                name,
                r["workers"],
                r["samples"],
                r["seconds"],
            )
            for kind in PSS_KINDS:
                if kind in r:
                    k = r[kind]
                    log.info(
                        "    %-10s summed %.1f -> %.1f MiB: growth %.1f MiB, %.2f MiB per worker",
                        kind,
                        k["start_mib"],
                        k["end_mib"],
                        k["growth_mib"],
                        k["growth_per_worker_mib"],
                    )
        if args.json:
            print(json.dumps(results))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
