"""Views and the hop without the bytes, against today's copies and a memcpy, in one run.

Writes N records of about 2.4 MB (octree, point hierarchy, exsum, query points, labels;
``bench/read_throughput.py``'s fields at scale 4) and N of about 0.13 MB into one LMDB
cache, then measures, in interleaved repeats (today, views, today, views, ...):

- a memcpy of 100 MB (NumPy ``copyto`` into a buffer already touched), GB/s;
- one process, random ``ds[i]`` over every record, 3 passes: ``CachedDataset`` as today
  (copies, every read hashed) and ``views=True`` (the first pass hashes, later passes
  trust the pinned bytes);
- a DataLoader with 2 forked workers, batch 4, ``collate_spc``, 3 epochs, both ways
  (with views the workers hand over where their checked records lie and the training
  process packs the batch by one copy), for the large and the small records; and with
  4 workers over the large ones (``loader4``: on a 2-core machine, more processes than
  cores);
- the same DataLoader over the large records with ``persistent_workers=True``
  (``loader2_persistent``): its workers are forked once, not at each epoch's start;
- the peer users pick for memory-mapped views, tensordict (when it is installed: the
  ``bench`` extra): the same records in a ``LazyStackedTensorDict`` written by
  ``memmap``, read back as ``MemoryMappedTensor`` views (nothing checked), random
  ``td[i]`` in one process, and the same DataLoaders (``collate_spc`` batches the views'
  fields into a new tensor; with workers that batch crosses in shared memory, as
  today's path does); plus a DataLoader with 0 workers, every way.

Each case starts from a process that has hashed and located no record (``VERIFIED``
and ``KNOWN`` cleared: as a new training process) and no garbage left to collect.
Every rate is records' bytes per second; each is printed with its ratio against
today's path and against the memcpy of the same repeat (and views against tensordict). The first batch of each way is
checked equal to a plain read.

An epoch here is ``--records`` records (128 in the runs recorded: 312 MB); a real epoch
is thousands of records, over which the start of each epoch's workers (the fork, torch's
worker set-up, each process's first read: tens of ms on the 2-core VM) weighs less than
over 128: ``--records 512`` shows the trend, and the persistent case the rate without it.

    python bench/zero_copy.py [--records 48] [--small 400] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
from torch.utils.data import DataLoader

from cache_store import CachedDataset, collate_spc
from cache_store.format.encode import encode_record
from cache_store.format.index import DatasetIndex
from cache_store.keys import compute_fingerprint
from cache_store.stores.lmdb import LMDBStore
from cache_store.stores.lmdb.leases import KNOWN
from cache_store.views.records import VERIFIED
from read_throughput import make_fields

log = logging.getLogger("bench.zero_copy")


def write_cache(path: Path, n: int, scale: float, level: int) -> tuple[str, int]:
    """``n`` records of ``scale`` x 0.6 MB under one fingerprint; returns it and the
    records' total bytes."""
    params = {"level": level, "surface_samples": 100_000}
    fp = compute_fingerprint("spc", 1, params)
    store = LMDBStore(path, readonly=False, map_size=1 << 30)
    rng = np.random.default_rng(level)
    ids, total, batch = [], 0, []
    for i in range(n):
        sid = f"shape{i:06d}"
        meta = {
            "recipe": "spc",
            "recipe_version": "1",
            "fingerprint": fp,
            "sample_id": sid,
            "source_hash": "0" * 16,
            "backend": "torch",
            "device": "cpu",
        }
        value = encode_record(make_fields(rng, scale), meta)
        total += len(value)
        batch.append((f"{fp}/{sid}", value))
        ids.append(sid)
        if len(batch) == 16:
            store.put_many(batch)
            batch = []
    store.put_many(batch)
    store.put_index(DatasetIndex(fp, "spc", 1, params, np.array(ids)))
    store.close()
    return fp, total


def memcpy_gbps(size: int = 100 << 20, rounds: int = 5) -> float:
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touched: the copy measures bandwidth, not page faults
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return size / best / 1e9


def _tensordict() -> Any:
    try:
        import tensordict
    except ImportError:
        return None
    return tensordict


class TensorDictViews(torch.utils.data.Dataset):
    """``td[i]`` of a memory-mapped lazy stack as a dict of its ``MemoryMappedTensor``
    views: what tensordict offers for records of different shapes, nothing checked."""

    def __init__(self, path: Path) -> None:
        self.td = _tensordict().TensorDict.load_memmap(path)

    def __len__(self) -> int:
        return len(self.td)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return dict(self.td[i].items())


