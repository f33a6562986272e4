"""Benchmark: exact mid-epoch resume, and what spcache's Sampler and DataLoader cost.

Three parts, in one run:

1. **Exactness.** Over a cache of ``--records`` synthetic records: for each case, ranks
   in step (simulated in this process, ``num_replicas``/``rank`` given) read part of an
   epoch through ``spcache.DataLoader`` (forked workers where the case has them), rank
   0's ``state_dict()`` goes through JSON, and new ranks of another world size, worker
   count and batch size load it and finish the epoch. Prints per case the samples
   yielded once, twice (the documented tail padding: at most ranks - 1) and never.
   (tests/cache_store/test_resume_ddp.py does the same with real gloo ranks and SIGKILL.)
2. **Overhead against a plain DataLoader.** One epoch over the same cache read with torch's
   ``DataLoader(shuffle=True)`` and with ``spcache.DataLoader(shuffle=True)``, batch
   ``--batch`` with ``collate_spc``, 0 and 2 workers, alternated ``--rounds`` times;
   samples/s and the ratio (median).
3. **The order's cost** for ``--ids`` synthetic ids: hashing them (once per sampler), one
   epoch's order (once per epoch), and ``state_dict()`` (per checkpoint).

Nothing here asserts a speed.

    python bench/resume.py [--records 3000] [--batch 32] [--rounds 3] [--ids 1000000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import spcache  # noqa: E402
from cache_store.format.ids import pack_ids  # noqa: E402
from cache_store.format.index import DatasetIndex  # noqa: E402
from cache_store.keys import compute_fingerprint  # noqa: E402
from cache_store.readers.order import epoch_order, id_hashes  # noqa: E402
from cache_store.recipes.registry import get_recipe_spec  # noqa: E402
from cache_store.stores.lmdb import LMDBStore  # noqa: E402
from cache_store.format.encode import encode_record  # noqa: E402

SPEC = get_recipe_spec("spc")
PARAMS = SPEC.resolve({"level": 5})
FP = compute_fingerprint("spc", SPEC.version, PARAMS)


def build(cache: Path, n: int) -> list[str]:
    """``n`` small records of recipe ``spc`` (random octree-shaped tensors)."""
    rng = np.random.default_rng(0)
    ids = [f"shapes/{i // 100:03d}/s{i:06d}" for i in range(n)]
    store = LMDBStore(cache, readonly=False)
    batch = []
    for sid in ids:
        size = int(rng.integers(200, 2000))
        tensors = {
            "octree": torch.from_numpy(rng.integers(0, 255, size, dtype=np.uint8)),
            "pyramid": torch.zeros((2, 7), dtype=torch.int32),
            "exsum": torch.from_numpy(np.arange(size, dtype=np.int32)),
            "point_hierarchy": torch.from_numpy(rng.integers(0, 32, (size, 3), dtype=np.int16)),
        }
        meta = {
            "recipe": "spc",
            "recipe_version": str(SPEC.version),
            "fingerprint": FP,
            "sample_id": sid,
            "source_hash": "0" * 16,
            "backend": "torch",
            "device": "cpu",
        }
        batch.append((f"{FP}/{sid}", encode_record(tensors, meta)))
        if len(batch) == 500:
            store.put_many(batch)
            batch = []
    store.put_many(batch)
    store.put_index(DatasetIndex(FP, "spc", SPEC.version, PARAMS, np.array(ids)))
    store.close()
    return ids


def _loaders(cache: Path, world: int, batch: int, workers: int) -> list[spcache.DataLoader]:
    out = []
    for rank in range(world):
        ds = spcache.CachedDataset(cache, FP)
        extra = {"multiprocessing_context": "fork"} if workers else {}
        out.append(
            spcache.DataLoader(
                ds,
                batch_size=batch,
                sampler=spcache.Sampler(ds, num_replicas=world, rank=rank),
                num_workers=workers,
                collate_fn=spcache.collate_spc,
                **extra,
            )
        )
    return out


def run_ranks(
    cache: Path, world: int, batch: int, workers: int, state: dict | None, steps: int | None
) -> tuple[list[str], dict]:
    loaders = _loaders(cache, world, batch, workers)
    iterators = []
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
        loader.set_epoch(state["epoch"] if state else 1)
        iterators.append(iter(loader))
    yielded: list[str] = []
    k = 0
    while steps is None or k < steps:
        batches = [next(it, None) for it in iterators]
        if all(b is None for b in batches):
            break
        yielded += [sid for b in batches if b is not None for sid in b["sample_ids"]]
        k += 1
    return yielded, json.loads(json.dumps(loaders[0].state_dict()))


def exactness(cache: Path, ids: list[str]) -> None:
    cases = [  # (ranks, batch, workers) before -> after, steps before the stop
        ((2, 8, 4), (3, 8, 0), 20),
        ((2, 8, 2), (2, 8, 2), 33),
        ((4, 4, 0), (1, 16, 2), 50),
        ((3, 5, 2), (8, 3, 0), 17),
        ((1, 32, 2), (48, 1, 0), 11),
    ]
    print("exactness: one epoch stopped and resumed (counts of samples)")
    print("| before (ranks x batch, workers) | after | stopped at | once | twice | never |")
    print("|---|---|---|---|---|---|")
    for before, after, steps in cases:
        first, state = run_ranks(cache, *before, state=None, steps=steps)
        rest, _ = run_ranks(cache, *after, state=state, steps=None)
        counts = Counter(first + rest)
        once = sum(1 for sid in ids if counts[sid] == 1)
        twice = sum(1 for sid in ids if counts[sid] == 2)
        never = sum(1 for sid in ids if counts[sid] == 0)
        print(
            f"| {before[0]} x {before[1]}, {before[2]} | {after[0]} x {after[1]}, {after[2]} "
            f"| {state['consumed']} | {once} | {twice} | {never} |",
            flush=True,
        )


def rate(loader: torch.utils.data.DataLoader) -> float:
    start = time.perf_counter()
    n = sum(len(b["lengths"]) for b in loader)
    return n / (time.perf_counter() - start)


def overhead(cache: Path, batch: int, rounds: int) -> None:
    print(f"\noverhead: one epoch, batch {batch}, collate_spc (samples/s, median of {rounds})")
    print("| workers | torch DataLoader(shuffle=True) | spcache.DataLoader(shuffle=True) | ratio |")
    print("|---|---|---|---|")
    for workers in (0, 2):
        extra = {"multiprocessing_context": "fork"} if workers else {}
        plain, ours = [], []
        for _ in range(rounds):
            ds = spcache.CachedDataset(cache, FP)
            common = dict(batch_size=batch, num_workers=workers, collate_fn=spcache.collate_spc)
            plain.append(rate(torch.utils.data.DataLoader(ds, shuffle=True, **common, **extra)))
            ds = spcache.CachedDataset(cache, FP)
            ours.append(rate(spcache.DataLoader(ds, shuffle=True, **common, **extra)))
        p, o = statistics.median(plain), statistics.median(ours)
        print(f"| {workers} | {p:,.0f} | {o:,.0f} | {o / p:.2f} |", flush=True)


def order_cost(n: int) -> None:
    ids = [f"shapes/category_{i % 50:02d}/mesh_{i:08d}" for i in range(n)]
    blob, offsets = pack_ids(ids)
    start = time.perf_counter()
    hashes = id_hashes(blob, offsets)
    hashed = time.perf_counter() - start
    start = time.perf_counter()
    epoch_order(hashes, 0, 1, shuffle=True, ids=[])
    ordered = time.perf_counter() - start
    of_sample = np.arange(n) // 1000
    names = tuple(f"part-{b}" for b in range(int(of_sample.max()) + 1))
    start = time.perf_counter()
    epoch_order(hashes, 0, 1, shuffle=True, ids=[], blocks=of_sample, block_names=names)
    blocked = time.perf_counter() - start
    print(f"\nthe order's cost for {n:,} ids:")
    print(f"- hashing the ids (once per sampler): {hashed:.2f} s")
    print(
        f"- one epoch's global order: {ordered:.2f} s; block-local (blocks of 1,000): {blocked:.2f} s"
    )


def state_cost(cache: Path) -> None:
    ds = spcache.CachedDataset(cache, FP)
    loader = spcache.DataLoader(ds, batch_size=8, shuffle=True, collate_fn=spcache.collate_spc)
    it = iter(loader)
    next(it)
    loader.state_dict()  # the first computes the epoch's digest
    start = time.perf_counter()
    for _ in range(100):
        state = loader.state_dict()
    took = (time.perf_counter() - start) / 100
    print(f"- state_dict(): {took * 1e6:.0f} us, {len(json.dumps(state))} bytes of JSON")


def main() -> int:
    parser = argparse.ArgumentParser(prog="resume.py", description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=3000, help="records in the cache")
    parser.add_argument("--batch", type=int, default=32, help="batch of the overhead part")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds per arm")
    parser.add_argument("--ids", type=int, default=1_000_000, help="ids of the order's cost")
    args = parser.parse_args()
    # 4 loader workers on a 2-core machine are what the exactness cases ask for
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    with tempfile.TemporaryDirectory(prefix="spcache-resume-") as tmp:
        cache = Path(tmp) / "cache"
        ids = build(cache, args.records)
        exactness(cache, ids)
        overhead(cache, args.batch, args.rounds)
        order_cost(args.ids)
        state_cost(cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
