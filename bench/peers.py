"""spcache's LMDB cache read every way a trainer reads it, and next to peer formats (issue 18).

Builds ``--samples`` spc_query-shaped records with the pure-PyTorch SPC ops (the
workload of ``bench/zarr_snapshot.py``), writes them into an spcache LMDB cache and
into every format in ``WRITERS`` (today only spcache's own: see the note there), checks
that each format gives back exactly the same tensors, then times, interleaved round by
round so machine load hits every format alike, and prints each rate and its ratio to
spcache LMDB:

- one process, random ``ds[i]``;
- DataLoader, 0 workers, batch 8 (a list-keeping collate, so every format pays the same
  collate; spcache also with ``collate_spc`` and per-sample with ``batch_size=None``);
- DataLoader, ``--workers`` workers (fork), batch 8, list-keeping collate;
- ingest (write) time.

Within spcache the rows compare with each other: batch 8 with a list-keeping collate or
``collate_spc`` against per-sample reads (``batch_size=None``) in the same run. A format
whose library is not installed is left out and named. Default run is short (two record
sizes, few samples); ``--samples``/``--level``/``--points``/``--queries`` change that.

    python bench/peers.py [--sizes large small] [--samples 240] [--unique 8] [--rounds 3]
                          [--workers 2] [--peers lmdb] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cache_store import CachedDataset, collate_spc  # noqa: E402
from cache_store.fingerprint import compute_fingerprint  # noqa: E402
from cache_store.lmdb_store import LMDBStore  # noqa: E402
from cache_store.record import encode_record  # noqa: E402
from cache_store.recipes import get_recipe_spec  # noqa: E402
from cache_store.store import DatasetIndex  # noqa: E402

log = logging.getLogger("bench.peers")

#: name -> (level, surface points, queries): ~2.6 MB and ~0.13 MB records.
SIZES = {"large": (8, 60_000, 48_000), "small": (6, 4_000, 2_000)}


def build_records(samples: int, unique: int, level: int, points: int,
                  queries: int) -> list[dict[str, Any]]:
    """``unique`` distinct records computed, cycled to ``samples`` (computing is slow;
    each copy is still its own record in every format)."""
    from zarr_snapshot import make_fields  # bench/ heads sys.path when run as a script
    from workers.ops import get_backend

    ops = get_backend("torch")
    gen = torch.Generator().manual_seed(level)
    made = [make_fields(ops, level, points, queries, gen) for _ in range(min(unique, samples))]
    return [made[i % len(made)] for i in range(samples)]


def list_collate(batch: list[Any]) -> list[Any]:
    return batch


# --------------------------------------------------------------------------- writers
# Each returns a Dataset factory (called once per timing, in the parent: fork-safe
# datasets are built lazily by each format's own reader).


def write_lmdb(root: Path, records: list[dict[str, torch.Tensor]]) -> Callable[[], Dataset]:
    spec = get_recipe_spec("spc_query")
    params = {"level": 0}
    fp = compute_fingerprint("spc_query", spec.version, params)
    store = LMDBStore(root / "lmdb", readonly=False)
    ids, batch = [], []
    for i, fields in enumerate(records):
        sid = f"s{i:06d}"
        meta = {"recipe": "spc_query", "recipe_version": str(spec.version), "fingerprint": fp,
                "sample_id": sid, "source_hash": "0" * 16, "backend": "torch", "device": "cpu"}
        batch.append((f"{fp}/{sid}", encode_record(fields, meta)))
        ids.append(sid)
        if len(batch) == 32:
            store.put_many(batch)
            batch = []
    if batch:
        store.put_many(batch)
    store.put_index(DatasetIndex(fp, "spc_query", spec.version, params, np.array(ids)))
    store.close()
    return lambda: CachedDataset(root / "lmdb", fp)


#: Formats timed. The peers of issue 18 (LitData, MosaicML Streaming, tensordict, HF
#: datasets) are not here yet: their pip resolution on this machine pulled a different
#: torch build (CUDA wheels), which the project's environment must not take; a peer is
#: one more ``write_<name>(root, records) -> Dataset factory`` in this table.
WRITERS = {"lmdb": write_lmdb}


# --------------------------------------------------------------------------- timing


def one_process(ds: Dataset, order: list[int]) -> float:
    start = time.perf_counter()
    for i in order:
        ds[i]
    return len(order) / (time.perf_counter() - start)


def loader_rate(ds: Dataset, order: list[int], workers: int, batch: int | None,
                collate: Callable[[list[Any]], Any] | None) -> float:
    """Samples/s of one epoch; with workers, the second epoch of persistent workers (worker
    start-up is not what is compared)."""
    loader = DataLoader(ds, batch_size=batch, sampler=order, num_workers=workers,
                        collate_fn=collate if batch else list_collate,
                        multiprocessing_context="fork" if workers else None,
                        persistent_workers=bool(workers),
                        prefetch_factor=2 if workers else None)
    if workers:
        for _ in loader:
            pass
    start = time.perf_counter()
    for _ in loader:
        pass
    rate = len(order) / (time.perf_counter() - start)
    del loader  # persistent workers end here
    return rate


def same_tensors(name: str, ds: Dataset, records: list[dict[str, torch.Tensor]]) -> None:
    for i in (0, len(records) - 1):
        got = ds[i]
        for field, want in records[i].items():
            have = got[field]
            if not (have.dtype == want.dtype and have.shape == want.shape
                    and torch.equal(have, want)):
                raise SystemExit(f"{name}: sample {i} field {field} differs from the source")


def run_size(label: str, level: int, points: int, queries: int, samples: int, unique: int,
             rounds: int, workers: int, peers: list[str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    records = build_records(samples, unique, level, points, queries)
    mb = sum(t.nbytes for t in records[0].values()) / 1e6
    log.info("%s: %d records of ~%.2f MB built in %.0fs", label, samples, mb,
             time.perf_counter() - t0)
    root = Path(tempfile.mkdtemp(prefix="spcache-peers-"))
    try:
        makers, ingest = {}, {}
        for name in peers:
            start = time.perf_counter()
            try:
                makers[name] = WRITERS[name](root, records)
            except ImportError as exc:
                log.info("  %s not installed (%s): left out", name, exc)
                continue
            ingest[name] = time.perf_counter() - start
            same_tensors(name, makers[name](), records)
        os.sync()
        order = np.random.default_rng(0).permutation(samples).tolist()
        rows = {"one process, random ds[i]": lambda ds: one_process(ds, order),
                "DataLoader 0 workers, per sample": lambda ds: loader_rate(ds, order, 0, None, None),
                "DataLoader 0 workers, batch 8": lambda ds: loader_rate(ds, order, 0, 8, list_collate),
                f"DataLoader {workers} workers, batch 8":
                    lambda ds: loader_rate(ds, order, workers, 8, list_collate)}
        spc_rows = {"DataLoader 0 workers, batch 8, collate_spc":
                    lambda ds: loader_rate(ds, order, 0, 8, collate_spc),
                    f"DataLoader {workers} workers, batch 8, collate_spc":
                    lambda ds: loader_rate(ds, order, workers, 8, collate_spc)}
        rates: dict[str, dict[str, list[float]]] = {}
        for _ in range(rounds):
            for row, timer in rows.items():
                for name, make in makers.items():
                    rates.setdefault(row, {}).setdefault(name, []).append(timer(make()))
            if "lmdb" in makers:
                for row, timer in spc_rows.items():
                    rates.setdefault(row, {}).setdefault("lmdb", []).append(timer(makers["lmdb"]()))
        result: dict[str, Any] = {"record_mb": mb, "samples": samples, "rows": {}}
        base_name = "lmdb" if "lmdb" in makers else next(iter(makers))
        for row, per in rates.items():
            med = {name: statistics.median(v) for name, v in per.items()}
            base = med.get(base_name)
            result["rows"][row] = {name: {"per_s": r, "ratio": (r / base if base else None)}
                                   for name, r in med.items()}
            log.info("  %-44s %s", row, "  ".join(
                f"{n} {r:,.0f}/s" + (f" ({r / base:.2f})" if base and n != base_name else "")
                for n, r in med.items()))
        result["ingest_s"] = ingest
        log.info("  %-44s %s", "ingest (write) seconds", "  ".join(
            f"{n} {s:.2f}s" + (f" ({s / ingest[base_name]:.2f})" if n != base_name else "")
            for n, s in ingest.items()))
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--unique", type=int, default=8, help="distinct records computed")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repeats (median)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--peers", nargs="+", default=list(WRITERS), choices=list(WRITERS))
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.info("machine: %d CPUs, load %s", os.cpu_count(), os.getloadavg())
    results = {label: run_size(label, *SIZES[label], args.samples, args.unique, args.rounds, args.workers,
                               args.peers) for label in args.sizes}
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