def write_tensordict(path: Path, cache: Path, fp: str) -> None:
    """The cache's records (plain reads) as a tensordict memory-mapped lazy stack."""
    td = _tensordict()
    ds = CachedDataset(cache, fp)
    records = [{name: t.clone() for name, t in ds[i].items()} for i in range(len(ds))]
    ds.close()
    stack = td.LazyStackedTensorDict(
        *(td.TensorDict(fields, batch_size=[]) for fields in records), stack_dim=0
    )
    stack.memmap(path)


def dataset(path: Path, fp: str, way: str) -> Any:
    """The records read ``way``: "today" (copies), "views", or "tensordict" (its
    memory-mapped stack at ``path``)."""
    gc.collect()  # no collection left over from the last case's garbage in this one
    if way == "tensordict":
        return TensorDictViews(path)
    VERIFIED.clear()  # each case hashes every record again, and looks each up again
    KNOWN.clear()
    return CachedDataset(path, fp, views=way == "views")


def one_process(path: Path, fp: str, way: str, total: int, passes: int = 3) -> float:
    """GB/s of random ``ds[i]`` over every record, ``passes`` times, in this process."""
    ds = dataset(path, fp, way)
    n = len(ds)
    orders = [np.random.default_rng(p).permutation(n).tolist() for p in range(passes)]
    start = time.perf_counter()
    for order in orders:
        for i in order:
            sample = ds[i]
    elapsed = time.perf_counter() - start
    del sample
    if way != "tensordict":
        ds.close()
    return passes * total / elapsed / 1e9


def loader(
    path: Path,
    fp: str,
    way: str,
    total: int,
    workers: int,
    epochs: int = 3,
    persistent: bool = False,
    pss: list[float] | None = None,
) -> float:
    """GB/s of a DataLoader (``workers`` forked, batch 4, collate_spc) over ``epochs``
    (its workers forked once with ``persistent``, else at each epoch's start). With
    ``pss``, the PSS of this process and its workers (MB), sampled in the middle of the
    last epoch, is appended to it."""
    ds = dataset(path, fp, way)
    dl = DataLoader(
        ds,
        batch_size=4,
        shuffle=True,
        num_workers=workers,
        collate_fn=collate_spc,
        multiprocessing_context="fork" if workers else None,
        persistent_workers=persistent and workers > 0,
    )
    count = 0
    start = time.perf_counter()
    for epoch in range(epochs):
        for b, batch in enumerate(dl):
            count += len(batch["lengths"])
            if pss is not None and epoch == epochs - 1 and b == len(dl) // 2:
                pss.append(pss_mb())
    elapsed = time.perf_counter() - start
    assert count == epochs * len(ds)
    del dl  # persistent workers end here, outside the time measured
    if way != "tensordict":
        ds.close()
    return epochs * total / elapsed / 1e9


def pss_mb() -> float:
    """The proportional set size of this process and its children (DataLoader workers),
    MB, from each one's ``/proc/PID/smaps_rollup``: shared pages count once in all."""
    import psutil

    kib = 0
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            with open(f"/proc/{proc.pid}/smaps_rollup") as rollup:
                kib += next(int(line.split()[1]) for line in rollup if line.startswith("Pss:"))
        except (OSError, StopIteration):
            continue  # a worker that ended meanwhile
    return kib / 1024


def check_tensordict_equal(td_path: Path, path: Path, fp: str) -> None:
    """Every tensordict record equals a plain read of the cache's."""
    plain, td = CachedDataset(path, fp), TensorDictViews(td_path)
    for i in range(len(plain)):
        got = td[i]
        for name, tensor in plain[i].items():
            assert torch.equal(got[name], tensor), (i, name)


