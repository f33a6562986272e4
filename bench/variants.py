"""Augmentation: an epoch over K cached variants vs rebuilding each augmented octree on the CPU.

O-CNN's data pipeline augments a shape's points and builds its octree inside every
``__getitem__``, each epoch. spcache instead computes K augmented variants of each shape
once (``variants=K``) and reads one per sample per epoch. This script measures both, in
one run, over the same shapes, level and augmentation:

- **cached**: ``spcache.precompute(..., variants=K)`` once (its time is reported apart,
  it is paid once), then epochs of ``CachedDataset`` + ``spcache.Sampler`` +
  ``DataLoader(num_workers=W, collate_fn=collate_spc)``;
- **rebuild (baseline)**: a ``Dataset`` whose ``__getitem__`` reads and parses the mesh,
  samples its surface, augments the points and builds the octree on the CPU (the ``spc``
  recipe's own ``prepare`` and ``compute`` with the torch backend, a generator seeded
  per epoch and sample), with the same DataLoader settings and collate.

The two sides' epochs alternate (so the machine's load hits both alike), each side's
persistent DataLoader workers kept across its epochs; the first epoch of each (worker
start-up) is reported apart. It prints seconds per epoch for each, the ratio of the
medians (rebuild / cached), and the disk each variant takes (store bytes / records).

    python bench/variants.py [--sources DIR] [--shapes 16] [--variants 8] [--level 7]
        [--surface-samples 100000] [--workers 2] [--epochs 2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.utils.data import DataLoader, Dataset

import spcache
from cache_store.readers.variants import EpochIndex, epoch_of
from cache_store.stores.lmdb.store import LMDBStore

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "meshes"
AUGMENT = {"rotation": "so3", "scale_min": 0.8, "scale_max": 1.2, "jitter": 0.002}


class RebuildEachEpoch(Dataset[dict[str, Any]]):
    """O-CNN's way: load, sample, augment and build the octree in every read."""

    def __init__(self, paths: list[Path], params: dict[str, Any]) -> None:
        self.paths = [str(p) for p in paths]
        self.params = params
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        from workers.ops import torch_spc
        from workers.recipe_run import get_recipe
        from workers.source_load import load_source

        recipe = get_recipe("spc")
        # a fresh augmentation each epoch, as a random transform in __getitem__ gives
        source = dataclasses.replace(load_source(self.paths[int(i)]), variant=1)  # augmented
        epoch = epoch_of(i, self.epoch)  # what spcache.Sampler deals reaches the workers
        generator = torch.Generator().manual_seed(epoch * 1_000_003 + int(i))
        full = recipe.spec.with_defaults(self.params)
        prepared = recipe.prepare(source, full, generator)
        return recipe.compute(prepared, full, torch.device("cpu"), torch_spc)


class EpochShuffle(torch.utils.data.Sampler[int]):
    """The baseline's sampler: a seeded shuffle per epoch whose indices carry the epoch
    (``EpochIndex``), so persistent workers draw that epoch's augmentation."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
        return iter([EpochIndex(i, self.epoch) for i in order.tolist()])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def make_loader(dataset: Any, workers: int) -> tuple[Any, Any]:
    cached = isinstance(dataset, spcache.CachedDataset)
    sampler = spcache.Sampler(dataset) if cached else EpochShuffle(len(dataset))
    loader = DataLoader(
        dataset,
        batch_size=4,
        sampler=sampler,
        num_workers=workers,
        collate_fn=spcache.collate_spc,
        persistent_workers=workers > 0,
    )
    return loader, sampler


def interleaved_epochs(sides: dict[str, Any], workers: int, epochs: int) -> dict[str, list[float]]:
    """Seconds per epoch of each side, the sides' epochs alternating (so the machine's
    load hits both alike); each side's DataLoader workers persist across its epochs."""
    loaders = {name: make_loader(ds, workers) for name, ds in sides.items()}
    out: dict[str, list[float]] = {name: [] for name in sides}
    for epoch in range(epochs):
        for name, (loader, sampler) in loaders.items():
            sampler.set_epoch(epoch)
            start = time.perf_counter()
            for batch in loader:
                assert batch["octree"].numel() > 0
            out[name].append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="variants.py", description=__doc__.split("\n")[0])
    parser.add_argument("--sources", type=Path, default=None, help="meshes (default: shared)")
    parser.add_argument("--shapes", type=int, default=16, help="shapes used (default 16)")
    parser.add_argument("--variants", type=int, default=8, help="K (default 8)")
    parser.add_argument("--level", type=int, default=7, help="octree level (default 7)")
    parser.add_argument("--surface-samples", type=int, default=100_000, help="per shape")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--epochs", type=int, default=2, help="epochs timed per side")
    parser.add_argument("--dir", type=Path, default=None, help="scratch (default: a tmp dir)")
    args = parser.parse_args(argv)

    if args.sources is None:
        if SHARED.is_dir():
            args.sources = SHARED
        else:
            from tests.data.corpus import ensure

            args.sources = ensure() / "meshes"
    paths = sorted(p for p in args.sources.iterdir() if p.is_file())[: args.shapes]
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench-variants-"))
    shapes = scratch / "shapes"
    shutil.rmtree(shapes, ignore_errors=True)
    shapes.mkdir(parents=True)
    for p in paths:
        (shapes / p.name).symlink_to(p.resolve())
    params = {"level": args.level, "surface_samples": args.surface_samples, **AUGMENT}
    cache = scratch / "cache"
    shutil.rmtree(cache, ignore_errors=True)

    start = time.perf_counter()
    result = spcache.precompute(
        shapes, "spc", cache, variants=args.variants, device="cpu", progress=False, **params
    )
    precompute_s = time.perf_counter() - start
    usable = [p for p in paths if not any(e.id == p.stem for e in result.errors)]
    cached = spcache.CachedDataset(cache, result.fingerprint)
    rebuild = RebuildEachEpoch(usable, params)
    timed = interleaved_epochs(
        {"cached": cached, "rebuild": rebuild}, args.workers, args.epochs + 1
    )
    # the first epoch of each starts its DataLoader workers: timed, not compared
    cached_s, rebuild_s = timed["cached"][1:], timed["rebuild"][1:]
    with LMDBStore(cache) as store:
        keys = list(store.keys(result.fingerprint))
        stored = sum(len(store.get(k)) for k in keys)
    report = {
        "shapes": len(cached),
        "variants": args.variants,
        "level": args.level,
        "surface_samples": args.surface_samples,
        "workers": args.workers,
        "precompute_once_s": round(precompute_s, 2),
        "records": len(keys),
        "failed": result.failed,
        "first_epochs_s": {k: round(v[0], 3) for k, v in timed.items()},
        "cached_epoch_s": [round(s, 3) for s in cached_s],
        "rebuild_epoch_s": [round(s, 3) for s in rebuild_s],
        "ratio_rebuild_over_cached": round(
            sorted(rebuild_s)[len(rebuild_s) // 2] / sorted(cached_s)[len(cached_s) // 2], 1
        ),
        "bytes_per_variant": stored // max(len(keys), 1),
        "epochs_to_repay_precompute": round(
            precompute_s / max(min(rebuild_s) - min(cached_s), 1e-9), 2
        ),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(report, indent=2))
    if args.dir is None:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
