"""Killed mid-epoch and resumed over a REMOTE snapshot read through ``local_cache``.

The README's checkpoint-and-resume loop (``train_resume.py``: a model, a checkpoint every
two steps with ``spcache.DataLoader.state_dict()``) runs as a script in its own process,
reading a sharded snapshot on moto's S3 server through a local directory whose
``cache_limit`` holds 5 of its 16 parts, with 2 forked loader workers. It is SIGKILLed
(with its workers) after a checkpoint, while one of its downloads is in flight: the
server holds the GET of a part that only later batches read. Resumed from that
checkpoint with 2 workers and with none: every sample of the epoch is trained exactly
once across the killed run and the resumed one, the resumed batches are the ones an
uninterrupted run trains, the directory never holds more than its limit (counted at
every fetch, eviction and removal each process logs, and sampled from outside), and the
dead process's download is reclaimed by the resumed run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from cache_store.local_cache import LocalCache, LocalDisk
from cache_store.local_cache.sharded import PartUnit
from cache_store.snapshot.sharded import ShardedSnapshot
from spcache import CachedDataset, Sampler
from tests.conftest import REPO_ROOT
from tests.helpers.local_cache import FP, limit_for, peak_bytes, write_sharded
from tests.helpers.procs import kill_tree, run, start, tree, wait_for, wait_gone
from tests.helpers.s3 import moto_s3

PARTS, PER_PART = 16, 4
BATCH, WORKERS = 4, 2
KILL_AFTER = 4  # the step after which the run is killed: its last checkpoint is step 3
CHECKPOINTED = 4  # batches the last checkpoint holds (steps 0 .. 3)

# The README's train_resume.py with the snapshot, local_cache and cache_limit for the
# cache directory, a log of each step's sample ids, and a stop for the kill.
SCRIPT = r"""
import json, logging, os, sys, time

import torch

import spcache

LOCATION, FINGERPRINT, LOCAL, LIMIT, CHECKPOINT, OUT, PHASE = sys.argv[1:8]
WORKERS, KILL_AFTER = int(sys.argv[8]), int(sys.argv[9])
EPOCHS = 1

# every fetch, eviction and removal of the local directory, with the bytes in use after
# it, from this process and its forked loader workers
disk_log = logging.FileHandler(os.path.join(OUT, f"{PHASE}-disk.log"))
disk_log.setFormatter(logging.Formatter("%(process)d %(message)s"))
logging.getLogger("cache_store.local_cache.disk").addHandler(disk_log)
logging.getLogger("cache_store.local_cache.disk").setLevel(logging.DEBUG)


def save(model, optimizer, loader_state):
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "loader": loader_state,
    }
    torch.save(state, CHECKPOINT + ".tmp")
    os.replace(CHECKPOINT + ".tmp", CHECKPOINT)


def main():
    ds = spcache.CachedDataset(LOCATION, FINGERPRINT, local_cache=LOCAL, cache_limit=int(LIMIT))
    extra = {"multiprocessing_context": "fork"} if WORKERS else {}
    loader = spcache.DataLoader(
        ds, batch_size=4, shuffle=True, num_workers=WORKERS, collate_fn=spcache.collate_spc,
        **extra,
    )
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    first_epoch = 0
    if PHASE != "uninterrupted" and os.path.exists(CHECKPOINT):
        checkpoint = torch.load(CHECKPOINT)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loader.load_state_dict(checkpoint["loader"])
        first_epoch = checkpoint["loader"]["epoch"]
    with open(os.path.join(OUT, f"{PHASE}.jsonl"), "w") as steps:
        for epoch in range(first_epoch, EPOCHS):
            loader.set_epoch(epoch)
            for step, batch in enumerate(loader):
                loss = model(batch["center"]).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                steps.write(json.dumps({"step": step, "ids": batch["sample_ids"]}) + "\n")
                steps.flush()
                if step % 2 == 1:
                    save(model, optimizer, loader.state_dict())
                if step == KILL_AFTER:  # trained on past the checkpoint; then killed
                    open(os.path.join(OUT, "kill-now"), "w").close()
                    time.sleep(600)
            save(model, optimizer, loader.state_dict())


main()
"""

ENV = {
    "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    "OMP_NUM_THREADS": "1",
}


def _argv(out: Path, location: str, local: Path, limit: int, phase: str, workers: int) -> list[str]:
    script = out / "train_resume.py"
    script.write_text(SCRIPT)
    kill_after = KILL_AFTER if phase == "killed" else -1
    checkpoint = out / f"{phase}-checkpoint.pt"  # a resume starts from a copy of the kill's
    args = (location, FP, local, limit, checkpoint, out, phase, workers, kill_after)
    return [sys.executable, str(script), *map(str, args)]


def _run(out: Path, location: str, local: Path, limit: int, phase: str, workers: int) -> None:
    done = run(_argv(out, location, local, limit, phase, workers), cwd=out, env=ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def _batches(out: Path, phase: str) -> list[list[str]]:
    lines = (out / f"{phase}.jsonl").read_text().splitlines()
    return [json.loads(line)["ids"] for line in lines]


def _in_use(out: Path, phase: str) -> list[int]:
    """Bytes in use after each fetch, eviction and removal the run's processes logged."""
    text = (out / f"{phase}-disk.log").read_text()
    return [int(n) for n in re.findall(r"; (-?\d+) bytes in use", text)]


