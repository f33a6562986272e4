"""Several precomputes into one cache divide the samples: each is computed once, a claim
of a run that died is taken over, and the index ends complete.

The runs are ``spcache precompute`` processes started together from fresh directories
(one per GPU of a machine would differ only by ``--device cuda:N``); a gate in the test
recipe's ``prepare`` (tests/helpers/gated_recipe.py) holds each at its first sample until
all of them have started, so they overlap whatever the machine's load.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

from cache_store.jobs.claims import RunClaims
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.procs import REPO_ROOT, run_spcache, start_spcache, wait_for
from tests.spcache.test_summaries import point_clouds, spcache, walked

N = 40
GATED = {"SPCACHE_RECIPES": "tests.helpers.gated_recipe:Gated", "PYTHONPATH": str(REPO_ROOT)}


def _argv(sources: Path, cache: Path, gate: Path) -> list[str]:
    return [
        "precompute",
        str(sources),
        "--recipe",
        "gated",
        "--param",
        f"gate={gate}",
        "--cache",
        str(cache),
        "--device",
        "cpu",
        "--loaders",
        "1",
        "--json",
    ]


def test_two_precomputes_started_together_compute_each_sample_once(tmp_path: Path) -> None:
    sources = point_clouds(tmp_path / "sources", N)
    cache, gate = tmp_path / "cache", tmp_path / "gate"
    runs = []
    for name in ("gpu0", "gpu1"):
        (tmp_path / name).mkdir()
        runs.append(start_spcache(*_argv(sources, cache, gate), cwd=tmp_path / name, env=GATED))
    wait_for(lambda: len(list(tmp_path.glob("gate.waiting.*"))) >= 2, timeout=120)
    gate.touch()
    summaries = []
    for run in runs:
        assert run.wait(timeout=300) == 0, run.err_lines
        summaries.append(json.loads("\n".join(run.out_lines)))
    done = [s["done"] for s in summaries]
    assert sum(done) == N and min(done) > 0, summaries  # divided, each sample once
    assert all(s["done"] + s["skipped"] == N and not s["failed"] for s in summaries)
    fp = summaries[0]["fingerprint"]
    assert walked(cache)[fp][0] == N
    listed = spcache(tmp_path / "ls", "ls", "--cache", cache)
    assert [(r["indexed"], r["records"], r["state"]) for r in listed] == [(N, N, "complete")]
    assert spcache(tmp_path / "verify", "verify", "--cache", cache)["ok"]


def _die_holding(cache: Path, fingerprint: str, ids: list[str]) -> None:
    claims = RunClaims(cache, fingerprint)
    assert claims.claim(ids) == set(ids)
    os._exit(0)  # dies holding them: no close


def test_the_claims_of_a_run_that_died_are_taken_over(tmp_path: Path) -> None:
    sources = point_clouds(tmp_path / "sources", 6)
    cache, gate = tmp_path / "cache", tmp_path / "gate"
    gate.touch()
    argv = _argv(sources, cache, gate)
    first = run_spcache(
        *argv[:1], str(tmp_path / "sources" / "p0000.npy"), *argv[2:], cwd=tmp_path, env=GATED
    )
    assert first.returncode == 0, first.stderr
    fp = json.loads(first.stdout)["fingerprint"]
    dead = multiprocessing.get_context("fork").Process(
        target=_die_holding, args=(cache, fp, [f"p{i:04d}" for i in range(1, 6)])
    )
    dead.start()
    dead.join(60)
    assert dead.exitcode == 0
    (tmp_path / "rerun").mkdir()
    rerun = run_spcache("-v", *argv, cwd=tmp_path / "rerun", env=GATED)
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads(rerun.stdout)
    assert (summary["done"], summary["skipped"]) == (5, 1), summary
    assert "died; this run takes them over" in rerun.stderr
    with LMDBStore(cache) as store:
        assert store.get_index(fp).sample_ids.tolist() == [f"p{i:04d}" for i in range(6)]
