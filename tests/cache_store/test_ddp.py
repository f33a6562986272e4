"""CachedDataset under DDP: two ranks on the CPU (gloo), launched by torchrun, each with a
DistributedSampler and forked loader workers. Every sample is read exactly once per epoch
across the ranks, and no rank holds the cache open before its workers fork (nor after)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cache_store.format.index import DatasetIndex
from cache_store.stores.lmdb import LMDBStore
from tests.conftest import REPO_ROOT
from tests.helpers.synthetic import fingerprint_of, make_record

FP = fingerprint_of("spc", level=4)
N = 26  # not a multiple of batch size x ranks: short last batches on both ranks

RANK_SCRIPT = r'''
import json, os, sys

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from cache_store import CachedDataset, collate_spc


class Indexed(CachedDataset):
    """Returns each sample with its index, so the ranks can say what they read."""

    def __getitems__(self, indices):
        return list(zip(indices, super().__getitems__(indices)))


def collate(pairs):
    return [i for i, _ in pairs], collate_spc([s for _, s in pairs])


def open_in(cache):
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(cache):
            found.append(target)
    return found


def main():
    cache, fingerprint, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = Indexed(cache, fingerprint)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)  # len(ds) reads the index, closes
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2,
                        multiprocessing_context="fork", collate_fn=collate)
    before = open_in(cache)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen = []
        for indices, batch in loader:
            assert batch["lengths"].shape[0] == len(indices)
            seen += [int(i) for i in indices]
        gathered = [None] * world
        dist.all_gather_object(gathered, seen)
        epochs.append(gathered)
    after = open_in(cache)
    opened = [None] * world
    dist.all_gather_object(opened, {"before": before, "after": after})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": world, "epochs": epochs, "opened": opened}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    path = tmp_path / "cache"
    store = LMDBStore(path, readonly=False)
    ids = [f"s{i:03d}" for i in range(N)]
    store.put_many(
        (f"{FP}/{sid}", make_record(FP, sid, seed=i, level=4)) for i, sid in enumerate(ids)
    )
    store.put_index(
        DatasetIndex(FP, "spc", 1, {"level": 4, "surface_samples": 100_000}, np.array(ids))
    )
    store.close()
    return path


@pytest.mark.slow
def test_two_gloo_ranks_read_every_sample_once_per_epoch(cache: Path, tmp_path: Path) -> None:
    script, out = tmp_path / "rank.py", tmp_path / "out.json"
    script.write_text(RANK_SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            str(cache),
            FP,
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2
    orders = []
    for ranks in result["epochs"]:
        first, second = ranks
        assert len(first) == len(second) == N // 2
        assert sorted(first + second) == list(range(N))  # each sample once, on one rank
        orders.append(first)
    assert orders[0] != orders[1]  # set_epoch reshuffles
    for opened in result["opened"]:  # the ranks themselves never held the cache open
        assert opened == {"before": [], "after": []}