def _held_part(location: str, order: list[str]) -> str:
    """A part to hold at the server while the run is killed: first read after the
    samples the killed run must train (so holding it never stops the run short of the
    kill), early enough that a loader worker asks for it before the kill (the loader
    has ``2 * WORKERS`` batches in flight), and in a fetch-lock stripe of its own among
    the parts read before it (a holder of the stripe would stop their fetches)."""
    with ShardedSnapshot(location) as store:
        part_of = {sid: store.entry_of(f"{FP}/{sid}").part for sid in order}  # type: ignore[union-attr]
        stripe = {
            part: LocalDisk.stripe(LocalDisk.digest(PartUnit(store, FP, part).name))
            for part in set(part_of.values())
        }
    first: dict[str, int] = {}
    for n, sid in enumerate(order):
        first.setdefault(part_of[sid], n)
    trained = (KILL_AFTER + 1) * BATCH
    in_flight = (KILL_AFTER + 1 + 2 * WORKERS) * BATCH
    taken = {stripe[part_of[sid]] for sid in order[:trained]}
    for part, at in sorted(first.items(), key=lambda item: item[1]):
        if trained <= at < in_flight and stripe[part] not in taken:
            return part
    raise AssertionError(f"no part to hold: first reads {first}, stripes {stripe}")


@pytest.mark.slow
def test_killed_mid_epoch_over_a_remote_snapshot_resumes_exactly_within_the_limit(
    tmp_path: Path,
) -> None:
    with moto_s3() as s3:
        location = f"s3://{s3.new_bucket()}/train/snap.zarr"
        ids = write_sharded(location, parts=PARTS, per_part=PER_PART)
        with ShardedSnapshot(location) as store:
            listed = store.fs.ls(store.path(FP, "parts"), detail=True, refresh=True)
        sizes = [int(info["size"]) for info in listed]
        assert len(sizes) == PARTS
        local = tmp_path / "local"
        limit = limit_for(local, 5, max(sizes))
        assert limit < sum(LocalDisk(LocalCache(str(local), limit)).cost(s) for s in sizes)

        whole = tmp_path / "whole"
        whole.mkdir()
        _run(whole, location, tmp_path / "local-whole", limit, "uninterrupted", WORKERS)
        uninterrupted = _batches(whole, "uninterrupted")
        plain = CachedDataset(location, FP)
        order = [plain.sample_id(i) for i in Sampler(plain, num_replicas=1, rank=0)]
        assert [sid for batch in uninterrupted for sid in batch] == order
        held = _held_part(location, order)
        with ShardedSnapshot(location) as store:
            dead_download = LocalDisk.digest(PartUnit(store, FP, held).name)

        out = tmp_path / "run"
        out.mkdir()
        with peak_bytes(local) as peak:
            with s3.requests.hold("GET", f"/parts/{held}.bin") as hold:
                argv = _argv(out, location, local, limit, "killed", WORKERS)
                with start(argv, cwd=out, env=ENV) as job:
                    wait_for(
                        lambda: (out / "kill-now").exists() and hold.arrived.is_set(),
                        what=f"step {KILL_AFTER} and the GET of part {held}",
                        proc=job,
                    )
                    procs = tree(job.pid)  # the script and its loader workers
                    kill_tree(procs)
                    assert wait_gone(procs) == []
                assert len(procs) >= 1 + WORKERS
            left = [name for name in os.listdir(local / "tmp") if name.startswith(dead_download)]
            assert left, f"no download of part {held} left by the killed run"

            state = torch.load(out / "killed-checkpoint.pt")["loader"]
            assert (state["epoch"], state["consumed"]) == (0, CHECKPOINTED * BATCH)
            for phase, workers in (("resumed", WORKERS), ("resumed-no-workers", 0)):
                shutil.copy(out / "killed-checkpoint.pt", out / f"{phase}-checkpoint.pt")
                _run(out, location, local, limit, phase, workers)

        killed = _batches(out, "killed")
        assert len(killed) == KILL_AFTER + 1  # it trained past its last checkpoint
        assert killed == uninterrupted[: KILL_AFTER + 1]
        before = [sid for batch in killed[:CHECKPOINTED] for sid in batch]
        for phase in ("resumed", "resumed-no-workers"):
            after = [sid for batch in _batches(out, phase) for sid in batch]
            assert Counter(before + after) == Counter(ids), phase  # each sample once
            assert _batches(out, phase) == uninterrupted[CHECKPOINTED:], phase

        # the bound, at every event of every process, and sampled from outside
        events = [
            n for phase in ("killed", "resumed", "resumed-no-workers") for n in _in_use(out, phase)
        ]
        assert events and max(events) <= limit, (max(events), limit)
        assert peak[0] <= limit, (peak[0], limit)
        evicted = (out / "resumed-disk.log").read_text()
        assert ": evicted " in evicted  # the resumed epoch read more than the limit
        # the dead process's download, reclaimed by the resumed run
        assert not any(name.startswith(dead_download) for name in os.listdir(local / "tmp"))
        assert all(f"removed {local / 'tmp' / name}" in evicted for name in left)
