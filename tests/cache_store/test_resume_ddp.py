"""Exact mid-epoch resume under DDP: real gloo ranks under torchrun, forked loader workers,
a checkpoint of rank 0's ``spcache.DataLoader.state_dict()``, then SIGKILL of every
process of the job (torchrun, ranks, loader workers) two steps later, and a new job that
loads the checkpoint: with 3 ranks and no workers instead of 2 ranks x 4 workers, each
sample of the epoch is yielded exactly once (the documented tail padding aside); with
the same world size, the resumed job yields the batches the uninterrupted one did."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.helpers.procs import kill_tree, run, start, tree, wait_file, wait_gone
from tests.helpers.resume import FP, assert_exactly_once, sample_ids, write_cache

N = 62
IDS = sample_ids(N)
EPOCH = 3

RANK_SCRIPT = r"""
import json, os, sys, time

import torch.distributed as dist

import spcache


def main():
    cache, fingerprint, out, phase = sys.argv[1:5]
    workers, batch, checkpoint_at = (int(a) for a in sys.argv[5:8])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = spcache.CachedDataset(cache, fingerprint)
    extra = {"multiprocessing_context": "fork"} if workers else {}
    loader = spcache.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                                collate_fn=spcache.collate_spc, **extra)
    checkpoint = os.path.join(out, "checkpoint.json")
    epoch = 3
    if phase == "resume":
        with open(checkpoint) as f:
            state = json.load(f)
        loader.load_state_dict(state)
        epoch = state["epoch"]
    loader.set_epoch(epoch)
    with open(os.path.join(out, f"{phase}-rank{rank}.jsonl"), "w") as log:
        for step, batch_ in enumerate(loader):
            log.write(json.dumps({"step": step, "ids": batch_["sample_ids"]}) + "\n")
            log.flush()
            dist.barrier()  # the ranks step together, as DDP's all-reduce makes them
            if step == checkpoint_at:
                state = loader.state_dict()  # any rank's is the global position
                if rank == 0:
                    with open(checkpoint + ".tmp", "w") as f:
                        json.dump(state, f)
                    os.replace(checkpoint + ".tmp", checkpoint)
            if phase == "killed" and step == checkpoint_at + 2:  # trained on; then killed
                if rank == 0:
                    open(os.path.join(out, "kill-now"), "w").close()
                time.sleep(600)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_cache(tmp_path_factory.mktemp("ddp") / "cache", IDS)


def _argv(
    out: Path, cache: Path, phase: str, ranks: int, workers: int, batch: int, at: int
) -> list[str]:
    script = out / "rank.py"
    script.write_text(RANK_SCRIPT)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone"] + [
        str(a)
        for a in ("--nproc_per_node", ranks, script, cache, FP, out, phase, workers, batch, at)
    ]


ENV = {
    "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    "OMP_NUM_THREADS": "1",
}


def _run(out: Path, cache: Path, phase: str, ranks: int, workers: int, batch: int) -> None:
    done = run(_argv(out, cache, phase, ranks, workers, batch, -1), cwd=out, env=ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def _run_and_kill(out: Path, cache: Path, ranks: int, workers: int, batch: int, at: int) -> int:
    """Start the job, wait until rank 0 is two steps past its checkpoint, SIGKILL every
    process of it; the number of processes killed."""
    with start(_argv(out, cache, "killed", ranks, workers, batch, at), cwd=out, env=ENV) as job:
        wait_file(out / "kill-now", proc=job)
        procs = tree(job.pid)  # torchrun, its ranks (own sessions), their loader workers
        kill_tree(procs)
        assert wait_gone(procs) == []
    return len(procs)


def _steps(out: Path, phase: str, ranks: int) -> list[list[dict]]:
    return [
        [json.loads(line) for line in (out / f"{phase}-rank{r}.jsonl").read_text().splitlines()]
        for r in range(ranks)
    ]


def _order(cache: Path) -> list[str]:
    import spcache

    ds = spcache.CachedDataset(cache, FP)
    sampler = spcache.Sampler(ds, num_replicas=1, rank=0)
    sampler.set_epoch(EPOCH)
    return [ds.sample_id(i) for i in sampler]


@pytest.mark.slow
def test_killed_with_two_ranks_resumed_with_three_yields_each_sample_once(
    cache: Path, tmp_path: Path
) -> None:
    killed = _run_and_kill(tmp_path, cache, ranks=2, workers=4, batch=4, at=2)
    assert killed >= 1 + 2 + 2 * 4  # torchrun, 2 ranks, 4 workers each
    state = json.loads((tmp_path / "checkpoint.json").read_text())
    assert (state["epoch"], state["consumed"]) == (EPOCH, 3 * 4 * 2)  # 3 steps of 2 x 4
    first = _steps(tmp_path, "killed", 2)
    assert all(len(rank) >= 4 for rank in first)  # it trained past the checkpoint
    before = [sid for rank in first for s in rank if s["step"] <= 2 for sid in s["ids"]]
    _run(tmp_path, cache, "resume", ranks=3, workers=0, batch=4)
    after = [sid for rank in _steps(tmp_path, "resume", 3) for s in rank for sid in s["ids"]]
    remaining = N - state["consumed"]
    padding = (-remaining) % 3
    assert padding == 1  # the case DDP's equal steps make: one sample read twice
    assert_exactly_once(before + after, IDS, _order(cache)[N - padding :])


@pytest.mark.slow
def test_killed_and_resumed_with_the_same_world_size_gives_the_same_batches(
    cache: Path, tmp_path: Path
) -> None:
    whole = tmp_path / "whole"
    whole.mkdir()
    _run(whole, cache, "uninterrupted", ranks=2, workers=2, batch=4)
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    _run_and_kill(stopped, cache, ranks=2, workers=2, batch=4, at=4)
    _run(stopped, cache, "resume", ranks=2, workers=2, batch=4)
    uninterrupted = _steps(whole, "uninterrupted", 2)
    resumed = _steps(stopped, "resume", 2)
    for rank in range(2):
        assert [s["ids"] for s in resumed[rank]] == [s["ids"] for s in uninterrupted[rank][5:]]
    killed = _steps(stopped, "killed", 2)
    for rank in range(2):  # and before the checkpoint too, the same job
        assert [s["ids"] for s in killed[rank][:5]] == [s["ids"] for s in uninterrupted[rank][:5]]