def check_equal(path: Path, fp: str) -> None:
    """The first batch through the hop equals a plain read of the same records."""
    plain = CachedDataset(path, fp)
    views = CachedDataset(path, fp, views=True)
    order = list(range(4))
    dl = DataLoader(
        views,
        batch_size=4,
        sampler=order,
        num_workers=2,
        collate_fn=collate_spc,
        multiprocessing_context="fork",
    )
    batch = next(iter(dl))
    want = collate_spc([plain[i] for i in order])
    assert batch.keys() == want.keys()
    for name in want:
        same = batch[name] == want[name] if isinstance(want[name], list) else None
        assert same or torch.equal(batch[name], want[name]), name
    for i in order:
        got = views[i]
        for name, tensor in plain[i].items():
            assert torch.equal(got[name], tensor), name


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--records",
        type=int,
        default=48,
        help="2.4 MB records: one epoch (a real epoch is thousands of records)",
    )
    parser.add_argument("--small", type=int, default=400, help="0.13 MB records")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        big = root / "big"
        small = root / "small"
        fp_big, bytes_big = write_cache(big, args.records, 4.0, 8)
        fp_small, bytes_small = write_cache(small, args.small, 0.2, 7)
        log.info(
            "records: %d x %.2f MB, %d x %.3f MB",
            args.records,
            bytes_big / args.records / 1e6,
            args.small,
            bytes_small / args.small / 1e6,
        )
        check_equal(big, fp_big)
        runs: dict[str, list[float]] = {}

        def note(name: str, value: float) -> None:
            runs.setdefault(name, []).append(value)

        td_big = root / "tensordict"
        if _tensordict() is not None:
            write_tensordict(td_big, big, fp_big)
            check_tensordict_equal(td_big, big, fp_big)
        else:
            log.info("tensordict is not installed (the bench extra): its rows are left out")

        for _ in range(args.repeats):
            note("memcpy", memcpy_gbps())
            for way in ("today", "views"):
                note(f"one_process_{way}", one_process(big, fp_big, way, bytes_big))
                note(f"loader2_{way}", loader(big, fp_big, way, bytes_big, 2))
                note(f"loader4_{way}", loader(big, fp_big, way, bytes_big, 4))
                note(f"loader2_small_{way}", loader(small, fp_small, way, bytes_small, 2))
                note(f"loader0_{way}", loader(big, fp_big, way, bytes_big, 0))
                note(
                    f"loader2_persistent_{way}",
                    loader(big, fp_big, way, bytes_big, 2, persistent=True),
                )
            if td_big.exists():
                note("one_process_tensordict", one_process(td_big, "", "tensordict", bytes_big))
                note("loader0_tensordict", loader(td_big, "", "tensordict", bytes_big, 0))
                note("loader2_tensordict", loader(td_big, "", "tensordict", bytes_big, 2))
        pss: dict[str, list[float]] = {}
        for way in ("today", "views", "tensordict"):  # not timed: PSS at equal work
            if way != "tensordict" or td_big.exists():
                where, fp = (td_big, "") if way == "tensordict" else (big, fp_big)
                loader(where, fp, way, bytes_big, 2, pss=pss.setdefault(way, []))
        result: dict[str, Any] = {k: median(v) for k, v in runs.items()}
        memcpy = result["memcpy"]
        cases = ("one_process", "loader2", "loader4", "loader2_small", "loader0")
        for case in (*cases, "loader2_persistent"):
            today, views_rate = result[f"{case}_today"], result[f"{case}_views"]
            result[f"{case}_views_over_today"] = views_rate / today
            # each repeat's own ratio (the two ran back to back): steadier under load
            paired = [
                v / t for v, t in zip(runs[f"{case}_views"], runs[f"{case}_today"], strict=True)
            ]
            result[f"{case}_views_over_today_paired"] = median(paired)
            result[f"{case}_today_over_memcpy"] = today / memcpy
            result[f"{case}_views_over_memcpy"] = views_rate / memcpy
            log.info(
                "%-18s today %.2f GB/s (%.3f of memcpy), views %.2f GB/s (%.3f of memcpy): "
                "%.2fx (median of each repeat's ratio %.2fx)",
                case,
                today,
                today / memcpy,
                views_rate,
                views_rate / memcpy,
                views_rate / today,
                median(paired),
            )
        for case in ("one_process", "loader0", "loader2"):
            if f"{case}_tensordict" not in result:
                continue
            peer = result[f"{case}_tensordict"]
            paired = [
                v / t
                for v, t in zip(runs[f"{case}_views"], runs[f"{case}_tensordict"], strict=True)
            ]
            result[f"{case}_views_over_tensordict"] = result[f"{case}_views"] / peer
            result[f"{case}_views_over_tensordict_paired"] = median(paired)
            log.info(
                "%-18s tensordict %.2f GB/s (%.3f of memcpy); views / tensordict %.2fx "
                "(median of each repeat's ratio %.2fx)",
                case,
                peer,
                peer / memcpy,
                result[f"{case}_views"] / peer,
                median(paired),
            )
        result["loader2_pss_mb"] = {way: values[0] for way, values in pss.items()}
        log.info(
            "loader2 PSS (training process and its 2 workers, mid last epoch): %s",
            ", ".join(f"{way} {mb:.0f} MB" for way, mb in result["loader2_pss_mb"].items()),
        )
        log.info("memcpy 100 MB: %.2f GB/s (median of %d repeats)", memcpy, args.repeats)
        result["runs"] = runs
        print(json.dumps(result, indent=2))
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
